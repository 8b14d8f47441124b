"""The greenhouse task: this package's model and data, handed to Orchard by make_task."""

from pathlib import Path

import numpy as np
import torch
from torch import nn

from orchard.tasks import ByColumn, Csv, Dirichlet, LoRA, load_data, make_task

DATA = Path(__file__).parent / "data" / "greenhouse.csv"
CONDITIONS = ("healthy", "nutrient_poor", "overheated", "thirsty")  # the label's values, sorted


class GreenhouseNet(nn.Module):
    """Standardise the 7 sensor readings, then a two-layer MLP over the 4 conditions."""

    def __init__(self, mean: np.ndarray, std: np.ndarray, hidden: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.fc1 = nn.Linear(7, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, len(CONDITIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1((x - self.mean) / self.std))
        return self.head(torch.relu(self.fc2(h)))


def build(*, hidden: int = 64, lora: bool = True, rank: int = 8, with_replacement: bool = False,
          alpha: float = 0.5, samples_per_client: int = 20):
    """Greenhouse sensors -> crop condition; one client per greenhouse, or any number
    drawn with replacement."""
    data = load_data(Csv(DATA, label="condition", columns=["greenhouse"]))
    # Every client reads the same file here, so the scaling is the same everywhere.
    mean, std = data.x.mean(axis=0), data.x.std(axis=0)
    return make_task(
        name="greenhouse",
        model=lambda: GreenhouseNet(mean, std, hidden),
        data=data,
        trainable=LoRA(target_modules=("fc1", "fc2", "head"), rank=rank, variant="full") if lora else "all",
        partitioner=Dirichlet(alpha=alpha, samples_per_client=samples_per_client) if with_replacement
        else ByColumn("greenhouse"),
        params={"hidden": hidden, "lora": lora, "rank": rank, "with_replacement": with_replacement,
                "alpha": alpha, "samples_per_client": samples_per_client},
    )
