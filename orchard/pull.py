"""``orchard run pull``: a run's global model from a live root, as files a script can load.

The directory it writes:

- ``model.safetensors``: the global model's tensors exactly as the root checkpointed
  them (for a LoRA task: the adapter's trained tensors), loadable with
  ``safetensors.torch.load_file`` into the task's model;
- ``adapter/`` (LoRA tasks only): the adapter in peft's format (``adapter_config.json``
  + ``adapter_model.safetensors``), for ``peft.PeftModel.from_pretrained(base, DIR)``;
- ``run.json``: the run id, the round, the checkpoint's sha256 and the run's config;
- ``report.json``: the run's status at pull time (every round's participants, bytes,
  metrics).

Like the CLI, this module sits at the top of the dependency graph: it imports the
tasks and the edge runtime lazily, only for a LoRA task.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from orchard import wire
from orchard.errors import OrchardError, UnknownRunError


class PullError(OrchardError):
    """A pull cannot be done as asked (round out of range, output not writable)."""


def check_writable(out: Path) -> None:
    """Create ``out`` (and its parents) and make sure a file can be written there, before
    anything is downloaded."""
    if out.exists() and not out.is_dir():
        raise PullError(f"--out {out} is a file; pass a directory (it is created if absent)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".orchard-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PullError(f"cannot write to --out {out}: {err.strerror or err}; pass a directory you can write") from None


def find_run(runs: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    if not runs:
        raise UnknownRunError((f"no run {run_id!r} on this server: " if run_id else "")
                              + "this server has no run yet; start one with `orchard run start`")
    if not run_id:
        return runs[0]
    for r in runs:
        if r["run_id"] == run_id:
            return r
    names = ", ".join(r["run_id"] for r in runs[:5]) + (", ..." if len(runs) > 5 else "")
    raise UnknownRunError(f"no run {run_id!r} on this server (its runs: {names}); see `orchard run list`")


def check_round(run: dict[str, Any], rnd: int | None) -> int:
    """The round to pull: the last completed one by default; 0 is the initial model."""
    done = int(run["completed_rounds"])
    if rnd is None:
        return done
    if not 0 <= rnd <= done:
        raise PullError(f"round {rnd} is out of range: run {run['run_id']} has checkpoints for rounds 0 "
                        f"(the initial model) to {done}")
    return rnd


def _shipped_base(task: str, params: dict[str, Any]) -> str | None:
    """Where the base model a LoRA run adapted lives, for the README's loading snippet."""
    base = params.get("base")
    if base is not None and base not in ("pretrained", "random"):
        return str(Path(base).resolve().parent if Path(base).is_file() else Path(base).resolve())
    if base == "random":
        return None
    from orchard.tasks.registry import task_module

    shipped = getattr(task_module(task), "SHIPPED_BASE", None)
    return str(shipped) if shipped is not None else None


def write_adapter(task_name: str, params: dict[str, Any], seed: int, arrays: Any, out: Path) -> Path | None:
    """The adapter in peft's format when the task is a LoRA task, else None."""
    from orchard.tasks import get_task

    task = get_task(task_name, **params)
    model = task.build_model(seed)  # type: ignore[attr-defined]
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    from orchard.edge_runtime.lora import save_adapter, set_arrays

    set_arrays(model, arrays, task.trainable)  # type: ignore[attr-defined]
    return save_adapter(model, out / "adapter")


def pull_run(ctl: Any, run_id: str, rnd: int | None, out: Path) -> dict[str, Any]:
    """Pull ``run_id`` (latest run when empty) at round ``rnd`` (last completed when None)
    into ``out``; returns what was written (also saved as ``run.json``)."""
    check_writable(out)
    run = find_run(ctl.list_runs(), run_id)
    rnd = check_round(run, rnd)
    blob = ctl.pull_global(run["run_id"], rnd)
    arrays = wire.blob_to_arrays(blob)
    cfg = run["config"]
    (out / "model.safetensors").write_bytes(blob)
    adapter = write_adapter(cfg["task"], dict(cfg.get("task_params", {})), int(cfg.get("seed", 0)), arrays, out)
    info = {"run_id": run["run_id"], "round": rnd, "sha256": wire.sha256_hex(blob), "task": cfg["task"],
            "task_params": cfg.get("task_params", {}), "tensors": {k: list(v.shape) for k, v in arrays.items()},
            "files": ["model.safetensors", "run.json", "report.json"] + (["adapter/"] if adapter else []),
            "base_model": _shipped_base(cfg["task"], cfg.get("task_params", {})) if adapter else None,
            "config": cfg}
    (out / "run.json").write_text(json.dumps(info, indent=2))
    (out / "report.json").write_text(json.dumps(ctl.status(run["run_id"]), indent=2))
    return info
