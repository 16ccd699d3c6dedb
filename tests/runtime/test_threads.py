"""Several threads calling one compiled model, and compiles the backend runs outside
Dynamo's (lazy, background) while other threads call."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dynamo_sizebackend as sb
from dynamo_sizebackend.compile import adaptor as compiler

from ..nets import TinyTransformer, batch, compile_sb
from ..spies import AdaptorSpy, run_threads

LISTED = [2, 4, 8]


@torch.no_grad()
def test_threads_share_one_compiled_model(monkeypatch):
    spy = AdaptorSpy(monkeypatch)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=LISTED, compiler="eager")
    sizes = [2, 3, 4, 5, 8]
    expected = {s: model(batch(s)) for s in sizes}
    rounds, threads = 6, 4
    # Cold start, every thread at once. Dynamo itself traces the frame once per thread
    # that missed its cache before the first compile finished (a plain counting backend
    # sees the same), so 1 to 4 graphs; every one of them must be right.
    run_threads(threads, lambda i: torch.testing.assert_close(compiled(batch(4)), expected[4]))
    graphs = sb.stats().graphs
    assert 1 <= graphs <= threads
    assert sb.stats().calls == {"4": threads}

    def work(i):
        for r in range(rounds):
            size = sizes[(i + r) % len(sizes)]
            torch.testing.assert_close(compiled(batch(size)), expected[size])

    before = sb.stats().calls
    with sb.expect(graphs=0, compiles={}):
        run_threads(threads, work)
    calls = {k: v - before.get(k, 0) for k, v in sb.stats().calls.items()}
    assert sum(calls.values()) == threads * rounds
    # Each thread starts at a different offset: every size is called 24 / 5 times, +-1.
    per_size = {s: sum((i + r) % len(sizes) == sizes.index(s)
                       for i in range(threads) for r in range(rounds)) for s in sizes}
    assert calls == {"2": per_size[2], "4": per_size[4], "8": per_size[8],
                     "dynamic": per_size[3] + per_size[5]}
    assert spy.runs == 3 * (threads + threads * rounds)
    assert sb.stats().graphs == graphs


@torch.no_grad()
def test_threads_racing_for_a_lazy_size_compile_it_once(monkeypatch):
    AdaptorSpy(monkeypatch)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager", compile_mode="lazy")
    compiled(batch(3))
    expected = model(batch(4))
    # The first thread to see size 4 compiles its 3 pieces, once; threads arriving
    # while it compiles do not wait, they run the general pieces.
    with sb.expect(graphs=0, compiles={4: 3}):
        run_threads(8, lambda i: torch.testing.assert_close(compiled(batch(4)), expected))
    calls = sb.stats().calls
    assert calls["4"] >= 1 and calls["4"] + calls["dynamic"] == 8 + 1
    with sb.expect(compiles={}, calls={"4": 1}):
        torch.testing.assert_close(compiled(batch(4)), expected)


class TracingCompiler(AdaptorSpy):
    """Like Inductor's AOT trace: each sized compile runs ``make_fx`` (which sets FX's
    process-global tracing flag and patches ``nn.Module.__call__`` for every thread)
    on a function that takes a while."""

    def __init__(self, monkeypatch, seconds: float):
        super().__init__(monkeypatch)
        checked = compiler.EagerAdaptor.compile

        def slow(x):
            time.sleep(seconds)
            return x * 2

        def compile(adaptor, gm, example_inputs, runtime_size, fake_mode=None):
            if runtime_size is not None:
                make_fx(slow)(torch.ones(2))
            return checked(adaptor, gm, example_inputs, runtime_size, fake_mode)

        monkeypatch.setattr(compiler.EagerAdaptor, "compile", compile)


@pytest.mark.parametrize("mode", ["background", "lazy"])
@torch.no_grad()
def test_calls_on_other_threads_survive_a_compile_outside_dynamo(monkeypatch, mode):
    # Without the compile-session flag Dynamo sets around its own compiles, calls made
    # while our own (background, lazy) compile traced raised "Detected that you are using
    # FX to symbolically trace a dynamo-optimized function".
    TracingCompiler(monkeypatch, seconds=0.3)
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager", compile_mode=mode)
    x3, x4 = batch(3), batch(4)
    want3, want4 = model(x3), model(x4)
    compiled(x3)
    done = threading.Event()

    def call_while_compiling(i):
        if i == 0 and mode == "lazy":  # this thread compiles size 4 (2 pieces, 0.6 s)
            torch.testing.assert_close(compiled(x4), want4)
            done.set()
            return
        deadline = time.monotonic() + 60
        while not (done.is_set() or sb.stats().compiles.get("4") == 2):
            torch.testing.assert_close(compiled(x3), want3)
            assert time.monotonic() < deadline

    run_threads(3, call_while_compiling)
    assert sb.stats().compiles.get("4") == 2


@torch.no_grad()
def test_lazy_size_does_not_queue_behind_another_size_compiling(monkeypatch):
    """While one thread compiles size 4, a first call of size 8 (pending too) runs the
    general pieces at once; size 8 compiles on its first call after that."""
    AdaptorSpy(monkeypatch)
    started, release = threading.Event(), threading.Event()
    checked = compiler.EagerAdaptor.compile

    def compile(adaptor, gm, example_inputs, runtime_size, fake_mode=None):
        if runtime_size == 4:
            started.set()
            release.wait(timeout=5)  # a queued size-8 call would hold this up 5 s
        return checked(adaptor, gm, example_inputs, runtime_size, fake_mode)

    monkeypatch.setattr(compiler.EagerAdaptor, "compile", compile)
    model = TinyTransformer(layers=1).eval()  # 2 pieces
    compiled = compile_sb(model, compile_sizes=[4, 8], compiler="eager", compile_mode="lazy")
    compiled(batch(3))
    want4, want8 = model(batch(4)), model(batch(8))
    first = threading.Thread(target=lambda: run_threads(
        1, lambda i: torch.testing.assert_close(compiled(batch(4)), want4)))
    first.start()
    assert started.wait(timeout=30)
    try:
        with sb.expect(compiles={}, calls={"dynamic": 1}):
            torch.testing.assert_close(compiled(batch(8)), want8)
        assert not release.is_set()  # size 4 still compiling: the call did not wait for it
    finally:
        release.set()
        first.join(timeout=60)
    assert sb.stats().compiles == {"dynamic": 2, "4": 2} and sb.stats().calls["4"] == 1
    with sb.expect(compiles={8: 2}, calls={"8": 1}):  # still pending: compiled now
        torch.testing.assert_close(compiled(batch(8)), want8)
    with sb.expect(compiles={}, calls={"4": 1, "8": 1}):
        compiled(batch(4)), compiled(batch(8))
