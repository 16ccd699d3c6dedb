"""CUDA-graph logic that needs no GPU (size rule, buffer planning), and GPU tests that
skip cleanly without one."""
import warnings

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.cudagraphs import (
    CudaGraphPiece,
    SimulatedGraphFactory,
    StablePointers,
    clone_outputs,
    effective_compile_sizes,
    plan_copies,
)
from dynamo_sizebackend.options import parse_options

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_seed_rule_drops_non_capture_sizes_with_one_warning():
    opts = parse_options({"compile_sizes": [1, 2, 3, 4, 5], "cudagraphs": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert effective_compile_sizes(opts) == (1, 2, 4)
    assert len(caught) == 1 and "[3, 5]" in str(caught[0].message)


def test_without_cudagraphs_every_size_is_kept():
    opts = parse_options({"compile_sizes": [1, 2, 3, 4, 5]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert effective_compile_sizes(opts) == (1, 2, 3, 4, 5)


def test_custom_capture_sizes():
    opts = parse_options({"compile_sizes": [3, 6, 8], "cudagraphs": True, "cudagraph_sizes": [3, 6]})
    with pytest.warns(UserWarning, match=r"\[8\]"):
        assert effective_compile_sizes(opts) == (3, 6)


def test_plan_copies_only_where_addresses_change():
    a, b = torch.zeros(4), torch.zeros(4)
    assert plan_copies([a, b, 3], [a, b.clone(), 3]) == [1]
    assert plan_copies([a, b], [a, b]) == []


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
    from dynamo_sizebackend.cudagraphs import CudaGraphFactory

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
    from dynamo_sizebackend import backend

    from .nets import TinyTransformer, batch, compile_sb

    monkeypatch.setattr(backend.cudagraphs, "cuda_available", lambda: True)
    monkeypatch.setattr(backend.cudagraphs, "CudaGraphFactory", SimulatedGraphFactory)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[2, 3, 4], compiler="eager", cudagraphs=True,
                          cudagraph_warmups=1, cache_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = compiled(batch(4))
    assert [r.getMessage() for r in caplog.records if "[3] are not in cudagraph_sizes" in r.getMessage()]
    outs = [first] + [compiled(batch(4, seed=s)) for s in range(2, 6)]
    for s, out in zip([1, 2, 3, 4, 5], outs):
        torch.testing.assert_close(out, model(batch(4, seed=s)))
    # Size 3 was dropped by the seed rule: compiles for the general shape, 2 and 4 only.
    assert sb.stats().compiles == {"dynamic": 3, "2": 3, "4": 3}
    # 3 pieces captured once at size 4 (first call warms up, second captures).
    assert sb.stats().captures == {"4": 3}
    torch.testing.assert_close(compiled(batch(3)), model(batch(3)))
    assert sb.stats().calls["dynamic"] == 1
