"""Upload admission as a pure function: every refusal by name, and what passes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchard.config import CodecSpec, RunConfig, SecureAggregationConfig
from orchard.errors import (
    DuplicateUploadError,
    NotSelectedError,
    PayloadTooLargeError,
    RoundClosedError,
    UpdateSchemaError,
)
from orchard.messages import PARTIAL_CODEC, UploadHeader, UploadKind
from orchard.server.admission import (
    SlotState,
    admit_header,
    check_assignment,
    check_round,
    check_schema,
)
from orchard.server.round import RoundTask
from orchard.typing import Role, TensorSpec

SCHEMA = (TensorSpec("w", (3, 2), "float32"), TensorSpec("b", (2,), "float32"))
LIMIT = 10_000


def _task(**run: object) -> RoundTask:
    cfg = RunConfig(codec=CodecSpec(name="float32"), **run)  # type: ignore[arg-type]
    return RoundTask(run_id="run", round=3, attempt=1, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"", model_hash="h", schema=SCHEMA, deadline_unix=0.0, target=4, shared_seed=0)


def _client(**kw: object) -> UploadHeader:
    h = UploadHeader(node_id="n1", run_id="run", round=3, attempt=1, task_id="t1", kind=UploadKind.CLIENT_UPDATE,
                     schema=SCHEMA, payload_sizes=(24, 8), codec="float32", payload_sha256="0" * 64, weight=5.0,
                     count=1, metric_sums={"loss": 1.0}, metric_weights={"loss": 5.0})
    return replace(h, **kw)  # type: ignore[arg-type]


def _partial(**kw: object) -> UploadHeader:
    fields: dict[str, object] = dict(kind=UploadKind.PARTIAL_SUM, codec=PARTIAL_CODEC, payload_sizes=(48, 16), count=7,
                                     weight=70.0)
    return _client(**{**fields, **kw})


SLOT = SlotState(task_id="t1", target=1)


def test_a_good_client_update_and_a_good_partial_pass() -> None:
    assert admit_header(_client(), "n1", Role.CLIENT, _task(), SLOT, LIMIT) is UploadKind.CLIENT_UPDATE
    agg = SlotState(task_id="t1", target=5)
    assert admit_header(_partial(), "n1", Role.AGGREGATOR, _task(), agg, LIMIT) is UploadKind.PARTIAL_SUM
    # An aggregator whose cohort delivered nothing sends an empty partial: count 0, weight 0.
    assert admit_header(_partial(count=0, weight=0.0), "n1", Role.AGGREGATOR, _task(), agg, LIMIT)


REFUSALS: list[tuple[str, object, type[Exception], str]] = [
    ("another node's header", _client(node_id="n2"), UpdateSchemaError, "caller"),
    ("wrong kind for a client", _partial(), UpdateSchemaError, "must upload CLIENT_UPDATE"),
    ("renamed tensor", _client(schema=(TensorSpec("x", (3, 2), "float32"), SCHEMA[1])), UpdateSchemaError, "names"),
    ("reshaped tensor", _client(schema=(TensorSpec("w", (2, 3), "float32"), SCHEMA[1])), UpdateSchemaError, "shape"),
    ("other dtype", _client(schema=(TensorSpec("w", (3, 2), "float64"), SCHEMA[1])), UpdateSchemaError, "dtype"),
    ("sizes do not match tensors", _client(payload_sizes=(24,)), UpdateSchemaError, "payload sizes"),
    ("negative size", _client(payload_sizes=(40, -8)), UpdateSchemaError, ">= 0"),
    ("too large", _client(payload_sizes=(LIMIT, 8)), PayloadTooLargeError, "limit"),
    ("other codec", _client(codec="qsgd"), UpdateSchemaError, "this round uses 'float32'"),
    ("client counts more than one", _client(count=2), UpdateSchemaError, "counts 1"),
    ("zero weight", _client(weight=0.0), UpdateSchemaError, "positive"),
    ("NaN weight", _client(weight=float("nan")), UpdateSchemaError, "positive"),
    ("infinite metric", _client(metric_sums={"loss": float("inf")}), UpdateSchemaError, "metric 'loss'"),
]


@pytest.mark.parametrize(("case", "header", "error", "says"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_client_header_refusals(case: str, header: UploadHeader, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        admit_header(header, "n1", Role.CLIENT, _task(), SLOT, LIMIT)


def test_partial_refusals() -> None:
    agg = SlotState(task_id="t1", target=5)
    for header, says in [(_partial(codec="float32"), "travel as"), (_partial(count=-1), "out of range"),
                         (_partial(weight=0.0), "partial weight"), (_client(), "must upload PARTIAL_SUM")]:
        with pytest.raises(UpdateSchemaError, match=says):
            admit_header(header, "n1", Role.AGGREGATOR, _task(), agg, LIMIT)


def test_slot_state_refusals() -> None:
    for slot, error, says in [(replace(SLOT, delivered=True), DuplicateUploadError, "already delivered"),
                              (replace(SLOT, in_flight=True), DuplicateUploadError, "in progress"),
                              (replace(SLOT, dropped=True), RoundClosedError, "dropped")]:
        with pytest.raises(error, match=says):
            admit_header(_client(), "n1", Role.CLIENT, _task(), slot, LIMIT)


def test_secure_rounds_take_no_plain_client_update() -> None:
    task = _task(secure_aggregation=SecureAggregationConfig(enabled=True))
    with pytest.raises(UpdateSchemaError, match="masked"):
        admit_header(_client(), "n1", Role.CLIENT, task, SLOT, LIMIT)


def test_round_matching() -> None:
    t = _task()
    assert check_round(t, False, "", "run", 3, 1) is t
    with pytest.raises(RoundClosedError, match="no round is open"):
        check_round(None, False, "", "run", 3, 1)
    with pytest.raises(RoundClosedError, match="stale"):
        check_round(t, False, "", "run", 2, 9)
    with pytest.raises(RoundClosedError, match="unknown or future"):
        check_round(t, False, "", "run", 4, 0)
    with pytest.raises(RoundClosedError, match="unknown or future"):
        check_round(t, False, "", "other-run", 3, 1)
    with pytest.raises(RoundClosedError, match="target reached"):
        check_round(t, True, "target reached", "run", 3, 1)


def test_assignment_matching() -> None:
    assert check_assignment(SLOT, "n1", "t1", 3) is SLOT
    with pytest.raises(NotSelectedError, match="holds no assignment"):
        check_assignment(None, "n1", "t1", 3)
    with pytest.raises(NotSelectedError, match="holds no assignment"):
        check_assignment(SLOT, "n1", "t0", 3)


def test_equal_schemas_pass_and_any_difference_is_named() -> None:
    check_schema(SCHEMA, SCHEMA)
    with pytest.raises(UpdateSchemaError, match="'b' declared shape"):
        check_schema((SCHEMA[0], TensorSpec("b", (3,), "float32")), SCHEMA)


def test_async_versions_known_current_stale_and_future() -> None:
    from orchard.errors import FutureModelVersionError, StaleUpdateError, UnknownModelVersionError
    from orchard.server.admission import check_version

    t = _task()  # serves version (round) 3
    assert check_version(t, False, "", "run", 3, 2) == (t, 0)
    assert check_version(t, False, "", "run", 1, 2) == (t, 2)
    # A continuation's updates are applied after the next step: one version staler.
    assert check_version(t, False, "", "run", 2, 2, ahead=1) == (t, 2)
    with pytest.raises(StaleUpdateError, match="3 versions stale"):
        check_version(t, False, "", "run", 1, 2, ahead=1)
    with pytest.raises(StaleUpdateError, match="at most 0 versions old"):
        check_version(t, False, "", "run", 2, 0)
    with pytest.raises(FutureModelVersionError, match="round 4 is from the future"):
        check_version(t, False, "", "run", 4, 2)
    for run, version in (("other", 3), ("run", 0), ("run", -1)):
        with pytest.raises(UnknownModelVersionError, match="no model version this tier served"):
            check_version(t, False, "", run, version, 2)
    with pytest.raises(RoundClosedError, match="closed"):
        check_version(t, True, "target reached", "run", 3, 2)
    with pytest.raises(RoundClosedError, match="no buffer is open"):
        check_version(None, False, "", "run", 3, 2)
