"""Issue 20: the CUDA-graph cases a real GPU gets wrong through its allocator and its
streams, and the policy that avoids them (``runtime/graph_factory.py: GraphFactory``).

The simulator models both: a pool block whose only references are weak is handed out
again to a later capture of the pool, a replay writes every block its capture could
use, and replays and captures are work on streams. Each scenario runs with the fixed
policy and with the one before issue 20 (:class:`Before`): on the simulator the latter
must fail (strict xfail: the test has teeth); on a GPU (``benchmarks/gpu_check.sh``) its
XFAIL says the hazard reproduced on real hardware, XPASS that it did not."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynamo_sizebackend as sb
from dynamo_sizebackend import devices
from dynamo_sizebackend.compile import pipeline
from dynamo_sizebackend.runtime import cudagraphs
from dynamo_sizebackend.runtime.cudagraphs import (
    CudaGraphFactory,
    CudaGraphPiece,
    SimulatedGraphFactory,
    StablePointers,
    clone_outputs,
)
from dynamo_sizebackend.runtime.graph_factory import SimulatedStream, simulated_stream

from ..nets import batch, compile_sb


class Before:
    """The policy before issue 20, over a factory: one pool for every capture, captures
    on the caller's stream (a private one only instead of the default stream), and no
    order between calls on different streams."""

    def begin_call(self, size):
        pass

    def _pool(self):
        if not self.pools:
            self.pools.append((self._new_pool(), set()))
        return self.pools[0][0]

    def _stream_for_capture(self, current):
        if current != self.default_stream():
            return current
        return super()._stream_for_capture(current)


class BeforeSimulated(Before, SimulatedGraphFactory):
    pass


class BeforeCuda(Before, CudaGraphFactory):
    pass


class Device:
    """What a scenario needs of a device: its factory (fixed or before), streams."""

    def __init__(self, name: str, policy: str):
        self.name, self.policy = name, policy
        self.cuda = name == "cuda"
        self.type = "cuda" if self.cuda else "cpu"

    def factory(self):
        if self.cuda:
            return BeforeCuda() if self.policy == "before" else CudaGraphFactory()
        return BeforeSimulated() if self.policy == "before" else SimulatedGraphFactory()

    def stream(self):
        return torch.cuda.Stream() if self.cuda else SimulatedStream()

    def using(self, stream):
        return torch.cuda.stream(stream) if self.cuda else simulated_stream(stream)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


_GPU = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
_BEFORE_SIM = pytest.mark.xfail(strict=True, reason="the policy before issue 20 must fail here")
_BEFORE_GPU = pytest.mark.xfail(
    strict=False, reason="issue 20's hazard under the old policy: XFAIL = reproduced on this GPU")


@pytest.fixture(params=[
    pytest.param(("sim", "fixed"), id="sim"),
    pytest.param(("sim", "before"), id="sim-before", marks=_BEFORE_SIM),
    pytest.param(("cuda", "fixed"), id="cuda", marks=_GPU),
    pytest.param(("cuda", "before"), id="cuda-before", marks=_GPU + [_BEFORE_GPU]),
])
def device(request) -> Device:
    return Device(*request.param)


def _close(device: Device, got, want) -> None:
    # GPU matmuls may round differently from the eager reference; the hazards give
    # NaN or another call's values, far outside either tolerance.
    tol = {"rtol": 1e-3, "atol": 1e-3} if device.cuda else {}
    torch.testing.assert_close(got, want, **tol)


# -- case 1: a capture in a call where earlier pieces replayed ---------------------------


class BusyOnce:
    """A capture lock another thread holds on the first try (a compile running)."""

    def __init__(self) -> None:
        self.tries = 0

    def acquire(self, blocking: bool = True) -> bool:
        self.tries += 1
        return self.tries > 1

    def release(self) -> None:
        pass


def _rotary_pieces(device: Device, lock=None):
    """Three pieces of one size as ``capture_pieces`` wraps them: piece 0 makes ``h``
    and a ``cos`` that both later pieces read (a Llama's rotary table); piece 1 alone
    takes an int ``n``, and the capture lock ``lock``."""
    factory, stable = device.factory(), StablePointers()
    w = torch.randn(8, 8, device=device.type)
    p0 = CudaGraphPiece(lambda x, w: (x @ w, torch.cos(x)), 4, factory, stable, warmups=1,
                        static_inputs=frozenset({1}))
    p1 = CudaGraphPiece(lambda h, c, n: (torch.relu(h) * c * n,), 4, factory, stable,
                        warmups=1, prepares=False, capture_lock=lock)
    p2 = CudaGraphPiece(lambda g, c: (g + c,), 4, factory, stable, warmups=1, prepares=False)

    def run(x, n):
        h, c = p0(x, w)
        (g,) = p1(h, c, n)
        return clone_outputs(p2(g, c))[0]

    def eager(x, n):
        return torch.relu(x @ w) * torch.cos(x) * n + torch.cos(x)

    return factory, run, eager, (p0, p1, p2)


@torch.no_grad()
def test_a_piece_whose_signature_alone_changed_is_captured_apart(device, monkeypatch):
    """n = 2 captures the 3 pieces in one call; n = 3 changes piece 1's signature only,
    so it is captured in a call where piece 0 replayed: ``h`` and ``cos`` were held
    weakly, free to the allocator, and the capture, in their pool, allocated over them.
    n = 4 is one signature past ``MAX_CAPTURES``: piece 1 runs uncaptured between two
    replays, and piece 2 copies its output into the block it borrows."""
    monkeypatch.setattr(cudagraphs, "MAX_CAPTURES", 2)
    factory, run, eager, pieces = _rotary_pieces(device)
    for n in (2, 2, 2, 3, 3, 3, 4, 4, 2, 3, 4):  # per n: warm-up, capture, replays
        x = torch.randn(4, 8, device=device.type)
        _close(device, run(x, n), eager(x, n))
    assert [len(p.captures) for p in pieces] == [1, 2, 1]
    assert sb.stats().fallbacks == {"cudagraph_captures": 1}
    if device.policy == "fixed":  # the second capture call of size 4 in a pool of its own
        assert len(factory.pools) == 2


@torch.no_grad()
def test_a_capture_deferred_by_a_compile_leaves_replayed_outputs_alone(device):
    """Piece 1's capture is deferred (a compile held the lock) to the next call, where
    piece 0 replays first: the same hazard through another door."""
    factory, run, eager, pieces = _rotary_pieces(device, BusyOnce())
    for _ in range(5):  # warm-up; 0 and 2 captured, 1 deferred; 1 captured; replays
        x = torch.randn(4, 8, device=device.type)
        _close(device, run(x, 2), eager(x, 2))
    assert [len(p.captures) for p in pieces] == [1, 1, 1]


class Rotary(nn.Module):
    """The backend-level case: cos computed in piece 0 and read by every later piece,
    ``n`` read by the last layer only (3 pieces: 2 attention layers)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.freq = nn.Parameter(torch.rand(dim))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x, n):
        b, t, d = x.shape
        cos = torch.cos(torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * self.freq)
        for i in range(2):
            q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2)
                       for z in self.qkv[i](x * cos).chunk(3, -1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out[i](a.transpose(1, 2).reshape(b, t, d)) * cos
        return x * n


@torch.no_grad()
def test_through_the_backend_a_later_capture_leaves_rotary_alone(monkeypatch, device):
    factories = []

    def make():
        factories.append(device.factory())
        return factories[-1]

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(pipeline.cudagraphs, "CudaGraphFactory", make)
    model = Rotary().to(device.type).eval()
    compiled = compile_sb(model, compiler="eager", cudagraphs=True, cache_dir=None,
                          compile_sizes=[4])
    for step, n in enumerate([2, 2, 2, 3, 3, 3, 2, 3]):  # per n: warm-up, capture, replays
        x = batch(4, seed=step).to(device.type)
        _close(device, compiled(x, n), model(x, n))
    # 3 pieces at n = 2, then the last piece again at n = 3, in a pool of its own.
    assert sb.stats().captures == {"4": 4} and sb.stats().fallbacks == {}
    fixed = device.policy == "fixed"
    assert len(factories) == 1 and len(factories[0].pools) == (2 if fixed else 1)
    if not device.cuda:
        assert factories[0].live_blocks() == 0  # no capture output outlived its call


@torch.no_grad()
def test_sizes_share_a_pool_and_a_size_captured_again_gets_another(simulator):
    """The memory side of the rule: the first capture calls of sizes 2 and 4 share one
    pool; a new sequence length is a second capture call of each, in a second pool."""
    from ..nets import TinyTransformer

    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compiler="eager", cudagraphs=True, cache_dir=None,
                          compile_sizes=[2, 4])
    for seq in (8, 12):
        for n in (2, 4):
            for _ in range(3):  # warm-up, capture, replay
                torch.testing.assert_close(compiled(batch(n, seq=seq)), model(batch(n, seq=seq)))
    assert sb.stats().captures == {"2": 4, "4": 4}  # 2 pieces x 2 sequence lengths
    assert [sorted(sizes) for _, sizes in simulator[0].pools] == [[2, 4], [2, 4]]


