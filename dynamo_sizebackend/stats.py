"""Counters every stage updates; tests and the CLI read them through :func:`stats`.

One process-wide :class:`Counters` instance lives behind a lock: the runner's per-call
increment is the hot path, so it takes the lock once per graph call, not per piece.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True)
class StatsSnapshot:
    """An immutable copy of the counters at one moment."""

    graphs: int = 0
    pieces: int = 0
    splits: int = 0
    compiles: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    reused: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0
    cache_skips: dict[str, int] = field(default_factory=dict)
    """Pieces the artifact cache could not serve or keep, by reason (``"corrupt"``,
    ``"guards"``, ``"unkeyable"``...; see ``cache.py``)."""
    captures: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "graphs": self.graphs,
            "pieces": self.pieces,
            "splits": self.splits,
            "compiles": dict(self.compiles),
            "calls": dict(self.calls),
            "reused": self.reused,
            "fallbacks": dict(self.fallbacks),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "cache_skips": dict(self.cache_skips),
            "captures": dict(self.captures),
            "compile_seconds": self.compile_seconds,
        }


class Counters:
    """Thread-safe counters. ``calls`` and friends are keyed by runtime size or "dynamic"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._ints: Counter[str] = Counter()
            self._maps: dict[str, Counter[str]] = {
                k: Counter() for k in ("compiles", "calls", "fallbacks", "captures", "cache_skips")
            }
            self._seconds = 0.0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._ints[name] += n

    def add_keyed(self, name: str, key: str, n: int = 1) -> None:
        if not n:  # a zero would still create the key and show up in snapshots
            return
        with self._lock:
            self._maps[name][key] += n

    def add_seconds(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                graphs=self._ints["graphs"],
                pieces=self._ints["pieces"],
                splits=self._ints["splits"],
                reused=self._ints["reused"],
                cache_hits=self._ints["cache_hits"],
                cache_misses=self._ints["cache_misses"],
                cache_skips=dict(self._maps["cache_skips"]),
                compiles=dict(self._maps["compiles"]),
                calls=dict(self._maps["calls"]),
                fallbacks=dict(self._maps["fallbacks"]),
                captures=dict(self._maps["captures"]),
                compile_seconds=self._seconds,
            )


COUNTERS = Counters()


def stats() -> StatsSnapshot:
    """A snapshot of everything the backend did in this process since the last reset."""
    return COUNTERS.snapshot()


def reset_stats() -> None:
    COUNTERS.reset()


def _delta(before: Any, after: Any) -> Any:
    if isinstance(after, dict):
        keys = set(before) | set(after)
        out = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
        return {k: v for k, v in out.items() if v}
    return after - before


@contextlib.contextmanager
def expect(**deltas: Any) -> Iterator[None]:
    """Assert that the block changes the named counters by exactly ``deltas``.

    ``with expect(graphs=1, compiles={"dynamic": 3, "4": 3}): ...``; dict fields compare
    their non-zero changes, so keys that did not move need not be listed.
    """
    before = stats().to_dict()
    yield
    after = stats().to_dict()
    for name, want in deltas.items():
        got = _delta(before[name], after[name])
        if isinstance(want, dict):
            want = {str(k): v for k, v in want.items() if v}
        assert got == want, f"stats().{name} changed by {got}, expected {want}"
