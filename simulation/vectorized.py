"""Train many small-model clients at once: ``torch.func.vmap`` over stacked parameters.

For a model like the digits MLP (4,810 parameters, 20 examples per client) a client's
training is a few microseconds of arithmetic wrapped in a millisecond of Python. Here C
clients that share a model structure, a dataset size and a step count train as one
batched computation: their parameters are stacked along a new leading dimension, and

    grads = vmap(grad(loss))(params[C, ...], x[C, B, ...], y[C, B])

runs every client's step in one call (``torch.func.functional_call`` evaluates the one
module with each client's parameters). The result is the same as running
:class:`orchard.tasks.torch_trainer.TorchTrainer` on each client, to float rounding:

- the same batches: each client's permutation comes from its own generator, seeded as
  TorchTrainer seeds it (``_seed_from(trainer.seed, config.seed)``), drawn per epoch;
- the same step: plain SGD ``p -= lr * (g + mu (p - p_global) + wd p)`` (FedProx's term
  added to the gradient before weight decay, as TorchTrainer and torch.optim.SGD do);
- the same metrics: example-weighted running loss and accuracy.

A plain MLP (a ``nn.Linear``, or an ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU``
layers ending in a Linear, on flat features) takes the same steps through
:func:`_mlp_step`: its forward and backward written out as batched matrix products
(``baddbmm``/``bmm`` over the client dimension). That is the same arithmetic as vmap's
(the same products, the same softmax-minus-one-hot gradient), without functorch's
per-call transforms, which cost more than a 64-64-10 step's arithmetic; any other model
goes through vmap.

:func:`supports` says when this applies (SGD without momentum, every parameter
trained, no buffers, no dropout or batch norm, whose behaviour depends on per-call
randomness or running statistics); anything else takes the per-client path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from orchard.tasks.torch_trainer import (
    TensorData,
    TensorRows,
    TorchTrainer,
    _seed_from,
    load_arrays,
    stack_rows,
)
from orchard.trainer import TrainConfig, TrainResult
from orchard.typing import NDArrays

_CPU_CLIENTS = 160  # at most this many clients per vmap call on a CPU (see train_many)
# ... and at most this many bytes of forward activations in one call (see cpu_slice).
_CPU_SLICE_BYTES = 24 << 20
_ACTIVATION_BYTES: dict[tuple, int] = {}  # cpu_slice's measurements, by model structure and batch

_STATEFUL_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                     nn.modules.batchnorm._BatchNorm)


def supports(trainer: object, config: TrainConfig) -> bool:
    """Whether ``trainer`` can train through the vectorised path with ``config``."""
    # Exactly a TorchTrainer: a subclass may train differently.
    if not isinstance(trainer, TorchTrainer) or type(trainer) is not TorchTrainer:
        return False
    if config.optimizer.lower() != "sgd" or config.momentum != 0.0:
        return False
    model = trainer.model
    names = [n for n, _ in model.named_parameters()]
    if trainer.trainable != names or any(True for _ in model.buffers()):
        return False
    return not any(isinstance(m, _STATEFUL_MODULES) for m in model.modules())


def _loss(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
          y: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    logits = functional_call(model, params, (x,))
    flat = logits.reshape(-1, logits.shape[-1])
    target = y.reshape(-1)
    loss = F.cross_entropy(flat, target)
    correct = (flat.argmax(dim=-1) == target).sum()
    return loss, (loss.detach(), correct)


def _weighted_loss(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                   w: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_loss` of a padded batch: row weights ``w`` (``1 / b`` on the b real rows, 0
    on padding) make it the mean over the real rows; padding rows count no hits."""
    logits = functional_call(model, params, (x,))
    loss = (F.cross_entropy(logits, y, reduction="none") * w).sum()
    correct = ((logits.argmax(dim=-1) == y) & (w > 0)).sum()
    return loss, (loss.detach(), correct)


