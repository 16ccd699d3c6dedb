"""CUDA-graph logic that needs no GPU (size rule, buffer planning), and GPU tests that
skip cleanly without one."""
import logging
import warnings

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend import devices, ops
from dynamo_sizebackend.runtime import cudagraphs
from dynamo_sizebackend.runtime.cudagraphs import (
    CudaGraphPiece,
    SimulatedGraphFactory,
    StablePointers,
    clone_outputs,
    plan_copies,
)
from dynamo_sizebackend.options import check_options, parse_options, uncaptured_sizes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compile_sizes_outside_capture_sizes_are_kept_uncaptured(monkeypatch, caplog):
    """Issue 12: the seed dropped 3 and 5 (they then ran on the general pieces); now
    they are compiled and run at their own size, without graphs, said once."""
    opts = parse_options({"compile_sizes": [1, 2, 3, 4, 5], "cudagraphs": True})
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="dynamo_sizebackend.options"):
        assert check_options(opts).compile_sizes == (1, 2, 3, 4, 5)
    assert uncaptured_sizes(opts) == (3, 5)
    assert [n for n in range(1, 6) if cudagraphs.captures_size(opts, n)] == [1, 2, 4]
    assert len([r for r in caplog.records if "[3, 5] are not in cudagraph_sizes" in r.getMessage()]) == 1


