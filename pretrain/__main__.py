"""``python -m orchard.pretrain`` / ``torchrun --nproc-per-node N -m orchard.pretrain``.

    python -m orchard.pretrain --config configs/pretrain.toml --steps 500 --optim.lr 3e-4

Every flag after ``--config`` is a dotted config key and its value (``--key value`` or
``--key=value``; dashes and underscores are interchangeable), validated with the file.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from orchard.errors import OrchardError
from orchard.pretrain.config import load_pretrain_config, parse_pretrain_config
from orchard.pretrain.recipe import run


def parse_overrides(rest: list[str]) -> list[str]:
    """``["--steps", "5", "--optim.lr=1e-3"]`` -> ``["steps=5", "optim.lr=1e-3"]``."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or arg == "--":
            raise OrchardError(f"unexpected argument {arg!r}: overrides look like --key value")
        key = arg[2:]
        if "=" in key:
            out.append(key)
            i += 1
        elif i + 1 < len(rest):
            out.append(f"{key}={rest[i + 1]}")
            i += 2
        else:
            raise OrchardError(f"override {arg} has no value")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="orchard.pretrain",
        description="Pretrain the base GPT (one process, or under torchrun).",
        epilog="Further --KEY VALUE pairs override config fields, e.g. --steps 100 --optim.lr 3e-4.",
    )
    parser.add_argument("--config", help="TOML file ([pretrain] table or top-level keys)")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        if args.config:
            cfg = load_pretrain_config(args.config, overrides)
        else:
            cfg = parse_pretrain_config({}, overrides)
        result = run(cfg)
    except OrchardError as err:
        Console(stderr=True).print(f"[red]error:[/red] {err}")
        return 2
    # A run stopped by SIGTERM or stop_after is a clean exit: its checkpoint resumes it.
    return 0 if result.finished or result.stopped_by else 1


if __name__ == "__main__":
    sys.exit(main())
