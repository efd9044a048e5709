"""Python's cyclic garbage collector around start-up.

Importing torch and transformers creates a quarter of a million objects that live as long as the process (modules,
classes, functions) and almost no garbage, yet the collector walks them again and again as they appear: ~500
collections, three of them over the whole heap, ~0.4 s; loading a model adds one more full walk (~0.15 s). That
is 0.6 s of a 6.7 s cold start (process to first token) on the 2-core Xeon of docs/benchmarks.md. So:
- `import_static` imports a module with the collector paused, then freezes (`gc.freeze`) what is alive, so that
  no later collection walks it again (as a paused import's objects would otherwise be, all at once, by the next);
- `paused_gc` pauses it while an engine loads (whose objects are few: the next collection takes ~7 ms);
- `freeze_startup_heap` collects once and freezes the server's heap after start-up, as vLLM's server does, so that
  a full collection while serving walks only what requests made since, not a pause of ~80 ms per quarter million
  objects in the engine thread's step.
A frozen object is never collected: `LLM` freezes no engine, since a process may build and drop several. At exit
the frozen objects go back to the collector (`gc.unfreeze`), so that Python's last collection finalises them as it
would have (extensions that count their objects, such as Triton's, would otherwise report them leaked).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    """The cyclic collector off inside the block (nested blocks leave it to the outermost); reference counting
    still frees everything acyclic at once, and the first collection after the block walks what it made (all of
    it young), taking any cycles left. With `freeze`, what is alive is frozen before the collector comes back:
    nothing walks it then."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            _freeze()
    finally:
        if enabled:
            gc.enable()


def import_static(name: str) -> ModuleType:
    """`importlib.import_module(name)`; the first time, with the collector paused, and what is alive afterwards
    frozen (with the import's cycles of garbage, a few thousand objects: a one-time leak)."""
    if name in sys.modules:
        return sys.modules[name]
    with paused_gc(freeze=True):
        return importlib.import_module(name)


def freeze_startup_heap() -> None:
    """Collect once, then leave every object alive now out of later collections."""
    gc.collect()
    _freeze()


def _freeze() -> None:
    _unfreeze_at_exit()
    gc.freeze()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
