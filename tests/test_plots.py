"""Round plots: whole-number rounds, accuracy on its whole scale, counts from zero."""

from __future__ import annotations

from orchard import plots

ROWS = [{"round": r, "accuracy": 0.5 + 0.001 * r, "loss": 1.0 - 0.01 * r, "bytes_up": 1e6, "bytes_down": 2e6,
         "selected": 4, "participants": 3} for r in (1, 2, 3)]


def test_rounds_are_whole_numbers_and_accuracy_is_not_magnified(tmp_path) -> None:
    fig, (acc, wire, part) = plots.subplots(3)
    plots.accuracy(acc, ROWS, "digits", loss=True)
    plots.bytes_on_the_wire(wire, ROWS)
    plots.participation(part, ROWS)
    fig.canvas.draw()
    for ax in (acc, wire, part):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert acc.get_ylim() == (0.0, 1.0)  # a 0.2-point wobble stays a wobble
    assert part.get_ylim()[0] == 0
    assert plots.save(fig, tmp_path / "p.png").stat().st_size > 0
