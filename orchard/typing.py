"""Domain type aliases, in one place.

Arrays cross every boundary as ``NDArrays``: an *ordered* mapping from a tensor name to
a numpy array. Order matters: the wire format and the schema hash follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

NDArray = npt.NDArray[np.generic]
NDArrays = dict[str, NDArray]
NodeId = str
RunId = str
RoundNumber = int
ModelHash = str  # lowercase hex sha256 of the serialised model blob
Metrics = dict[str, float]


class Role(StrEnum):
    """What a node is in the tree. Every non-leaf is the same coordinator code."""

    CLIENT = "client"
    AGGREGATOR = "aggregator"


class Weighting(StrEnum):
    """How a client's update is weighted in the cohort's sum (``cohort.weighting``).

    EXAMPLES   w = examples trained on (FedAvg)
    STEPS      w = local steps done
    UNIFORM    w = 1
    FEDNOVA    FedNova (Wang et al., 2020): the client sends ``Delta_i / a_i`` weighted by
               its data and reports ``a_i``; the root rescales the mean (eq. 6)
    """

    EXAMPLES = "examples"
    STEPS = "steps"
    UNIFORM = "uniform"
    FEDNOVA = "fednova"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor in an update or a model."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class DeviceState:
    """What a device reports at check-in; the coordinator uses it for eligibility."""

    battery_percent: float | None = None  # 0..100, None when the device has no battery
    charging: bool | None = None
    temperature_c: float | None = None
    unmetered_network: bool | None = None
    idle: bool | None = None
    extra: dict[str, float] = field(default_factory=dict)


def schema_of(arrays: NDArrays) -> list[TensorSpec]:
    """The schema (ordered names, shapes, dtypes) of a set of named arrays."""
    return [TensorSpec(k, tuple(int(s) for s in v.shape), str(v.dtype)) for k, v in arrays.items()]
