"""Errors raised by the codecs. Every one says what was expected and what came."""

from __future__ import annotations

from orchard.errors import CodecError, UpdateSchemaError


class MalformedPayloadError(CodecError):
    """A payload's bytes do not parse: truncated, bad magic, bad field, bad index, bad length."""


class CodecMismatchError(CodecError):
    """A well-formed payload made by another codec, codec version or configuration."""


class NonFiniteError(CodecError):
    """A well-formed payload whose values include NaN or Inf."""


class StateError(CodecError):
    """A codec state (PowerSGD factor, error-feedback residual) does not fit the tensor."""


class UpdateMismatchError(UpdateSchemaError):
    """The names or shapes of a whole update do not match what the caller expects."""
