"""A Flower ``ClientApp`` as an Orchard :class:`~orchard.trainer.Trainer`.

An existing Flower app (Message API, flwr >= 1.20: ``@app.train()`` and
``@app.evaluate()`` handlers taking ``(msg: Message, context: Context)``) runs
unchanged behind Orchard's tiers, codecs and secure aggregation. Each call builds the
``Message`` a Flower SuperNode would deliver and invokes the app in-process through
its public ``ClientApp.__call__(message, context)``:

- content ``"arrays"``: an ``ArrayRecord`` of the global arrays, in Orchard's order;
- content ``"config"``: a ``ConfigRecord`` from :class:`~orchard.trainer.TrainConfig`,
  under Flower's usual kebab-case keys plus ``"lr"`` (what Flower's templates read);
- ``Context.node_config``: ``{"partition-id", "num-partitions"}``, as Flower's
  simulation engine sets it; ``Context.run_config`` is the ``run_config`` given here;
  ``Context.state`` persists across calls, as it does on a SuperNode.

The reply must carry exactly one ``ArrayRecord`` (train only) with the same names and
shapes that were sent, and a ``MetricRecord`` holding an integer ``"num-examples"``,
which becomes the update's weight. An app that raises, replies with a Flower
``Error``, or replies with malformed records raises :class:`FlowerAppError` or
:class:`FlowerReplyError`; both are :class:`~orchard.errors.OrchardError`, which the
client runtime reports as a failed task instead of crashing.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import (
    DEFAULT_TTL,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    Metadata,
    RecordDict,
)
from flwr.clientapp import ClientApp

from orchard.client.flower_arrays import ArrayBytes
from orchard.errors import ConfigError, OrchardError, UpdateSchemaError
from orchard.trainer import EvalResult, TrainConfig, TrainResult
from orchard.typing import NDArrays

NUM_EXAMPLES = "num-examples"  # Flower's key for the weight of a reply
NUM_STEPS = "num-steps"  # optional; Flower apps rarely report it


class FlowerAdapterError(OrchardError):
    """Base of the errors a wrapped Flower app can cause."""


class FlowerAppError(FlowerAdapterError):
    """The Flower app raised, or replied with a Flower ``Error``."""


class FlowerReplyError(FlowerAdapterError, UpdateSchemaError):
    """The Flower app's reply does not hold what a train/evaluate reply must hold."""


def load_client_app(app_ref: str) -> ClientApp:
    """``"package.module:attribute"`` -> the ``ClientApp`` it names (as ``flwr run``
    resolves ``clientapp`` in ``pyproject.toml``)."""
    module_name, sep, attr = app_ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"Flower app reference {app_ref!r} must look like 'package.module:app'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot load Flower app {app_ref!r}: {err}") from err
    if not isinstance(obj, ClientApp):
        raise ConfigError(f"{app_ref!r} is a {type(obj).__name__}, not a flwr.clientapp.ClientApp")
    return obj


def config_record(config: TrainConfig) -> ConfigRecord:
    """A TrainConfig as Flower config values. ``extra`` entries of a Flower-compatible
    type pass through under their own names (and win over the derived keys)."""
    values: dict[str, Any] = {
        "lr": float(config.learning_rate),
        "learning-rate": float(config.learning_rate),
        "local-epochs": int(config.epochs),
        "batch-size": int(config.batch_size),
        "optimizer": str(config.optimizer),
        "momentum": float(config.momentum),
        "weight-decay": float(config.weight_decay),
        "proximal-mu": float(config.proximal_mu),
        "seed": int(config.seed),
    }
    if config.steps is not None:
        values["local-steps"] = int(config.steps)
    for key, value in config.extra.items():
        if isinstance(value, bool | int | float | str | bytes):
            values[str(key)] = value
    return ConfigRecord(values)


