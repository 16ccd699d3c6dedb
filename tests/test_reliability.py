"""Compile failures, odd runtime shapes, odd models, autograd and threads: whatever
happens, the compiled model returns what eager returns or raises a clear error.

Most tests use the eager compiler adaptor, wrapped by a spy that calls the real one;
the few that need a real compile are marked ``inductor``.
"""
from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import dynamo_sizebackend as sb
from dynamo_sizebackend import compiler
from dynamo_sizebackend.backend import SizeCompileError

from .nets import TinyTransformer, batch, compile_sb

LISTED = [2, 4, 8]
BACKEND_LOG = "dynamo_sizebackend.backend"


class AdaptorSpy:
    """Wraps the real ``EagerAdaptor.compile``: records every compile, raises for the
    runtime sizes in ``fail`` (``None``: the general or static compile), and makes every
    piece it returns check, on each call, that each tensor argument has the concrete dims
    the piece was compiled for (a symbolic dim accepts anything)."""

    def __init__(self, monkeypatch, fail: set[int | None] = frozenset()):
        self.fail = set(fail)
        self.compiled: list[int | None] = []
        self.runs = 0
        self._lock = threading.Lock()
        real = compiler.EagerAdaptor.compile
        spy = self

        def compile(adaptor, gm, example_inputs, runtime_size, fake_mode=None):
            if runtime_size in spy.fail:
                raise RuntimeError(f"injected failure at size {runtime_size}\nsecond line")
            forward = real(adaptor, gm, example_inputs, runtime_size, fake_mode)
            spy.compiled.append(runtime_size)
            return spy._checked(forward, example_inputs, runtime_size)

        monkeypatch.setattr(compiler.EagerAdaptor, "compile", compile)

    def _checked(self, forward, example_inputs, runtime_size):
        wanted = [
            tuple(d if isinstance(d, int) else None for d in v.shape)
            if isinstance(v, torch.Tensor) else None
            for v in example_inputs
        ]

        def run(*args):
            for want, arg in zip(wanted, args):
                if want is None:
                    continue
                got = tuple(arg.shape)
                assert len(got) == len(want) and all(
                    w is None or w == g for w, g in zip(want, got)
                ), f"piece compiled for {want} (size {runtime_size}) called with {got}"
            with self._lock:
                self.runs += 1
            return forward(*args)

        return run


def warnings_from(caplog, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == BACKEND_LOG and r.levelno == logging.WARNING and text in r.getMessage()
    ]


# --- a piece that fails to compile -------------------------------------------------


@torch.no_grad()
def test_size_that_fails_to_compile_is_served_by_general_pieces(monkeypatch, caplog):
    spy = AdaptorSpy(monkeypatch, fail={4})
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


# --- graph breaks ----------------------------------------------------------------------


class Chatty(torch.nn.Module):
    """A print and a data-dependent branch: Dynamo breaks the graph at both."""

    def __init__(self):
        super().__init__()
        self.a = TinyTransformer(layers=1, seed=1)
        self.b = TinyTransformer(layers=1, seed=2)

    def forward(self, x):
        x = self.a(x)
        print("sizebackend test: between the blocks")
        if x.mean() > 0:
            return self.b(x)
        return -self.b(-x)


