"""_torch.direct_call: Inductor's code called without AOT's per-call layers, only where
those layers provably do nothing, and with the same results as the artifact."""
import pytest
import torch
from torch._inductor.standalone_compile import CacheCompiledArtifact

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import direct_call

from ..nets import TinyTransformer, batch, compile_sb

pytestmark = pytest.mark.inductor


@pytest.fixture
def artifact_calls(monkeypatch):
    """Counts calls that went through a CompiledArtifact (the slow path)."""
    calls = []
    original = CacheCompiledArtifact.__call__

    def counting(self, *args):
        calls.append(self)
        return original(self, *args)

    monkeypatch.setattr(CacheCompiledArtifact, "__call__", counting)
    return calls


def _artifact(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    return torch._inductor.standalone_compile(gm, list(inputs), dynamic_shapes="from_example_inputs")


class _Two(torch.nn.Module):
    def forward(self, x, w):
        y = torch.relu(x @ w)
        return y + 1, y.sum(-1)


class _One(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2


class _MutatesInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class _ReturnsInputView(torch.nn.Module):
    def forward(self, x):
        return x.t(), x * 2


@torch.no_grad()
@pytest.mark.parametrize("module, inputs, returns_one", [
    (_Two(), (torch.randn(4, 8), torch.randn(8, 3)), False),
    (_One(), (torch.randn(5, 2),), True),
])
def test_direct_call_equals_artifact(module, inputs, returns_one, artifact_calls):
    artifact = _artifact(module, *inputs)
    direct = direct_call.direct_call(artifact, returns_one=returns_one)
    assert direct is not None
    expected = artifact(*inputs)
    for _ in range(3):  # the first call goes through the artifact, the rest do not
        got = direct(*inputs)
        assert type(got) is type(expected)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(module(*inputs), expected)
    assert len(artifact_calls) == 2  # our reference call above, and direct's first call


def test_grad_mode_calls_go_through_the_artifact(artifact_calls):
    x = torch.randn(5, 2)
    with torch.no_grad():
        _artifact(_One(), x)
        artifact = _artifact(_One(), x)  # the second is an AOT cache hit: one more layer
        direct = direct_call.direct_call(artifact, returns_one=True)
        direct(x)
    direct(x)  # grad on: AOT's wrapper turns it off around the call, so keep it
    assert len(artifact_calls) == 2
    torch.testing.assert_close(direct(x), _One()(x))


@torch.no_grad()
@pytest.mark.parametrize("module", [_MutatesInput(), _ReturnsInputView()])
def test_graphs_that_need_aots_epilogue_keep_the_full_path(module):
    # An in-place write to an input is applied (or an aliased output rebuilt) by AOT's
    # runtime wrapper after the call: skipping it would drop that.
    x = torch.randn(3, 4)
    artifact = _artifact(module, x.clone())
    assert direct_call.direct_call(artifact, returns_one=False) is None


def test_non_artifacts_are_left_alone():
    assert direct_call.direct_call(lambda x: x, returns_one=True) is None


@torch.no_grad()
def test_backend_pieces_run_direct_and_match_eager(artifact_calls):
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor", cache_dir=None)
    for size in (4, 3):
        torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    first = len(artifact_calls)
    # 1 attention -> 2 compiled pieces per program; each went through its artifact once.
    assert first == 4, first
    for size in (4, 3, 4, 3, 6):  # size 6 runs the general pieces, already warm
        torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    assert len(artifact_calls) == first
    assert sb.stats().calls == {"4": 3, "dynamic": 4}


@torch.no_grad()
def test_general_outputs_keep_their_dynamic_marks(artifact_calls):
    # AOT marks the dynamic dims of a general piece's outputs (what Dynamo would see if
    # they reached another compiled function); the direct path keeps doing so.
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor", cache_dir=None)
    via_artifact = compiled(batch(3))
    direct = compiled(batch(5))
    assert getattr(via_artifact, "_dynamo_dynamic_indices", None) == getattr(
        direct, "_dynamo_dynamic_indices", None
    )


@torch.no_grad()
def test_pieces_loaded_from_the_disk_cache_run_direct(tmp_path, artifact_calls):
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor", cache_dir=str(tmp_path))
    compiled(batch(4))
    torch._dynamo.reset()
    sb.reset_stats()
    artifact_calls.clear()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor", cache_dir=str(tmp_path))
    for _ in range(3):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))
    assert sb.stats().cache_hits >= 2 and not sb.stats().cache_misses
    # 2 pieces of size 4, loaded from disk: each through its artifact once, then direct.
    assert len(artifact_calls) == 2


@torch.no_grad()
@pytest.mark.parametrize("switch", ["option", "environment"])
def test_direct_calls_off_keeps_the_full_path(artifact_calls, monkeypatch, switch):
    """The off switch: every call of every piece goes through its artifact."""
    options = {"compile_sizes": [4], "compiler": "inductor", "cache_dir": None}
    if switch == "option":
        options["direct_calls"] = False
    else:
        monkeypatch.setenv("SIZEBACKEND_DIRECT_CALLS", "0")
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, **options)
    for size in (4, 3, 4, 3):
        torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    # 2 compiled pieces per call, 4 calls, each piece through its artifact every time.
    assert len(artifact_calls) == 8
