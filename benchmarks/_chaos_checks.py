"""The chaos run's invariants (``benchmarks/chaos.py``), read after every process stopped:
from the root's store (runs, round records, checkpoints), the aggregates the root
recorded beside its checkpoints, the clients' event logs (the uploads' ids: client index
and upload number, one model coordinate each) and the driver's own record of its kills."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from chaos_client import SLOTS, TENSOR

FD_GROWTH_MAX = 32  # descriptors an incarnation may gain from its second quarter to its last
RSS_GROWTH_MAX_MIB = 128.0
MIN_LIFE_S = 30.0  # incarnations serving for less are too short to show growth
WARM_S = 8.0  # seconds after an incarnation serves before its samples count (its first round)


def _events(work: Path) -> tuple[list[dict[str, Any]], set[tuple[int, int]]]:
    """Uploads the clients saw end (accepted or not) and every (client, upload) they trained."""
    uploads, trained = [], set()
    for f in sorted(work.glob("c-*.events")):
        for line in f.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill (whole lines are written in one write)
            if ev.get("event") == "upload" and ev.get("seq", -1) >= 0:
                uploads.append(ev)
            elif ev.get("event") == "phase" and ev.get("phase") == "training":
                trained.add((int(f.stem.split("-")[1]), int(ev["seq"])))
    return uploads, trained


def _replay(store, run_id: str, rounds: list[dict[str, Any]], cfg) -> tuple[bool, bool, bool, np.ndarray, str]:
    """Step the initial checkpoint through the run's recorded aggregates; the coordinates'
    counts. Returns (replay equals every checkpoint, aggregates whole, counts match records,
    counts, what went wrong first)."""
    from orchard import wire
    from orchard.aggregation import Partial, server_step
    from orchard.aggregation.server_opt import ServerOptimizer
    from orchard.server.root import aggregate_path

    ck0 = store.checkpoint(run_id, 0)
    arrays = wire.blob_to_arrays(Path(ck0.path).read_bytes())
    opt = ServerOptimizer(cfg.server_optimizer, arrays)
    counts = np.zeros(arrays[TENSOR].size, np.int64)
    replay_ok = whole = match = True
    why = ""
    for rec in sorted((r for r in rounds if r["status"] == "completed"), key=lambda r: r["round"]):
        ck = store.checkpoint(run_id, rec["round"])
        agg = wire.blob_to_arrays(Path(aggregate_path(Path(ck.path))).read_bytes())
        s = agg[TENSOR]
        k = np.rint(s)
        # SecAgg+ quantizes with stochastic rounding: a coordinate of a secure cohort's sum
        # is its count plus one rounding error per client (a few hundredths each), still
        # far from the half that would make the count ambiguous.
        tol = 0.4 if cfg.secure_aggregation.enabled else 1e-6
        if np.abs(s - k).max() > tol or k.min() < 0:
            whole, why = False, why or f"round {rec['round']}: aggregate not whole counts"
        if int(k.sum()) != rec["participants"]:
            match, why = False, why or f"round {rec['round']}: {int(k.sum())} counted, record says {rec['participants']}"
        counts += k.astype(np.int64)
        arrays, _ = server_step(Partial(agg, float(rec["weight"]), int(rec["participants"])), cfg, opt)
        want = wire.blob_to_arrays(Path(ck.path).read_bytes())
        if not all(np.array_equal(arrays[n], want[n]) for n in want):
            replay_ok, why = False, why or f"round {rec['round']}: replay differs from the checkpoint"
    return replay_ok, whole, match, counts, why


def drop_reason(ev: dict[str, Any], rounds: list[dict[str, Any]], recorded: dict[tuple[str, str], str]) -> str:
    """Why an acknowledged upload is in no aggregate, as the root's store records it, or ""
    when it records nothing: the upload's own row in the dropped uploads its aggregator
    reported (``orchard.server.droplog``), or its attempt's status (failed, interrupted or
    stopped: the root's attempt and everything it held are gone)."""
    why = recorded.get((ev["node"], ev["task"]))
    if why:
        return why
    att = [r for r in rounds if r["round"] == ev["round"] and r["attempt"] == ev["attempt"]]
    if att and att[0]["status"] in ("failed", "interrupted", "stopped"):
        return f"its attempt {att[0]['status']}"
    return ""


