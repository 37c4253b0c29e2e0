"""What every process kvserve spawns of its own needs (tensor-parallel workers, the engine core process): a start
that never re-imports the caller's script, and an end with the parent that started it."""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def caller_script_hidden() -> Iterator[None]:
    """A bare `__main__` while a process starts. A spawned process re-imports the parent's main script before it runs
    its target, so a script that builds its `LLM(tensor_parallel_size=N)` at top level, without
    `if __name__ == "__main__":`, would build another in every child and die with multiprocessing's bootstrapping
    error. The children need nothing of the script (their target and arguments are kvserve's): hidden, it is never
    imported in them."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def exit_with_parent() -> None:
    """In a spawned child: exit as soon as the parent is gone (killed, with no chance to stop us), instead of
    waiting on it forever."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()
