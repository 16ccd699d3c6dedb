"""Run a function on N gloo ranks, each a spawned process, with a deadline.

A rank that hangs (a collective its peers never join) must fail the test, not stall
CI: :func:`run_ranks` waits until a deadline, then kills what is left and raises.
Every rank gets its own process group (``init_process_group`` over a file store in a
temporary folder, so no port can clash) with a timeout of its own, one intra-op
thread (2 ranks on 2 cores), and sends back either its result or its traceback.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable


class RankFailed(AssertionError):
    """A rank raised, or did not finish before the deadline."""


def _child(fn: Callable[..., Any], rank: int, world_size: int, store: str, pg_timeout: float,
           results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which decides
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120,
              pg_timeout: float = 60, raise_errors: bool = True) -> dict[int, Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (``fn`` must be
    importable: a module-level function). Returns ``{rank: result}``; a rank that raised
    gives ``("error", traceback text)`` when ``raise_errors`` is false, else
    :class:`RankFailed`. A rank not done after ``timeout`` seconds is killed and fails the
    call whatever ``raise_errors`` says."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="sizebackend-ranks-") as folder:
        store = os.path.join(folder, "store")
        procs = [context.Process(target=_child, daemon=True,
                                 args=(fn, rank, world_size, store, pg_timeout, results, args))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, Any]] = {}
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break  # a rank died without a word (a crash in C++)
                    continue
                got[rank] = (status, value)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join()
    missing = sorted(set(range(world_size)) - set(got))
    if missing:
        done = {r: s for r, (s, _) in got.items()}
        raise RankFailed(f"rank(s) {missing} did not finish within {timeout:.0f} s (hung or "
                         f"died; exit codes {[p.exitcode for p in procs]}); the others: {done}")
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if errors and raise_errors:
        raise RankFailed("\n".join(f"rank {r} raised:\n{v}" for r, v in sorted(errors.items())))
    return {r: (v if s == "ok" else ("error", v)) for r, (s, v) in got.items()}
