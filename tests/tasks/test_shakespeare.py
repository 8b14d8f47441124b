import numpy as np
import pytest

from orchard.errors import ConfigError
from orchard.gpt import read_base_model
from orchard.tasks import get_task, shakespeare
from orchard.tasks.shakespeare import client_texts, is_public_role, load_text, speeches, windows
from orchard.text import CharTokenizer
from orchard.trainer import TrainConfig


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return get_task("shakespeare")


def test_roles_are_parsed_and_public_roles_are_not_clients() -> None:
    roles = speeches(load_text())
    assert len(roles) > 250 and "ROMEO" in roles
    assert roles["ROMEO"].startswith("Is the day so young?\nAy me! sad hours seem long.\n")
    clients = client_texts(load_text(), max_chars_per_client=700, min_chars=405)
    assert len(clients) >= 1000
    names = {name.rsplit("#", 1)[0] for name, _ in clients}
    public = {r for r in roles if is_public_role(r)}
    assert public and not names & public
    assert all(len(text) >= 405 for _, text in clients)


def test_windows_predict_the_next_character() -> None:
    x, y = windows(np.arange(10), 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert windows(np.arange(3), 3)[0].shape == (0, 3)


def test_natural_partition_has_over_1000_clients_each_with_a_test_window(task) -> None:  # type: ignore[no-untyped-def]
    n = task.info["num_natural_clients"]
    assert n >= 1000
    p = task.partition(n, seed=0)
    assert min(p.sizes) >= 1 and all(len(t) >= 1 for t in p.test_indices)
    assert sum(p.sizes) == len(task.train_data)
    assert p.label_skew.histograms.shape == (n, 65)
    grouped = task.partition(10, seed=0)
    assert sum(grouped.sizes) == len(task.train_data) and len(grouped.sizes) == 10
    with pytest.raises(ConfigError, match="natural clients"):
        task.partition(n + 1, seed=0)


def test_lora_task_global_state_is_b_and_starts_at_the_base(task) -> None:  # type: ignore[no-untyped-def]
    arrays = task.initial_arrays(0)
    assert arrays and all(".lora_B." in name for name in arrays)
    assert all(not a.any() for a in arrays.values())  # B = 0: the adapted model is the base
    # The shipped base was pretrained on other roles; it already beats chance (1/65) by far.
    assert task.evaluate(arrays)["accuracy"] > 0.35


def test_a_client_trains_only_its_adapter(task) -> None:  # type: ignore[no-untyped-def]
    n = task.info["num_natural_clients"]
    trainer = task.client_trainer(3, n, seed=0)
    init = task.initial_arrays(0)
    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=1e-2, optimizer="adam")
    result = trainer.train(init, cfg)
    assert list(result.arrays) == list(init)
    assert any(np.abs(result.arrays[k]).max() > 0 for k in init)
    again = task.client_trainer(3, n, seed=0).train(init, cfg)
    assert all(np.array_equal(result.arrays[k], again.arrays[k]) for k in init)


def test_full_parameter_variant_and_shipped_base_sizes() -> None:
    full = get_task("shakespeare", lora=False, base="random", n_layer=1, d_model=32)
    names = list(full.initial_arrays(0))
    assert "wte.weight" in names and not any("lora" in n for n in names)
    tuned = get_task("shakespeare", lora=False)  # full fine-tuning starts from the shipped base
    assert tuned.evaluate(tuned.initial_arrays(0))["accuracy"] > 0.35
    with pytest.raises(ConfigError, match="shipped pretrained base has d_model 64"):
        get_task("shakespeare", d_model=32)
    with pytest.raises(ConfigError):
        get_task("shakespeare", base="/no/such/file.safetensors")


def test_shipped_base_is_what_the_committed_pretraining_config_writes(task) -> None:  # type: ignore[no-untyped-def]
    """The shipped base is an `orchard pretrain` export of data/shakespeare/pretrain.toml:
    the task takes its architecture, tokenizer and LoRA targets from the directory."""
    from orchard.pretrain import load_pretrain_config

    cfg = load_pretrain_config(shakespeare.PRETRAIN_CONFIG)
    base = read_base_model(shakespeare.SHIPPED_BASE)
    want = cfg.model.model_dump()
    assert want.pop("vocab_size") is None
    assert {k: getattr(base.model.config, k) for k in want} == want
    assert base.tokenizer == CharTokenizer.from_text(load_text())
    assert {k: task.params[k] for k in ("seq_len", "n_layer", "n_head", "d_model")} == {
        k: want[k] for k in ("seq_len", "n_layer", "n_head", "d_model")
    }
    assert {n.split(".lora_B")[0].split(".", 4)[-1] for n in task.trainable} == set(base.lora_targets)
    # Only what the task loads is shipped: no ONNX file, shards, checkpoints or metrics.
    assert sorted(p.name for p in shakespeare.SHIPPED_BASE.iterdir()) == [
        "config.json", "lora_targets.json", "model.safetensors", "tokenizer.json"
    ]


@pytest.mark.slow
def test_the_committed_config_rebuilds_the_shipped_base(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`orchard pretrain --config data/shakespeare/pretrain.toml` on one CPU thread (as
    SOURCES.md says the shipped base was made) gives the shipped weights exactly."""
    import torch

    from orchard.pretrain import load_pretrain_config, run

    overrides = {"output_dir": str(tmp_path / "work"), "export_dir": str(tmp_path / "base"),
                 "progress": False}
    run(load_pretrain_config(shakespeare.PRETRAIN_CONFIG, overrides))
    got = read_base_model(tmp_path / "base").model.state_dict()
    shipped = read_base_model(shakespeare.SHIPPED_BASE).model.state_dict()
    assert got.keys() == shipped.keys()
    assert all(torch.equal(got[k], shipped[k]) for k in got)
