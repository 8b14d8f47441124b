"""Experiment tracking: each round's metrics, bytes and participation, to TensorBoard or MLflow.

``orchard run start`` and ``orchard simulate`` take ``--tensorboard DIR`` and
``--mlflow-uri URI``. Both feed the same round records through :func:`round_scalars`,
so a simulated run and a live one show the same names side by side:

==========================  ==================================================
``eval/accuracy``, ``eval/loss``   the global model on the task's held-out data
                                   (the simulator, ``run start --evaluate``)
``clients/<metric>``               the cohort's weighted mean of a client metric
                                   (``train_loss``, ``train_accuracy``, ...)
``bytes/up``, ``bytes/down``       bytes on the wire in the round, all tiers
``participation/updates``          updates in the global model
``participation/selected``         nodes selected
``participation/dropped``          selected nodes that never delivered
``participation/refused``          uploads refused (any reason)
``round/seconds``                  wall-clock duration of the round
``privacy/epsilon``                the privacy budget spent, when the run reports one
                                   (``epsilon``, or ``privacy.epsilon`` of a round record)
==========================  ==================================================

TensorBoard events are written with ``torch.utils.tensorboard`` (the ``tensorboard``
package); MLflow is the optional extra ``pip install 'orchard-fl[mlflow]'``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from orchard.errors import OrchardError


class TrackingError(OrchardError):
    """A tracking backend cannot be used as asked (not installed, not writable)."""


def round_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one round record: the root's (``run status``) or the simulator's."""
    out: dict[str, float] = {}
    for key, name in (("accuracy", "eval/accuracy"), ("loss", "eval/loss"), ("bytes_up", "bytes/up"),
                      ("bytes_down", "bytes/down"), ("participants", "participation/updates"),
                      ("selected", "participation/selected"), ("dropped", "participation/dropped"),
                      ("seconds", "round/seconds"), ("epsilon", "privacy/epsilon")):
        v = rec.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[name] = float(v)
    privacy = rec.get("privacy")
    if isinstance(privacy, dict) and isinstance(privacy.get("epsilon"), int | float):
        out["privacy/epsilon"] = float(privacy["epsilon"])  # the budget spent after this round
    if "dropped" not in rec and isinstance(rec.get("vanished"), int):
        out["participation/dropped"] = float(rec["vanished"])  # the simulator's name for it
    rejected = rec.get("rejected")
    if isinstance(rejected, dict):
        out["participation/refused"] = float(sum(int(n) for n in rejected.values()))
    for k, v in {**(rec.get("metrics") or {}), **(rec.get("train_metrics") or {})}.items():
        if isinstance(v, int | float):
            out[f"clients/{k}"] = float(v)
    return {k: v for k, v in out.items() if math.isfinite(v)}


class Tracker(Protocol):
    def name_run(self, run_id: str) -> None: ...

    def log_round(self, rnd: int, rec: dict[str, Any]) -> None: ...

    def close(self, status: str) -> None: ...


class TensorBoardTracker:
    """One TensorBoard run directory; the step of every scalar is the round number."""

    def __init__(self, log_dir: Path, params: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise TrackingError(f"--tensorboard needs the tensorboard package ({err}); "
                                "pip install tensorboard") from None
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrackingError(f"cannot write TensorBoard events to {log_dir}: {err.strerror or err}") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))
        lines = [f"| {k} | {v} |" for k, v in sorted(params.items())]
        self.writer.add_text("run", "| parameter | value |\n|---|---|\n" + "\n".join(lines), 0)

    def name_run(self, run_id: str) -> None:
        self.writer.add_text("run_id", run_id, 0)

    def log_round(self, rnd: int, rec: dict[str, Any]) -> None:
        for name, v in round_scalars(rec).items():
            self.writer.add_scalar(name, v, rnd)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


class MlflowTracker:
    """One MLflow run in ``experiment`` at ``uri``; scalars are logged per round as steps."""

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any]) -> None:
        try:
            import mlflow
        except ImportError:
            raise TrackingError("--mlflow-uri needs the mlflow extra: pip install 'orchard-fl[mlflow]'") from None
        self.mlflow = mlflow
        try:
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(experiment)
            self.run = mlflow.start_run(run_name=run_name or None)
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        except Exception as err:  # MlflowException, connection errors: say which URI, stop before the run
            raise TrackingError(f"cannot log to MLflow at {uri}: {err}") from None

    def name_run(self, run_id: str) -> None:
        self.mlflow.set_tag("mlflow.runName", run_id)
        self.mlflow.set_tag("orchard.run_id", run_id)

    def log_round(self, rnd: int, rec: dict[str, Any]) -> None:
        scalars = round_scalars(rec)
        # MLflow metric keys may not hold every character TensorBoard's do; '/' is allowed.
        self.mlflow.log_metrics(scalars, step=rnd)

    def close(self, status: str) -> None:
        self.mlflow.set_tag("orchard.status", status)
        ok = status == "completed"
        self.mlflow.end_run(status="FINISHED" if ok else "FAILED")


class Trackers:
    """Every tracker asked for, driven together."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def name_run(self, run_id: str) -> None:
        for t in self.trackers:
            t.name_run(run_id)

    def log_round(self, rnd: int, rec: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_round(rnd, rec)

    def close(self, status: str) -> None:
        for t in self.trackers:
            t.close(status)


def open_trackers(tensorboard: Path | None, mlflow_uri: str | None, run_name: str, params: dict[str, Any],
                  experiment: str = "orchard") -> Trackers:
    trackers: list[Any] = []
    if tensorboard is not None:
        trackers.append(TensorBoardTracker(tensorboard, params))
    if mlflow_uri:
        trackers.append(MlflowTracker(mlflow_uri, experiment, run_name, params))
    return Trackers(trackers)
