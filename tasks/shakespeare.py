"""``shakespeare``: next-character prediction on tiny Shakespeare, one client per role.

Clients follow LEAF (Caldas et al., 2018): a client is a speaking role, here a speaker
name of tiny Shakespeare (which has no play boundaries, so a name such as GLOUCESTER
spans several plays). Roles longer than ``max_chars_per_client`` are cut into equal
consecutive pieces, each its own client, so the population exceeds 1,000 (1,170 with
the defaults); roles shorter than ``min_chars`` are dropped. Each client's text is
split by position: the first ``1 - test_fraction`` trains, the rest is its local test
set, so a client never tests on text it trained on.

Examples are non-overlapping windows of ``seq_len + 1`` characters; the model predicts
every next character of a window (GPT-style), and accuracy and loss are per predicted
character. LEAF scores only the last character of an 80-character window, which is a
different (easier) number.

The model is :class:`orchard.gpt.GPT` with the shared character tokenizer of
:mod:`orchard.text`. By default (``lora=True``) the task is a LoRA task: the base is
frozen and the global state is the adapter (FFA-LoRA: ``B`` only; see
:mod:`orchard.edge_runtime.lora`). An adapter on a random base learns
little (its loss barely moves), hence the pretrained default below.
``lora=False`` trains every parameter instead.

The base is ``base="pretrained"`` by default: ``data/shakespeare/base/``, a base-model
directory written by ``orchard pretrain --config tasks/data/shakespeare/pretrain.toml``
(weights, ``config.json`` with the architecture and tokenizer, ``lora_targets.json``).
That config trains on the *public* roles only (:func:`is_public_role`, about a fifth of
the text, selected by :func:`public_text`), which are never federated clients, so the
federation adapts a base to text it has not seen. ``base`` may also be any directory
``orchard pretrain`` wrote (or its ``model.safetensors``): the task takes the
architecture, tokenizer and LoRA targets from it. ``base="random"`` starts from
``base_seed`` instead, with the sizes given (default 80 / 2 / 4 / 64).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
from torch import nn

from orchard.edge_runtime.lora import LoRASpec, LoRATrainer, apply_lora, trainable_names
from orchard.errors import ConfigError
from orchard.gpt import (
    BASE_WEIGHTS,
    GPT,
    BaseModel,
    BaseModelError,
    GPTConfig,
    lora_target_modules,
    read_base_model,
)
from orchard.tasks.core import SupervisedTask, seeded_model
from orchard.tasks.partition import Partition, RaggedIndex, group_by_owner, label_skew
from orchard.tasks.torch_trainer import TensorData, TorchTrainer
from orchard.text import CharTokenizer

DATA_DIR = Path(__file__).parent / "data" / "shakespeare"
DATA_FILE = DATA_DIR / "tinyshakespeare_input.txt"
SHIPPED_BASE = DATA_DIR / "base"  # written by `orchard pretrain --config PRETRAIN_CONFIG`
PRETRAIN_CONFIG = DATA_DIR / "pretrain.toml"
# Sizes of a ``base="random"`` model when none are given.
RANDOM_BASE_ARCH = {"seq_len": 80, "n_layer": 2, "n_head": 4, "d_model": 64}


def load_text() -> str:
    return DATA_FILE.read_text(encoding="ascii")


def speeches(text: str) -> dict[str, str]:
    """Speaker name -> everything the speaker says, in order of appearance.

    Speeches are blank-line-separated blocks whose first line is ``Name:``.
    """
    by_speaker: dict[str, list[str]] = defaultdict(list)
    for block in text.split("\n\n"):
        block = block.strip("\n")
        head, _, body = block.partition("\n")
        if not head.endswith(":") or not body:
            continue
        by_speaker[head[:-1]].append(body + "\n")
    return {name: "".join(parts) for name, parts in sorted(by_speaker.items())}


def is_public_role(name: str) -> bool:
    """Roles held out of the federation as the base model's "public" pretraining text
    (about a fifth of the roles and of the text). crc32, not ``hash``: the split must
    not change with Python's hash seed."""
    return zlib.crc32(name.encode("utf-8")) % 5 == 0


def public_text(text: str) -> str:
    """The public roles' speeches, role by role (what the shipped base is pretrained on:
    ``data.select`` of ``data/shakespeare/pretrain.toml``)."""
    return "".join(role for name, role in speeches(text).items() if is_public_role(name))


