"""Per-size tuning: Inductor patches only for the pieces of a listed size, and constant
(frozen) weights for them, with the weights' later changes caught."""
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.select_algorithm import ExternKernelCaller

import dynamo_sizebackend as sb
from dynamo_sizebackend import parse_options
from dynamo_sizebackend._torch import autotune, direct_call, inductor, pch, templates
from dynamo_sizebackend.options import SIZED_DEFAULTS

from ..nets import MLP, TinyTransformer, batch, compile_sb

TOL = {"rtol": 1e-4, "atol": 1e-4}


def test_sized_defaults_per_device_and_explicit_choice(monkeypatch):
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")
    auto = parse_options({})
    assert auto.sized_inductor_options is None
    assert auto.sized_options_for("cpu") == SIZED_DEFAULTS["cpu"]
    assert auto.sized_options_for("cpu")["freezing"] is True
    cuda = auto.sized_options_for("cuda")
    assert cuda["max_autotune"] is True and cuda["coordinate_descent_tuning"] is True
    assert parse_options({"sized_inductor_options": {}}).sized_options_for("cpu") == {}
    chosen = parse_options({"sized_inductor_options": {"max-autotune": True}})
    assert chosen.sized_options_for("cuda") == {"max_autotune": True}
    monkeypatch.setenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "{'freezing': True}")
    assert parse_options({}).sized_options_for("cpu") == {"freezing": True}
    monkeypatch.setenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "auto")
    assert parse_options({}).sized_inductor_options is None


@pytest.mark.parametrize("value, match", [
    ({"no_such_entry": 1}, r"'sized_inductor_options'.*'no_such_entry'.*no such"),
    ({"freezing": "yes"}, r"'sized_inductor_options'.*'freezing'.*bool"),
    ([("freezing", True)], r"'sized_inductor_options'.*dict of str keys"),
])
def test_bad_sized_options_name_key_and_value(value, match):
    with pytest.raises(ValueError, match=match):
        parse_options({"sized_inductor_options": value})


def test_bad_sized_options_environment_is_an_error(monkeypatch):
    monkeypatch.setenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "{'freezing': True")
    with pytest.raises(ValueError, match="SIZEBACKEND_SIZED_INDUCTOR_OPTIONS"):
        parse_options({})


@pytest.fixture
def compiles(monkeypatch):
    """The Inductor patches of every real compile, by whether it was the general shape."""
    seen = []
    real = inductor.standalone_compile

    def spy(gm, example_inputs, *, from_graph, inductor_options, fake_mode=None):
        seen.append((from_graph, dict(inductor_options)))
        return real(gm, example_inputs, from_graph=from_graph,
                    inductor_options=inductor_options, fake_mode=fake_mode)

    monkeypatch.setattr(inductor, "standalone_compile", spy)
    return seen


@pytest.mark.inductor
@torch.no_grad()
def test_sized_options_reach_only_sized_pieces(compiles):
    model = MLP().eval()
    compiled = compile_sb(model, compile_sizes=[2, 4], cache_dir=None,
                          inductor_options={"epilogue_fusion": False},
                          sized_inductor_options={"max_autotune_pointwise": True})
    for n in (3, 2, 4):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    # MLP: 1 piece, general + sizes 2 and 4.
    assert compiles == [
        (True, {"epilogue_fusion": False}),
        (False, {"epilogue_fusion": False, "max_autotune_pointwise": True}),
        (False, {"epilogue_fusion": False, "max_autotune_pointwise": True}),
    ]
    assert sb.stats().compiles == {"dynamic": 1, "2": 1, "4": 1}


FREEZE = {"sized_inductor_options": {"freezing": True}, "cache_dir": None}


@pytest.mark.inductor
@torch.no_grad()
def test_frozen_sized_pieces_match_eager_and_hold_constant_weights(tmp_path):
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], debug_dir=str(tmp_path), **FREEZE)
    # 1 attention -> 2 pieces; both size-4 pieces take parameters, so both are frozen
    # (and not cached: torch cannot save a frozen graph).
    with sb.expect(compiles={"dynamic": 2, 4: 2}, cache_skips={"frozen": 2},
                   calls={4: 3, "dynamic": 2}):
        for n in (4, 3, 4, 5, 4):
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)), **TOL)
    sized = sorted(p.name for p in tmp_path.glob("*_4.code.py"))
    general = sorted(p.name for p in tmp_path.glob("*_dynamic.code.py"))
    assert len(sized) == 2 and len(general) == 2
    assert all("_frozen_param" in (tmp_path / name).read_text() for name in sized)
    assert not any("_frozen_param" in (tmp_path / name).read_text() for name in general)


@pytest.mark.inductor
@torch.no_grad()
def test_frozen_pieces_run_direct(monkeypatch):
    calls = []
    real = direct_call._argument_builder

    def counting(layers, keep):
        build = real(layers, keep)
        calls.append(layers.preserved is not None)
        return build

    monkeypatch.setattr(direct_call, "_argument_builder", counting)
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], **FREEZE)
    for n in (4, 4, 3):
        torch.testing.assert_close(compiled(batch(n)), model(batch(n)), **TOL)
    # 2 general pieces (nothing frozen) and 2 frozen size-4 pieces took the direct path.
    assert sorted(calls) == [False, False, True, True]


