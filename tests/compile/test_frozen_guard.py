"""Frozen sized pieces never serve stale values (issue 21): each way a user changes a
tensor the sized pieces froze is either seen by the per-call check (the size compiles
again, once per changed tensor) or is never frozen at all.

"Stale" would be: the size-2 call differs from eager while size 3 (general pieces) is
right. Every case runs with freezing on and real Inductor compiles.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import inductor

FREEZE = {"compile_sizes": [2], "sized_inductor_options": {"freezing": True}, "cache_dir": None}
TOL = {"rtol": 1e-5, "atol": 1e-5}


class Net(nn.Module):
    """One piece (no attention): a linear, a registered buffer, a plain tensor attribute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.rand(8) + 0.5)
        self.plain = torch.randn(8)  # not registered: an input, never frozen

    def forward(self, x, ctx=None):
        y = self.lin(x) * self.scale + self.plain
        return y if ctx is None else y + ctx.bias


class Ctx:
    def __init__(self, seed: int):
        self.bias = torch.randn(8, generator=torch.Generator().manual_seed(seed))


def compiled_net(model, **extra):
    compiled = torch.compile(model, backend="sizebackend", options={**FREEZE, **extra})
    x = torch.randn(3, 8)
    torch._dynamo.decorators.mark_unbacked(x, 0)  # one graph for every size
    return compiled, x


def agree(compiled, model, *extra):
    """Sizes 2 (frozen, sized) and 3 (general) against eager."""
    for n in (2, 3):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x, *extra), model(x, *extra), **TOL)


def replace_weight(m):
    m.lin.weight = nn.Parameter(torch.randn(8, 8))


def assign_state(m):
    sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)


def reassign_buffer(m):
    m.scale = torch.rand(8) + 2.0  # a registered buffer: stays a buffer


def write_in_place(m):
    m.lin.weight.mul_(2.0)


def load_in_place(m):
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})


def new_storage(m):
    m.lin.bias.data = torch.randn(8)


def write_through_view(m):
    m.lin.weight[0].fill_(3.0)


@pytest.mark.inductor
@pytest.mark.parametrize("change", [
    replace_weight, assign_state, reassign_buffer, write_in_place, load_in_place,
    new_storage, write_through_view,
])
@torch.no_grad()
def test_a_change_is_seen_and_costs_one_recompile(change):
    model = Net().eval()
    compiled, x = compiled_net(model)
    with sb.expect(compiles={"dynamic": 1, 2: 1}):  # 1 piece: general + size 2
        compiled(x)
        agree(compiled, model)
    change(model)
    # Seen on the next size-2 call: the size compiles again (1 piece), with the changed
    # tensors as inputs from now on.
    with sb.expect(compiles={2: 1}, fallbacks={"frozen_weights": 1}, calls={2: 1, "dynamic": 1}):
        agree(compiled, model)
    # The same change again: those tensors are inputs now, nothing recompiles.
    change(model)
    with sb.expect(compiles={}, fallbacks={}, calls={2: 1, "dynamic": 1}):
        agree(compiled, model)
    assert sb.stats().compiles == {"dynamic": 1, "2": 2}


@pytest.mark.inductor
@torch.no_grad()
def test_plain_attributes_and_argument_attributes_are_never_frozen():
    model = Net().eval()
    compiled, x = compiled_net(model)
    compiled(x, Ctx(0))
    with sb.expect(compiles={}, fallbacks={}):
        for seed in range(3):  # per-call data, as a Hugging Face cache object carries
            agree(compiled, model, Ctx(seed))
        model.plain = torch.randn(8)
        agree(compiled, model, Ctx(5))
    assert sb.stats().cache_skips == {"frozen": 1}  # the size-2 piece froze lin and scale


@pytest.mark.inductor
@torch.no_grad()
def test_a_buffer_written_every_step_recompiles_once(caplog):
    model = Net().eval()
    compiled, x = compiled_net(model)
    compiled(x)
    caplog.set_level(logging.INFO, logger="dynamo_sizebackend")
    with sb.expect(compiles={2: 1}, fallbacks={"frozen_weights": 1}, calls={2: 4}):
        for _ in range(4):
            model.scale.add_(1.0)  # the model's eager code, between calls
            x2 = torch.randn(2, 8)
            torch.testing.assert_close(compiled(x2), model(x2), **TOL)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "frozen" in r.getMessage()]
    assert len(warnings) == 1
    assert "l_self_buffers_scale_" in warnings[0].getMessage()


@pytest.mark.inductor
@torch.no_grad()
def test_a_write_while_the_size_compiles_is_seen(monkeypatch):
    model = Net().eval()
    real = inductor.standalone_compile
    writes = []

    def writing(gm, example_inputs, *, from_graph, inductor_options, fake_mode=None):
        if not from_graph and not writes:  # the first sized compile: a load_state_dict beside it
            writes.append(1)
            model.lin.weight.add_(1.0)
        return real(gm, example_inputs, from_graph=from_graph,
                    inductor_options=inductor_options, fake_mode=fake_mode)

    monkeypatch.setattr(inductor, "standalone_compile", writing)
    compiled, x = compiled_net(model)
    with sb.expect(compiles={"dynamic": 1, 2: 2}, fallbacks={"frozen_weights": 1}):
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        agree(compiled, model)
    assert writes == [1]


