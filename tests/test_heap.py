"""pagedllm.heap: the cyclic garbage collector paused while start-up builds long-lived objects, and what start-up
left frozen out of later collections."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from pagedllm.heap import freeze_startup_heap, import_static, paused_gc


class _Node:
    """An object that can hold a reference cycle."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    """A garbage reference cycle, alive until a collection finds it; the weak reference says whether it did."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def unfrozen():
    """Whatever a test freezes goes back to the collector afterwards."""
    yield
    gc.unfreeze()


def test_paused_gc_pauses_the_collector_and_gives_back_the_state_it_found():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()   # the inner block leaves it to the outer one
        cycle = _cycle()
        allocated = [_Node() for _ in range(10 * gc.get_threshold()[0])]   # many times what starts a collection
        assert cycle() is not None  # no collection ran
    assert gc.isenabled()
    gc.collect()
    assert cycle() is None and allocated  # and the collector takes it afterwards
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("a failed start-up")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()   # a collector the caller turned off stays off
    finally:
        gc.enable()


def _collected_ids() -> set[int]:
    """The ids of the objects the collector walks (a frozen one is in none of its generations)."""
    return {id(obj) for obj in gc.get_objects()}


def test_paused_gc_can_freeze_what_the_block_left_alive(unfrozen):
    with paused_gc(freeze=True):
        kept = [_Node() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)
    walked = _collected_ids()
    assert not any(id(node) in walked for node in kept)


def test_import_static_freezes_a_new_module_once(tmp_path, monkeypatch, unfrozen):
    (tmp_path / "pagedllm_heap_probe.py").write_text("TABLE = {i: [i] for i in range(1000)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pagedllm_heap_probe", raising=False)
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda freeze=gc.freeze: freezes.append(gc.isenabled()) or freeze())
    module = import_static("pagedllm_heap_probe")
    assert module.TABLE[999] == [999]
    assert freezes == [False]       # frozen before the collector came back, so nothing walked the import's objects
    assert gc.isenabled()
    assert import_static("pagedllm_heap_probe") is module
    assert freezes == [False]       # an import already done freezes nothing more


def test_freeze_startup_heap_collects_first_then_freezes(unfrozen):
    cycle, kept = _cycle(), _Node()
    freeze_startup_heap()
    assert cycle() is None          # garbage is collected, not frozen
    later = _Node()
    walked = _collected_ids()
    assert id(kept) not in walked and id(later) in walked


def test_frozen_objects_go_back_to_the_collector_at_exit():
    """So that Python's last collection finalises them (Triton's bindings report objects never finalised)."""
    script = ("import atexit, gc\n"
              "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))  # runs after pagedllm's\n"
              "from pagedllm.heap import freeze_startup_heap\n"
              "freeze_startup_heap()\n"
              "print('frozen:', gc.get_freeze_count() > 0)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[:2] == ["frozen: True", "frozen at exit: 0"]