def guess(ev: dict[str, Any], run_end: float, kills: list[dict[str, Any]], holder: str, window_s: float) -> str:
    """A diagnostic for an upload the store records nothing about: what happened around it
    (from the kill times and the run's end); never counted as a reason."""
    t, t_end = ev["t"], ev["t"] + window_s
    if run_end and run_end < t:
        return "acknowledged after the run's last round was applied"
    if t <= run_end <= t_end:
        return "the run ended while it was on its way"
    for k in kills:
        if t <= k["t"] <= t_end and k["name"] == holder:
            return f"its aggregator {holder} was killed {k['t'] - t:.1f} s later"
    for k in kills:
        if t <= k["t"] <= t_end and k["kind"] == "root":
            return f"the root was killed {k['t'] - t:.1f} s later"
    return "no kill or run end near it"


def _kind(reason: str) -> str:
    """A recorded reason without what varies from one upload to the next (a round number, an
    error's details), to count them by kind."""
    for sep in (" (", ": ["):
        reason = reason.split(sep)[0]
    return re.sub(r"round \d+", "round N", reason)


def _growth(incarnations: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind: the largest growth of open descriptors and resident MiB over any
    incarnation that lived MIN_LIFE_S: the median of its last quarter of samples over the
    median of its second quarter (after WARM_S: start-up and the first round's imports
    and allocations are not growth; a leak keeps growing through the second half)."""
    out: dict[str, dict[str, float]] = {}
    for _name, (kind, incs) in incarnations.items():
        g = out.setdefault(kind, {"fd_growth": 0, "rss_growth_mib": 0.0, "longest_life_s": 0.0, "incarnations": 0})
        for inc in incs:
            g["incarnations"] += 1
            ready = inc.get("ready", inc["start"])
            s = [x for x in inc["samples"] if x[0] - ready >= WARM_S]
            if not s:
                continue
            life = s[-1][0] - ready
            g["longest_life_s"] = max(g["longest_life_s"], round(life, 1))
            if life < MIN_LIFE_S:
                continue
            q = max(1, len(s) // 4)
            early, late = s[q:2 * q] or s[:1], s[-q:]
            g["fd_growth"] = max(g["fd_growth"], int(np.median([x[1] for x in late]) - np.median([x[1] for x in early])))
            rss = (np.median([x[2] for x in late]) - np.median([x[2] for x in early])) / 2**20
            g["rss_growth_mib"] = max(g["rss_growth_mib"], round(float(rss), 1))
    return out


def check(facts: dict[str, Any]) -> dict[str, Any]:
    """Every invariant of the module doc of ``benchmarks/chaos.py``, from ``facts`` (``drive``)."""
    from orchard.config import RunConfig
    from orchard.server.droplog import DropLog
    from orchard.server.store import SQLiteStore

    work = Path(facts["work"])
    store = SQLiteStore(work / "root" / "orchard.db")
    drops = DropLog(work / "root" / "orchard.db")
    recorded_total = 0
    recorded_but_counted: Counter[str] = Counter()  # a record the aggregates contradict, by reason
    uploads, trained = _events(work)
    kills = facts["kills"]
    counted = double = phantom = not_acked = 0
    dropped: Counter[str] = Counter()
    lost: list[dict[str, Any]] = []
    inv = {"runs_finished": bool(facts["runs"]), "integer_aggregates": True, "counts_match_records": True,
           "no_double_count": True, "no_phantom_updates": True, "every_accepted_update_accounted": True,
           "replay_equals_final": True}
    problems: list[str] = []
    rounds_finished = 0
    runs_out = []
    try:
        for run in facts["runs"]:
            row = store.get_run(run["run_id"])
            cfg = RunConfig.model_validate_json(row.config_json)
            rounds = store.rounds(run["run_id"])
            done = [r for r in rounds if r["status"] == "completed"]
            rounds_finished += len(done)
            finished = row.status == "completed" and row.completed_rounds == cfg.rounds
            inv["runs_finished"] &= finished
            replay_ok, whole, match, counts, why = _replay(store, run["run_id"], rounds, cfg)
            inv["replay_equals_final"] &= replay_ok
            inv["integer_aggregates"] &= whole
            inv["counts_match_records"] &= match
            if why:
                problems.append(f"{run['run_id']}: {why}")
            double += int((counts > 1).sum())
            counted += int((counts > 0).sum())
            mine = [e for e in uploads if e["run"] == run["run_id"]]
            made = {(e["index"], e["seq"]) for e in mine} | trained
            for c in np.nonzero(counts)[0]:
                if (int(c) // SLOTS, int(c) % SLOTS) not in made:
                    phantom += 1
            acked = {(e["index"], e["seq"]) for e in mine if e["accepted"]}
            not_acked += sum(1 for c in np.nonzero(counts)[0] if (int(c) // SLOTS, int(c) % SLOTS) not in acked)
            run_end = max((r["finished"] or 0.0 for r in done), default=0.0)
            recorded = {(d["node_id"], d["task_id"]): d["reason"] for d in drops.dropped(run["run_id"])}
            recorded_total += len(recorded)
            for e in mine:
                if not e["accepted"] or counts[e["index"] * SLOTS + e["seq"]] > 0:
                    if (e["node"], e["task"]) in recorded and e["accepted"]:
                        recorded_but_counted[_kind(recorded[(e["node"], e["task"])])] += 1
                    continue
                why = drop_reason(e, rounds, recorded)
                if why:
                    dropped[_kind(why)] += 1
                else:
                    lost.append({**e, "diagnostic": guess(e, run_end, kills, facts["holders"][str(e["index"])],
                                                          facts["window_s"])})
            runs_out.append({"run_id": run["run_id"], "mode": run["mode"], "status": row.status,
                             "completed_rounds": row.completed_rounds, "rounds": cfg.rounds,
                             "attempts": len(rounds), "updates_counted": int((counts > 0).sum())})
    finally:
        drops.close()
        store.close()
    inv["no_double_count"] = double == 0
    inv["no_phantom_updates"] = phantom == 0
    inv["every_accepted_update_accounted"] = not lost
    growth = _growth(facts["incarnations"])
    inv["fds_bounded"] = all(g["fd_growth"] <= FD_GROWTH_MAX for g in growth.values())
    inv["rss_bounded"] = all(g["rss_growth_mib"] <= RSS_GROWTH_MAX_MIB for g in growth.values())
    return {
        "kills": len(kills), "kills_by_kind": dict(Counter(k["kind"] for k in kills)),
        "kills_by_phase": dict(Counter(f"{k['kind']}: {k['phase']}" for k in kills)),
        "double_counted": double, "lost_without_reason": len(lost), "lost_examples": lost[:10],
        "dropped_with_reason": dict(dropped), "drops_recorded": recorded_total,
        "recorded_dropped_but_counted": dict(recorded_but_counted),
        "lost_diagnostics": dict(Counter(e["diagnostic"] for e in lost)), "updates_counted": counted, "counted_not_acknowledged": not_acked,
        "phantom_updates": phantom, "uploads_acknowledged": sum(1 for e in uploads if e["accepted"]),
        "rounds_finished": rounds_finished, "runs": runs_out, "invariants": inv,
        "invariants_ok": all(inv.values()), "problems": problems, "growth": growth,
        "bounds": {"fd_growth_max": FD_GROWTH_MAX, "rss_growth_max_mib": RSS_GROWTH_MAX_MIB,
                   "min_life_s": MIN_LIFE_S, "drop_window_s": facts["window_s"]},
    }