def test_without_cudagraphs_every_size_is_kept():
    opts = parse_options({"compile_sizes": [1, 2, 3, 4, 5]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_options(opts).compile_sizes == (1, 2, 3, 4, 5)
    assert uncaptured_sizes(opts) == ()
    assert not any(cudagraphs.captures_size(opts, n) for n in range(1, 6))


def test_custom_capture_sizes():
    opts = parse_options({"compile_sizes": [3, 6, 8], "cudagraphs": True, "cudagraph_sizes": [3, 6]})
    assert opts.compile_sizes == (3, 6, 8)
    assert uncaptured_sizes(opts) == (8,)


def test_plan_copies_only_where_addresses_change():
    a, b = torch.zeros(4), torch.zeros(4)
    assert plan_copies([a, b, 3], [a, b.clone(), 3]) == [1]
    assert plan_copies([a, b], [a, b]) == []
    # A static input (a parameter) is never copied into, whatever its address.
    assert plan_copies([a, b], [a.clone(), b.clone()], static=frozenset({0})) == [1]


def _two_pieces(weight):
    first = lambda x, w: (x @ w, )  # noqa: E731
    second = lambda h: (torch.relu(h) + 1, )  # noqa: E731
    return first, second


def test_piecewise_replay_is_correct_and_copies_only_fresh_inputs():
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    first, second = _two_pieces(w)
    factory, stable = SimulatedGraphFactory(), StablePointers()
    p1 = CudaGraphPiece(first, 4, factory, stable, warmups=1, static_inputs=frozenset({1}))
    p2 = CudaGraphPiece(second, 4, factory, stable, warmups=1)

    def run(x):
        (h,) = p1(x, w)
        (y,) = p2(h)
        return clone_outputs(y)

    sb.reset_stats()
    results = []
    for step in range(5):  # 1 warm-up, 1 capture, 3 replays
        x = torch.randn(4, 8)
        results.append((run(x), torch.relu(x @ w) + 1))
    for got, want in results:
        torch.testing.assert_close(got, want)
    # A fresh user tensor each call: copied on each of the 3 replays. The weight is
    # static and the second piece reads the first one's captured output: never copied.
    assert (p1.copies, p2.copies) == (3, 0)
    assert p1.buffers[1] is w
    assert sb.stats().captures == {"4": 2}  # two pieces captured once at size 4


def test_returned_outputs_survive_the_next_replay():
    factory, stable = SimulatedGraphFactory(), StablePointers()
    piece = CudaGraphPiece(lambda x: (x * 2,), 2, factory, stable, warmups=0)
    first = clone_outputs(piece(torch.ones(2)))
    piece(torch.full((2,), 5.0))
    torch.testing.assert_close(first[0], torch.full((2,), 2.0))


@gpu
def test_cuda_piece_capture_and_replay():
    from dynamo_sizebackend.runtime.cudagraphs import CudaGraphFactory

    w = torch.randn(8, 8, device="cuda")
    factory, stable = CudaGraphFactory(), StablePointers()
    piece = CudaGraphPiece(lambda x, w: (x @ w,), 4, factory, stable, warmups=1,
                           static_inputs=frozenset({1}))
    for _ in range(4):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(clone_outputs(piece(x, w))[0], x @ w)


@torch.no_grad()
def test_cudagraph_wiring_through_the_backend_on_a_simulator(monkeypatch, caplog):
    """The whole path (seed rule, per-piece capture, split ops eager, outputs cloned)
    on CPU, with the simulated graph standing in for torch.cuda.CUDAGraph."""
    from dynamo_sizebackend.compile import pipeline as backend

    from ..nets import TinyTransformer, batch, compile_sb

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(backend.cudagraphs, "CudaGraphFactory", SimulatedGraphFactory)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[2, 3, 4], compiler="eager", cudagraphs=True,
                          cudagraph_warmups=1, cache_dir=None)
    with caplog.at_level(logging.INFO, logger="dynamo_sizebackend.options"):
        first = compiled(batch(4))
    assert [r.getMessage() for r in caplog.records if "[3] are not in cudagraph_sizes" in r.getMessage()]
    outs = [first] + [compiled(batch(4, seed=s)) for s in range(2, 6)]
    for s, out in zip([1, 2, 3, 4, 5], outs):
        torch.testing.assert_close(out, model(batch(4, seed=s)))
    # Size 3 is not a capture size but is kept: 3 pieces x (general + 2, 3, 4).
    assert sb.stats().compiles == {"dynamic": 3, "2": 3, "3": 3, "4": 3}
    # 3 pieces captured once at size 4 (first call warms up, second captures).
    assert sb.stats().captures == {"4": 3}
    for _ in range(3):  # size 3 runs its own pieces, never captured
        torch.testing.assert_close(compiled(batch(3)), model(batch(3)))
    assert sb.stats().calls == {"4": 5, "3": 3}
    assert sb.stats().captures == {"4": 3} and sb.stats().fallbacks == {}


class GraphSpy(SimulatedGraphFactory):
    """The simulator, keeping its graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs = []

    def capture(self, fn, inputs=(), prepare=True):
        graph, outputs = super().capture(fn, inputs, prepare)
        self.graphs.append(graph)
        return graph, outputs


def test_pieces_hold_captured_outputs_weakly():
    w = torch.randn(8, 8)
    first, second = _two_pieces(w)
    factory, stable = GraphSpy(), StablePointers()
    p1 = CudaGraphPiece(first, 4, factory, stable, warmups=0, static_inputs=frozenset({1}))
    p2 = CudaGraphPiece(second, 4, factory, stable, warmups=0)
    for step in range(3):  # 1 capture, 2 replays
        x = torch.randn(4, 8)
        (h,) = p1(x, w)
        torch.testing.assert_close(clone_outputs(p2(h))[0], torch.relu(x @ w) + 1)
        # The capture hands on the owning output, a replay a weak view of it.
        assert factory.live_blocks() == (1 if step == 0 else 0)
    del h
    # The pieces read and write the pool's blocks (the graphs' outputs and the second
    # piece's buffer for the first one's output) through views that own none of them.
    written = [g.outputs[0].data_ptr() for g in factory.graphs]
    assert [p.outputs[0].data_ptr() for p in (p1, p2)] == written
    assert p2.buffers[0].data_ptr() == written[0]
    assert factory.live_blocks() == 0  # the pieces kept none of them alive
    assert sb.stats().fallbacks == {}


@torch.no_grad()
def test_backend_replays_sizes_in_any_order_and_owns_no_capture_outputs(monkeypatch):
    """Captures at sizes 2, 4 and 8 through the backend; replays interleaved across sizes
    (4, 2, 4, 8, 2, 4) still match eager, and once the simulated graphs (the pool) let
    go of their outputs, nothing in the compiled model keeps any of them alive."""
    from dynamo_sizebackend.compile import pipeline as backend

    from ..nets import TinyTransformer, batch, compile_sb

    factories = []

    def make_factory():
        factories.append(GraphSpy())
        return factories[-1]

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(backend.cudagraphs, "CudaGraphFactory", make_factory)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[2, 4, 8], compiler="eager", cudagraphs=True,
                          cudagraph_warmups=1, cache_dir=None)
    # Per size: one warm-up call, one capture call, then replays.
    order = [4, 4, 2, 2, 4, 8, 8, 2, 4, 8, 4, 2]
    for step, size in enumerate(order):
        torch.testing.assert_close(compiled(batch(size, seed=step)), model(batch(size, seed=step)))
    # TinyTransformer(layers=2) splits into 3 pieces: 3 captures at each of 3 sizes.
    assert sb.stats().captures == {"2": 3, "4": 3, "8": 3}
    assert sb.stats().fallbacks == {}
    assert len(factories) == 1 and len(factories[0].graphs) == 9
    assert factories[0].live_blocks() == 0
    assert compiled is not None  # the runner and its pieces are alive all along


@pytest.fixture
def no_weak_ref(monkeypatch):
    """A ``_C`` built before ``weak_ref`` existed."""
    monkeypatch.setattr(ops, "has_weak_ref", lambda: False)
    cudagraphs._weak_refs_supported.cache_clear()
    yield
    cudagraphs._weak_refs_supported.cache_clear()


def test_without_weak_ref_pieces_own_their_outputs(no_weak_ref, caplog):
    w = torch.randn(8, 8)
    first, second = _two_pieces(w)
    factory, stable = SimulatedGraphFactory(), StablePointers()
    p1 = CudaGraphPiece(first, 4, factory, stable, warmups=0, static_inputs=frozenset({1}))
    p2 = CudaGraphPiece(second, 4, factory, stable, warmups=0)
    with caplog.at_level(logging.WARNING, logger="dynamo_sizebackend.runtime.cudagraphs"):
        for _ in range(3):
            x = torch.randn(4, 8)
            (h,) = p1(x, w)
            torch.testing.assert_close(clone_outputs(p2(h))[0], torch.relu(x @ w) + 1)
    # The pieces own what the capture returned: the pool can never hand it out again.
    assert p2.buffers[0] is p1.outputs[0] and factory.live_blocks() == 2
    assert sb.stats().fallbacks == {"weak_ref": 2}  # one per capture
    assert len([r for r in caplog.records if "no weak_ref op" in r.getMessage()]) == 1


@gpu
def test_cuda_capture_outputs_go_back_to_the_pool():
    """A piece with a large output: once the capturing call's result is cloned and
    dropped, the output's block no longer counts as allocated (the pool keeps it
    reserved), and replays of two sizes sharing the pool, 4, 8, 4, stay correct."""
    from dynamo_sizebackend.runtime.cudagraphs import CudaGraphFactory

    fn = lambda x: (x.repeat(1, 1024) * 2,)  # noqa: E731  [n, 1024] -> [n, 1M] floats
    factory = CudaGraphFactory()
    pieces = {n: CudaGraphPiece(fn, n, factory, StablePointers(), warmups=1) for n in (4, 8)}
    for n in (4, 8):
        x = torch.randn(n, 1024, device="cuda")
        pieces[n](x)  # warm-up, outside the pool
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = clone_outputs(pieces[n](x))  # capture
        torch.testing.assert_close(out[0], fn(x)[0])
        del out
        torch.cuda.synchronize()
        output_bytes = n * 1024 * 1024 * 4
        # What stays allocated is the piece's input buffer (n x 4 KiB), not the output.
        assert torch.cuda.memory_allocated() - before < output_bytes // 2
    for n in (4, 8, 4, 8):
        x = torch.randn(n, 1024, device="cuda")
        torch.testing.assert_close(clone_outputs(pieces[n](x))[0], fn(x)[0])


# -- issue 12 on a real GPU: the CudaGraphFactory paths the simulator stands in for ------


@gpu
@torch.no_grad()
def test_cuda_captures_per_signature_on_a_private_stream():
    """Two sequence lengths and two int values, called on a non-default current stream,
    each replayed correctly; every capture records on the factory's one private stream
    (issue 20: never the caller's, which other threads may enqueue on), also when the
    caller is on the default stream."""
    from dynamo_sizebackend.runtime.cudagraphs import CudaGraphFactory

    w = torch.randn(16, 16, device="cuda")
    fn = lambda x, w, n: (torch.relu(x @ w) * n,)  # noqa: E731
    factory = CudaGraphFactory()
    piece = CudaGraphPiece(fn, 4, factory, StablePointers(), warmups=1, static_inputs=frozenset({1}))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for seq, n in [(8, 3), (8, 3), (8, 3), (12, 3), (12, 3), (12, 5), (12, 5), (8, 3), (12, 5)]:
            x = torch.randn(4, seq, 16, device="cuda")
            torch.testing.assert_close(clone_outputs(piece(x, w, n))[0], fn(x, w, n)[0])
    torch.cuda.synchronize()
    private = factory._capture_stream
    assert len(piece.captures) == 3 and private is not None and private != stream
    assert factory.prepares == 3  # a lone piece starts every batch
    x = torch.randn(4, 16, 16, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(clone_outputs(piece(x, w, 2))[0], fn(x, w, 2)[0])
    assert factory._capture_stream is private and len(piece.captures) == 4


@gpu
def test_cuda_refuses_grad_mode_and_cpu_inputs():
    from dynamo_sizebackend.runtime.cudagraphs import CudaGraphFactory

    factory = CudaGraphFactory()
    w = torch.randn(8, 8, device="cuda", requires_grad=True)
    piece = CudaGraphPiece(lambda x, w: (x @ w,), 4, factory, StablePointers(), warmups=1,
                           static_inputs=frozenset({1}))
    for _ in range(3):
        out = piece(torch.randn(4, 8, device="cuda"), w)[0]
    assert out.requires_grad and piece.captures == {}
    with torch.no_grad():
        scale = torch.tensor(2.0)  # a CPU scalar a capture would bake in
        cpu = CudaGraphPiece(lambda x, s: (x * s,), 4, factory, StablePointers(), warmups=1)
        for value in (2.0, 2.0, 3.0):
            scale.fill_(value)
            x = torch.randn(4, device="cuda")
            torch.testing.assert_close(cpu(x, scale)[0], x * value)
        assert cpu.captures == {}
    assert sb.stats().fallbacks == {"cudagraph_grad_mode": 1, "cudagraph_device": 1}


@gpu
@torch.no_grad()
def test_cuda_capture_writes_an_input_where_it_is():
    """An input the piece writes (a KV cache) is read in place, keyed by its address:
    the real graph's replays write the caller's tensor, and another tensor there gets a
    capture of its own."""
    from dynamo_sizebackend.runtime.cudagraphs import CudaGraphFactory

    def body(x, acc):
        acc.add_(1)
        return (x * 2,)

    piece = CudaGraphPiece(body, 4, CudaGraphFactory(), StablePointers(), warmups=1,
                           static_inputs=frozenset({1}))
    acc, other = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    for _ in range(4):  # warm-up, capture, 2 replays
        x = torch.randn(4, device="cuda")
        torch.testing.assert_close(piece(x, acc)[0], x * 2)
    for _ in range(3):
        piece(torch.randn(4, device="cuda"), other)
    torch.cuda.synchronize()
    torch.testing.assert_close(acc, torch.full((4,), 4.0, device="cuda"))
    torch.testing.assert_close(other, torch.full((4,), 3.0, device="cuda"))
    assert len(piece.captures) == 2


@gpu
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@torch.no_grad()
def test_cuda_backend_end_to_end(compiler):
    """TinyTransformer on the GPU through the backend with real graphs: sizes 1 (its
    own static graph), 2 and 4 captured, 3 compiled but uncaptured, two sequence
    lengths; every call matches eager."""
    from ..nets import TinyTransformer, compile_sb

    model = TinyTransformer(layers=2).cuda().eval()
    compiled = compile_sb(model, compile_sizes=[1, 2, 3, 4], compiler=compiler, cudagraphs=True,
                          cache_dir=None, sized_inductor_options={})
    calls = 0
    for seq in (8, 12):
        for n in (1, 2, 3, 4):
            for step in range(3):  # warm-up, capture, replay
                x = torch.randn(n, seq, 32, device="cuda")
                torch.testing.assert_close(compiled(x), model(x), rtol=2e-3, atol=2e-3)
                calls += 1
    # 3 pieces x 2 sequence lengths at each of the capture sizes 1, 2, 4.
    assert sb.stats().captures == {"1": 6, "2": 6, "4": 6}
    assert sb.stats().fallbacks == {}
    assert sum(sb.stats().calls.values()) == calls
