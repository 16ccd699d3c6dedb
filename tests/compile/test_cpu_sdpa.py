"""The SDPA between a CPU graph's pieces runs ``sizebackend::sdpa`` (compile/cpu_sdpa.py):
the direct kernel for a serving step's small calls, counted; the same values as eager;
off with ``SIZEBACKEND_CPU_SDPA=0``; an SDPA inside a piece stays Inductor's."""
from __future__ import annotations

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend import ops
from dynamo_sizebackend.models.sdpa import TinyTransformer

TOL = dict(rtol=1e-4, atol=1e-4)


def tokens(batch: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(batch, 4, 16, generator=torch.Generator().manual_seed(seed))
    torch._dynamo.decorators.mark_unbacked(x, 0)  # one graph, symbolic batch
    return x


def direct_per_call(compiled, model, batch: int, calls: int = 3, seed: int = 0) -> float:
    """Direct-kernel SDPA calls per call of ``compiled`` at ``batch`` (checked against
    ``model`` in eager)."""
    before = ops.sdpa_counts()[0]
    for i in range(calls):
        x = tokens(batch, seed + i)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    return (ops.sdpa_counts()[0] - before) / calls


@torch.no_grad()
@pytest.mark.parametrize("setting", ["default", "off"])
def test_split_sdpa_runs_the_direct_kernel(monkeypatch, setting):
    """Listed (2) and unlisted (3) sizes alike: each of the 2 layers' attention is one
    direct-kernel call; with the switch off, none."""
    if setting == "off":
        monkeypatch.setenv("SIZEBACKEND_CPU_SDPA", "0")
    model = TinyTransformer(2, 16, 4).eval()
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "compiler": "eager", "cache_dir": None})
    expected = 2 if setting == "default" else 0
    with sb.expect(compiles={"dynamic": 3, 2: 3}, splits=2, fallbacks={}):
        assert direct_per_call(compiled, model, 3) == expected
    assert direct_per_call(compiled, model, 2) == expected
    assert sb.stats().calls == {"dynamic": 3, "2": 3}


@torch.no_grad()
def test_sdpa_inside_a_piece_stays_inductors():
    """``splitting_ops=[]``: the SDPA is part of the one piece, compiled, not swapped."""
    model = TinyTransformer(1, 16, 4).eval()
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "compiler": "eager", "cache_dir": None, "splitting_ops": []})
    assert direct_per_call(compiled, model, 2) == direct_per_call(compiled, model, 3) == 0
    assert sb.stats().splits == 0


def reload(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.2
                           for k, v in model.state_dict().items()})


@pytest.mark.inductor
@torch.no_grad()
@pytest.mark.parametrize("built", ["normally", "under inference_mode"])
def test_real_defaults_with_inductor(real_defaults, tmp_path, built):
    """A user's setup: the CPU default options (frozen, autotuned sized pieces stored as
    packages that run as one C++ chain), a model built normally or under
    ``torch.inference_mode()`` (not frozen then), weights reloaded after compiling: the
    direct kernel serves every attention, values follow eager and the new weights."""
    if built == "normally":
        model = TinyTransformer(1, 16, 4).eval()
    else:
        with torch.inference_mode():
            model = TinyTransformer(1, 16, 4).eval()
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "cache_dir": str(tmp_path), "store_frozen": "inline"})
    assert direct_per_call(compiled, model, 3) == 1  # general pieces
    assert direct_per_call(compiled, model, 2) == 1  # size 2's
    if built == "normally":
        assert sb.stats().cache_skips == {}  # size 2 frozen and stored as packages
    else:
        assert sb.stats().fallbacks.get("inference_tensors_not_frozen") == 1
    if built == "normally":
        reload(model, 1)  # a checkpoint loaded in place after compiling
    else:
        with torch.inference_mode():
            reload(model, 1)
    assert direct_per_call(compiled, model, 2, seed=5) == 1
    assert direct_per_call(compiled, model, 3, seed=5) == 1


def test_only_dense_strided_tensors_are_swapped():
    """A call whose traced tensors are not all dense and strided (a sparse or nested
    input, or one with no traced value) stays ATen's SDPA."""
    from dynamo_sizebackend.compile import cpu_sdpa

    def call_with(example):
        graph = torch.fx.Graph()
        q = graph.placeholder("q")
        if example is not None:
            q.meta["example_value"] = example
        node = graph.call_function(torch._C._nn.scaled_dot_product_attention, (q, q, q))
        graph.output(node)
        return node

    dense = torch.randn(1, 2, 3, 4)
    assert cpu_sdpa._plain_tensors(call_with(dense))
    assert not cpu_sdpa._plain_tensors(call_with(dense.to_sparse()))
    assert not cpu_sdpa._plain_tensors(call_with(None))
