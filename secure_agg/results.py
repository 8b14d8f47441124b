"""What a server's session reports: a stage's close (:class:`StageReport`) and the
session's end (:class:`SecAggResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from orchard.secure_agg.messages import Stage

__all__ = ["SecAggResult", "StageReport"]


@dataclass(frozen=True)
class StageReport:
    """What closing a stage did: who sent, who dropped out, who was pruned."""

    stage: Stage
    next_stage: Stage
    received: tuple[str, ...]
    dropped: tuple[str, ...]  # expected in this stage, did not send
    excluded: tuple[str, ...] = ()  # sent, but left with fewer than t live neighbours


@dataclass(frozen=True, eq=False)
class SecAggResult:
    """The unmasked sum of the contributors' inputs, modulo 2^modulus_bits."""

    total: np.ndarray
    contributors: tuple[str, ...]  # U3: whose inputs are in ``total`` (pass len() to decode)
    dropped: tuple[str, ...]  # participants whose inputs are not in ``total``
    measurements: dict[str, float] = field(default_factory=dict)
    # Holders whose unmasking shares disagreed with the others' and were discarded
    # (active sessions). Their own inputs, if they are contributors, are in ``total``.
    offenders: tuple[str, ...] = ()
