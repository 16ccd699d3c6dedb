"""compile/linears.py: the linears of pieces compiled with their weights as inputs (the
general pieces) call ``sizebackend::packed_linear``, oneDNN's GEMM (or ``panel_linear``
for few rows) on a copy of the weight packed at run time, where that is measured faster
on this CPU; every change to a weight that its version counter shows is packed again,
without a recompile.

Where to pack is a timing decision (``runtime_min_rows``, ``runtime_panel_rows``): every
test here fixes its answers and checks what each answer compiles to and computes."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import dynamo_sizebackend as sb
from dynamo_sizebackend import _C
from dynamo_sizebackend._torch import packed_linear
from dynamo_sizebackend.cache import store
from dynamo_sizebackend.compile import linears as linears_module

from ..nets import TinyTransformer, batch
from .test_frozen import (Net, assign_state_dict, load_state_dict, new_parameter, set_data,
                          write_in_place, write_through_view)

pytestmark = [
    pytest.mark.inductor,
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packs for oneDNN"),
]

OP = "torch.ops.sizebackend.packed_linear.default"
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _own_compiles():
    store.forget_shared()  # no piece reused from an earlier test's compile
    yield
    store.forget_shared()


@pytest.fixture
def onednn_from(monkeypatch):
    """Pin the measurements: oneDNN from ``rows`` rows on (``None``: never), the panels
    from 1 to ``panels`` rows (0: never)."""
    def pin(rows, panels=0):
        monkeypatch.setattr(packed_linear, "runtime_min_rows", lambda k, n: rows)
        monkeypatch.setattr(packed_linear, "runtime_panel_rows", lambda k, n: panels)
    return pin


def _packs() -> int:
    return _C.packed_linear_counts()[1]


def _linears(model) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


def _compile_and_call(model, x, **options):
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [4], "cache_dir": None, **options})
    torch._dynamo.decorators.mark_unbacked(x, 0)
    out, code = run_and_get_code(compiled, x)
    torch.testing.assert_close(out, model(x), **TOL)
    return compiled, "\n".join(code)


@torch.no_grad()
def test_general_pieces_run_packed_linears(onednn_from, caplog):
    onednn_from(2)
    caplog.set_level(logging.INFO, logger="dynamo_sizebackend")
    model = TinyTransformer(layers=2).eval()
    linears = _linears(model)
    before = _packs()
    compiled, code = _compile_and_call(model, batch(3))
    # Every linear of the general pieces and of the (untuned, unfrozen) size-4 pieces.
    assert code.count(OP + "(") == 2 * linears
    assert f"{linears} linears of the dynamic pieces run on weights packed" in caplog.text
    assert _packs() == before + linears  # the first call packed each weight once
    for n in (3, 5, 4, 7):
        x = batch(n)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert _packs() == before + linears  # and never again: the weights did not change
    assert sb.stats().compiles == {"dynamic": 3, "4": 3}  # 3 pieces: 2 blocks split at SDPA
    assert sb.stats().calls == {"dynamic": 4, "4": 1}


#: What the op runs in the tests that take both: oneDNN from 1 row, or the panels up to
#: 64 rows (every call of these tests) with oneDNN never.
KERNELS = {"onednn": (1, 0), "panels": (None, 64)}


@pytest.mark.parametrize("onednn, packs_per_weight", [(None, 1), (2, 2)])
@torch.no_grad()
def test_general_pieces_run_panels_up_to_their_rows(onednn_from, onednn, packs_per_weight):
    """Up to the panels' rows (here 32) a general piece's linears run ``panel_linear`` on
    a copy packed at the first such call; above, oneDNN's copy from its rows (packed
    then), or aten's linear where oneDNN never pays."""
    onednn_from(onednn, 32)
    model = TinyTransformer(layers=2).eval()
    linears = _linears(model)
    before = _packs()
    compiled, code = _compile_and_call(model, batch(3))  # 24 rows
    assert code.count(OP + "(") == 2 * linears
    assert code.count(f", {linears_module.NEVER if onednn is None else onednn}, 32)") == 2 * linears
    assert _packs() == before + linears  # each weight's panels, once
    for n in (3, 5, 4, 7):  # 24, 40, 32, 56 rows
        x = batch(n)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert _packs() == before + packs_per_weight * linears
    assert sb.stats().compiles == {"dynamic": 3, "4": 3}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("change", [
    write_in_place, load_state_dict, write_through_view, set_data, new_parameter,
    assign_state_dict,
])
@torch.no_grad()
def test_every_change_of_a_weight_is_computed_with(onednn_from, change, kernel):
    onednn_from(*KERNELS[kernel])
    model = Net().eval()
    compiled, code = _compile_and_call(model, torch.randn(3, 8))
    assert code.count(OP + "(") == 2  # general and size 4
    change(model)
    for n in (3, 4, 3):  # general and sized pieces, then again (now packed anew)
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    # Nothing recompiled for it: the op packs the new values.
    assert sb.stats().compiles == {"dynamic": 1, "4": 1}
    assert sb.stats().fallbacks == {}


