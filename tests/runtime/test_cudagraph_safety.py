"""Issue 12: the CUDA-graph cases that gave silent wrong results, each on the CPU
simulator (through the whole backend where the case lives there), so that they fail
without a GPU if the fix regresses."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import dynamo
from dynamo_sizebackend.compile import pipeline
from dynamo_sizebackend.runtime import cudagraphs
from dynamo_sizebackend.runtime.cudagraphs import (
    CudaGraphPiece,
    SimulatedGraphFactory,
    StablePointers,
)

from ..nets import TinyTransformer, batch, compile_sb
from ..spies import run_threads


def _cg(model, **options):
    return compile_sb(model, compiler="eager", cudagraphs=True, cache_dir=None, **options)


class Scaled(nn.Module):
    """One piece (no attention) that reads an int argument."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, n):
        return self.lin(x) * n + n


# -- keys ---------------------------------------------------------------------------


@torch.no_grad()
def test_an_int_argument_keys_its_own_capture(simulator):
    """Captured at n=3, called at n=5: the seed replayed the n=3 graph (x * 3)."""
    model = Scaled().eval()
    compiled = _cg(model, compile_sizes=[4])
    x = torch.randn(4, 8)
    for n in (3, 3, 3, 5, 5, 5, 3):  # per n: warm-up, capture, replay
        torch.testing.assert_close(compiled(x, n), model(x, n))
    assert sb.stats().captures == {"4": 2}  # one piece, two signatures (n = 3, 5)
    assert sb.stats().fallbacks == {}


@torch.no_grad()
def test_a_new_sequence_length_gets_its_own_capture(simulator):
    """Captured at sequence length 8, called at 12: the seed copied a [4, 12, 32] input
    into the [4, 8, 32] buffer and raised."""
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[4])
    for step, seq in enumerate([8, 8, 8, 12, 12, 12, 8, 12]):
        x = batch(4, seq=seq, seed=step)
        torch.testing.assert_close(compiled(x), model(x))
    # 3 pieces x 2 sequence lengths; every later call of each length replays.
    assert sb.stats().captures == {"4": 6}
    assert sb.stats().calls == {"4": 8}


def test_captures_per_piece_are_bounded(monkeypatch):
    monkeypatch.setattr(cudagraphs, "MAX_CAPTURES", 2)
    piece = CudaGraphPiece(lambda x, n: (x * n,), 2, SimulatedGraphFactory(), StablePointers(),
                           warmups=1)
    x = torch.ones(2)
    for n in (1, 1, 2, 2, 3, 3, 3):  # the third signature is one too many
        torch.testing.assert_close(cudagraphs.clone_outputs(piece(x, n))[0], x * n)
    assert len(piece.captures) == 2
    assert sb.stats().captures == {"2": 2}
    assert sb.stats().fallbacks == {"cudagraph_captures": 1}  # once per piece, not per call


# -- in-place writes ------------------------------------------------------------------


class Accumulates(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, acc):
        acc.add_(1)
        return self.lin(x)


@torch.no_grad()
def test_a_piece_that_writes_a_user_input_writes_the_callers_tensor(simulator):
    """The seed captured it with ``acc`` cloned into a buffer: after 4 calls acc was 1.
    Now the capture writes ``acc`` where it is, keyed by its address."""
    model = Accumulates().eval()
    compiled = _cg(model, compile_sizes=[4])
    x, acc = torch.randn(4, 8), torch.zeros(4)
    for _ in range(4):  # 1 warm-up, 1 capture, 2 replays
        torch.testing.assert_close(compiled(x, acc), model.lin(x))
    torch.testing.assert_close(acc, torch.full((4,), 4.0))
    assert sb.stats().captures == {"4": 1} and sb.stats().fallbacks == {}
    # Another tensor in its place: a capture of its own (after its warm-up), and the
    # first tensor is never written again.
    other = torch.zeros(4)
    for _ in range(3):
        compiled(x, other)
    torch.testing.assert_close(other, torch.full((4,), 3.0))
    torch.testing.assert_close(acc, torch.full((4,), 4.0))
    assert sb.stats().captures == {"4": 2}


# -- ownership ------------------------------------------------------------------------


class State:
    def __init__(self, value: float):
        self.bias = torch.full((8,), value)


class ReadsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, state):
        return self.lin(x) + state.bias


@torch.no_grad()
def test_a_tensor_reached_through_an_attribute_is_copied_never_written(simulator):
    """``state.bias`` is no parameter: the seed held it as static and, when a call came
    with another state, copied the new bias into the first caller's tensor."""
    model = ReadsState().eval()
    compiled = _cg(model, compile_sizes=[4])
    first, second = State(1.0), State(2.0)
    x = torch.randn(4, 8)
    for _ in range(3):  # warm-up, capture, replay
        torch.testing.assert_close(compiled(x, first), model(x, first))
    torch.testing.assert_close(compiled(x, second), model(x, second))
    torch.testing.assert_close(first.bias, torch.full((8,), 1.0))  # the caller's own
    torch.testing.assert_close(compiled(x, first), model(x, first))
    assert sb.stats().captures == {"4": 1}  # same signature: copied, not recaptured


@torch.no_grad()
def test_a_weight_given_new_storage_is_captured_again(simulator):
    """Parameters are read in place; their address is part of the key. The seed replayed
    a graph that read the old storage (the simulator raises where a GPU reads garbage)."""
    model = Scaled().eval()
    compiled = _cg(model, compile_sizes=[4])
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, 2), model(x, 2))
    model.lin.weight.data = torch.randn(8, 8)
    for _ in range(3):  # new address: warm-up, capture, replay
        torch.testing.assert_close(compiled(x, 2), model(x, 2))
    assert sb.stats().captures == {"4": 2}


