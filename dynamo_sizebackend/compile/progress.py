"""A progress bar for the compiles one graph waits on.

Shown only when there are more than a few pieces to compile (a long wait) and stderr is
a terminal: logs, CI and tests stay quiet. Compiles that run after the graph has been
handed back (lazy and background modes) are not shown: nobody is waiting on them, and a
bar redrawn from a background thread would interleave with the program's own output.
"""
from __future__ import annotations

import sys
from typing import Any

#: Fewer compiles than this take seconds; no bar.
MIN_STEPS = 5


class CompileProgress:
    """``expect(n, what)`` opens a bar for the next ``n`` compiles, ``step()`` advances
    it and closes it after the ``n``-th; steps without an open bar do nothing."""

    def __init__(self, label: str):
        self.label = label
        self._bar: Any = None
        self._left = 0

    def expect(self, steps: int, what: str) -> None:
        self.close()
        if steps < MIN_STEPS or not stderr_is_terminal():
            return
        from tqdm import tqdm

        self._bar = tqdm(total=steps, desc=f"{self.label}: {what}", unit="piece", leave=False)
        self._left = steps

    def step(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        self._left -= 1
        if self._left <= 0:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False
