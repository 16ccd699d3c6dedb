"""Splitting, per-size compiles and dispatch, with the eager compiler adaptor (fast)."""
import time

import torch

import dynamo_sizebackend as sb

from .nets import MLP, TinyTransformer, batch, compile_sb

LISTED = [2, 4, 8]
UNLISTED = [3, 6]


@torch.no_grad()
def test_numerics_and_dispatch_keys():
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=LISTED, compiler="eager")
    for size in LISTED + UNLISTED:
        with sb.expect(calls={str(size) if size in LISTED else "dynamic": 1}):
            out = compiled(batch(size))
        torch.testing.assert_close(out, model(batch(size)))


@torch.no_grad()
def test_counts_for_fullgraph_model():
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=LISTED, compiler="eager")
    # 2 attention calls split the graph into 2 + 1 = 3 pieces; each compiles once for
    # the general shape and once per listed size: 3 x (3 + 1) = 12 compiles.
    with sb.expect(graphs=1, pieces=3, splits=2, compiles={"dynamic": 3, 2: 3, 4: 3, 8: 3}):
        compiled(batch(3))
    # Later calls compile nothing and land on their size's pieces.
    with sb.expect(graphs=0, compiles={}, calls={"4": 2, "dynamic": 1, "8": 1}):
        for size in (4, 4, 5, 8):
            compiled(batch(size))


@torch.no_grad()
def test_size_one_is_its_own_static_graph():
    # Dynamo specializes a dim of size 1, so batch 1 arrives as a static graph: compiled
    # once (3 pieces) for that shape and counted under its size.
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[1, 2], compiler="eager")
    compiled(batch(2))
    with sb.expect(graphs=1, pieces=3, compiles={"1": 3}, calls={"1": 1}):
        out = compiled(batch(1))
    torch.testing.assert_close(out, model(batch(1)))
    # The dynamic graph's range starts at 2, so it did not compile size 1 a second time.
    assert sb.stats().compiles == {"dynamic": 3, "2": 3, "1": 3}


@torch.no_grad()
def test_no_split_op_gives_one_piece():
    model = MLP().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    x = torch.randn(4, 16)
    with sb.expect(pieces=1, splits=0, compiles={"dynamic": 1, 4: 1}, calls={"4": 1}):
        out = compiled(x)
    torch.testing.assert_close(out, model(x))


@torch.no_grad()
def test_user_named_split_op():
    model = TinyTransformer(layers=2).eval()
    ops = ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.gelu"]
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager", splitting_ops=ops)
    # 2 SDPA + 2 GELU = 4 split ops -> 5 pieces.
    with sb.expect(pieces=5, splits=4, compiles={"dynamic": 5, 4: 5}):
        out = compiled(batch(4))
    torch.testing.assert_close(out, model(batch(4)))


@torch.no_grad()
def test_graph_break_gives_graphs_with_state_of_their_own():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = TinyTransformer(layers=1, seed=1)
            self.b = TinyTransformer(layers=1, seed=2)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    model = Broken().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    # Two graphs of one attention each: 2 pieces each, general + size 4.
    with sb.expect(graphs=2, pieces=4, splits=2, compiles={"dynamic": 4, 4: 4}):
        out = compiled(batch(4))
    torch.testing.assert_close(out, model(batch(4)))
    with sb.expect(calls={"dynamic": 2}):
        torch.testing.assert_close(compiled(batch(5)), model(batch(5)))


@torch.no_grad()
def test_dynamo_reset_resets_the_backend():
    model = MLP().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    compiled(torch.randn(4, 16))
    torch._dynamo.reset()
    with sb.expect(graphs=1, compiles={"dynamic": 1, 4: 1}):
        compiled(torch.randn(4, 16))


@torch.no_grad()
def test_batch_dim_option_picks_the_batch():
    class Scaled(torch.nn.Module):
        def forward(self, scale, x):  # scale [16] comes first but is not the batch
            return torch.relu(x * scale)

    model = Scaled()
    scale = torch.randn(16)
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "compiler": "eager", "batch_dim": [1, 0]})
    for size, key in ((4, "4"), (5, "dynamic")):
        x = torch.randn(size, 16)
        with sb.expect(calls={key: 1}):
            torch.testing.assert_close(compiled(scale, x), model(scale, x))