class FlowerTrainer:
    """Runs a Flower ``ClientApp`` as this client's trainer.

    ``node_id`` identifies the simulated node in the Flower ``Context`` (default:
    ``partition_id``); ``run_config`` is what the app reads from
    ``context.run_config`` (for example ``{"local-epochs": 1}``). ``array_bytes``:
    where the arrays' ``.npy`` bytes are kept, shared by the trainers of one app's
    simulated clients so that every message of one global model reuses them
    (:mod:`orchard.client.flower_arrays`); by default this trainer's own.
    """

    # The app reads the round from its config record ("server-round"), live and simulated
    # alike (orchard.trainer.round_config puts it there).
    reads_round = True

    def __init__(
        self,
        app_ref: str | ClientApp,
        partition_id: int,
        num_partitions: int,
        run_config: Mapping[str, Any] | None = None,
        node_id: int | None = None,
        array_bytes: ArrayBytes | None = None,
    ) -> None:
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
        self.app = load_client_app(app_ref) if isinstance(app_ref, str) else app_ref
        if not isinstance(self.app, ClientApp):
            raise ConfigError(
                f"expected a flwr.clientapp.ClientApp or 'module:app', got {type(app_ref).__name__}"
            )
        self.node_id = partition_id if node_id is None else node_id
        # One Context per node for the trainer's lifetime: Flower apps may keep
        # per-client state (personalised layers, optimizer state) in context.state.
        self.context = Context(
            run_id=0,
            node_id=self.node_id,
            node_config={"partition-id": partition_id, "num-partitions": num_partitions},
            state=RecordDict(),
            run_config=dict(run_config or {}),
        )
        self._explicit_run_config = dict(run_config or {})
        self._sent = 0  # messages sent, for unique message ids
        self._bytes = array_bytes if array_bytes is not None else ArrayBytes()

    def _call(self, kind: str, arrays: NDArrays, config: TrainConfig) -> RecordDict:
        # Flower apps read their hyper-parameters from context.run_config (Flower fills it
        # from the app's pyproject); here the round's training config fills it, and an
        # explicit run_config given to this trainer wins.
        values = config_record(config)
        self.context.run_config = {**values, **self._explicit_run_config}
        content = RecordDict({"arrays": self._bytes.record(arrays), "config": values})
        self._sent += 1
        message_id = f"orchard-{self.node_id}-{self._sent}"
        # Explicit metadata, as Flower's own simulation builds it: the short form
        # Message(content, dst_node_id, message_type) reads a process-wide task identity
        # that only a running SuperNode sets.
        message = Message(  # type: ignore[call-overload]  # metadata= is untyped in flwr's overloads
            content=content,
            metadata=Metadata(
                run_id=self.context.run_id,
                message_id=message_id,
                src_node_id=0,
                dst_node_id=self.node_id,
                reply_to_message_id="",
                group_id="",
                created_at=time.time(),
                ttl=DEFAULT_TTL,
                message_type=kind,
            ),
        )
        try:
            reply = self.app(message, self.context)
        except Exception as err:  # noqa: BLE001 - any failure of user code is the app's failure
            raise FlowerAppError(
                f"the Flower app's {kind} handler raised {type(err).__name__}: {err}"
            ) from err
        if not isinstance(reply, Message):
            raise FlowerReplyError(
                f"the Flower app's {kind} handler returned {type(reply).__name__}, not a flwr.app.Message"
            )
        if reply.metadata.reply_to_message_id != message_id:
            raise FlowerReplyError(
                f"the Flower app's {kind} handler returned a message that does not reply to the one it got; "
                "build it with Message(content, reply_to=msg)"
            )
        if reply.has_error():
            raise FlowerAppError(
                f"the Flower app's {kind} handler replied with error {reply.error.code}: {reply.error.reason}"
            )
        if not reply.has_content():
            raise FlowerReplyError(
                f"the Flower app's {kind} reply has neither content nor an error"
            )
        return reply.content

    @staticmethod
    def _metrics(content: RecordDict, kind: str) -> tuple[int, dict[str, float]]:
        records = list(content.metric_records.values())
        if len(records) != 1:
            raise FlowerReplyError(
                f"a {kind} reply must hold one MetricRecord with {NUM_EXAMPLES!r}; it holds {len(records)}"
            )
        record = records[0]
        count = record.get(NUM_EXAMPLES)
        if isinstance(count, float) and count.is_integer():
            count = int(count)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise FlowerReplyError(
                f"the {kind} reply's MetricRecord must hold {NUM_EXAMPLES!r} as a non-negative integer "
                f"(the update's weight); got {count!r}"
            )
        metrics = {
            k: float(v)
            for k, v in record.items()
            if k != NUM_EXAMPLES and isinstance(v, int | float)
        }
        return count, metrics

    def train(self, arrays: NDArrays, config: TrainConfig) -> TrainResult:
        content = self._call(MessageType.TRAIN, arrays, config)
        records = list(content.array_records.items())
        if len(records) != 1:
            raise FlowerReplyError(
                f"a train reply must hold exactly one ArrayRecord; it holds {len(records)}"
            )
        returned = {k: self._bytes.numpy(v) for k, v in records[0][1].items()}
        if set(returned) != set(arrays):
            raise FlowerReplyError(
                f"the train reply's ArrayRecord names {sorted(set(returned) ^ set(arrays))[:5]} "
                "differ from the arrays sent; a reply must return the model it was given"
            )
        for name, value in arrays.items():
            if returned[name].shape != np.shape(value):
                raise FlowerReplyError(
                    f"array {name!r}: sent shape {np.shape(value)}, the reply has {returned[name].shape}"
                )
        num_examples, metrics = self._metrics(content, "train")
        steps = metrics.pop(NUM_STEPS, 0.0)
        return TrainResult(
            arrays={name: returned[name] for name in arrays},  # Orchard's order, not the app's
            weight=float(num_examples),
            num_examples=num_examples,
            num_steps=int(steps),
            metrics=metrics,
        )

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        content = self._call(MessageType.EVALUATE, arrays, config)
        num_examples, metrics = self._metrics(content, "evaluate")
        return EvalResult(num_examples=num_examples, metrics=metrics)
