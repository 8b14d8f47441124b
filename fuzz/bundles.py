"""Targets for what a device reads from a bundle directory: ``client.json`` (with the
bundle check: every named file present and matching its digest), the training-program
manifest, and the ``task.json`` and ``tokenizer.json`` sidecars.

Each input is written into a scratch bundle directory (in memory where /dev/shm exists)
and read back with the client's own functions. Besides refusing bad bytes with a named
error, a bundle that reads must name only files inside its own directory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from orchard.edge_runtime import bundle as b
from orchard.edge_runtime import bundle_task as bt
from orchard.edge_runtime import et_program as ep
from orchard.errors import OrchardError

# The files a seed client.json names, with these contents (their digests are in the seeds).
BUNDLE_FILES = {b.MODEL_FILE: b"onnx", b.ADAPTER_ONNX_FILE: b"adapter", b.ADAPTER_SAFETENSORS_FILE: b"st",
                ep.PROGRAM_FILE: b"pte", b.TOKEN_FILE: b"orc_token\n"}


class FuzzBug(AssertionError):
    """A reader accepted a bundle and then broke a promise about it."""


def scratch_bundle() -> Path:
    root = Path(tempfile.mkdtemp(prefix="orchard-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    for name, data in BUNDLE_FILES.items():
        (root / name).write_bytes(data)
    os.chmod(root / b.TOKEN_FILE, 0o600)
    return root


def file_digests() -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in BUNDLE_FILES.items()}


def _inside(root: Path, p: Path | None) -> None:
    if p is not None and p.resolve().parent != root.resolve():
        raise FuzzBug(f"the bundle names {p}, outside its directory {root}")


def _one_file(name: str, check: Callable[[Path], None]) -> Callable[[bytes], None]:
    """A target whose input is the bundle file ``name``: ``check(root)`` reads the bundle
    and asserts what its reader promises; a refusal (OrchardError) is a pass."""
    root = scratch_bundle()

    def one_input(data: bytes) -> None:
        (root / name).write_bytes(data)
        try:
            check(root)
        except OrchardError:
            return

    return one_input


def _check_client_json(root: Path) -> None:
    bundle = b.read_bundle(root)
    cfg = bundle.config
    for f in (cfg.model, cfg.adapter_onnx, cfg.adapter_safetensors, cfg.training_program):
        _inside(root, None if f is None else root / f.name)
    _inside(root, bundle.ca_cert_path)
    _inside(root, None if cfg.enrollment_token is None else root / cfg.enrollment_token)
    bundle.enrollment_token()
    _ = bundle.root_public_key


def client_json():
    return _one_file(b.CONFIG_FILE, _check_client_json)


def training_manifest():
    return _one_file(ep.MANIFEST_FILE, lambda root: _inside(root, root / ep.read_manifest(root).program.name))


def task_json():
    """Input: one byte (even: task.json, odd: tokenizer.json), then the file."""
    root = scratch_bundle()

    def one_input(data: bytes) -> None:
        if not data:
            return
        tokenizer = data[0] & 1
        (root / (bt.TOKENIZER_FILE if tokenizer else bt.TASK_FILE)).write_bytes(data[1:])
        try:
            if tokenizer:
                tok = bt.read_tokenizer(root)
                tok.decode(tok.encode("".join(tok.chars)))
            else:
                bt.read_bundle_task(root)
        except OrchardError:
            return

    return one_input
