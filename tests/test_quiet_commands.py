"""What a person sees: a command prints no stray library warnings (torch's pytree lines,
glog-style ``W1128 ...`` lines, Python warnings) around its own output."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

# glog's format (torch's internal logging): a level letter, month and day, a time.
_GLOG = re.compile(r"^[IWE]\d{4} \d{2}:\d{2}:\d{2}", re.M)


@pytest.mark.parametrize("argv", [["tasks", "list"], ["--help"]], ids=["tasks-list", "help"])
def test_a_command_prints_no_library_warnings(argv) -> None:
    res = subprocess.run([sys.executable, "-m", "orchard.cli", *argv], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    noise = res.stderr + res.stdout
    assert not _GLOG.search(noise), noise
    assert "pytree" not in noise and "Warning" not in noise, noise