@pytest.mark.inductor
@torch.no_grad()
def test_a_weight_changed_after_compile_recompiles_the_size(caplog):
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], **FREEZE)
    torch.testing.assert_close(compiled(batch(4)), model(batch(4)), **TOL)
    model.blocks[0].qkv.weight.mul_(1.5)  # in place, as load_state_dict or an optimizer
    with sb.expect(compiles={4: 2}, fallbacks={"frozen_weights": 1}, calls={4: 2}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)), **TOL)
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)), **TOL)
    model.blocks[0].mlp[0].weight.data = model.blocks[0].mlp[0].weight.data * 0.5  # new storage
    with sb.expect(compiles={4: 2}, fallbacks={"frozen_weights": 1}, calls={4: 1}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)), **TOL)


@pytest.mark.inductor
def test_grad_mode_on_compiles_sized_pieces_unfrozen():
    """Inductor freezes only graphs without backward: with grad on nothing is frozen."""
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], **FREEZE)
    with sb.expect(compiles={"dynamic": 2, 4: 2}):
        out = compiled(batch(4))
    assert "frozen" not in sb.stats().cache_skips
    with torch.no_grad():
        torch.testing.assert_close(out, model(batch(4)), **TOL)


class _Template:
    """A GEMM candidate as ``autotune.prune`` sees it: its output layout, its activation
    input ``[rows, K]`` and its kind."""

    def __init__(self, rows, k=64, n=64, device="cpu"):
        self.layout = SimpleNamespace(size=[rows, n], device=torch.device(device))
        self.input_nodes = [SimpleNamespace(get_size=lambda: [rows, k])] if k else []


class _Aten(_Template, ExternKernelCaller):  # ATen's candidates are ExternKernelCallers
    pass


@pytest.mark.parametrize("rows, k, n, kept", [
    (1, 64, 64, "template"), (2, 1408, 512, "template"), (4, 256, 256, "template"),
    (1, 512, 8192, "both"),  # an lm_head: ATen won it at 1 row
    (4, 512, 512, "both"), (4, 512, 1408, "both"),  # ATen won the second at 4 rows
    (8, 64, 64, "template"), (8, 256, 256, "both"), (16, 64, 64, "aten"),
    (2, None, 64, "both"),  # K unreadable: benchmarked
    (256, 4096, 4096, "aten")])
def test_autotune_pruning_keeps_the_kind_that_wins_at_that_shape(rows, k, n, kept):
    choices = [_Template(rows, k, n), _Aten(rows, k, n)]
    with autotune.pruning(False):
        assert autotune.prune(choices) == choices  # off: Inductor's full search
    with autotune.pruning(True):
        out = autotune.prune(choices)
        gpu = [_Template(rows, k, n, "cuda"), _Aten(rows, k, n, "cuda")]
        assert autotune.prune(gpu) == gpu  # GPU choices are never touched
    assert [type(c) for c in out] == {"template": [_Template], "aten": [_Aten],
                                      "both": [_Template, _Aten]}[kept]


@pytest.mark.inductor
@torch.no_grad()
def test_the_default_tuning_benchmarks_no_gemm_that_measurement_decided(monkeypatch):
    """The real CPU default (freeze + max-autotune, ``prune_autotune=True``): at 2 rows,
    and at 8 rows with these 16 x 16 weights, only the C++ template and at 32 rows only
    ATen are built, nothing is benchmarked; with ``prune_autotune=False`` 2 rows
    benchmark both."""
    from dynamo_sizebackend._torch import packed_linear

    # Autotune's candidates only: a GEMM panel_linear wins never reaches autotune.
    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: False)
    from torch._inductor import select_algorithm

    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")
    # The libraries' GEMMs as autotune sees them: panel_linear (measured faster at these
    # 32 rows on some CPUs) would take ATen's place before autotune runs.
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    benchmarked = []
    select_algorithm.add_feedback_saver(lambda timings, name, *rest: benchmarked.append(name))
    try:
        model = MLP().eval()
        before, parses = dict(autotune.DECISIONS), dict(templates.COUNTS)
        compiled = compile_sb(model, compile_sizes=[2, 8, 32], cache_dir=None)
        for n in (3, 2, 8, 32):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
        made = {k: v - before.get(k, 0) for k, v in autotune.DECISIONS.items()}
        assert made.get("template", 0) >= 1 and made.get("aten", 0) >= 1, made
        # The template's Jinja sources repeat within one GEMM's render: parsed once each.
        assert templates.COUNTS["reused"] > parses["reused"], (parses, templates.COUNTS)
        assert made.get("both", 0) == 0 and benchmarked == []
        assert sb.stats().compiles == {"dynamic": 1, "2": 1, "8": 1, "32": 1}

        torch._dynamo.reset()
        given = pch.COUNTS["given"]
        full = compile_sb(model, compile_sizes=[2], cache_dir=None, prune_autotune=False)
        for n in (3, 2):
            x = torch.randn(n, 16)
            torch.testing.assert_close(full(x), model(x), **TOL)
        assert benchmarked, "the unpruned search benchmarked nothing"
        # The template candidate it benchmarked was built with the precompiled header.
        assert pch.COUNTS["given"] > given
    finally:
        select_algorithm.clear_feedback_savers()


