"""A hook put into torch once per process and active only on the threads inside a
block: how the backend changes Inductor's behaviour for its own compiles (autotune
pruning, template parsing) while every other caller in the process keeps torch's."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class ThreadScopedHook:
    """``install`` runs once, on the first :meth:`scope` that is on; the hook it put in
    place asks :attr:`active` whether the calling thread is inside such a scope."""

    def __init__(self, install: Callable[[], None]):
        self._install = install
        self._installed = False
        self._lock = threading.Lock()
        self._state = threading.local()

    @property
    def active(self) -> bool:
        return getattr(self._state, "on", False)

    def _ensure_installed(self) -> None:
        """Install the hook once; call with :attr:`_lock` held."""
        if not self._installed:
            self._install()
            self._installed = True

    @contextlib.contextmanager
    def scope(self, on: bool = True) -> Iterator[None]:
        """Make the hook active on this thread inside the block when ``on``."""
        if not on:
            yield
            return
        with self._lock:
            self._ensure_installed()
        before = self._enter()
        try:
            yield
        finally:
            self._leave(before)

    def _enter(self) -> bool:
        before = self.active
        self._state.on = True
        return before

    def _leave(self, before: bool) -> None:
        self._state.on = before


class ProcessScopedHook(ThreadScopedHook):
    """Like :class:`ThreadScopedHook`, but :attr:`active` on every thread while any
    thread is inside a :meth:`scope`: for torch work that a compile hands to a thread
    pool of its own (Inductor precompiles autotune candidates on pool threads)."""

    def __init__(self, install: Callable[[], None]):
        super().__init__(install)
        self._inside = 0

    @property
    def active(self) -> bool:
        return self._inside > 0

    def _enter(self) -> bool:
        with self._lock:
            self._inside += 1
        return True

    def _leave(self, before: bool) -> None:
        with self._lock:
            self._inside -= 1