@torch.no_grad()
def test_graph_breaks_give_several_graphs_each_correct(monkeypatch, capsys):
    AdaptorSpy(monkeypatch)
    model = Chatty().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    # Graph 1: block a (2 pieces). Graph 2: x.mean() > 0 (1 piece, no attention).
    # Graph 3: one branch, block b (2 pieces). 5 pieces, each general + size 4.
    with sb.expect(graphs=3, pieces=5, compiles={"dynamic": 5, 4: 5}, calls={"4": 3}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    # The other branch is a fourth graph.
    x = batch(4) - 10
    with sb.expect(graphs=1, pieces=2, calls={"4": 3}):
        torch.testing.assert_close(compiled(x), model(x))
    for size in (3, 4):
        for sign in (1, -1):
            x = sign * (batch(size) + 10)
            torch.testing.assert_close(compiled(x), model(x))
    assert "between the blocks" in capsys.readouterr().out


# --- where attention sits ---------------------------------------------------------------


class AttnFirst(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v).relu() * 2


class AttnLast(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * 2, k, v)


class AttnOnly(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class AttnTwice(torch.nn.Module):
    def forward(self, q, k, v):
        a = F.scaled_dot_product_attention(q.sin(), k, v)
        return F.scaled_dot_product_attention(a, k, v, is_causal=True).cos()


class NoAttn(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.tanh(q) * k + v


def qkv(size: int, heads: int = 3, seq: int = 5, dim: int = 4, grad: bool = False):
    g = torch.Generator().manual_seed(size)
    return [torch.randn(size, heads, seq, dim, generator=g, requires_grad=grad) for _ in range(3)]


@pytest.mark.parametrize(
    "model, pieces, splits",
    [
        (AttnFirst(), 1, 1),  # nothing before the attention: one piece after it
        (AttnLast(), 1, 1),  # nothing after it
        (AttnOnly(), 0, 1),  # no piece at all; the runner still dispatches
        (AttnTwice(), 2, 2),  # adjacent attentions: no piece between them
        (NoAttn(), 1, 0),  # no attention: the whole graph is one piece
    ],
    ids=["first", "last", "only", "twice", "none"],
)
@torch.no_grad()
def test_attention_placement(monkeypatch, model, pieces, splits):
    AdaptorSpy(monkeypatch)
    compiled = compile_sb(model, compile_sizes=[2, 4], compiler="eager")
    # Distinct heads/seq/dim so that Dynamo's duck sizing ties no dim to the batch.
    with sb.expect(graphs=1, pieces=pieces, splits=splits,
                   compiles={"dynamic": pieces, 2: pieces, 4: pieces}):
        compiled(*qkv(3))
    for size, key in ((2, "2"), (4, "4"), (5, "dynamic")):
        with sb.expect(calls={key: 1}):
            out = compiled(*qkv(size))
        torch.testing.assert_close(out, model(*qkv(size)))


# --- aliasing, mutation, buffers, non-tensor outputs -------------------------------------


class Stateful(torch.nn.Module):
    """Mutates its inputs and buffers, returns aliases of its input and non-tensors."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x, q):
        x.add_(1)  # the caller must see this
        self.calls += 1
        self.running.mul_(0.5).add_(x.mean(0))
        a = F.scaled_dot_product_attention(q, q, q)
        q.mul_(2)  # after the split op read q
        return {"x": x, "flat": x.view(-1), "n": x.shape[0], "out": (self.proj(a), self.calls)}


def stateful_inputs(size: int):
    g = torch.Generator().manual_seed(size)
    return torch.randn(size, 4, generator=g), torch.randn(size, 2, 3, 4, generator=g)


@pytest.mark.parametrize(
    "compiler_name", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
@torch.no_grad()
def test_aliases_mutations_buffers_and_non_tensor_outputs(compiler_name):
    model, reference = Stateful(), Stateful()
    reference.load_state_dict(model.state_dict())
    compiled = compile_sb(model, compile_sizes=[4], compiler=compiler_name)
    for size in (3, 4, 4, 5):
        x, q = stateful_inputs(size)
        x_ref, q_ref = stateful_inputs(size)
        out, ref = compiled(x, q), reference(x_ref, q_ref)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close((x, q), (x_ref, q_ref))  # input mutations as in eager
        torch.testing.assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
        assert out["x"] is x
        assert out["flat"]._base is x and out["flat"].data_ptr() == x.data_ptr()
        assert type(out["n"]) is int and out["n"] == size
    assert int(model.calls) == 4
    assert sb.stats().calls == {"dynamic": 2, "4": 2}


# --- autograd ------------------------------------------------------------------------------


def assert_same_grads(model, reference):
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    torch.testing.assert_close(grads, {n: p.grad for n, p in reference.named_parameters()})


def test_training_gradients_equal_eager(monkeypatch):
    AdaptorSpy(monkeypatch)
    model = TinyTransformer(layers=2)  # train mode; no dropout, so eager is deterministic
    reference = copy.deepcopy(model)
    compiled = compile_sb(model, compile_sizes=[2, 4], compiler="eager")
    with torch.no_grad():  # an inference graph first: grad mode is guarded, not reused
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    for size, key in ((4, "4"), (3, "dynamic"), (2, "2")):
        model.zero_grad(), reference.zero_grad()
        x, x_ref = batch(size).requires_grad_(), batch(size).requires_grad_()
        with sb.expect(calls={key: 1}):
            out = compiled(x)
        ref = reference(x_ref)
        torch.testing.assert_close(out, ref)
        out.square().mean().backward()
        ref.square().mean().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
        assert_same_grads(model, reference)


class AttnThenMLP(torch.nn.Module):
    """Attention on the inputs, then one compiled piece with parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)

    def forward(self, q, k, v):
        return self.down(F.gelu(self.up(F.scaled_dot_product_attention(q, k, v))))


@pytest.mark.inductor
def test_inductor_training_gradients_equal_eager():
    model = AttnThenMLP()
    reference = copy.deepcopy(model)
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor")
    for size, key in ((3, "dynamic"), (4, "4")):
        model.zero_grad(), reference.zero_grad()
        inputs, inputs_ref = qkv(size, grad=True), qkv(size, grad=True)
        with sb.expect(calls={key: 1}, fallbacks={}):
            out = compiled(*inputs)
        ref = reference(*inputs_ref)
        torch.testing.assert_close(out, ref)
        out.square().mean().backward()
        ref.square().mean().backward()
        torch.testing.assert_close([t.grad for t in inputs], [t.grad for t in inputs_ref])
        assert_same_grads(model, reference)


# --- threads -------------------------------------------------------------------------------


def run_threads(n: int, work) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def target(i):
        try:
            barrier.wait()
            with torch.no_grad():  # grad mode is per thread (and guarded by Dynamo)
                work(i)
        except BaseException as e:  # re-raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


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
