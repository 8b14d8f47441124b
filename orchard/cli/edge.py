"""``orchard edge infer``: on-device inference from a client bundle (no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from orchard.cli.common import fail, out
from orchard.errors import OrchardError

app = typer.Typer(no_args_is_help=True, help="On-device inference from a client bundle.")


@app.command("infer")
def edge_infer(
    bundle: Annotated[Path, typer.Option("--bundle", help="Client bundle dir.")],
    text: Annotated[str | None, typer.Option("--text", help="Prompt: print the predicted next characters.")] = None,
    input_file: Annotated[Path | None, typer.Option("--input", help="Model input as .npy: print a logits summary.")] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="How many next characters to list.")] = 5,
    generate: Annotated[int, typer.Option("--generate", help="Greedy continuation length (characters).")] = 40,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run the bundle's base model with its active adapter through ONNX Runtime (no torch)."""
    if (text is None) == (input_file is None):
        fail(OrchardError("pass exactly one of --text PROMPT or --input FILE.npy"))
    try:
        if text is not None:
            _predict_text(bundle, text, top_k, generate, as_json)
        elif input_file is not None:
            _summarize(bundle, input_file, as_json)
    except (OrchardError, OSError, ValueError) as err:
        fail(err)


def _predict_text(bundle: Path, text: str, top_k: int, generate: int, as_json: bool) -> None:
    from orchard.edge_runtime import infer

    p = infer.predict_text(bundle, text, top_k=top_k, generate=generate)
    if as_json:
        out.print_json(json.dumps({"prompt": p.prompt, "adapter_version": p.adapter_version,
                                   "top": [{"char": c.char, "p": c.probability} for c in p.top],
                                   "continuation": p.continuation}))
        return
    out.print(f"adapter version {p.adapter_version}; next character after {p.prompt!r}:", highlight=False)
    for c in p.top:
        out.print(f"  {c.char!r:>6}  {c.probability:.3f}", highlight=False)
    out.print(f"greedy continuation: {p.prompt + p.continuation!r}", highlight=False, soft_wrap=True)


def _summarize(bundle: Path, input_file: Path, as_json: bool) -> None:
    import numpy as np

    from orchard.edge_runtime import infer

    s = infer.summarize_array(bundle, np.load(input_file, allow_pickle=False))
    if as_json:
        out.print_json(json.dumps({"shape": list(s.shape), "dtype": s.dtype, "min": s.min, "max": s.max,
                                   "mean": s.mean, "argmax_last": s.argmax_last}))
        return
    out.print(f"logits {s.shape} {s.dtype}: min {s.min:.4g}, max {s.max:.4g}, mean {s.mean:.4g}; "
              f"argmax at the last position per row: {s.argmax_last}", highlight=False, soft_wrap=True)
