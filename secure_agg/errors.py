"""Errors of :mod:`orchard.secure_agg`, each a subclass of a core error.

Every refusal names what was expected, what came and (where there is one) what to do.
The gRPC layer maps :class:`~orchard.errors.SecAggError` to INVALID_ARGUMENT /
FAILED_PRECONDITION and :class:`~orchard.errors.SecAggAbort` to ABORTED.
"""

from __future__ import annotations

from orchard.errors import ConfigError, SecAggAbort, SecAggError

__all__ = [
    "DuplicateMessage",
    "ExcludedNode",
    "MalformedMessage",
    "NotEnoughShares",
    "SecAggAbort",
    "SecAggConfigError",
    "SecAggError",
    "TamperedCiphertext",
    "UnknownPeer",
    "WrongSession",
    "WrongStage",
]


class SecAggConfigError(ConfigError):
    """Secure-aggregation parameters are impossible (threshold, neighbours, headroom)."""


class MalformedMessage(SecAggError):
    """A message does not parse, or a field has the wrong length, type or range."""


class WrongStage(SecAggError):
    """A message belongs to another stage than the one the session is in."""


class WrongSession(SecAggError):
    """A message names another session id or round: replayed from elsewhere or misrouted."""


class DuplicateMessage(SecAggError):
    """A node sent twice in one stage (a replay); the first message stands."""


class UnknownPeer(SecAggError):
    """A message names a node that is not a participant, not a neighbour, or not expected."""


class TamperedCiphertext(SecAggError):
    """An encrypted share failed authentication (modified, misaddressed or replayed)."""


class ExcludedNode(SecAggError):
    """A node that dropped out (missed a stage, or was pruned) tries to take part again."""


class NotEnoughShares(SecAggError):
    """Fewer than ``threshold`` Shamir shares were given: the secret cannot be reconstructed."""
