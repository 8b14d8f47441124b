"""ONNX Runtime with federated LoRA adapters: parity with PyTorch, adapter switching
on one base, and refusal of adapters that do not fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peft import LoraConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402

from orchard.edge_runtime.onnx_export import (  # noqa: E402
    ExportError,
    adapter_arrays,
    load_adapter_arrays,
    lora_parameter_map,
)
from orchard.edge_runtime.ort_runtime import (  # noqa: E402
    AdapterMismatchError,
    InferenceError,
    OrtLoraModel,
    read_onnx_adapter,
    write_onnx_adapter,
)

TOL = 1e-4  # max abs logit difference, float32


def _torch_logits(model, adapter: dict[str, np.ndarray], idx: np.ndarray) -> np.ndarray:
    load_adapter_arrays(model, adapter)
    with torch.no_grad():
        return model(torch.from_numpy(idx)).numpy()


def _tokens(rng: np.random.Generator, shape: tuple[int, int], vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=shape, dtype=np.int64)


def test_parity_and_switching(exported_gpt, tmp_path: Path) -> None:
    g = exported_gpt
    paths = []
    for v, arrays in enumerate(g.adapters, start=1):
        p = tmp_path / f"v{v}.onnx_adapter"
        write_onnx_adapter(arrays, p, adapter_version=v)
        paths.append(p)
    ort_model = OrtLoraModel(g.onnx_path)
    a1, a2 = (ort_model.load_adapter(p) for p in paths)
    assert (a1.adapter_version, a2.adapter_version) == (1, 2)
    rng = np.random.default_rng(0)
    for shape in [(2, 8), (3, 5), (1, 32)]:  # batch and sequence length are dynamic
        idx = _tokens(rng, shape, g.vocab_size)
        ref1 = _torch_logits(g.peft_model, g.adapters[0], idx)
        ref2 = _torch_logits(g.peft_model, g.adapters[1], idx)
        assert np.abs(ref1 - ref2).max() > 0.05  # the two versions really differ
        out1 = ort_model.run(idx, a1)
        out2 = ort_model.run(idx, a2)  # same session, other adapter
        assert out1.shape == (*shape, g.vocab_size)
        assert np.abs(out1 - ref1).max() <= TOL
        assert np.abs(out2 - ref2).max() <= TOL
        assert np.abs(ort_model.run(idx, a1) - ref1).max() <= TOL  # and back


def test_no_adapter_is_the_base_model(exported_gpt) -> None:
    g = exported_gpt
    idx = _tokens(np.random.default_rng(1), (2, 6), g.vocab_size)
    load_adapter_arrays(g.peft_model, g.adapters[0])
    with torch.no_grad(), g.peft_model.disable_adapter():
        base = g.peft_model(torch.from_numpy(idx)).numpy()
    ort_model = OrtLoraModel(g.onnx_path)
    assert np.abs(ort_model.run({"input": idx}) - base).max() <= TOL
    # The LoRA inputs are optional (zero initializers), and named by state-dict key.
    assert set(ort_model.lora_specs) == set(g.adapters[0])
    assert ort_model.input_name == "input" and ort_model.output_name == "logits"


def test_adapter_file_roundtrip(exported_gpt, tmp_path: Path) -> None:
    arrays = exported_gpt.adapters[1]
    write_onnx_adapter(arrays, tmp_path / "a.onnx_adapter", adapter_version=7, model_version=3)
    back = read_onnx_adapter(tmp_path / "a.onnx_adapter")
    assert (back.adapter_version, back.model_version) == (7, 3)
    assert set(back.arrays) == set(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(back.arrays[k], v)


def test_mismatched_adapters_are_refused(exported_gpt, tmp_path: Path) -> None:
    ort_model = OrtLoraModel(exported_gpt.onnx_path)
    good = exported_gpt.adapters[0]
    k = sorted(good)[0]
    wrong_rank = dict(good)
    wrong_rank[k] = np.zeros((good[k].shape[0] + 1, *good[k].shape[1:]), np.float32)
    write_onnx_adapter(wrong_rank, tmp_path / "bad.onnx_adapter")
    with pytest.raises(AdapterMismatchError, match="base expects"):
        ort_model.load_adapter(tmp_path / "bad.onnx_adapter")
    missing = {kk: v for kk, v in good.items() if kk != k}
    with pytest.raises(AdapterMismatchError, match="missing"):
        ort_model.check_adapter(missing)
    with pytest.raises(InferenceError):
        ort_model.run({"input": np.zeros((1, 4), np.int64), k: good[k]})
    with pytest.raises(InferenceError):
        ort_model.run(np.zeros((1, 4), np.float32))  # token ids are int64


def test_export_refuses_non_lora_adapter_state() -> None:
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    with pytest.raises(ExportError, match="not LoRA"):
        lora_parameter_map(model)


def test_adapter_arrays_roundtrip_into_torch() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"]))
    arrays = {k: np.full(v.shape, 0.5, np.float32) for k, v in adapter_arrays(model).items()}
    load_adapter_arrays(model, arrays)
    assert all(np.all(v == 0.5) for v in adapter_arrays(model).values())
    with pytest.raises(ExportError):
        load_adapter_arrays(model, {"nope": np.zeros(1, np.float32)})


def test_lora_trainer_arrays_map_onto_export_names() -> None:
    """The LoRA trainer uploads parameter-named tensors (only B for FFA-LoRA); after
    ``set_arrays`` they come out of ``adapter_arrays`` under the export's input names,
    with the shared frozen A alongside."""
    lora = pytest.importorskip("orchard.edge_runtime.lora")
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    spec = lora.LoRASpec(target_modules=("0", "2"), rank=2, variant="ffa")
    model = lora.apply_lora(base, spec)
    assert set(lora_parameter_map(model).values()) == set(lora.adapter_names(model))
    names = lora.trainable_names(model, spec)
    uploaded = {
        n: np.full(v.shape, 0.25, np.float32) for n, v in lora.get_arrays(model, names).items()
    }
    lora.set_arrays(model, uploaded, names)
    out = adapter_arrays(model)
    assert len(out) == 2 * len(names)
    for n in names:
        np.testing.assert_array_equal(out[n.replace(".default", "")], uploaded[n])