@pytest.mark.inductor
@torch.no_grad()
def test_the_default_tuning_builds_8_row_candidates_with_the_precompiled_header(monkeypatch):
    """The real CPU default at 8 rows and 256 x 256 weights, where pruning keeps both
    kinds: the template candidates it benchmarks are built with the precompiled header."""
    from dynamo_sizebackend._torch import packed_linear

    # Autotune's candidates only: a GEMM panel_linear wins never reaches autotune.
    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: False)
    from torch._inductor import select_algorithm

    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")
    # The libraries' GEMMs as autotune sees them: panel_linear (measured faster at these
    # 32 rows on some CPUs) would take ATen's place before autotune runs.
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    benchmarked = []
    select_algorithm.add_feedback_saver(lambda timings, name, *rest: benchmarked.append(name))
    try:
        model = MLP(256).eval()  # 2**16 weights: above the 8-row template-only bound
        both, given = autotune.DECISIONS["both"], pch.COUNTS["given"]
        compiled = compile_sb(model, compile_sizes=[8], cache_dir=None)
        for n in (3, 8):
            x = torch.randn(n, 256)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
        assert autotune.DECISIONS["both"] > both and benchmarked
        assert pch.COUNTS["given"] > given
        assert sb.stats().compiles == {"dynamic": 1, "8": 1}
    finally:
        select_algorithm.clear_feedback_savers()


def test_benchmark_candidates_get_the_precompiled_header_only_inside_our_compiles():
    import threading

    from torch._inductor.codecache import CppCodeCache, CppPythonBindingsCodeCache

    kernels = CppPythonBindingsCodeCache._get_uncompiled_header("cpu")
    assert CppCodeCache._get_uncompiled_header("cpu") is None  # torch's own answer
    with pch.precompiled():
        # Inductor builds candidates on a pool of its own: every thread sees it.
        seen = []
        thread = threading.Thread(
            target=lambda: seen.append(CppCodeCache._get_uncompiled_header("cpu")))
        thread.start()
        thread.join()
        assert seen == [kernels] == [CppCodeCache._get_uncompiled_header("cpu")]
        assert CppCodeCache._get_uncompiled_header("cuda") is None
        assert CppPythonBindingsCodeCache._get_uncompiled_header("cpu") == kernels
    assert CppCodeCache._get_uncompiled_header("cpu") is None


def test_template_sources_are_parsed_once_only_inside_our_compiles():
    import threading

    from torch._inductor.codegen.common import KernelTemplate

    source = "{{ a }} and {{ b | indent_except_first(1) }}"
    with templates.memoized():
        first = KernelTemplate._template_from_string(source)
        assert KernelTemplate._template_from_string(source) is first
        assert first.render(a=1, b="x\ny") == "1 and x\n    y"
        elsewhere = []  # another thread meanwhile gets Inductor's own parse
        thread = threading.Thread(
            target=lambda: elsewhere.append(KernelTemplate._template_from_string(source)))
        thread.start()
        thread.join()
        assert elsewhere[0] is not first and elsewhere[0].render(a=2, b="z") == "2 and z"
    assert KernelTemplate._template_from_string(source) is not first


class SwiGLU(torch.nn.Module):
    """Llama's MLP: two linears of one input (gate, up), then a third."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.inductor
@torch.no_grad()
def test_the_default_concatenates_linears_of_one_input(real_defaults, monkeypatch):
    # The CPU default concatenates frozen linears that share their input (gate and up
    # here; q, k and v in attention) into one GEMM. Every static GEMM of a sized piece
    # outside the C++ template's rows is asked first whether panel_linear wins (pinned
    # here: no, so the libraries are asked next): the shapes asked are the GEMMs compiled.
    from dynamo_sizebackend._torch import packed_linear

    gemms = []
    monkeypatch.setattr(packed_linear, "panels_faster",
                        lambda rows, k, n: gemms.append((rows, k, n)) or False)
    monkeypatch.setattr(packed_linear, "onednn_faster", lambda rows, k, n: True)
    torch.manual_seed(0)
    model = SwiGLU().eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [16], "cache_dir": None})
    x = torch.randn(16, 32)
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(compiled(x), model(x), **TOL)
    # 16 rows: only aten's GEMM is a candidate (autotune.ATEN_ONLY_MIN_ROWS), no template built.
    assert sorted(gemms) == [(16, 32, 2 * 64), (16, 64, 32)]
    assert sb.stats().compiles == {"dynamic": 1, "16": 1}
