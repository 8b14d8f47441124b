"""What a device reads from a bundle directory, fed bytes that are not what
``orchard client bundle`` writes: each is refused with a named error, never a crash.
The inputs are the fuzzer's finds (``fuzz/``, targets ``bundle_*``), byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchard.edge_runtime import bundle as b
from orchard.edge_runtime import bundle_task as bt
from orchard.edge_runtime import et_program as ep
from orchard.errors import ConfigError
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


def _client_json(**fields: object) -> bytes:
    f = {"name": "model.onnx", "sha256": "0" * 64}
    return json.dumps({"format_version": 1, "server_address": "h:1", "model": f, "input_name": "x",
                       "output_name": "y", "adapter_onnx": {**f, "name": "a.onnx_adapter"},
                       "adapter_safetensors": {**f, "name": "a.safetensors"}, "adapter_version": 0,
                       **fields}).encode()


@pytest.mark.parametrize("fields", [
    # fuzz target bundle_client_json found the first (its input file was not kept; the name is
    # from its report): a token file below the bundle was read, and "/etc/passwd" would be too
    {"enrollment_token": "enroll:ment.tokeababababababababababababababab/bab"},
    {"enrollment_token": "/etc/passwd"},
    {"ca_cert": "../ca.pem"},
    {"model": {"name": "/dev/zero", "sha256": "0" * 64}},
    {"training_program": {"name": "..", "sha256": "0" * 64}},
])
def test_a_bundle_names_only_files_in_its_own_directory(tmp_path: Path, fields: dict) -> None:
    (tmp_path / b.CONFIG_FILE).write_bytes(_client_json(**fields))
    with pytest.raises(ConfigError, match="file name in the bundle's directory"):
        b.read_bundle(tmp_path, verify=False)
