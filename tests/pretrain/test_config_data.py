"""Config loading and overrides; token shards and the deterministic batch stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchard.errors import ConfigError, OrchardError
from orchard.pretrain.__main__ import parse_overrides
from orchard.pretrain.config import load_pretrain_config, parse_pretrain_config
from orchard.pretrain.data import (
    DataError,
    Prefetcher,
    ShardIndex,
    WindowSampler,
    build_shards,
    shipped_corpus,
)
from orchard.pretrain.recipe import lr_multiplier


def test_toml_with_overrides(tmp_path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[pretrain]\nsteps = 7\n[pretrain.optim]\nlr = 0.01\nmin_lr = 0.001\n")
    cfg = load_pretrain_config(path, ["optim.lr=0.02", "model.n-layer=3", "strategy=fsdp"])
    assert (cfg.steps, cfg.optim.lr, cfg.optim.min_lr, cfg.model.n_layer) == (7, 0.02, 0.001, 3)
    assert cfg.strategy == "fsdp"


def test_every_problem_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_pretrain_config({"steps": 0, "strategy": "zero3", "model": {"n_layer": 0}})
    assert len(err.value.problems) == 3
    with pytest.raises(ConfigError, match="fp16"):
        parse_pretrain_config({"precision": "fp16", "strategy": "fsdp"})


def test_whole_model_compile_is_refused_with_fsdp() -> None:
    with pytest.raises(ConfigError, match="compile_scope 'blocks'"):
        parse_pretrain_config({"compile": True, "compile_scope": "model", "strategy": "fsdp"})
    assert parse_pretrain_config({"compile": True, "compile_scope": "model"}).compile_scope == "model"


def test_cli_override_flags() -> None:
    assert parse_overrides(["--steps", "5", "--optim.lr=1e-3"]) == ["steps=5", "optim.lr=1e-3"]
    with pytest.raises(OrchardError):
        parse_overrides(["--steps"])


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    cfg = parse_pretrain_config(
        {"steps": 100, "optim": {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}}
    )
    lrs = [lr_multiplier(s, cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[100] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> ShardIndex:
    return build_shards([shipped_corpus()], tmp_path_factory.mktemp("shards"), 4, 0.1)


def test_shards_cover_the_corpus(index: ShardIndex) -> None:
    text = shipped_corpus().read_text(encoding="utf-8")
    assert index.tokenizer.vocab_size == len(set(text)) == 65
    assert sum(s.tokens for s in index.shards) == len(text)
    assert len(index.split("train")) == 4 and len(index.split("val")) == 1
    first = index.open(index.split("train")[0])
    assert index.tokenizer.decode(first[:40]) == text[:40]
    # The same bytes and settings reuse the shards instead of rewriting them.
    mtime = (index.directory / "index.json").stat().st_mtime_ns
    build_shards([shipped_corpus()], index.directory, 4, 0.1)
    assert (index.directory / "index.json").stat().st_mtime_ns == mtime


def test_batches_are_a_function_of_step_and_rank(index: ShardIndex) -> None:
    a = WindowSampler(index, "train", 16, 4, seed=1, rank=0, world_size=2)
    b = WindowSampler(index, "train", 16, 4, seed=1, rank=1, world_size=2)
    x, y = a.batch(3)
    assert x.shape == (4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    torch.testing.assert_close(a.batch(3)[0], x)
    assert not torch.equal(a.batch(4)[0], x)
    assert not torch.equal(b.batch(3)[0], x)
    # Rank r samples only its shards (r, r + W, ...).
    assert len(a.arrays) == len(b.arrays) == 2
    assert not np.shares_memory(a.arrays[0], b.arrays[0])


def test_prefetcher_yields_exactly_the_direct_batches(index: ShardIndex) -> None:
    s = WindowSampler(index, "train", 16, 4, seed=0)
    loader = Prefetcher(s, start=5, stop=9, grad_accum=2, device=torch.device("cpu"), depth=2)
    got = list(loader)
    loader.close()
    assert len(got) == 4
    for step, batch in zip(range(5, 9), got, strict=True):
        assert [x.shape[0] for x, _ in batch] == [2, 2]
        torch.testing.assert_close(torch.cat([x for x, _ in batch]), s.batch(step)[0])


def test_too_long_sequence_is_a_named_error(index: ShardIndex) -> None:
    with pytest.raises(DataError, match="seq_len"):
        WindowSampler(index, "val", 10_000_000, 1, seed=0)


def test_shipped_demo_config_is_valid() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "pretrain.toml"
    cfg = load_pretrain_config(path)
    assert cfg.steps > 0 and cfg.data.corpus == []


def _first_half(text: str) -> str:
    return text[: len(text) // 2]


def test_select_keeps_part_of_each_file_but_the_vocabulary_of_all(tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 50 + "XYZ" * 100)  # X, Y, Z only in the second half
    sel = build_shards([corpus], tmp_path / "sel", 1, 0.1, _first_half)
    assert sel.tokenizer.chars == sorted(set("abcdefghXYZ"))
    tokens = np.concatenate([sel.open(s) for s in sel.shards])
    assert len(tokens) == 350 and sel.tokenizer.decode(tokens) == _first_half(corpus.read_text())
    whole = build_shards([corpus], tmp_path / "sel", 1, 0.1)  # another selection: rebuilt
    assert whole.source_digest != sel.source_digest
    assert sum(s.tokens for s in whole.shards) == 700


def test_select_names_a_function_that_is_imported_at_build_time(tmp_path) -> None:
    from orchard.pretrain.data import resolve_select
    from orchard.tasks.shakespeare import public_text

    assert resolve_select("orchard.tasks.shakespeare:public_text") is public_text
    with pytest.raises(DataError, match="cannot import"):
        resolve_select("orchard.tasks.shakespeare:no_such_function")
    with pytest.raises(ConfigError, match="data.select"):
        parse_pretrain_config({"data": {"select": "not a dotted name"}})


def test_shakespeare_base_config_pretrains_on_public_roles_only() -> None:
    """The committed config of the task's shipped base: CPU, no ONNX, the public roles,
    and the base-model files exported where the task loads them."""
    from pathlib import Path

    from orchard.tasks import shakespeare

    cfg = load_pretrain_config(shakespeare.PRETRAIN_CONFIG)
    repo = Path(__file__).resolve().parents[2]
    assert repo / cfg.export_dir == shakespeare.SHIPPED_BASE
    assert cfg.output_dir != cfg.export_dir
    assert cfg.device == "cpu" and not cfg.export_onnx
    assert cfg.data.corpus == [] and cfg.data.select == "orchard.tasks.shakespeare:public_text"