def client_texts(text: str, max_chars_per_client: int, min_chars: int) -> list[tuple[str, str]]:
    """(client name, text) per client: roles cut into equal pieces of at most
    ``max_chars_per_client``, public and short (< ``min_chars``) roles dropped; sorted
    by role."""
    out = []
    for name, role in speeches(text).items():
        if len(role) < min_chars or is_public_role(name):
            continue
        # As many pieces as max_chars_per_client asks for, but none shorter than
        # min_chars, so that every client keeps a local test window.
        pieces = max(1, min(math.ceil(len(role) / max_chars_per_client), len(role) // min_chars))
        cuts = np.linspace(0, len(role), pieces + 1).astype(int)
        for k in range(pieces):
            out.append((f"{name}#{k}", role[cuts[k] : cuts[k + 1]]))
    return out


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping (input, target) windows: x[t] = ids[t], y[t] = ids[t + 1]."""
    n = (len(ids) - 1) // seq_len
    if n <= 0:
        return np.empty((0, seq_len), np.int64), np.empty((0, seq_len), np.int64)
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return x.astype(np.int64), y.astype(np.int64)


def build(
    *,
    seq_len: int | None = None,
    n_layer: int | None = None,
    n_head: int | None = None,
    d_model: int | None = None,
    max_chars_per_client: int = 700,
    min_chars: int = 0,
    test_fraction: float = 0.2,
    lora: bool = True,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_variant: str = "ffa",
    lora_seed: int = 0,
    base_seed: int = 0,
    base: str = "pretrained",
    central_test_windows: int = 256,
) -> SupervisedTask:
    """Build the Shakespeare task.

    ``seq_len``, ``n_layer``, ``n_head``, ``d_model`` default to the base's (from its
    ``config.json``); given with a pretrained base they must match it. ``min_chars`` 0
    means "long enough for one test window": ``ceil((seq_len + 1) / test_fraction)``.
    ``central_test_windows`` caps the held-out windows :meth:`evaluate` scores (a fixed
    seeded subset of all clients' test windows) so that central evaluation stays a few
    seconds on a CPU.
    """
    given = dict(locals())  # exactly the keyword arguments: the task's parameters
    asked = {"seq_len": seq_len, "n_layer": n_layer, "n_head": n_head, "d_model": d_model}
    pretrained = _load_base(base, asked)
    if pretrained is not None:
        arch = {k: getattr(pretrained.model.config, k) for k in asked}
    else:
        arch = {k: v if v is not None else RANDOM_BASE_ARCH[k] for k, v in asked.items()}
    seq_len = arch["seq_len"]
    problems = []
    if not 0.0 < test_fraction < 1.0:
        problems.append(f"test_fraction must be in (0, 1), got {test_fraction}")
    if seq_len < 1 or max_chars_per_client < 2 * (seq_len + 1):
        problems.append(
            f"max_chars_per_client ({max_chars_per_client}) must hold at least two windows of seq_len + 1 = {seq_len + 1}"
        )
    if problems:
        raise ConfigError(problems)
    min_chars = min_chars or math.ceil((seq_len + 1) / test_fraction)

    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    if pretrained is not None:
        # The base's ids are the ones it learned: encode with its tokenizer.
        unknown = sorted(set(tokenizer.chars) - set(pretrained.tokenizer.chars))
        if unknown:
            raise ConfigError(
                f"base {pretrained.directory} has no token for characters {unknown} of the "
                "Shakespeare text; pretrain it on a corpus that holds them"
            )
        tokenizer = pretrained.tokenizer
        gpt_cfg = pretrained.model.config
    else:
        gpt_cfg = GPTConfig(vocab_size=tokenizer.vocab_size, **arch)
    clients = client_texts(text, max_chars_per_client, min_chars)
    train_x: list[np.ndarray] = []
    train_y: list[np.ndarray] = []
    test_x: list[np.ndarray] = []
    test_y: list[np.ndarray] = []
    train_owner: list[np.ndarray] = []
    test_owner: list[np.ndarray] = []
    for i, (_, body) in enumerate(clients):
        ids = tokenizer.encode_array(body)
        cut = int(round(len(ids) * (1.0 - test_fraction)))
        for ids_part, xs, ys, owner in (
            (ids[:cut], train_x, train_y, train_owner),
            (ids[cut:], test_x, test_y, test_owner),
        ):
            x, y = windows(ids_part, seq_len)
            xs.append(x)
            ys.append(y)
            owner.append(np.full(len(x), i, np.int64))
    tx, ty = np.concatenate(train_x), np.concatenate(train_y)
    vx, vy = np.concatenate(test_x), np.concatenate(test_y)
    train_owner_all, test_owner_all = np.concatenate(train_owner), np.concatenate(test_owner)
    num_clients = len(clients)

    targets = pretrained.lora_targets if pretrained is not None else tuple(lora_target_modules())
    spec = LoRASpec(
        target_modules=tuple(targets),
        rank=lora_rank,
        alpha=lora_alpha,
        variant=lora_variant,
        init_seed=lora_seed,
    )
    base_state = (
        {k: v.clone() for k, v in pretrained.model.state_dict().items()}
        if pretrained is not None
        else None
    )

    def base_model() -> nn.Module:
        model = seeded_model(lambda: GPT(gpt_cfg), base_seed)
        if base_state is not None:
            model.load_state_dict(base_state, strict=True)
        return model

    def model(seed: int) -> nn.Module:
        # A LoRA model's base and A are shared by every client (base_seed, lora_seed).
        # A full-parameter model starts from the base when there is one (fine-tuning),
        # from the run seed otherwise.
        if lora:
            return apply_lora(base_model(), spec)
        return base_model() if base_state is not None else seeded_model(lambda: GPT(gpt_cfg), seed)

    def partitioner(num_partitions: int, seed: int) -> Partition:
        return _group_clients(
            num_clients,
            num_partitions,
            seed,
            train_owner_all,
            test_owner_all,
            ty,
            tokenizer.vocab_size,
        )

    def lora_trainer(model_factory, train, test, trainable, seed):  # type: ignore[no-untyped-def]
        return LoRATrainer(
            base_model,
            spec,
            lambda factory, names: TorchTrainer(factory, train, test, trainable=names, seed=seed),
            trainable=trainable,
        )

    rng = np.random.default_rng(0)
    central = np.sort(rng.permutation(len(vx))[:central_test_windows])
    probe = model(0)
    return SupervisedTask(
        name="shakespeare",
        train=TensorData.from_numpy(tx, ty),
        test=TensorData.from_numpy(vx, vy),
        num_classes=tokenizer.vocab_size,
        model=model,
        partitioner=partitioner,
        params={**given, **arch, "min_chars": min_chars},  # sizes and min_chars as resolved
        info={"num_natural_clients": num_clients, "vocab": tokenizer.chars},
        trainable=trainable_names(probe, spec) if lora else None,
        trainer_factory=lora_trainer if lora else TorchTrainer,
        central_test=TensorData.from_numpy(vx[central], vy[central]),
    )


def _load_base(base: str, asked: dict[str, int | None]) -> BaseModel | None:
    """``base``: "pretrained" (the shipped base), "random" (None: from ``base_seed``), or
    a base-model directory written by ``orchard pretrain`` (or its ``model.safetensors``).
    Sizes in ``asked`` that are not None must be the base's."""
    if base == "random":
        return None
    path = SHIPPED_BASE if base == "pretrained" else Path(base)
    if path.is_file() and path.name == BASE_WEIGHTS:
        path = path.parent
    if not path.is_dir():
        raise ConfigError(
            f"base {base!r} is neither 'pretrained', 'random' nor a base-model directory "
            "written by `orchard pretrain` (or its model.safetensors)"
        )
    try:
        loaded = read_base_model(path)
    except BaseModelError as err:
        raise ConfigError(f"base {base!r}: {err}") from None
    have = loaded.model.config
    clash = {
        k: (v, getattr(have, k))
        for k, v in asked.items()
        if v is not None and v != getattr(have, k)
    }
    if clash:
        which = "the shipped pretrained base" if base == "pretrained" else f"base {path}"
        raise ConfigError(
            f"{which} has "
            + ", ".join(f"{k} {got}" for k, (_, got) in clash.items())
            + ", the task asks for "
            + ", ".join(f"{k} {want}" for k, (want, _) in clash.items())
            + "; leave the sizes unset to take the base's, or use base='random'"
        )
    return loaded


def _group_clients(
    num_clients: int,
    num_partitions: int,
    seed: int,
    train_owner: np.ndarray,
    test_owner: np.ndarray,
    train_targets: np.ndarray,
    vocab_size: int,
) -> Partition:
    """The natural clients as partitions; fewer partitions group them (seeded)."""
    if not 1 <= num_partitions <= num_clients:
        raise ConfigError(
            f"shakespeare has {num_clients} natural clients (roles and role pieces); num_partitions must be "
            f"in [1, {num_clients}], got {num_partitions}; lower max_chars_per_client for more"
        )
    if num_partitions == num_clients:
        groups = np.arange(num_clients)
    else:
        groups = np.empty(num_clients, np.int64)
        order = np.random.default_rng(seed).permutation(num_clients)
        for g, members in enumerate(np.array_split(order, num_partitions)):
            groups[members] = g
    train_idx = group_by_owner(groups[train_owner], num_partitions)
    test_idx = group_by_owner(groups[test_owner], num_partitions)
    # Label skew over next-character targets: per client, the histogram of the
    # characters it learns to predict (every position of each of its windows).
    per_window = train_targets.shape[1]
    windows_flat = train_idx.values.astype(np.int64)
    positions = RaggedIndex(
        (windows_flat[:, None] * per_window + np.arange(per_window)).reshape(-1),
        train_idx.offsets * per_window,
    )
    skew = label_skew(train_targets.reshape(-1), positions, vocab_size)
    return Partition(
        indices=train_idx,
        test_indices=test_idx,
        label_skew=skew,
        scheme="natural(role)"
        if num_partitions == num_clients
        else f"natural(role) grouped into {num_partitions}",
    )