@pytest.mark.inductor
@torch.no_grad()
def test_writes_through_data_need_weights_updated():
    model = Net().eval()
    compiled, x = compiled_net(model)
    compiled(x)
    agree(compiled, model)
    model.lin.weight.data.mul_(2.0)  # .data: a version counter of its own, not seen
    x2 = torch.randn(2, 8)
    assert not torch.allclose(compiled(x2), model(x2), **TOL)  # the documented limit
    assert sb.weights_updated(nn.Linear(8, 8)) == 0  # holds none of its tensors
    assert sb.weights_updated(model) == 1  # the size-2 program
    with sb.expect(compiles={2: 1}, fallbacks={}):
        agree(compiled, model)
    # Frozen again with the new values: a later in-place write is still seen.
    model.lin.weight.mul_(0.5)
    with sb.expect(compiles={2: 1}, fallbacks={"frozen_weights": 1}):
        agree(compiled, model)


@pytest.mark.inductor
def test_a_model_built_under_inference_mode_is_not_frozen():
    with torch.inference_mode():
        model = Net().eval()
        compiled, x = compiled_net(model)
        with sb.expect(compiles={"dynamic": 1, 2: 1}, fallbacks={"inference_tensors_not_frozen": 1}):
            compiled(x)
            agree(compiled, model)
        model.lin.weight.mul_(2.0)  # no version counter: would be invisible if frozen
        agree(compiled, model)
    assert "frozen" not in sb.stats().cache_skips


@pytest.mark.inductor
def test_inference_mode_model_with_the_real_defaults(monkeypatch):
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")  # the CPU default: freeze + autotune
    with torch.inference_mode():
        model = Net().eval()
        compiled = torch.compile(model, backend="sizebackend",
                                 options={"compile_sizes": [2], "cache_dir": None})
        x = torch.randn(3, 8)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        agree(compiled, model)
    assert sb.stats().fallbacks == {"inference_tensors_not_frozen": 1}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied, as language models tie them

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.inductor
@torch.no_grad()
def test_tied_weights_change_once():
    model = Tied().eval()
    compiled = torch.compile(model, backend="sizebackend", options=FREEZE)
    ids = torch.randint(0, 16, (3, 4))
    torch._dynamo.decorators.mark_unbacked(ids, 0)
    compiled(ids)

    def check():
        for n in (2, 3):
            i = torch.randint(0, 16, (n, 4))
            torch.testing.assert_close(compiled(i), model(i), **TOL)

    check()
    model.emb.weight.mul_(2.0)  # one tensor, read by both uses
    with sb.expect(compiles={2: 1}, fallbacks={"frozen_weights": 1}):
        check()


@pytest.mark.inductor
@torch.no_grad()
def test_two_compiled_models_sharing_a_submodule():
    shared = nn.Linear(8, 8)
    a, b = Net().eval(), Net().eval()
    a.lin = b.lin = shared
    ca, x = compiled_net(a)
    cb, _ = compiled_net(b, compile_sizes=[2])
    ca(x)
    cb(x)
    agree(ca, a)
    agree(cb, b)
    shared.weight.mul_(-1.0)
    agree(ca, a)
    agree(cb, b)
    assert sb.stats().fallbacks["frozen_weights"] == 2  # each model's size 2 saw it


@pytest.mark.inductor
@torch.no_grad()
def test_dtype_and_device_moves():
    model = Net().eval()
    compiled, x = compiled_net(model)
    compiled(x)
    agree(compiled, model)
    model.to("cpu")  # already there: the same tensors, nothing recompiles
    with sb.expect(compiles={}, fallbacks={}):
        agree(compiled, model)
    model.to(torch.float64)  # new tensors of another dtype: a new Dynamo graph
    for n in (2, 3):
        x = torch.randn(n, 8, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    model.half()
    for n in (2, 3):
        x = torch.randn(n, 8, dtype=torch.float16)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-2, atol=1e-2)


@pytest.mark.inductor
@torch.no_grad()
def test_weights_replaced_and_reloaded_with_the_real_defaults(monkeypatch):
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")  # the CPU default: freeze + autotune
    model = Net().eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [2], "cache_dir": None})
    x = torch.randn(3, 8)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    compiled(x)
    agree(compiled, model)
    assert sb.stats().cache_skips == {"frozen": 1}  # the default froze the size-2 piece
    load_in_place(model)  # a checkpoint reloaded in place
    agree(compiled, model)
    assign_state(model)  # and one that replaces the tensors
    agree(compiled, model)
    # The reload changed every frozen tensor: size 2 compiled again once, with all of
    # them as inputs, so the replacement after it costs nothing.
    assert sb.stats().fallbacks == {"frozen_weights": 1}
    assert sb.stats().compiles == {"dynamic": 1, "2": 2}
