"""A Flower ClientApp written as Flower's quickstart writes one runs unchanged as an
Orchard trainer; broken apps give named errors."""

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from orchard.client.flower_adapter import (
    FlowerAppError,
    FlowerReplyError,
    FlowerTrainer,
    load_client_app,
)
from orchard.errors import ConfigError, OrchardError, UpdateSchemaError
from orchard.trainer import TrainConfig, Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def quickstart(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(FIXTURES))
    import flower_quickstart_app

    return flower_quickstart_app


def _initial(module) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return {k: v.numpy().copy() for k, v in module.Net().state_dict().items()}


def test_quickstart_app_trains_and_evaluates_through_the_adapter(quickstart) -> None:  # type: ignore[no-untyped-def]
    trainer = FlowerTrainer(
        "flower_quickstart_app:app",
        partition_id=1,
        num_partitions=4,
        run_config={"local-epochs": 2},
    )
    assert isinstance(trainer, Trainer)
    init = _initial(quickstart)
    result = trainer.train(init, TrainConfig(learning_rate=0.01))
    assert list(result.arrays) == list(init)
    assert all(result.arrays[k].shape == init[k].shape for k in init)
    assert any(not np.array_equal(result.arrays[k], init[k]) for k in init)
    expected_examples = len(quickstart.load_data(1, 4)[0].dataset)
    assert result.num_examples == expected_examples and result.weight == float(expected_examples)
    assert "train_loss" in result.metrics and "num-examples" not in result.metrics

    before = trainer.evaluate(init, TrainConfig())
    after = trainer.evaluate(result.arrays, TrainConfig())
    assert before.num_examples == len(quickstart.load_data(1, 4)[1].dataset)
    assert after.metrics["eval_acc"] > before.metrics["eval_acc"] + 0.2


def test_app_object_and_reference_give_the_same_update(quickstart) -> None:  # type: ignore[no-untyped-def]
    init = _initial(quickstart)
    torch.manual_seed(1)  # the quickstart DataLoader shuffles with torch's global RNG
    a = FlowerTrainer(quickstart.app, 0, 2, run_config={"local-epochs": 1}).train(
        init, TrainConfig()
    )
    torch.manual_seed(1)
    b = FlowerTrainer("flower_quickstart_app:app", 0, 2, run_config={"local-epochs": 1}).train(
        init, TrainConfig()
    )
    assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in init)


def test_the_app_sees_node_config_and_train_config() -> None:
    seen: dict[str, object] = {}
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.update(context.node_config)
        seen.update({f"config:{k}": v for k, v in msg.content["config"].items()})
        seen["rounds"] = int(context.state.config_records.get("mine", {"n": 0})["n"]) + 1
        from flwr.app import ConfigRecord

        context.state["mine"] = ConfigRecord({"n": seen["rounds"]})
        arrays = msg.content["arrays"]
        return Message(
            RecordDict(
                {"arrays": arrays, "metrics": MetricRecord({"num-examples": 3, "num-steps": 5})}
            ),
            reply_to=msg,
        )

    trainer = FlowerTrainer(app, partition_id=2, num_partitions=7)
    cfg = TrainConfig(epochs=3, steps=9, batch_size=8, learning_rate=0.2, extra={"server-round": 4})
    result = trainer.train({"w": np.ones((2, 2), np.float32)}, cfg)
    assert seen["partition-id"] == 2 and seen["num-partitions"] == 7
    assert seen["config:lr"] == pytest.approx(0.2) and seen["config:local-epochs"] == 3
    assert seen["config:local-steps"] == 9 and seen["config:batch-size"] == 8
    assert seen["config:server-round"] == 4
    assert result.num_steps == 5 and result.num_examples == 3
    trainer.train({"w": np.ones((2, 2), np.float32)}, cfg)
    assert seen["rounds"] == 2  # context.state persists across calls, as on a SuperNode


def _app_replying(reply_content) -> ClientApp:  # type: ignore[no-untyped-def]
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return reply_content(msg)

    return app


ARRAYS = {"w": np.ones(3, np.float32)}


def test_an_app_that_raises_is_a_named_error() -> None:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(FlowerAppError, match="CUDA out of memory") as err:
        FlowerTrainer(app, 0, 1).train(ARRAYS, TrainConfig())
    assert isinstance(err.value, OrchardError)


def test_an_error_reply_is_a_named_error() -> None:
    app = _app_replying(lambda msg: Message(Error(code=3, reason="dataset missing"), reply_to=msg))
    with pytest.raises(FlowerAppError, match="dataset missing"):
        FlowerTrainer(app, 0, 1).train(ARRAYS, TrainConfig())


def test_a_missing_handler_is_a_named_error() -> None:
    app = ClientApp()  # no @app.evaluate()
    with pytest.raises(FlowerAppError, match="evaluate"):
        FlowerTrainer(app, 0, 1).evaluate(ARRAYS, TrainConfig())


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (lambda msg: "not a message", "not a flwr.app.Message"),
        (
            lambda msg: Message(
                RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg
            ),
            "ArrayRecord",
        ),
        (
            lambda msg: Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg),
            "MetricRecord",
        ),
        (
            lambda msg: Message(
                RecordDict(
                    {"arrays": msg.content["arrays"], "metrics": MetricRecord({"train_loss": 0.1})}
                ),
                reply_to=msg,
            ),
            "num-examples",
        ),
        (
            lambda msg: Message(
                RecordDict(
                    {"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": -4})}
                ),
                reply_to=msg,
            ),
            "num-examples",
        ),
        (
            lambda msg: Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord([np.zeros(3, np.float32)]),
                        "metrics": MetricRecord({"num-examples": 1}),
                    }
                ),
                reply_to=msg,
            ),
            "names",
        ),
        (
            lambda msg: Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({"w": torch.zeros(4)}),
                        "metrics": MetricRecord({"num-examples": 1}),
                    }
                ),
                reply_to=msg,
            ),
            "shape",
        ),
    ],
)
def test_malformed_replies_are_named_errors(reply, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FlowerReplyError, match=match) as err:
        FlowerTrainer(_app_replying(reply), 0, 1).train(ARRAYS, TrainConfig())
    assert isinstance(err.value, UpdateSchemaError)


def test_bad_app_references_are_config_errors(quickstart) -> None:  # type: ignore[no-untyped-def]
    for ref in (
        "no_colon",
        "no_such_module_xyz:app",
        "flower_quickstart_app:nope",
        "flower_quickstart_app:Net",
    ):
        with pytest.raises(ConfigError):
            load_client_app(ref)
    with pytest.raises(ConfigError):
        FlowerTrainer(quickstart.app, partition_id=3, num_partitions=3)
