"""Named errors. Each says what was expected, what came, and what to do.

Library code raises these; the gRPC layer maps them to status codes (see
``orchard.server.servicer``) and the CLI prints them without a traceback.
"""

from __future__ import annotations


class OrchardError(Exception):
    """Base of every error Orchard raises on purpose."""


class ConfigError(OrchardError):
    """A configuration is invalid. ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


class UpdateSchemaError(OrchardError):
    """An update's names, shapes, dtypes or values do not match what the round expects."""


class CodecError(OrchardError):
    """A payload cannot be encoded or decoded with the codec it names (bad length, bad index, wrong codec id)."""


class SecAggError(OrchardError):
    """A secure-aggregation message is malformed, replayed, tampered with, or out of stage."""


class SecAggAbort(SecAggError):
    """Too few survivors to unmask: the cohort's round is aborted and the global model stays as it was."""


class RoundClosedError(OrchardError):
    """An upload or request names a round that is not open (stale, future, or already closed)."""


class UnknownModelVersionError(RoundClosedError):
    """An asynchronous update names a model version this tier never served (another run, or no version)."""


class FutureModelVersionError(RoundClosedError):
    """An asynchronous update names a model version newer than the one the tier serves."""


class StaleUpdateError(RoundClosedError):
    """An asynchronous update was trained on a model version more than ``max_staleness`` versions old."""
class UnknownRunError(OrchardError):
    """A request names a run this root has never had (see ``orchard run list``)."""


class DuplicateUploadError(OrchardError):
    """A node uploaded twice for the same round; the first upload stands."""


class NotSelectedError(OrchardError):
    """A node uploaded for a round it was not selected for."""


class UnknownNodeError(OrchardError):
    """A request names a node that never joined (or whose registration expired)."""


# The words that end an UnknownNodeError's message when the node should rejoin (it never
# joined, or its registration expired): a client's link rejoins on exactly these.
JOIN_FIRST = "call Join first"


class AuthError(OrchardError):
    """Missing or invalid enrollment/admin token."""


class IntegrityError(OrchardError):
    """A blob or chunk failed its sha256 check, or a stream ended before its declared size."""


class PayloadTooLargeError(OrchardError):
    """A stream exceeds the size the round allows for it."""


class BudgetExceeded(OrchardError):
    """A device budget (energy, time, thermal, battery) ran out; training stopped cleanly."""


class PrivacyBudgetExceeded(OrchardError):
    """Another round would spend more privacy (epsilon) than the run's target allows."""


class RoundFailed(OrchardError):
    """A round could not reach its minimum number of participants before its deadline."""


class StoreError(OrchardError):
    """The durable store is missing, corrupt, or from an incompatible version."""


class InvalidRequestError(OrchardError):
    """A request's field is out of its bounds (too long, wrong characters, not a finite number in range)."""


class RateLimitedError(OrchardError):
    """A caller asked more often than a tier allows (failed joins, joins that never poll); ``retry_after_s`` says when."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"{message}; retry in {retry_after_s:.1f}s")
