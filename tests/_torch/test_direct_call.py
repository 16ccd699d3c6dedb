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
def test_input_writes_run_direct_with_aots_epilogue(artifact_calls):
    # AOT's wrapper bumps the written input's version counter (what the frozen-weights
    # check reads) and copies back writes the graph did not keep; the direct path runs
    # that same epilogue around Inductor's call.
    artifact = _artifact(_MutatesInput(), torch.randn(3, 4))
    direct = direct_call.direct_call(artifact, returns_one=True)
    assert direct is not None
    x, reference = torch.randn(3, 4), None
    for _ in range(3):
        expected_x = x.clone()
        reference = _MutatesInput()(expected_x)
        version = x._version
        got = direct(x)
        torch.testing.assert_close(x, expected_x)
        torch.testing.assert_close(got, reference)
        assert x._version > version
    assert len(artifact_calls) == 1  # the first call only


@torch.no_grad()
def test_outputs_aliasing_inputs_stay_views_on_the_direct_path(artifact_calls):
    artifact = _artifact(_ReturnsInputView(), torch.randn(3, 4))
    direct = direct_call.direct_call(artifact, returns_one=False)
    assert direct is not None
    x = torch.randn(3, 4)
    for _ in range(3):
        view, doubled = direct(x)
        torch.testing.assert_close(view, x.t())
        torch.testing.assert_close(doubled, x * 2)
        view[0, 1] = 42.0  # a view of x, as eager's x.t() is: the write reaches x
        assert x[1, 0].item() == 42.0
    assert len(artifact_calls) == 1


class _CacheWrite(torch.nn.Module):
    """A decode step's shape: project, write keys and values into a cache passed in
    (in place), attend over the cache's first ``batch`` rows (views of it)."""

    def __init__(self, dim=32):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, cache_k, cache_v, pos):
        q, k, v = self.qkv(x).chunk(3, -1)
        keys = cache_k[: x.shape[0]]
        values = cache_v[: x.shape[0]]
        keys.index_copy_(1, pos, k)
        values.index_copy_(1, pos, v)
        a = torch.nn.functional.scaled_dot_product_attention(q[:, None], keys[:, None], values[:, None])
        return self.out(a[:, 0])


@torch.no_grad()
@pytest.mark.parametrize("defaults", [False, True], ids=["general-options", "real-defaults"])
def test_cache_writing_pieces_run_direct_and_match_eager(defaults, artifact_calls, monkeypatch):
    # The piece that writes the cache returns views of it to the attention piece: AOT's
    # epilogue on both counts. With the real defaults the listed size is frozen too
    # (weights constants, the cache and the step's inputs passed on).
    if defaults:
        monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")
    torch.manual_seed(0)
    model = _CacheWrite().eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [2], "cache_dir": None})
    ours = [torch.zeros(4, 6, 32), torch.zeros(4, 6, 32)]
    theirs = [t.clone() for t in ours]
    for step, size in enumerate((2, 3, 2, 3, 2, 3)):
        x, pos = torch.randn(size, 1, 32), torch.tensor([step])
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, *ours, pos), model(x, *theirs, pos))
        torch.testing.assert_close(ours, theirs)
    stats = sb.stats()
    assert stats.calls == {"2": 3, "dynamic": 3}
    assert ("frozen" in stats.cache_skips) == defaults
    # 2 compiled pieces (before and after attention) per program, 2 programs: each piece
    # through its artifact on its first call only.
    assert len(artifact_calls) == 4, len(artifact_calls)


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
