"""Models of every form: graph breaks, attention anywhere, aliased and mutated inputs,
buffers, non-tensor outputs, and training. Each compiled model must match eager:
outputs, mutations, buffers and gradients.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dynamo_sizebackend as sb

from ..nets import TinyTransformer, batch, compile_sb
from ..spies import AdaptorSpy


# --- graph breaks ----------------------------------------------------------------------


class Chatty(torch.nn.Module):
    """A print and a data-dependent branch: Dynamo breaks the graph at both.

    The branch reads the *input's* mean, not block a's output: that ends in a LayerNorm
    (weight 1, bias 0), so its mean is 0 up to float noise (+-1e-7, sign set by the CPU's
    ISA level). The tests feed inputs shifted by +-10 (|mean| >= 9.9), so the data, not
    rounding, picks the branch.
    """

    def __init__(self):
        super().__init__()
        self.a = TinyTransformer(layers=1, seed=1)
        self.b = TinyTransformer(layers=1, seed=2)

    def forward(self, x):
        h = self.a(x)
        print("sizebackend test: between the blocks")
        if x.mean() > 0:
            return self.b(h)
        return -self.b(-h)


def shifted(size: int, shift: float) -> torch.Tensor:
    """``batch(size) + shift``; ``batch`` is randn with |mean| < 0.1 for the sizes used."""
    return batch(size) + shift


@torch.no_grad()
def test_graph_breaks_give_several_graphs_each_correct(monkeypatch, capsys):
    AdaptorSpy(monkeypatch)
    model = Chatty().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    up, down = shifted(4, 10.0), shifted(4, -10.0)
    assert up.mean() > 9.9 and down.mean() < -9.9  # the branch is decided by the data
    # Graph 1: block a (2 pieces: before and after its attention). Graph 2: x.mean() > 0
    # (1 piece, no attention). Graph 3: the taken branch, block b (2 pieces). 5 pieces,
    # each compiled general + size 4; a size-4 call runs 3 graphs.
    with sb.expect(graphs=3, pieces=5, compiles={"dynamic": 5, 4: 5}, calls={"4": 3}):
        torch.testing.assert_close(compiled(up), model(up))
    # The other branch is a fourth graph (block b again: 2 pieces).
    with sb.expect(graphs=1, pieces=2, calls={"4": 3}):
        torch.testing.assert_close(compiled(down), model(down))
    for size in (3, 4):
        for shift in (10.0, -10.0):
            x = shifted(size, shift)
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
