"""``benchmarks/privacy.py`` at a toy size: the robustness cases run for their own number
of rounds and are read against a clean run of that length, not the shorter DP baseline;
testing the model along the way does not change the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "privacy.py"
TOY = ["--task", "digits", "--population", "60", "--per-round", "10", "--aggregators", "1", "--epsilons"]


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "privacy.json"
    res = subprocess.run([sys.executable, str(SCRIPT), *TOY, *args, "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got: dict[str, Any] = json.loads(out.read_text())
    return got


def test_attacks_are_read_against_a_clean_run_of_their_length(tmp_path: Path) -> None:
    got = _bench(tmp_path, "--rounds", "2", "--robust-rounds", "3", "--eval-every", "2", "--seeds", "0", "1",
                 "--only", "sign_flip, norm")
    assert got["complete"] and got["rounds"] == 2 and got["robust_rounds"] == 3
    # Only the asked case and what it is read against: the 2-round baseline is not run.
    clean, attacked = got["cases"]
    assert (clean["case"], attacked["case"]) == ("no attack, 3 rounds", "10% sign_flip, norm bound")
    assert clean["rounds"] == attacked["rounds"] == 3
    assert clean["reference"] is None and attacked["reference"] == clean["case"]
    assert attacked["accuracy_minus_reference"] == round(attacked["accuracy"] - clean["accuracy"], 4)
    diffs = [a["accuracy"] - c["accuracy"] for a, c in zip(attacked["per_seed"], clean["per_seed"], strict=True)]
    assert attacked["paired_minus_reference"][0] == round(sum(diffs) / 2, 4)
    for x in attacked["per_seed"]:  # tested after round 2 and after the last
        assert sorted(x["accuracy_by_round"]) == ["2", "3"] and x["accuracy_by_round"]["3"] == x["accuracy"]

    # Equal lengths: the attacks are read against the non-private run, and the same
    # seed's attacked run, now tested only at its end, ends where it did.
    again = _bench(tmp_path, "--rounds", "3", "--robust-rounds", "3", "--seeds", "0", "--only", "sign_flip, norm")
    assert [(c["case"], c["reference"]) for c in again["cases"]] == [
        ("non-private", None), ("10% sign_flip, norm bound", "non-private")]
    assert again["cases"][1]["per_seed"][0]["accuracy"] == attacked["per_seed"][0]["accuracy"]
    assert again["cases"][0]["per_seed"][0]["accuracy"] == clean["per_seed"][0]["accuracy"]


def _levels_containing(rounds: int, restart: int | None) -> int:
    """Reference: the most tree nodes any one leaf lies under, trees of ``restart`` leaves
    (one participation's sum of c^2), by listing every node's interval."""
    size = rounds if restart is None else restart
    best = 0
    for start in range(0, rounds, size):
        n = min(size, rounds - start)
        nodes = [(j * 2 ** h, (j + 1) * 2 ** h) for h in range(n.bit_length() + 1) for j in range(-(-n // 2 ** h))]
        best = max(best, max(sum(1 for lo, hi in set(nodes) if lo < t <= hi) for t in range(1, n + 1)))
    return best


def _epsilon_of_gaussian(mu: float, delta: float) -> float:
    """Reference: epsilon of one Gaussian mechanism of sensitivity over noise ``mu`` at
    ``delta`` from its Renyi DP ``alpha mu^2 / 2``, with the conversion
    ``eps = rdp + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)``
    (Canonne, Kamath and Steinke 2020), minimised over a fine grid of orders."""
    import math

    best = math.inf
    for i in range(1, 200_000):
        alpha = 1.0 + i * 0.0025
        rdp = alpha * mu * mu / 2
        best = min(best, rdp + math.log((alpha - 1) / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1))
    return best


def _exact_delta(mu: float, eps: float) -> float:
    """Reference: the Gaussian mechanism's exact delta at ``eps`` (Balle and Wang 2018)."""
    import math

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    return phi(mu / 2 - eps / mu) - math.exp(eps) * phi(-mu / 2 - eps / mu)


def test_the_ledgers_epsilon_is_recomputed_independently(tmp_path: Path) -> None:
    got = _bench(tmp_path, "8", "--rounds", "5", "--seeds", "0", "--no-robustness", "--only", "central DP",
                 "DP-FTRL", "--max-participations", "1", "--min-separation", "5")
    cases = {c["case"]: c for c in got["cases"]}
    assert set(cases) == {"non-private", "central DP eps=8", "DP-FTRL eps=8"}
    for name, case in cases.items():
        if name == "non-private":
            continue
        for run in case["per_seed"]:
            p, z, t = run["privacy_config"], run["noise_multiplier"], run["rounds_charged"]
            assert t == 5 and p["adjacency"] == "replace_one"
            # Squared sensitivity in clip norms: replace-one moves a contribution by 2C.
            if p["mode"] == "central":  # every device in every round
                s2 = 4.0 * t
            else:
                assert p["max_participations"] == 1  # one participation: its leaf's nodes
                s2 = 4.0 * _levels_containing(t, p["restart_every"])
            mu = (s2 ** 0.5) / z
            ref = _epsilon_of_gaussian(mu, p["delta"])
            assert ref <= run["epsilon"] * (1 + 1e-6) and run["epsilon"] <= ref * 1.01, (name, ref, run["epsilon"])
            assert run["epsilon"] <= 8.0 * (1 + 1e-6)
            assert _exact_delta(mu, run["epsilon"]) <= p["delta"]  # the guarantee, exactly
            # What the run reports: no clamped noise in either, so delta is the accountant's, <= 1 / population.
            assert run["delta"] == p["delta"] <= 1 / got["population"]
    # DP-FTRL needs less noise than central DP for the same epsilon over the same rounds.
    assert cases["DP-FTRL eps=8"]["noise_multiplier"] < cases["central DP eps=8"]["noise_multiplier"]
