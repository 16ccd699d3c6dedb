"""A cold start's sized pieces swapped for the packages the worker built, while it serves.

Why: with the default ``store_frozen=True`` a frozen sized piece that is not stored yet
compiles on the JIT path to serve at once, and the package worker builds its AOT
package for the next start (``cache/package_worker.py``). Until this, the running
process kept the JIT pieces for its whole life: a server started on a cold cache never
ran a size as one C++ chain (``runtime/chain.py``), which needs every piece of the size
to be a package, nor on the packages' 64-byte aligned constants, however long it ran.

How: a sized program some of whose pieces went to the worker carries a
:class:`PackageSwap`. A serving call of that size asks it :meth:`~PackageSwap.due`
(one read of the worker's answer count while nothing new came back); once the worker
has answered for every such piece, that call loads the stored packages (each counted in
``cache_hits``, as a restart's load is), and the runner publishes a program of the same
size made of them in place of the old one: the same shape check and frozen-weight
record, chained where all pieces are now packages (a piece whose build failed keeps its
JIT compile). Loaded on a serving call, not on the worker's reader thread, so that
counters move only inside calls, and never for a program that a weight change retired
meanwhile (the runner checks the weights first), and never while a compile holds
Dynamo's compile lock (which loading a package takes: a call does not wait for a
background compile; the next one swaps). One swap per program: after it, or when
nothing could be loaded, it is never asked again.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

from .._torch.dynamo import COMPILE_LOCK
from ..cache import aot, package_worker

log = logging.getLogger(__name__)


class PackageSwap:
    """The pieces of one sized program that the worker is building (``sent``, by piece
    name) and how to make the program again with some pieces replaced (``remake``)."""

    def __init__(self, sent: Mapping[str, aot.Sent], remake: Callable[[dict[str, Any]], Any],
                 graph_id: int, key: str):
        self._sent = dict(sent)
        self._remake = remake
        self._graph_id, self._key = graph_id, key
        self._seen = -1  # the worker's answer count at the last look
        self._ready = False  # every piece sent has its answer
        self._lock = threading.Lock()
        self.done = False

    def due(self) -> bool:
        """Whether the worker has answered for every piece sent (cheap while it has
        answered nothing new since the last look)."""
        if self.done or self._ready:
            return not self.done
        answered = package_worker.answered()
        if answered == self._seen:
            return False
        self._seen = answered
        self._ready = all(s.answered() is not None for s in self._sent.values())
        return self._ready

    def build(self) -> Any:
        """The program with every stored package in place of its JIT piece; ``None``
        where none loads, where another call swapped or is swapping, or where a compile
        holds Dynamo's compile lock (a background compile of another size: loading a
        package takes that lock, and a serving call never waits for a compile; a later
        call swaps)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self.done or not COMPILE_LOCK.acquire(blocking=False):
                return None
            try:
                self.done = True
                loaded = self._load()
            finally:
                COMPILE_LOCK.release()
            if not loaded:
                log.info("sizebackend: graph %d: size %s keeps its JIT pieces (no package "
                         "of the worker's loaded)", self._graph_id, self._key)
                return None
            program = self._remake(loaded)
            log.info("sizebackend: graph %d: size %s runs %d package(s) the worker built "
                     "(of %d sent)%s", self._graph_id, self._key, len(loaded), len(self._sent),
                     ", as one chain" if program.chain is not None else "")
            return program
        finally:
            self._lock.release()

    def _load(self) -> dict[str, Any]:
        loaded = {}
        for name, sent in self._sent.items():
            if sent.answered() in ("stored", "present"):
                piece = sent.load()
                if piece is not None:
                    loaded[name] = piece
        return loaded