# -- autograd and devices -------------------------------------------------------------


def test_grad_mode_runs_uncaptured_with_gradients(simulator):
    """With grad on, the seed captured and replayed detached outputs: no gradients."""
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[4])
    for step in range(3):
        out = compiled(batch(4, seed=step))
        assert out.requires_grad
        torch.testing.assert_close(out, model(batch(4, seed=step)))
    out.sum().backward()
    assert model.blocks[0].qkv.weight.grad is not None
    assert sb.stats().captures == {}
    assert sb.stats().fallbacks == {"cudagraph_grad_mode": 3}  # 3 pieces at size 4, once each


@torch.no_grad()
def test_inputs_on_another_device_are_not_captured(simulator, monkeypatch):
    """A graph for CUDA fed CPU tensors: a real capture would bake their values in."""
    monkeypatch.setattr(pipeline.cudagraphs, "CudaGraphFactory",
                        lambda: SimulatedGraphFactory("cuda"))
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[4])
    for step in range(3):
        torch.testing.assert_close(compiled(batch(4, seed=step)), model(batch(4, seed=step)))
    assert sb.stats().captures == {}
    assert sb.stats().fallbacks == {"cudagraph_device": 3}


# -- concurrency ----------------------------------------------------------------------


class SlowGraphs(SimulatedGraphFactory):
    """Replays that take long enough for another thread to get in between a piece's
    input copy and its replay."""

    class _Graph(SimulatedGraphFactory._Graph):
        def replay(self) -> None:
            time.sleep(0.002)
            super().replay()


@torch.no_grad()
def test_concurrent_calls_of_a_captured_graph_take_turns(simulator, monkeypatch):
    monkeypatch.setattr(pipeline.cudagraphs, "CudaGraphFactory", SlowGraphs)
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[2, 4])
    inputs = {(n, s): batch(n, seed=s) for n in (2, 4) for s in range(4)}
    expected = {k: model(v) for k, v in inputs.items()}
    for n in (2, 4):  # warm up and capture both sizes on one thread first
        compiled(inputs[n, 0]), compiled(inputs[n, 0])
    assert sb.stats().captures == {"2": 3, "4": 3}

    def work(i):
        for r in range(6):
            key = ((2, 4)[(i + r) % 2], (i + r) % 4)
            torch.testing.assert_close(compiled(inputs[key]), expected[key])

    run_threads(4, work)
    assert sb.stats().captures == {"2": 3, "4": 3}  # replays only


def test_a_capture_waits_while_another_thread_compiles():
    """Captures run under Dynamo's compile lock, taken without waiting: a compile on
    another thread defers the capture to a later call instead of breaking it."""
    piece = CudaGraphPiece(lambda x: (x + 1,), 2, SimulatedGraphFactory(), StablePointers(),
                           warmups=1)
    x = torch.zeros(2)
    piece(x)  # warm-up
    held, done = threading.Event(), threading.Event()

    def compile_elsewhere():
        with dynamo.COMPILE_LOCK:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=compile_elsewhere)
    thread.start()
    held.wait(10)
    try:
        torch.testing.assert_close(piece(x)[0], x + 1)
        assert piece.captures == {}  # deferred
    finally:
        done.set()
        thread.join()
    torch.testing.assert_close(piece(x)[0], x + 1)
    assert len(piece.captures) == 1 and sb.stats().captures == {"2": 1}


# -- policy ---------------------------------------------------------------------------


@torch.no_grad()
def test_a_statically_traced_size_is_captured(simulator):
    """Size 1 gets a graph of its own (0/1 specialization); the seed never captured it."""
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[1, 4])
    for step in range(4):
        torch.testing.assert_close(compiled(batch(1, seed=step)), model(batch(1, seed=step)))
    assert sb.stats().captures == {"1": 3}  # 3 pieces of the static graph
    assert sb.stats().calls == {"1": 4}


@torch.no_grad()
def test_cached_memory_is_freed_once_per_batch_of_captures(simulator):
    """torch.cuda.graph synchronizes and empties the cache on every capture; the pieces of
    a size are captured in one call and need it once."""
    model = TinyTransformer(layers=2).eval()
    compiled = _cg(model, compile_sizes=[2, 4])
    for n in (2, 2, 4, 4, 4):
        compiled(batch(n))
    assert sb.stats().captures == {"2": 3, "4": 3}
    assert [f.prepares for f in simulator] == [2]  # one per size, not one per piece (6)


def test_an_unhashable_argument_is_not_captured():
    piece = CudaGraphPiece(lambda x, s: (x + len(s),), 2, SimulatedGraphFactory(),
                           StablePointers(), warmups=1)
    for _ in range(3):
        torch.testing.assert_close(piece(torch.zeros(2), [1, 2])[0], torch.full((2,), 2.0))
    assert piece.captures == {} and sb.stats().fallbacks == {"cudagraph_signature": 1}


def test_a_failed_capture_is_counted_and_runs_uncaptured():
    class Breaks(SimulatedGraphFactory):
        def capture(self, fn, inputs=(), prepare=True):
            raise RuntimeError("operation not permitted when stream is capturing")

    piece = CudaGraphPiece(lambda x: (F.relu(x),), 2, Breaks(), StablePointers(), warmups=1)
    for _ in range(4):
        torch.testing.assert_close(piece(-torch.ones(2))[0], torch.zeros(2))
    assert piece.captures == {} and sb.stats().fallbacks == {"cudagraph_capture_failed": 1}