# -- case 2: replays on two streams --------------------------------------------------------


def _heavy(dim: int):
    """A piece whose replay runs long before it reads ``x``: a chain of matmuls by the
    identity, so the result is ``x`` and another call's ``x`` is plain to see."""

    def fn(x, w):
        z = w
        for _ in range(8):
            z = z @ w
        return (x @ z,)

    return fn


def _take_turns(device: Device, rounds: int, step) -> list[BaseException]:
    """Two threads, each on a stream of its own, run ``step(i, r)`` strictly in turn
    (the host order is never in question); what they raised."""
    turn = [threading.Semaphore(1), threading.Semaphore(0)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        with torch.no_grad(), device.using(device.stream()):
            for r in range(rounds):
                turn[i].acquire()
                try:
                    step(i, r)
                except BaseException as e:
                    errors.append(e)
                finally:
                    turn[1 - i].release()

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@torch.no_grad()
def test_replays_on_two_streams_are_ordered(device):
    """Two threads, each on a stream of its own, strictly take turns on one captured
    piece under a lock, as the runner's calls do. The lock orders the host only: a call
    on the second stream copied its input into the buffer, and replayed into the pool,
    while the first stream's replay and clone could still run."""
    dim = 4096 if device.cuda else 8
    factory = device.factory()
    w = torch.eye(dim, device=device.type)
    piece = CudaGraphPiece(_heavy(dim), 4, factory, StablePointers(), warmups=1,
                           static_inputs=frozenset({1}))
    lock = threading.Lock()

    def call(x):
        with lock:  # the runner's _replaying
            return clone_outputs(piece(x, w))[0]

    for _ in range(2):  # warm-up, capture on this thread's stream
        call(torch.zeros(4, dim, device=device.type))
    results: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def step(i: int, r: int) -> None:
        x = torch.full((4, dim), float(10 * i + r), device=device.type)
        results[i, r] = (call(x), x)

    errors = _take_turns(device, 6, step)
    device.synchronize()
    assert errors == []
    for got, x in results.values():
        _close(device, got, x)
    assert len(results) == 12 and len(piece.captures) == 1


@torch.no_grad()
def test_through_the_backend_calls_on_two_streams_are_ordered(simulator):
    """The runner's calls, two threads on streams of their own taking turns: the first
    captured piece of the size orders each call after the previous one's stream."""
    from ..nets import TinyTransformer

    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compiler="eager", cudagraphs=True, cache_dir=None,
                          compile_sizes=[4])
    inputs = [batch(4, seed=s) for s in range(4)]
    expected = [model(x) for x in inputs]
    for x in inputs[:2]:  # warm-up and capture on the default stream
        compiled(x)

    def step(i: int, r: int) -> None:
        k = (i + r) % len(inputs)
        torch.testing.assert_close(compiled(inputs[k]), expected[k])

    assert _take_turns(Device("sim", "fixed"), 4, step) == []
    assert sb.stats().captures == {"4": 2} and sb.stats().calls == {"4": 10}


