"""Character tokenizer shared by pretraining and the federated Shakespeare task.

The vocabulary is a text's sorted distinct characters; id i is the i-th of them. Sorting
makes the vocabulary a function of the character set alone, so every client and the
pretraining run that saw the same characters agree on ids without exchanging anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from orchard.errors import OrchardError


class TokenizerError(OrchardError, ValueError):
    """Text holds a character the vocabulary lacks, an id is out of range, or a tokenizer file is malformed."""


class CharTokenizer:
    def __init__(self, chars: Iterable[str]) -> None:
        self.chars: list[str] = list(chars)
        if any(not isinstance(c, str) or len(c) != 1 for c in self.chars) or len(set(self.chars)) != len(self.chars):
            raise TokenizerError("a character vocabulary must hold distinct single characters")
        if len(self.chars) > 65535:
            raise TokenizerError(f"{len(self.chars)} characters do not fit uint16 token ids")
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise TokenizerError(
                f"character {err.args[0]!r} is not in the vocabulary of {self.vocab_size} characters"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a uint16 array (what token shards store)."""
        return np.asarray(self.encode(text), dtype=np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        try:
            return "".join(self.chars[int(i)] for i in ids)
        except IndexError:
            raise TokenizerError(f"token id out of range [0, {self.vocab_size})") from None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        if not isinstance(data, dict) or data.get("type") != "char" or not isinstance(data.get("chars"), list):
            raise TokenizerError('expected a character tokenizer: {"type": "char", "chars": [...]}')
        return cls(data["chars"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TokenizerError(f"cannot read tokenizer {p}: {err}") from None
        except RecursionError:
            raise TokenizerError(f"cannot read tokenizer {p}: its JSON nests too deeply") from None
        return cls.from_dict(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __hash__(self) -> int:
        return hash(tuple(self.chars))
