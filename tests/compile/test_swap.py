"""A cold start's sized pieces are swapped for the packages the worker builds
(``compile/swap.py``): the next call of the size after the worker answered loads them
(counted as cache hits, once), runs them as one chain, and gives eager's values.

Real defaults and Inductor, the default ``store_frozen`` (the package worker): the path
of a server started on an empty cache. The SDPA transformer, its batch dim alone
dynamic (every sized piece static, so each can be a package), split at attention.
"""
from __future__ import annotations

import logging
import threading

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.cache import aot
from dynamo_sizebackend.models.sdpa import TinyTransformer

pytestmark = pytest.mark.inductor
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _batch(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, 4, 16, generator=torch.Generator().manual_seed(seed))
    torch._dynamo.mark_dynamic(x, 0)
    return x


@torch.no_grad()
def test_a_cold_start_runs_the_workers_packages_as_a_chain(real_defaults, runners, tmp_path, caplog):
    made, calls = runners
    model = TinyTransformer(2, 16, 4, mlp_ratio=4).eval()
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "cache_dir": str(tmp_path)})
    before = sb.wait_for_packages()
    # Cold: 2 layers split at attention, 3 sized pieces, each compiled on the JIT path
    # to serve now and sent to the worker (a miss each, besides the general pieces').
    with sb.expect(compiles={"dynamic": 3, 2: 3}, cache_hits=0, calls={2: 1}, fallbacks={}):
        x = _batch(2, 0)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    (graph,) = made
    cold = graph._by_size[2]
    assert cold.chain is None and cold.swap is not None
    done = sb.wait_for_packages(timeout=600)
    assert (done.pending, done.failed - before.failed, done.stored - before.stored) == (0, 0, 3), done.errors

    # Not while a compile (here: another thread) holds Dynamo's compile lock: the call
    # runs the JIT pieces at once rather than wait for it to load the packages.
    from dynamo_sizebackend._torch.dynamo import COMPILE_LOCK

    held, release = threading.Event(), threading.Event()

    def hold():
        with COMPILE_LOCK:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        with sb.expect(compiles={}, cache_hits=0, calls={2: 1}):
            x = _batch(2, 3)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
        assert graph._by_size[2] is cold
    finally:
        release.set()
        holder.join()

    # The next call of size 2 loads the three packages and runs them as one chain.
    with caplog.at_level(logging.INFO, logger="dynamo_sizebackend"), \
            sb.expect(compiles={}, cache_hits=3, cache_misses=0, calls={2: 1}, fallbacks={}):
        x = _batch(2, 1)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    swapped = graph._by_size[2]
    assert swapped is not cold and swapped.chain is not None and swapped.swap is None
    assert swapped.check is cold.check and swapped.frozen is cold.frozen
    assert {n: type(p) for n, p in swapped.pieces.items() if n in cold.swap._sent} == \
        dict.fromkeys(cold.swap._sent, aot.AotPiece)
    assert calls["pieces"] == 0
    assert "size 2 runs 3 package(s) the worker built (of 3 sent), as one chain" in caplog.text
    # Once: later calls load nothing; the batch of 3 still runs the general pieces.
    with sb.expect(compiles={}, cache_hits=0, calls={2: 1, "dynamic": 1}):
        for n in (2, 3):
            x = _batch(n, 2)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert calls["pieces"] == 0