# One step of an MLP's plan: ("linear", weight name, bias name or None) or ("relu", "", None).
MlpLayer = tuple[str, str, str | None]


def _mlp_plan(model: nn.Module, names: Sequence[str]) -> list[MlpLayer] | None:
    """The layers of a plain MLP whose every parameter is trained (see the module's
    docstring), in order; None for any other model."""
    if type(model) is nn.Linear:
        layers: list[tuple[str, nn.Module]] = [("", model)]
    elif type(model) is nn.Sequential:
        layers = list(model.named_children())
    else:
        return None
    if not layers or type(layers[0][1]) is not nn.Linear or type(layers[-1][1]) is not nn.Linear:
        return None
    plan: list[MlpLayer] = []
    for name, layer in layers:
        prefix = f"{name}." if name else ""
        if type(layer) is nn.Linear:
            plan.append(("linear", prefix + "weight", None if layer.bias is None else prefix + "bias"))
        elif type(layer) is nn.ReLU:
            plan.append(("relu", "", None))
        else:
            return None
    wanted = [n for kind, w, b in plan if kind == "linear" for n in (w, b) if n is not None]
    return plan if sorted(wanted) == sorted(names) else None


def _mlp_step(plan: Sequence[MlpLayer], params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              shared: bool, row_w: torch.Tensor | None = None
              ) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Every client's gradient of its mean cross-entropy, its loss and its hits, for an
    MLP ``plan``: ``x`` (C, B, F), ``y`` (C, B); ``params`` stacked (C, ...) or, with
    ``shared``, one model every client starts from (1, ...). ``row_w`` (C, B): row weights of
    padded batches, ``1 / b_c`` on client c's ``b_c`` real rows and 0 on padding (see
    :func:`_uneven_plan`), so each client's mean is over its own rows; None: every row
    is real."""
    c, b = y.shape
    inputs: list[torch.Tensor] = []  # each Linear's input, for its weight's gradient
    masks: list[torch.Tensor] = []  # where each ReLU passed its input through
    h = x
    for kind, w, bias in plan:
        if kind == "relu":
            masks.append(h > 0)
            h = h.clamp_min(0)
            continue
        inputs.append(h)
        weight = params[w]
        if shared:  # one product over every client's batch
            flat = h.reshape(c * b, -1)
            out = (torch.addmm(params[bias][0], flat, weight[0].t()) if bias is not None
                   else flat @ weight[0].t())
            h = out.reshape(c, b, -1)
        else:
            h = (torch.baddbmm(params[bias].unsqueeze(1), h, weight.transpose(1, 2)) if bias is not None
                 else torch.bmm(h, weight.transpose(1, 2)))
    logp = torch.log_softmax(h, dim=-1)
    target = y.unsqueeze(-1)
    nll = -logp.gather(-1, target).squeeze(-1)
    hit = h.argmax(dim=-1) == y
    loss = nll.mean(dim=1) if row_w is None else (nll * row_w).sum(dim=1)
    hits = (hit if row_w is None else hit & (row_w > 0)).sum(dim=1)
    # d(mean cross-entropy)/d(logits) = (softmax - one_hot) / B, per client; a padding
    # row's is exactly 0, so it adds exactly nothing to any gradient below.
    g = logp.exp()
    g.scatter_add_(-1, target, torch.full_like(target, -1, dtype=g.dtype))
    if row_w is None:
        g.div_(b)
    else:
        g.mul_(row_w.unsqueeze(-1))
    grads: dict[str, torch.Tensor] = {}
    for i, (kind, w, bias) in enumerate(reversed(plan)):
        if kind == "relu":
            g = g * masks.pop()
            continue
        inp = inputs.pop()
        grads[w] = torch.bmm(g.transpose(1, 2), inp)
        if bias is not None:
            grads[bias] = g.sum(dim=1)
        if i < len(plan) - 1:  # the first layer's input needs no gradient
            weight = params[w]
            g = (g.reshape(c * b, -1) @ weight[0]).reshape(c, b, -1) if shared else torch.bmm(g, weight)
    return grads, (loss, hits)


def _plan(n: int, config: TrainConfig) -> list[tuple[int, int]]:
    """(epoch, start) of every step, as TorchTrainer's loop walks them."""
    steps_per_epoch = -(-n // config.batch_size)
    total = config.steps if config.steps is not None else config.epochs * steps_per_epoch
    out: list[tuple[int, int]] = []
    epoch = 0
    while len(out) < total:
        for start in range(0, n, config.batch_size):
            if len(out) >= total:
                break
            out.append((epoch, start))
        epoch += 1
    return out


def _uneven_plan(trainers: Sequence[TorchTrainer], configs: Sequence[TrainConfig], sizes: np.ndarray
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Batches of clients of different sizes, padded to one shape: ``idx`` (C, T, B), the
    row of each client's batch at each step (each client's own TorchTrainer order: its
    permutation of each epoch cut at ``0, B, 2B, ...``, the epoch's last batch short), -1
    where a client's batch is shorter or its steps have run out; ``count`` (C, T), its
    real rows at each step (0: no step); and each client's number of steps.

    A client of at most B examples trains on them in stored order, as TorchTrainer does
    (one batch, no gather: the order does not change the mean)."""
    cfg = configs[0]
    bs = cfg.batch_size
    plans = {int(n): _plan(int(n), cfg) for n in np.unique(sizes)}
    t_max = max(len(p) for p in plans.values())
    c = len(trainers)
    idx = torch.full((c, t_max, bs), -1, dtype=torch.int64)
    gen = torch.Generator()
    for n, plan in plans.items():
        members = np.flatnonzero(sizes == n)
        if not plan:
            continue
        per_epoch = -(-n // bs)
        epochs = plan[-1][0] + 1
        if n <= bs:
            order = torch.arange(n).expand(len(members), epochs, n)
        else:  # each client's stream, seeded as TorchTrainer seeds it (see train_group)
            drawn = []
            for i in members:
                gen.manual_seed(_seed_from(trainers[i].seed, configs[i].seed))
                drawn += [torch.randperm(n, generator=gen) for _ in range(epochs)]
            order = torch.stack(drawn).view(len(members), epochs, n)
        # Pad each epoch to whole batches, then read it batch by batch: the plan's steps.
        padded = F.pad(order, (0, per_epoch * bs - n), value=-1).reshape(len(members), epochs * per_epoch, bs)
        idx[torch.from_numpy(members), :len(plan)] = padded[:, :len(plan)]
    count = (idx >= 0).sum(dim=2)
    return idx, count, [len(plans[int(n)]) for n in sizes]


def _padded_rows(datas: Sequence[TensorData | TensorRows], n_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stack_rows` of datasets of different lengths, each padded to ``n_max`` rows
    by repeating its last row (a real row: finite values for padding that weighs 0)."""
    lengths = np.array([len(d) for d in datas])
    pos = np.minimum(np.arange(n_max), (lengths - 1)[:, None])  # (C, n_max)
    first = datas[0]
    if isinstance(first, TensorRows) and all(isinstance(d, TensorRows) and d.pool is first.pool for d in datas):
        pool = first.pool
        if pool.x.device.type == "cpu" and pool.y.device.type == "cpu" and not pool.x.requires_grad:
            rows = np.take_along_axis(np.stack([np.pad(d.index, (0, n_max - len(d.index))) for d in datas]), pos, 1)
            return torch.from_numpy(pool.x.numpy()[rows]), torch.from_numpy(pool.y.numpy()[rows])
    at = torch.from_numpy(pos)
    return (torch.stack([d.x[p] for d, p in zip(datas, at, strict=True)]),
            torch.stack([d.y[p] for d, p in zip(datas, at, strict=True)]))


def train_group(trainers: Sequence[TorchTrainer], global_arrays: NDArrays,
                configs: Sequence[TrainConfig], device: str = "cpu") -> list[TrainResult]:
    """Train clients that share a model structure and a step plan's hyperparameters.

    ``configs[i]`` differ only in ``seed`` (each client's round seed); the caller groups
    clients by (steps, epochs, batch size, step hyperparameters) -- see :func:`train_many`.
    Clients of one dataset size take the same steps on whole batches. Clients of different
    sizes (uneven clients) are padded to one shape (:func:`_uneven_plan`): padding rows
    weigh exactly 0 and each real row ``1 / b`` (b: the client's real rows at that step),
    so each client still takes its own mean gradient over its own batch, and a client
    whose steps have run out takes no step at all (its parameters are left as they are,
    weight decay and the proximal term included). ``device``: where the stacked
    parameters, data and steps live ("cpu", or "cuda" when one is present); the batch
    orders are drawn on the CPU either way, as TorchTrainer draws them, and the results
    come back as CPU arrays.
    """
    first, cfg = trainers[0], configs[0]
    model = first.model
    names = first.trainable
    load_arrays(model, global_arrays, names)  # the module only supplies structure
    dev = torch.device(device)
    if dev.type != "cpu":
        model = model.to(dev)  # buffers with it; parameters are passed in explicitly
    c = len(trainers)
    sizes = np.array([len(t.train_data) for t in trainers], dtype=np.int64)
    even = bool((sizes == sizes[0]).all())
    n = int(sizes.max())
    plan = _plan(n, cfg)
    if even:
        # Each client's batch order from its own stream, exactly as TorchTrainer draws it from
        # a generator seeded for it: one (C, n) matrix of permutations per epoch. One
        # generator, reseeded for each client, is in the state a new one seeded alike is in
        # (manual_seed resets the whole state), and costs less than a generator a client.
        epochs = (plan[-1][0] + 1) if plan else 0
        if n <= 1 or epochs == 0:
            perms = torch.zeros((epochs, c, n), dtype=torch.int64)
        else:
            gen = torch.Generator()
            drawn = []
            for t, tc in zip(trainers, configs, strict=True):
                gen.manual_seed(_seed_from(t.seed, tc.seed))
                drawn += [torch.randperm(n, generator=gen) for _ in range(epochs)]
            perms = torch.stack(drawn).view(c, epochs, n).transpose(0, 1).contiguous()  # (epochs, C, n)
        perms = perms.to(dev)
        x_all, y_all = stack_rows([t.train_data for t in trainers])  # (C, n, ...), (C, n, ...)
        steps_of = [len(plan)] * c
    else:
        pad_idx, count, steps_of = _uneven_plan(trainers, configs, sizes)
        plan = [(0, 0)] * pad_idx.shape[1]  # the padded steps; pad_idx says which rows
        x_all, y_all = _padded_rows([t.train_data for t in trainers], n)
        # (C, T, B): rows to read (padding reads a real row, which weighs 0), their weights,
        # and which clients take each step.
        weights = torch.where(pad_idx >= 0, 1.0 / count.clamp_min(1).unsqueeze(-1).float(), 0.0).to(dev)
        pad_idx = pad_idx.clamp_min(0).to(dev)
        active = (count > 0).t().contiguous()  # (T, C)
        all_active = active.all(dim=1).tolist()
        active_f = active.to(dev, torch.float32)
        count = count.to(dev)
    x_all, y_all = x_all.to(dev), y_all.to(dev)
    g = {k: torch.from_numpy(np.ascontiguousarray(global_arrays[k], dtype=np.float32)).to(dev) for k in names}
    anchors = {k: v.unsqueeze(0) for k, v in g.items()}
    # Every client starts from the global model: until the first step, their parameters
    # are one broadcast view (vmap's in_dims None), so the first forward pass is one
    # matrix product over every client's batch instead of C small ones.
    params: dict[str, torch.Tensor] = anchors
    mu, wd, lr = cfg.proximal_mu, cfg.weight_decay, cfg.learning_rate
    # The written-out MLP step takes flat float features and integer class targets.
    flat_data = x_all.dim() == 3 and x_all.dtype == torch.float32 and y_all.dim() == 2 and y_all.dtype == torch.int64
    mlp = _mlp_plan(model, names) if flat_data else None
    if mlp is not None:
        def step(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, shared: bool,
                 w: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
            return _mlp_step(mlp, p, x, y, shared, w)
    else:
        loss_fn = grad(lambda p, x, y: _loss(model, p, x, y), has_aux=True)
        step_fn, first_fn = vmap(loss_fn), vmap(loss_fn, in_dims=(None, 0, 0))
        w_fn = grad(lambda p, x, y, w: _weighted_loss(model, p, x, y, w), has_aux=True)
        w_step_fn, w_first_fn = vmap(w_fn), vmap(w_fn, in_dims=(None, 0, 0, 0))

        def step(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, shared: bool,
                 w: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
            if w is not None:
                return w_first_fn(g, x, y, w) if shared else w_step_fn(p, x, y, w)
            return first_fn(g, x, y) if shared else step_fn(p, x, y)
    loss_sum = torch.zeros(c, dtype=torch.float64, device=dev)
    correct = torch.zeros(c, dtype=torch.int64, device=dev)
    seen = torch.zeros(c, dtype=torch.int64, device=dev)
    rows = torch.arange(c, device=dev).unsqueeze(1)
    for i, (epoch, start) in enumerate(plan):
        w = None
        if not even:
            idx = pad_idx[:, i]  # (C, B)
            x, y, w = x_all[rows, idx], y_all[rows, idx], weights[:, i]
        elif n <= cfg.batch_size:
            x, y = x_all, y_all  # one batch: TorchTrainer skips the gather too
        else:
            idx = perms[epoch, :, start:start + cfg.batch_size]  # (C, B)
            x, y = x_all[rows, idx], y_all[rows, idx]
        grads, (loss, hits) = step(params, x, y, i == 0, w)
        with torch.no_grad():
            nxt = {}
            # Uneven: clients whose steps have run out take none (a 0 factor leaves them as they are).
            off = None if even or all_active[i] else active_f[i]
            for k, p in params.items():
                d = grads[k]
                if mu > 0:
                    d = d + mu * (p - anchors[k])
                if wd != 0:
                    d = d + wd * p
                if off is not None:
                    d = d * off.view(-1, *([1] * (d.dim() - 1)))
                if i == 0:  # p - lr d, as the in-place step below computes it: now C copies
                    nxt[k] = p - lr * d
                else:
                    p.sub_(lr * d)
            if i == 0:
                params = nxt
            if even:
                loss_sum += loss.double() * y[0].numel()
                seen += y[0].numel()
            else:  # one target a row (train_many pads no other kind)
                loss_sum += loss.double() * count[:, i]
                seen += count[:, i]
            correct += hits
    if not plan:  # no step: every client keeps the global model
        params = {k: v.repeat(c, *([1] * (v.dim() - 1))) for k, v in anchors.items()}
    out = []
    arrays = {k: v.cpu().numpy() for k, v in params.items()}
    losses, hits_total, seen_total = loss_sum.tolist(), correct.tolist(), seen.tolist()
    for i in range(c):
        # Views into the stacked parameters: the caller takes a delta (a new array) at once.
        out.append(TrainResult(
            arrays={k: arrays[k][i] for k in names},
            weight=float(sizes[i]), num_examples=int(sizes[i]), num_steps=steps_of[i],
            metrics={"train_loss": losses[i] / max(seen_total[i], 1),
                     "train_accuracy": hits_total[i] / max(seen_total[i], 1)}))
    return out


def activation_bytes(model: nn.Module, example: torch.Tensor, batch_size: int) -> int:
    """Bytes of the forward activations (every leaf module's output) of one client's
    batch of ``batch_size`` examples like ``example`` (one example, without a batch
    dimension): one forward of that example on the CPU, measured by hooks."""
    total = 0

    def count(_m: nn.Module, _inp: object, out: object) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel() * out.element_size()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            model(example.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return total * batch_size


def cpu_slice(trainer: TorchTrainer, config: TrainConfig) -> int:
    """How many clients a vmap call trains at once on a CPU: up to ``_CPU_CLIENTS``,
    and no more than ``_CPU_SLICE_BYTES`` of forward activations in all.

    Small models (the digits MLP: 5 KiB of activations a client) take the cap: the stacked
    parameters and activations of ~150 clients stay in cache, so a client costs ~40% less
    than in a slice of 512. A convolutional model's batched-weight convolutions (vmap runs
    them as grouped convolutions) run out of cache much sooner: the MNIST CNN (1.7 MiB a
    client at batch 10) trained 69 clients per CPU-second in slices of 16 against 60 in
    slices of 160 (and 48 one client at a time). A client's result does not depend on
    the slice it is in."""
    batch = min(config.batch_size, len(trainer.train_data))  # the weights do not change the shapes
    model, example = trainer.model, trainer.train_data.x[0]
    key = (repr(model), tuple(example.shape), example.dtype, batch)  # the repr names every layer's shape
    per_client = _ACTIVATION_BYTES.get(key)
    if per_client is None:  # once per model structure and batch, not once per call
        per_client = _ACTIVATION_BYTES[key] = activation_bytes(model, example, batch)
    return max(1, min(_CPU_CLIENTS, _CPU_SLICE_BYTES // max(1, per_client)))


def _one_target_a_row(data: TensorData | TensorRows) -> bool:
    """Whether each example has one class target (what padding weighs row by row)."""
    y = data.pool.y if isinstance(data, TensorRows) else data.y  # a TensorRows' pool: no gather
    return y.dim() == 1 and not y.is_floating_point()


def train_many(trainers: Sequence[TorchTrainer], global_arrays: NDArrays,
               configs: Sequence[TrainConfig], device: str = "cpu") -> list[TrainResult]:
    """Group by (steps, hyperparameters) and train each group at once, in slices.

    Clients of different sizes share a group when each example has one class target:
    sorted by size, so a slice holds clients of close sizes and pads little (see
    :func:`train_group`); a slice of one size trains unpadded. Other data (sequences,
    regression targets) is grouped by size as well, and never padded."""
    groups: dict[tuple, list[int]] = {}
    for i, (t, c) in enumerate(zip(trainers, configs, strict=True)):
        n = len(t.train_data)
        key = (None if n > 0 and _one_target_a_row(t.train_data) else n, c.steps, c.epochs, c.batch_size,
               c.learning_rate, c.weight_decay, c.proximal_mu)
        groups.setdefault(key, []).append(i)
    results: list[TrainResult | None] = [None] * len(trainers)
    cpu = torch.device(device).type == "cpu"
    for idx in groups.values():
        if len(trainers[idx[0]].train_data) == 0:
            for i in idx:  # nothing to train on: TorchTrainer's own answer
                results[i] = trainers[i].train(global_arrays, configs[i])
            continue
        idx = sorted(idx, key=lambda i: len(trainers[i].train_data))  # stable: one size keeps its order
        # On a CPU, cache-sized slices (see cpu_slice; the largest client's batch sizes
        # them); on a GPU, the whole group at once.
        size = cpu_slice(trainers[idx[-1]], configs[idx[-1]]) if cpu else len(idx)
        for lo in range(0, len(idx), size):
            part = idx[lo:lo + size]
            for i, r in zip(part, train_group([trainers[i] for i in part], global_arrays,
                                              [configs[i] for i in part], device), strict=True):
                results[i] = r
    return [r for r in results if r is not None]