@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_a_write_through_data_is_taken_after_weights_updated(onednn_from, kernel):
    onednn_from(*KERNELS[kernel])
    model = Net().eval()
    compiled, _ = _compile_and_call(model, torch.randn(3, 8))
    model.lin.weight.data.mul_(2.0)  # .data has a counter of its own: not seen
    x = torch.randn(3, 8)
    assert not torch.allclose(compiled(x), model(x), **TOL)  # the documented limit
    sb.weights_updated(model)
    torch.testing.assert_close(compiled(x), model(x), **TOL)


@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_real_defaults_pack_the_general_pieces_beside_the_frozen_sizes(real_defaults, onednn_from,
                                                                       kernel):
    onednn_from(*KERNELS[kernel])
    model = TinyTransformer(layers=1).eval()
    compiled, code = _compile_and_call(model, batch(3))
    assert code.count(OP + "(") == _linears(model)  # the general pieces only: size 4 froze
    assert sb.stats().cache_skips == {"frozen": 2}  # both size-4 pieces froze the weights
    for n in (4, 5):
        torch.testing.assert_close(compiled(batch(n)), model(batch(n)), **TOL)
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    for n in (4, 5):
        torch.testing.assert_close(compiled(batch(n)), model(batch(n)), **TOL)
    # The frozen size saw the reload and compiled again; the general pieces packed anew.
    assert sb.stats().fallbacks == {"frozen_weights": 1}
    assert sb.stats().compiles == {"dynamic": 2, "4": 4}


def _left_alone(model, x, **options):
    compiled, code = _compile_and_call(model, x, **options)
    assert OP not in code
    return compiled


@torch.no_grad()
def test_left_alone_where_aten_is_as_fast(onednn_from):
    onednn_from(None)
    _left_alone(TinyTransformer(layers=1).eval(), batch(3))


@torch.no_grad()
def test_left_alone_where_the_measurement_fails(monkeypatch):
    def fails(k, n):
        raise RuntimeError("no oneDNN kernel here")

    monkeypatch.setattr(packed_linear, "runtime_min_rows", fails)
    _left_alone(TinyTransformer(layers=1).eval(), batch(3))
    assert sb.stats().fallbacks == {}  # the pieces compiled, with aten's linears


@torch.no_grad()
def test_left_alone_when_switched_off(onednn_from, monkeypatch):
    onednn_from(2)
    monkeypatch.setenv("SIZEBACKEND_PACKED_LINEAR", "torch")
    _left_alone(TinyTransformer(layers=1).eval(), batch(3))


def test_left_alone_while_grad_mode_is_on(onednn_from):
    onednn_from(2)
    model = TinyTransformer(layers=1)
    compiled = torch.compile(model, backend="sizebackend", options={"cache_dir": None})
    x = batch(3)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    out, code = run_and_get_code(compiled, x)
    assert OP not in "\n".join(code)
    out.sum().backward()
    assert model.blocks[0].mlp[0].weight.grad is not None


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_alone_for_a_model_built_under_inference_mode(real_defaults, onednn_from, kernel):
    onednn_from(*KERNELS[kernel])
    with torch.inference_mode():
        model = TinyTransformer(layers=1).eval()
        _left_alone(model, batch(3))


@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_hugging_face_generate_with_the_real_defaults(real_defaults, onednn_from, kernel):
    """README recipe 1 (``model.forward`` compiled, static cache) on a random-weight HF
    Llama: batch 3 is not listed and runs the general pieces, packed; then a checkpoint
    reload, which the packed copies must follow (the frozen sizes' side of a reload is
    tests/models/test_hf_inductor.py's)."""
    pytest.importorskip("transformers")
    from ..models.test_hf_generate import counting_forward, generate, prompt, tiny_llama

    onednn_from(*KERNELS[kernel])
    model = tiny_llama()
    scenario = [prompt(2, 0), prompt(3, 0), prompt(3, 1)]
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    model.forward = counting_forward(model, {"compile_sizes": [2], "cache_dir": None})
    (first, *rest), code = run_and_get_code(
        lambda: [generate(model, inputs, cache_implementation="static") for inputs in scenario])
    assert all(torch.equal(a, b) for a, b in zip([first, *rest], expected))
    assert OP + "(" in "\n".join(code)
    # Nothing failed or went stale; whether the prefill graph's size 2 is tuned is the
    # rows measurement's call (compile/rows.py), not this test's.
    assert set(sb.stats().fallbacks) <= {"sized_untuned_symbolic_rows"}
    assert sb.stats().calls.get("dynamic", 0) > 0  # batch 3 ran the general pieces

    torch.manual_seed(1)
    fresh = {k: torch.randn_like(v) * 0.02 for k, v in model.state_dict().items()}
    reference = tiny_llama()
    reference.load_state_dict(fresh)
    model.load_state_dict(fresh)  # in place: new values in the same tensors
    before = sb.stats().compiles
    inputs = prompt(3, 0)
    want = generate(reference, inputs, cache_implementation="static")
    assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    assert sb.stats().compiles == before  # packed again at the next call, nothing compiled