@torch.no_grad()
def test_lazy_mode_compiles_a_size_on_first_sight():
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[2, 4], compiler="eager", compile_mode="lazy")
    with sb.expect(compiles={"dynamic": 3}, calls={"dynamic": 1}):
        compiled(batch(3))
    with sb.expect(compiles={4: 3}, calls={"4": 1}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    with sb.expect(compiles={}, calls={"4": 1}):
        compiled(batch(4))


@torch.no_grad()
def test_background_mode_serves_at_once_and_swaps_in():
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[2, 4], compiler="eager", compile_mode="background")
    deadline = time.monotonic() + 60
    while sb.stats().calls.get("4", 0) == 0:
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
        assert time.monotonic() < deadline, "background compile never finished"
    assert sb.stats().compiles == {"dynamic": 3, "2": 3, "4": 3}


@torch.no_grad()
def test_dynamic_false_warns_once_that_compile_sizes_are_unused(monkeypatch, recwarn):
    from dynamo_sizebackend.compile import pipeline

    monkeypatch.setattr(pipeline, "_warned_static", False)
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=False,
                             options={"compile_sizes": [2, 4], "compiler": "eager"})
    # Every size is a static graph of its own, counted under its size: the same keys
    # as listed sizes, but no listed size was compiled in a symbolic graph.
    with sb.expect(graphs=3, calls={"2": 1, "3": 1, "4": 1}):
        for size in (2, 3, 4):
            torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    unused = [w for w in recwarn if "compile_sizes [2, 4] are unused" in str(w.message)]
    assert len(unused) == 1 and "dynamic=False" in str(unused[0].message)


@torch.no_grad()
def test_default_dynamic_does_not_warn_about_unused_sizes(monkeypatch, recwarn):
    from dynamo_sizebackend.compile import pipeline

    monkeypatch.setattr(pipeline, "_warned_static", False)
    compiled = torch.compile(TinyTransformer(layers=1).eval(), backend="sizebackend",
                             options={"compile_sizes": [2, 4], "compiler": "eager"})
    # The first call is traced static, the second size brings the symbolic graph.
    with sb.expect(graphs=2, calls={"3": 1, "4": 1}):
        compiled(batch(3))
        compiled(batch(4))
    assert not [w for w in recwarn if "unused" in str(w.message)]


class _KeywordNet(torch.nn.Module):
    """Called with keywords only, the batch not first in the signature."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, mask=None, bias=None, x=None):
        return self.proj(x) + bias.sum(0)


@torch.no_grad()
def test_batch_dim_counts_passed_tensors_in_signature_order():
    model, bias = _KeywordNet().eval(), torch.randn(3, 16)
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager", batch_dim=[1, 0])
    # Keywords out of order, ``mask`` left out: inputs are (bias, x); index 1 is x.
    with sb.expect(graphs=1, calls={"4": 1, "dynamic": 1}):
        for rows in (4, 5):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x=x, bias=bias), model(x=x, bias=bias))


@torch.no_grad()
def test_without_batch_dim_a_keyword_model_may_dispatch_on_another_input():
    model, bias = _KeywordNet().eval(), torch.randn(3, 16)
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    # The first tensor in signature order is ``bias`` (3 rows): every call is "size 3".
    with sb.expect(graphs=1, calls={"dynamic": 2}):
        for rows in (4, 4):
            compiled(x=torch.randn(rows, 16), bias=bias)


@torch.no_grad()
def test_torch_guard_filter_fn_passes_beside_our_options():
    # README recipe 1: Dynamo takes guard_filter_fn out of the options before the backend
    # sees them, so our strict option check never rejects it; dispatch is unchanged.
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[2], compiler="eager",
                          guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)
    with sb.expect(calls={2: 2, "dynamic": 1}):
        for n in (2, 3, 2):
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)))
