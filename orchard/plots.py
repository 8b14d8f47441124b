"""Round-by-round plots, drawn one way for every command that writes them (``orchard demo``,
``orchard simulate``): rounds are whole numbers on the x axis, accuracy is drawn on its
whole scale (0 to 1) and losses and bytes from zero, so that an axis never magnifies the
noise of a few rounds into a trend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Rows = Sequence[dict[str, Any]]


def subplots(ncols: int = 1) -> tuple[Any, list[Any]]:
    """A figure of ``ncols`` panels side by side, on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols if ncols > 1 else 6, 4), squeeze=False)
    return fig, list(axes[0])


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def accuracy(ax: Any, rows: Rows, title: str, *, loss: bool = False) -> None:
    """Test accuracy per round on [0, 1]; with ``loss``, the test loss from zero on a
    second axis."""
    acc = [(x["round"], x["accuracy"]) for x in rows if x.get("accuracy") is not None]
    if acc:
        ax.plot(*zip(*acc, strict=True), marker="o", label="test accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    _rounds(ax)
    losses = [(x["round"], x["loss"]) for x in rows if x.get("loss") is not None] if loss else []
    if losses:
        right = ax.twinx()
        right.plot(*zip(*losses, strict=True), marker="s", color="tab:orange", label="test loss")
        right.set_ylim(bottom=0.0)
        right.set_ylabel("test loss")
        lines = ax.get_lines() + right.get_lines()
        ax.legend(lines, [line.get_label() for line in lines])


def bytes_on_the_wire(ax: Any, rows: Rows, title: str = "bytes on the wire") -> None:
    """Bytes up and down per round, in MB, side by side."""
    r = [x["round"] for x in rows]
    ax.bar([x - 0.2 for x in r], [x["bytes_up"] / 1e6 for x in rows], width=0.4, label="up")
    ax.bar([x + 0.2 for x in r], [x["bytes_down"] / 1e6 for x in rows], width=0.4, label="down")
    ax.set_ylabel("MB")
    ax.set_title(title)
    ax.legend()
    _rounds(ax)


def participation(ax: Any, rows: Rows) -> None:
    """Clients selected, aggregated, late and vanished per round."""
    r = [x["round"] for x in rows]
    for key, label in (("selected", "selected"), ("participants", "aggregated"), ("late", "late"),
                       ("vanished", "vanished")):
        ax.plot(r, [x.get(key, 0) for x in rows], marker=".", label=label)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("clients")
    ax.set_title("participation")
    ax.legend()
    _rounds(ax)


__all__ = ["accuracy", "bytes_on_the_wire", "participation", "save", "subplots"]
