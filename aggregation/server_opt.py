"""Server optimizers on the pseudo-gradient (Reddi et al., 2021, Algorithm 2).

The root treats ``-mean_delta`` (the negated weighted mean of client model deltas) as
a gradient and steps a ``torch.optim`` optimizer on the global model:

    FedAvg     SGD, lr = server_lr (1.0 gives plain FedAvg: x + mean_delta)
    FedAvgM    SGD with momentum (Hsu et al., 2019)
    FedAdam    Adam, eps = tau
    FedAdagrad Adagrad, eps = tau
    FedYogi    Yogi (Zaheer et al., 2018): torch has no Yogi, so it is a small
               torch.optim.Optimizer below, following the paper's update rule.

torch's Adam applies bias correction, which Algorithm 2 omits; with the default
beta2 = 0.99 the difference fades within a few hundred rounds.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from orchard.config import ServerOptimizerConfig
from orchard.errors import UpdateSchemaError
from orchard.typing import NDArrays


class Yogi(torch.optim.Optimizer):
    """Yogi: v_t = v_{t-1} - (1 - beta2) * g^2 * sign(v_{t-1} - g^2) (Zaheer et al., 2018, Alg. 2)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-2,
                 betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-3,
                 initial_accumulator_value: float = 1e-6) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.full_like(p, group["initial_accumulator_value"])
                m, v = st["m"], st["v"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                g2 = g * g
                v.addcmul_(torch.sign(v - g2), g2, value=-(1 - b2))
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])


class ServerOptimizer:
    """Holds the global model as torch tensors and applies one optimizer step per round."""

    def __init__(self, cfg: ServerOptimizerConfig, global_arrays: NDArrays) -> None:
        self.cfg = cfg
        self.params = {k: torch.nn.Parameter(torch.from_numpy(np.array(v, dtype=np.float32)))
                       for k, v in global_arrays.items()}
        ps = list(self.params.values())
        name = cfg.name
        opt: torch.optim.Optimizer
        if name == "fedavg":
            opt = torch.optim.SGD(ps, lr=cfg.lr)
        elif name == "fedavgm":
            opt = torch.optim.SGD(ps, lr=cfg.lr, momentum=cfg.momentum)
        elif name == "fedadam":
            opt = torch.optim.Adam(ps, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.tau)
        elif name == "fedadagrad":
            opt = torch.optim.Adagrad(ps, lr=cfg.lr, eps=cfg.tau, initial_accumulator_value=cfg.tau**2)
        else:  # fedyogi; the config's Literal type admits nothing else
            opt = Yogi(ps, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.tau,
                       initial_accumulator_value=cfg.tau**2)
        self.opt = opt

    def arrays(self) -> NDArrays:
        return {k: p.detach().numpy().copy() for k, p in self.params.items()}

    def step(self, mean_delta: NDArrays) -> NDArrays:
        """Apply ``x <- opt(x, g = -mean_delta)`` and return the new global arrays."""
        if set(mean_delta) != set(self.params):
            raise UpdateSchemaError(
                f"mean update names {sorted(mean_delta)[:5]} do not match the global model {sorted(self.params)[:5]}"
            )
        for k, p in self.params.items():
            d = mean_delta[k]
            if tuple(d.shape) != tuple(p.shape):
                raise UpdateSchemaError(f"mean update {k!r} has shape {d.shape}, model has {tuple(p.shape)}")
            p.grad = torch.from_numpy(np.negative(d, dtype=np.float32))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.arrays()

    def state_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        return buf.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        self.opt.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))


def build_server_optimizer(cfg: ServerOptimizerConfig, global_arrays: NDArrays) -> ServerOptimizer:
    return ServerOptimizer(cfg, global_arrays)
