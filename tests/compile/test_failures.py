"""Compile failures and odd runtime shapes: whatever happens, the compiled model returns
what eager returns or raises a clear error.

Most tests use the eager compiler adaptor, wrapped by a spy that calls the real one
(``spies.py``); the few that need a real compile are marked ``inductor``.
"""
from __future__ import annotations

import time

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.compile import adaptor as compiler
from dynamo_sizebackend import SizeCompileError

from ..nets import TinyTransformer, batch, compile_sb
from ..spies import AdaptorSpy, warnings_from

LISTED = [2, 4, 8]


# --- a piece that fails to compile -------------------------------------------------


@torch.no_grad()
def test_size_that_fails_to_compile_is_served_by_general_pieces(monkeypatch, caplog):
    AdaptorSpy(monkeypatch, fail={4})
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=LISTED, compiler="eager")
    # 3 pieces. General, 2 and 8 compile all 3; size 4 gives up at its first piece and
    # keeps nothing (a half-specialized program buys nothing): 1 fallback.
    with sb.expect(compiles={"dynamic": 3, 2: 3, 8: 3}, fallbacks={4: 1}, calls={"dynamic": 1}):
        out = compiled(batch(4))
    torch.testing.assert_close(out, model(batch(4)))
    with sb.expect(compiles={}, fallbacks={}, calls={"dynamic": 2, "2": 1, "8": 1}):
        for size in (4, 2, 8, 4):
            torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    logged = warnings_from(caplog, "failed to compile for size 4")
    assert len(logged) == 1, logged
    assert "injected failure at size 4 ..." in logged[0]  # first line only, marked cut
    assert "second line" not in logged[0]
    assert "serving that size with the general pieces" in logged[0]


@torch.no_grad()
def test_general_compile_failure_runs_the_graph_uncompiled(monkeypatch, caplog):
    spy = AdaptorSpy(monkeypatch, fail={None})
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    # All 3 general compiles fail (3 fallbacks, pieces run as they are); size 4 still
    # compiles its 3 pieces.
    with sb.expect(graphs=1, compiles={4: 3}, fallbacks={"dynamic": 3}, calls={"dynamic": 1}):
        out = compiled(batch(3))
    torch.testing.assert_close(out, model(batch(3)))
    with sb.expect(calls={"4": 1}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    # Batch 1 is a static graph of its own: its only compile is a "general" one.
    with sb.expect(graphs=1, compiles={}, fallbacks={1: 3}, calls={"1": 1}):
        torch.testing.assert_close(compiled(batch(1)), model(batch(1)))
    logged = warnings_from(caplog, "running it uncompiled")
    assert len(logged) == 2, logged  # once per graph, not once per piece
    assert spy.compiled == [4, 4, 4]


@pytest.mark.parametrize("fail", [4, None], ids=["size", "general"])
@torch.no_grad()
def test_strict_turns_a_fallback_into_an_error(monkeypatch, fail):
    AdaptorSpy(monkeypatch, fail={fail})
    compiled = compile_sb(TinyTransformer(layers=1).eval(), compile_sizes=[4], compiler="eager",
                          strict=True)
    key = "dynamic" if fail is None else "4"
    with pytest.raises(SizeCompileError, match=rf"submod_0 failed to compile for size {key} "
                       rf"\(RuntimeError: injected failure .*strict=True") as info:
        compiled(batch(3))
    assert isinstance(info.value, RuntimeError)  # not wrapped in BackendCompilerFailed
    assert sb.stats().fallbacks == {}


@torch.no_grad()
def test_lazy_size_failure(monkeypatch):
    AdaptorSpy(monkeypatch, fail={4})
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[2, 4], compiler="eager", compile_mode="lazy")
    compiled(batch(3))
    with sb.expect(fallbacks={4: 1}, calls={"dynamic": 1}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    with sb.expect(fallbacks={}, compiles={}, calls={"dynamic": 1}):  # not retried
        compiled(batch(4))

    torch._dynamo.reset()
    strict = compile_sb(model, compile_sizes=[2, 4], compiler="eager", compile_mode="lazy",
                        strict=True)
    strict(batch(3))
    for _ in range(2):  # the first call of size 4 raises, and so does every later call
        with pytest.raises(SizeCompileError, match="size 4"):
            strict(batch(4))
    with pytest.raises(SizeCompileError, match="size 4"):
        strict(batch(3))


@torch.no_grad()
def test_background_failure_under_strict_reaches_the_next_call(monkeypatch):
    AdaptorSpy(monkeypatch, fail={4})
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager",
                          compile_mode="background", strict=True)
    deadline = time.monotonic() + 60
    with pytest.raises(SizeCompileError, match="size 4"):
        while True:  # general pieces serve until the background compile has failed
            torch.testing.assert_close(compiled(batch(3)), model(batch(3)))
            assert time.monotonic() < deadline, "background compile never finished"
            time.sleep(0.01)


