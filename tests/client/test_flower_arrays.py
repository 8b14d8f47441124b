"""The .npy bytes shared between simulated clients' messages: every client still gets
its own record, an app cannot reach another client's input through it, and arrays read
back are what ``Array.numpy()`` reads."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from orchard.client.flower_adapter import FlowerTrainer
from orchard.client.flower_arrays import ArrayBytes
from orchard.trainer import TrainConfig

GLOBAL = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.linspace(-1, 1, 4).astype(np.float32)}


def _vandal_app(seen: list[dict[str, np.ndarray]]) -> ClientApp:
    """Records what it received, then does everything an app could do to it."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rec = msg.content["arrays"]
        seen.append({k: a.numpy().copy() for k, a in rec.items()})
        rec["w"].numpy()[...] = 99.0  # a fresh copy: writes go nowhere
        rec["b"].data = Array(np.zeros(4, np.float32)).data  # the Array object itself
        rec["w"] = Array(np.full((3, 4), -5.0, np.float32))  # the record's entry
        msg.content["config"]["lr"] = 123.0
        out = ArrayRecord({"w": Array(np.ones((3, 4), np.float32)), "b": Array(np.ones(4, np.float32))})
        return Message(RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    return app


def test_an_app_that_mutates_its_input_does_not_change_another_clients() -> None:
    seen: list[dict[str, np.ndarray]] = []
    app = _vandal_app(seen)
    shared = ArrayBytes()
    for pid in range(3):
        FlowerTrainer(app, partition_id=pid, num_partitions=3, array_bytes=shared).train(GLOBAL, TrainConfig())
    assert len(seen) == 3
    for got in seen:
        assert list(got) == ["w", "b"]
        for k, v in GLOBAL.items():
            np.testing.assert_array_equal(got[k], v)
    np.testing.assert_array_equal(GLOBAL["w"], np.arange(12, dtype=np.float32).reshape(3, 4))


def test_each_message_has_its_own_record_and_arrays_over_the_same_bytes() -> None:
    shared = ArrayBytes()
    one, two = shared.record(GLOBAL), shared.record(GLOBAL)
    assert one is not two
    for k in GLOBAL:
        assert one[k] is not two[k]
        assert one[k].data is two[k].data  # built once
        reference = Array(np.ascontiguousarray(GLOBAL[k]))
        assert (one[k].dtype, one[k].shape, one[k].stype, one[k].data) == (
            reference.dtype, reference.shape, reference.stype, reference.data)


def test_arrays_changed_in_place_are_encoded_again() -> None:
    shared = ArrayBytes()
    arrays = {k: v.copy() for k, v in GLOBAL.items()}
    first = shared.record(arrays)["w"].numpy()
    arrays["w"][0, 0] = 42.0  # the same dict and array objects, new content
    second = shared.record(arrays)["w"].numpy()
    assert first[0, 0] == 0.0 and second[0, 0] == 42.0
    arrays["w"] = arrays["w"].astype(np.float64)  # a new dtype: new bytes and header
    assert shared.record(arrays)["w"].numpy().dtype == np.float64


@pytest.mark.parametrize("value", [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    np.array(3.5, dtype=np.float16),
    np.zeros((0, 4), np.float32),
    np.arange(5, dtype=">i4"),
    np.arange(24, dtype=np.int64).reshape(2, 3, 4)[:, ::2],
])
def test_numpy_reads_what_array_numpy_reads(value: np.ndarray) -> None:
    shared = ArrayBytes()
    for _ in range(2):  # the header parsed, then cached
        array = Array(value)
        got, want = shared.numpy(array), array.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable
        if got.size:
            got.flat[0] = 7
            np.testing.assert_array_equal(array.numpy(), want)  # a copy, not the reply's bytes


def test_numpy_leaves_what_it_does_not_know_to_flower() -> None:
    shared = ArrayBytes()
    bad = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=Array(np.ones(3, np.float32)).data[:-4])
    with pytest.raises(ValueError):  # np.load's own error for a truncated file
        shared.numpy(bad)
    other = Array(dtype="float32", shape=(2,), stype="torch.Tensor", data=b"\x00" * 8)
    with pytest.raises(TypeError):
        shared.numpy(other)
