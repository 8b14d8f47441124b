"""The GPT model and the character tokenizer: shapes, causality, LoRA targets, FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchard.errors import ConfigError
from orchard.gpt import GPT, GPTConfig, lora_target_modules
from orchard.text import CharTokenizer, TokenizerError

CFG = GPTConfig(vocab_size=11, seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_forward_shape_and_tied_head() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    logits = model(torch.randint(0, 11, (3, 16)))
    assert logits.shape == (3, 16, 11)
    assert model.lm_head.weight is model.wte.weight


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    idx = torch.randint(0, 11, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 11
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_activation_checkpointing_gives_same_gradients() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, 11, (2, 16))
    model(idx).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing = True
    model(idx).sum().backward()
    for a, p in zip(ref, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


def test_lora_targets_name_plain_linears_in_every_block() -> None:
    model = GPT(CFG)
    targets = lora_target_modules()
    hits = [
        name
        for name, m in model.named_modules()
        if any(name == t or name.endswith("." + t) for t in targets)
    ]
    assert len(hits) == 4 * CFG.n_layer
    assert all(type(dict(model.named_modules())[h]) is nn.Linear for h in hits)
    assert "lm_head" not in hits


def test_lora_targets_work_with_peft() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        GPT(CFG), peft.LoraConfig(r=2, target_modules=GPT.lora_target_modules())
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_num_params_and_flops_match_gpt2_small() -> None:
    model = GPT(GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768))
    assert 123e6 < model.num_params() < 125e6
    n, c = model.num_params(), model.config
    assert model.flops_per_token() == 6 * n + 12 * c.n_layer * c.d_model * c.seq_len


def test_config_validation_reports_every_problem() -> None:
    with pytest.raises(ConfigError) as err:
        GPTConfig(n_head=3, d_model=128, dropout=1.5)
    assert len(err.value.problems) == 2
    assert GPTConfig.from_dict(CFG.to_dict()) == CFG


def test_char_tokenizer_round_trip(tmp_path) -> None:
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.decode(tok.encode("low")) == "low"
    assert tok.encode_array("lo").dtype.name == "uint16"
    tok.save(tmp_path / "t.json")
    assert CharTokenizer.load(tmp_path / "t.json") == tok
    with pytest.raises(TokenizerError):
        tok.encode("z")
    with pytest.raises(TokenizerError):
        tok.decode([99])