# --- runtime shapes ------------------------------------------------------------------


@torch.no_grad()
def test_runtime_sizes_zero_one_largest_and_far_larger(monkeypatch):
    spy = AdaptorSpy(monkeypatch)
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[1, 2, 4, 8], compiler="eager")
    # 0 and 1 are static graphs of their own (Dynamo's 0/1 specialization); 8 is the
    # largest listed size; 100 was never listed and runs the general pieces.
    for size, key in ((0, "0"), (1, "1"), (8, "8"), (100, "dynamic"), (3, "dynamic")):
        with sb.expect(calls={key: 1}):
            out = compiled(batch(size))
        assert out.shape == (size, 8, 32)
        torch.testing.assert_close(out, model(batch(size)))
    assert spy.runs == 5 * 3


SHAPES = [(4, 8), (5, 8), (4, 8), (4, 12), (6, 12), (2, 5), (1, 8), (8, 3), (3, 3)]


@pytest.mark.parametrize("dynamic", [None, False, True])
@torch.no_grad()
def test_changed_shapes_never_reach_pieces_compiled_for_other_shapes(monkeypatch, dynamic):
    spy = AdaptorSpy(monkeypatch)  # every piece asserts the dims it was compiled for
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=dynamic,
                             options={"compile_sizes": [2, 4], "compiler": "eager"})
    for b, t in SHAPES:
        x = batch(b, seq=t)
        torch.testing.assert_close(compiled(x), model(x), msg=f"batch {b}, seq {t}")
    assert sum(sb.stats().calls.values()) == len(SHAPES)
    assert spy.runs == 2 * len(SHAPES)  # 2 pieces per call, each checked
    if dynamic is False:  # one static graph per distinct shape, nothing symbolic
        assert sb.stats().graphs == len(set(SHAPES))
        assert "dynamic" not in sb.stats().compiles


class SeqDecider(AdaptorSpy):
    """Like Inductor deciding on a symbolic dim: the size-4 compile reads ``seq <= 10``
    (a guard in its own ShapeEnv) and its pieces are only valid where that holds."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.decided = []
        checked = compiler.EagerAdaptor.compile

        def compile(adaptor, gm, example_inputs, runtime_size, fake_mode=None):
            forward = checked(adaptor, gm, example_inputs, runtime_size, fake_mode)
            if runtime_size != 4:
                return forward
            seq = next(v.shape[1] for v in example_inputs if isinstance(v, torch.Tensor))
            short = bool(seq <= 10)  # records a guard on the fresh seq symbol
            self.decided.append(short)

            def run(*args):
                got = next(a.shape[1] for a in args if isinstance(a, torch.Tensor))
                assert (got <= 10) == short, f"piece compiled for seq<=10 == {short} got {got}"
                return forward(*args)

            return run

        monkeypatch.setattr(compiler.EagerAdaptor, "compile", compile)


@torch.no_grad()
def test_sized_pieces_run_only_where_their_own_guards_hold(monkeypatch):
    spy = SeqDecider(monkeypatch)
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    compiled(batch(3, seq=8))
    assert spy.decided == [True, True]  # both pieces decided at the traced seq of 8
    for seq, key in ((8, "4"), (10, "4"), (12, "dynamic"), (30, "dynamic"), (2, "4")):
        with sb.expect(calls={key: 1}, graphs=0):
            out = compiled(batch(4, seq=seq))
        torch.testing.assert_close(out, model(batch(4, seq=seq)))


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_decision_on_another_dim_is_not_reused_where_it_does_not_hold():
    # Traced at 3x20 the graph holds for every batch*seq < 64, batch 4 seq 10 included.
    # Size 4 compiles with seq 20, where 4*20 >= 64, so Inductor bakes in a slice of 64
    # rows and guards 4*seq >= 64. Run at 4x10 without that guard, it read past the end
    # (NaN/garbage); with it, such calls go to the general pieces.
    class Head(torch.nn.Module):
        def forward(self, x):
            return (x.flatten(0, 1)[:64] * 2).sum(0)

    model = Head()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor")
    compiled(torch.randn(3, 20, 8))
    for seq in (10, 15):
        x = torch.randn(4, seq, 8)
        with sb.expect(graphs=0, calls={"dynamic": 1}):
            out = compiled(x)
        torch.testing.assert_close(out, model(x))
