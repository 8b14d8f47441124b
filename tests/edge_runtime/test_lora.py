"""LoRA trainer: only adapters train and travel, peft format round trip, FFA exactness."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orchard.edge_runtime.lora import (
    LoRAError,
    LoRASpec,
    LoRATrainer,
    adapter_names,
    apply_lora,
    get_arrays,
    load_adapter,
    merge,
    save_global_adapter,
    set_arrays,
    trainable_names,
)
from orchard.errors import ConfigError, UpdateSchemaError
from orchard.gpt import GPT, GPTConfig, lora_target_modules
from orchard.tasks.torch_trainer import TensorData, TorchTrainer
from orchard.trainer import TrainConfig

CFG = GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2, d_model=16)
CONFIG = TrainConfig(epochs=2, batch_size=4, learning_rate=0.05, optimizer="adam", seed=1)


def base() -> GPT:
    gen_state = torch.get_rng_state()
    torch.manual_seed(42)
    model = GPT(CFG)
    torch.set_rng_state(gen_state)
    return model


def spec(variant: str = "ffa", init_seed: int = 0) -> LoRASpec:
    return LoRASpec(
        target_modules=tuple(lora_target_modules()),
        rank=4,
        alpha=8,
        variant=variant,
        init_seed=init_seed,
    )


def data(seed: int, n: int = 12) -> TensorData:
    g = torch.Generator().manual_seed(seed)
    # A client-specific cyclic pattern so that different clients learn different updates.
    start = torch.randint(0, CFG.vocab_size, (n, 1), generator=g)
    step = 1 + seed % 3
    ids = (start + step * torch.arange(CFG.seq_len + 1)) % CFG.vocab_size
    return TensorData(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def trainer(s: LoRASpec, client: int) -> LoRATrainer:
    d = data(client)
    return LoRATrainer(
        base, s, lambda factory, names: TorchTrainer(factory, d, d, trainable=names, seed=client)
    )


def initial(s: LoRASpec) -> dict[str, np.ndarray]:
    m = apply_lora(base(), s)
    return get_arrays(m, trainable_names(m, s))


def test_ffa_update_holds_only_b_and_the_base_is_bit_identical() -> None:
    s = spec("ffa")
    t = trainer(s, 0)
    init = initial(s)
    result = t.train(init, CONFIG)
    assert list(result.arrays) == list(init)
    assert result.arrays and all(".lora_B." in n for n in result.arrays)
    assert any(not np.array_equal(result.arrays[n], init[n]) for n in init)  # B trained
    assert result.num_examples == 12 and result.num_steps == 2 * 3

    model = t.inner.model  # type: ignore[attr-defined]
    fresh = base().state_dict()
    params = dict(model.named_parameters())
    for name, value in fresh.items():
        wrapped = "base_model.model." + name.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias"
        )
        tensor = params.get("base_model.model." + name, params.get(wrapped))
        if tensor is None:  # the tied LM head appears once, as wte.weight
            continue
        assert torch.equal(tensor, value), name
    fresh_a = {n: p for n, p in apply_lora(base(), s).named_parameters() if ".lora_A." in n}
    assert all(torch.equal(params[n], a) for n, a in fresh_a.items())  # A frozen


def test_full_variant_trains_and_sends_a_and_b() -> None:
    s = spec("full")
    init = initial(s)
    assert any(".lora_A." in n for n in init) and any(".lora_B." in n for n in init)
    result = trainer(s, 0).train(init, CONFIG)
    changed = {n for n in init if not np.array_equal(result.arrays[n], init[n])}
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)
    ffa = sum(a.size for a in initial(spec("ffa")).values())
    assert ffa < sum(a.size for a in init.values())  # FFA sends strictly fewer floats
    model = apply_lora(base(), s)
    # Per adapted layer, B is d x r and A is r x k.
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_B." in n) == ffa


def test_training_is_deterministic_and_a_follows_init_seed() -> None:
    s = spec("ffa")
    r1 = trainer(s, 3).train(initial(s), CONFIG)
    r2 = trainer(s, 3).train(initial(s), CONFIG)
    assert all(np.array_equal(r1.arrays[n], r2.arrays[n]) for n in r1.arrays)
    a0 = [p for n, p in apply_lora(base(), spec(init_seed=0)).named_parameters() if ".lora_A." in n]
    a0b = [
        p for n, p in apply_lora(base(), spec(init_seed=0)).named_parameters() if ".lora_A." in n
    ]
    a1 = [p for n, p in apply_lora(base(), spec(init_seed=1)).named_parameters() if ".lora_A." in n]
    assert all(torch.equal(x, y) for x, y in zip(a0, a0b, strict=True))
    assert not torch.equal(a0[0], a1[0])


def test_wrapping_does_not_disturb_the_global_rng() -> None:
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    apply_lora(base(), spec())
    assert torch.equal(torch.rand(4), expected)


def test_arrays_that_are_not_the_adapter_are_refused() -> None:
    s = spec("ffa")
    init = initial(s)
    t = trainer(s, 0)
    with pytest.raises(LoRAError):
        t.train({**init, "wte.weight": np.zeros((11, 16), np.float32)}, CONFIG)
    full_arrays = initial(spec("full"))
    with pytest.raises(UpdateSchemaError):  # LoRAError is an UpdateSchemaError
        t.train(full_arrays, CONFIG)
    model = apply_lora(base(), s)
    name = next(iter(init))
    with pytest.raises(LoRAError, match="shape"):
        set_arrays(model, {**init, name: np.zeros((1, 1), np.float32)}, list(init))


def test_bad_spec_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as err:
        LoRASpec(target_modules=(), rank=0, variant="half")
    assert len(err.value.problems) == 3


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _merged(s: LoRASpec, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    model = apply_lora(base(), s)
    set_arrays(model, arrays, trainable_names(model, s))
    return _weights(merge(model))


@pytest.mark.parametrize("variant", ["ffa", "full"])
def test_averaging_the_adapter_vs_averaging_merged_models(variant: str) -> None:
    """FFA-LoRA: mean_i(W + s B_i A) == W + s mean_i(B_i) A exactly (A shared and
    frozen). "full": mean(B_i) mean(A_i) != mean(B_i A_i), so the two differ."""
    s = spec(variant)
    init = initial(s)
    weights = np.array([12.0, 5.0, 7.0])
    updates = [trainer(s, c).train(init, CONFIG).arrays for c in range(3)]
    w = weights / weights.sum()
    avg_adapter = {
        n: sum(wi * u[n].astype(np.float64) for wi, u in zip(w, updates, strict=True)).astype(
            np.float32
        )
        for n in init
    }
    merged_of_avg = _merged(s, avg_adapter)
    merged_each = [_merged(s, u) for u in updates]
    avg_of_merged = {
        k: sum(float(wi) * m[k].double() for wi, m in zip(w, merged_each, strict=True))
        for k in merged_of_avg
    }
    gap = max(
        float((merged_of_avg[k].double() - avg_of_merged[k]).abs().max()) for k in merged_of_avg
    )
    moved = max(float((merged_each[0][k] - _weights(base())[k]).abs().max()) for k in merged_of_avg)
    assert moved > 1e-3  # the clients really updated the model
    if variant == "ffa":
        assert gap < 1e-6
    else:
        assert gap > 1e-5


def test_merge_matches_the_adapted_model_and_drops_peft() -> None:
    s = spec("ffa")
    result = trainer(s, 1).train(initial(s), CONFIG)
    model = apply_lora(base(), s)
    set_arrays(model, result.arrays, trainable_names(model, s))
    x = data(5).x
    with torch.no_grad():
        adapted = model(x)
        merged = merge(model)
        assert not adapter_names(merged)
        assert torch.allclose(merged(x), adapted, atol=1e-5)
        assert not torch.allclose(base()(x), adapted, atol=1e-4)


PLAIN_SCRIPT = """
import json, sys
import numpy as np, torch
from peft import PeftModel
from orchard.gpt import GPT, GPTConfig
cfg = GPTConfig(**json.loads(sys.argv[2]))
torch.manual_seed(42)
base = GPT(cfg)
model = PeftModel.from_pretrained(base, sys.argv[1])
x = torch.from_numpy(np.load(sys.argv[3]))
with torch.no_grad():
    np.save(sys.argv[4], model(x).numpy())
    np.save(sys.argv[5], model.merge_and_unload()(x).numpy())
"""


def test_saved_adapter_loads_with_plain_peft(tmp_path: Path) -> None:
    s = spec("ffa")
    result = trainer(s, 2).train(initial(s), CONFIG)
    out = save_global_adapter(base(), s, result.arrays, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4

    x = data(9).x
    np.save(tmp_path / "x.npy", x.numpy())
    script = tmp_path / "load.py"
    script.write_text(PLAIN_SCRIPT)
    subprocess.run(
        [
            sys.executable,
            str(script),
            str(out),
            json.dumps(CFG.to_dict()),
            str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"),
            str(tmp_path / "ym.npy"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    model = apply_lora(base(), s)
    set_arrays(model, result.arrays, trainable_names(model, s))
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "ym.npy"), expected, atol=1e-5)

    reloaded = load_adapter(base(), out)
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(x).numpy(), expected, atol=1e-6)