# -- case 3: the capture stream ------------------------------------------------------------


@torch.no_grad()
def test_a_capture_records_nothing_another_thread_enqueues_on_the_callers_stream(device):
    """Thread A captures while its current stream is S (not the default stream);
    meanwhile thread B replays another graph on S. Recorded on S, the capture took B's
    replay in instead of letting it run: B's result was the previous call's."""
    shared = device.stream()
    capturing, replayed = threading.Event(), threading.Event()
    calls = []

    def slow(x):
        calls.append(1)
        if len(calls) == 2:  # warm-up, then the capture's recording
            capturing.set()
            replayed.wait(10)
        return (x + 1,)

    a = CudaGraphPiece(slow, 4, device.factory(), StablePointers(), warmups=1)
    b = CudaGraphPiece(lambda x: (x * 2,), 4, device.factory(), StablePointers(), warmups=1)
    with device.using(shared):
        for _ in range(2):  # b: warm-up, capture
            b(torch.ones(4, device=device.type))
    got = {}

    def thread_b():
        x = torch.full((4,), 5.0, device=device.type)
        capturing.wait(10)
        try:
            with torch.no_grad(), device.using(shared):
                got["b"] = clone_outputs(b(x))[0]
        finally:
            replayed.set()

    other = threading.Thread(target=thread_b)
    other.start()
    with device.using(shared):
        for _ in range(2):  # a: warm-up, capture (while b replays)
            a(torch.zeros(4, device=device.type))
    other.join(30)
    device.synchronize()
    _close(device, got["b"], torch.full((4,), 10.0, device=device.type))
    with device.using(shared):
        _close(device, clone_outputs(a(torch.zeros(4, device=device.type)))[0],
               torch.ones(4, device=device.type))
    assert len(a.captures) == 1 and len(b.captures) == 1 and sb.stats().fallbacks == {}
