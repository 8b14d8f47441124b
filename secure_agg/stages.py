"""Stage numbers for transports: a stable index for each :class:`Stage` (the wire carries ints)."""

from __future__ import annotations

from orchard.errors import SecAggError
from orchard.secure_agg.messages import Stage

# CONSISTENCY (active sessions) comes last so that the older stages keep their numbers.
STAGE_ORDER: tuple[Stage, ...] = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING,
                                  Stage.DONE, Stage.ABORTED, Stage.CONSISTENCY)


def stage_index(stage: Stage) -> int:
    return STAGE_ORDER.index(stage)


def stage_of(index: int) -> Stage:
    if not 0 <= index < len(STAGE_ORDER):
        raise SecAggError(f"unknown secure-aggregation stage {index}; expected 0..{len(STAGE_ORDER) - 1}")
    return STAGE_ORDER[index]
