"""What a device reads from a bundle directory, fed bytes that are not what
``orchard client bundle`` writes: each is refused with a named error, never a crash.
The inputs are the fuzzer's finds (``fuzz/``, targets ``bundle_*``), byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.edge_runtime import bundle as b
from orchard.edge_runtime import bundle_task as bt
from orchard.edge_runtime import et_program as ep
from orchard.text import TokenizerError

DEEP = b"[" * 100_000  # nests past the JSON parser's recursion limit
NOT_JSON_TEXT = [b"\n\x87", b"\x84", b"\xed\x8a\x8a", DEEP, b"[]", b"1", b'"x"', b"null"]


@pytest.mark.parametrize("data", NOT_JSON_TEXT)
def test_client_json_that_is_not_a_json_object_is_a_bundle_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / b.CONFIG_FILE).write_bytes(data)
    with pytest.raises(b.BundleError, match=b.CONFIG_FILE):
        b.read_bundle(tmp_path)


@pytest.mark.parametrize("data", NOT_JSON_TEXT)
def test_a_training_manifest_that_is_not_a_json_object_is_a_training_program_error(tmp_path: Path,
                                                                                   data: bytes) -> None:
    (tmp_path / ep.MANIFEST_FILE).write_bytes(data)
    with pytest.raises(ep.TrainingProgramError, match=ep.MANIFEST_FILE):
        ep.read_manifest(tmp_path)


@pytest.mark.parametrize("data", NOT_JSON_TEXT)
def test_a_task_sidecar_that_is_not_a_json_object_is_a_bundle_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / bt.TASK_FILE).write_bytes(data)
    with pytest.raises(b.BundleError, match=bt.TASK_FILE):
        bt.read_bundle_task(tmp_path)


@pytest.mark.parametrize("data", [*NOT_JSON_TEXT, b'{"type": "char", "chars": [1, 2]}',
                                  b'{"type": "char", "chars": [null]}'])
def test_a_tokenizer_file_that_does_not_hold_a_tokenizer_is_a_tokenizer_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / bt.TOKENIZER_FILE).write_bytes(data)
    with pytest.raises(TokenizerError):
        bt.read_tokenizer(tmp_path)
