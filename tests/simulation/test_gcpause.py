import gc
import weakref

from orchard.simulation.gcpause import cyclic_gc_paused


class _Node:
    me: object = None


def test_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
        a = _Node()
        a.me = a  # a cycle made during the round: reference counting cannot free it
        ref = weakref.ref(a)
        del a
        assert ref() is not None  # nothing collects it while paused
    assert gc.isenabled()
    assert ref() is None  # collected as the block ends


def test_leaves_a_disabled_collector_alone() -> None:
    gc.disable()
    try:
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restored_when_the_round_raises() -> None:
    try:
        with cyclic_gc_paused():
            raise RuntimeError("round failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
