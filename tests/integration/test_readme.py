"""The README's by-hand walkthrough, run as written (on free ports), and its loading snippets."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
VENV_BIN = str(Path(sys.executable).parent)


def block(name: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- {name}: begin -->\s*```\w+\n(.*?)```\s*<!-- {name}: end -->", text, re.S)
    assert m, f"README has no {name} block"
    return m.group(1)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_python(code: str, cwd: Path) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_by_hand_walkthrough(tmp_path: Path) -> None:
    script = block("by-hand")
    for old, new in zip(("7070", "7071", "8080"), free_ports(3), strict=True):
        script = script.replace(old, str(new))
    script = script.replace('$PWD/.venv/bin', VENV_BIN)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
    assert proc.returncode == 0, f"{out[-4000:]}\n{logs}"
    tail = f"{out[-4000:]}\n{logs}"
    assert "https://localhost:" in out and "/?token=orc_admin_" in out, tail
    assert "run-" in out and "completed" in out, tail
    assert "completed after 10 rounds" in out, tail  # the log, followed to its end
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["model.safetensors", "report.json", "run.json"]
    info = json.loads((tmp_path / "final" / "run.json").read_text())
    assert info["round"] == 10
    printed = run_python(block("load-model"), tmp_path)
    assert info["run_id"] in printed and "accuracy" in printed


def test_adapter_snippet_loads_a_pulled_adapter(tmp_path: Path) -> None:
    from orchard.pull import _shipped_base, write_adapter
    from orchard.tasks import get_task

    arrays = get_task("shakespeare").initial_arrays(0)
    write_adapter("shakespeare", {}, 0, arrays, tmp_path / "final")
    (tmp_path / "final" / "run.json").write_text(json.dumps({"base_model": _shipped_base("shakespeare", {})}))
    printed = run_python(block("load-adapter"), tmp_path)
    assert printed.strip().startswith("torch.Size([1, 16, ")
