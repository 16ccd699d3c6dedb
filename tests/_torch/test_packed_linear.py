"""_torch.packed_linear: a frozen sized piece's static float32 GEMMs are packed for the
library measured faster on this CPU (oneDNN or MKL); torch's own choice everywhere
else. And the row count from which an unfrozen piece's linears run on weights packed
at run time (compile/linears.py). The measurement itself is timing, so these tests fix its answer and check what
each answer compiles to, through the backend with its real defaults; one leaves it to
this CPU and checks that what was measured is what compiled."""
import hashlib

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import packed_linear

pytestmark = pytest.mark.skipif(
    not (torch._C.has_mkl and torch.backends.mkldnn.is_available()),
    reason="torch chooses between MKL and oneDNN only where it has both")

ROWS = 16  # past autotune.py's template-only rows: the ATen kernel is the one that runs


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 32)).eval()


def _sized_code(model, cache_dir=None):
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [ROWS], "cache_dir": cache_dir})
    x = torch.randn(ROWS, 64)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
        torch.testing.assert_close(out, model(x))
    return "\n".join(code)


@pytest.mark.inductor
@pytest.mark.parametrize("onednn, kernel, other, store", [
    # As a user runs it: an artifact cache, the frozen piece served JIT while the
    # package worker stores it for the next start.
    (True, "mkldnn._linear_pointwise", "mkl._mkl_linear", True),
    (False, "mkl._mkl_linear", "mkldnn._linear_pointwise", False),
])
def test_the_measured_library_is_the_one_the_sized_piece_calls(
        real_defaults, monkeypatch, tmp_path, onednn, kernel, other, store):
    monkeypatch.setattr(packed_linear, "onednn_faster", lambda rows, k, n: onednn)
    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: False)
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    stored = sb.wait_for_packages(timeout=600).stored  # since the process started
    code = _sized_code(_mlp(), str(tmp_path) if store else None)
    if store:
        assert sb.wait_for_packages(timeout=600).stored == stored + 1
    assert kernel in code and other not in code
    # Both linears of the size-16 piece were measured and decided (the general piece
    # is not frozen: nothing packed there).
    assert packed_linear.DECISIONS == {"onednn" if onednn else "mkl": 2}
    assert sb.stats().compiles == {"dynamic": 1, str(ROWS): 1}


@pytest.mark.inductor
def test_switched_off_and_other_callers_keep_torchs_choice(real_defaults, monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_faster", lambda rows, k, n: True)
    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: True)
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    model = _mlp()
    # torch.compile with Inductor's own freezing, outside the backend: MKL, as torch picks.
    x = torch.randn(ROWS, 64)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        _, code = run_and_get_code(torch.compile(model), x)
    assert "mkl._mkl_linear" in "\n".join(code)
    torch._dynamo.reset()
    monkeypatch.setenv("SIZEBACKEND_PACKED_LINEAR", "torch")
    assert "mkl._mkl_linear" in _sized_code(model)
    assert packed_linear.DECISIONS == {}


def _first_linear_only(asked):
    def faster(rows, k, n):
        asked.append((rows, k, n))
        return (k, n) == (64, 128)
    return faster


@pytest.mark.inductor
def test_panels_where_measured_faster(real_defaults, monkeypatch):
    """Where ``panel_linear`` is measured faster than the library torch's packing would
    call, the frozen piece calls it on a weight packed at compile time (a constant of the
    piece). Each linear is timed against the library that would otherwise run: here MKL,
    as measured faster than oneDNN."""
    asked, libraries = [], []
    monkeypatch.setattr(packed_linear, "onednn_faster",
                        lambda rows, k, n: libraries.append((rows, k, n)) or False)
    monkeypatch.setattr(packed_linear, "panels_faster", _first_linear_only(asked))
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    code = _sized_code(_mlp())
    assert code.count("torch.ops.sizebackend.panel_linear.default(") == 1
    assert "_frozen_param" in code and "pack_panels" not in code  # packed once, at compile
    assert "mkl._mkl_linear" in code  # the second linear: MKL, as measured
    assert sorted(asked) == [(ROWS, 64, 128), (ROWS, 128, 32)]
    # The panels are asked first: the libraries are compared only where they lost.
    assert libraries == [(ROWS, 128, 32)]
    assert packed_linear.DECISIONS == {"panels": 1, "mkl": 1}


@pytest.mark.inductor
def test_panels_without_a_library_comparison(real_defaults, monkeypatch):
    """Where oneDNN and MKL are not compared (a torch without MKL: ``onednn_wins`` has no
    answer), a JIT piece still takes the panels where they were measured faster, as the
    package built from it does: the two run one kernel per shape."""
    monkeypatch.setattr(packed_linear, "onednn_wins", lambda rows, k, n, dtype: None)
    monkeypatch.setattr(packed_linear, "panels_faster", _first_linear_only([]))
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    code = _sized_code(_mlp())
    assert code.count("torch.ops.sizebackend.panel_linear.default(") == 1
    assert packed_linear.DECISIONS == {"panels": 1}  # the other linear: torch's own choice


@pytest.mark.inductor
def test_panels_in_a_package(real_defaults, monkeypatch, tmp_path):
    """In an AOT package (built in the process: ``store_frozen="inline"``), timed against
    oneDNN, which torch packs for there; the package calls the op (the AOT runner's call
    back into PyTorch), runs, and is read back by a later compile."""
    import zipfile

    asked = []
    monkeypatch.setattr(packed_linear, "panels_faster", _first_linear_only(asked))
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    options = {"compile_sizes": [ROWS], "cache_dir": str(tmp_path), "store_frozen": "inline"}
    x = torch.randn(ROWS, 64)
    torch._dynamo.mark_dynamic(x, 0)
    model = _mlp()
    with torch.no_grad():
        out = torch.compile(model, backend="sizebackend", options=dict(options))(x)
    torch.testing.assert_close(out, model(x))
    assert sorted(asked) == [(ROWS, 64, 128), (ROWS, 128, 32)]
    assert packed_linear.DECISIONS == {"panels": 1, "onednn": 1}
    assert sb.stats().cache_misses >= 1 and sb.stats().fallbacks == {}
    calls = []
    for path in tmp_path.rglob("*"):
        if path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                calls += [archive.read(n).decode(errors="replace") for n in archive.namelist()
                          if n.endswith(".json")]
    assert sum("sizebackend::panel_linear" in c for c in calls) == 1, "no package calls the op"

    torch._dynamo.reset()
    asked.clear()
    again = torch.compile(_mlp(), backend="sizebackend", options=dict(options))
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    assert asked == [] and sb.stats().cache_hits >= 1  # read back: nothing compiled or timed


@pytest.mark.inductor
def test_panels_switched_off(real_defaults, monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_faster", lambda rows, k, n: True)
    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: True)
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    code = _sized_code(_mlp())
    assert "panel_linear" not in code and "mkldnn._linear_pointwise" in code


@pytest.mark.parametrize("rows, dtype, on, timed", [
    (4, torch.float32, "1", True),
    (packed_linear.PANEL_MAX_ROWS, torch.float32, "1", True),
    (packed_linear.PANEL_MAX_ROWS + 1, torch.float32, "1", False),  # past the tiles' range
    (4, torch.bfloat16, "1", False),
    (4, torch.float32, "0", False),
])
def test_which_gemms_panels_are_timed_for(monkeypatch, rows, dtype, on, timed):
    asked = []
    monkeypatch.setattr(packed_linear, "panels_faster", lambda *a: asked.append(a) or True)
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", on)
    assert packed_linear.panels_win(rows, 64, 32, dtype) is timed
    assert len(asked) == timed
    assert packed_linear.panels_win("s0", 64, 32, dtype) is False  # rows not a number


def test_a_panel_measurement_is_a_real_ratio_taken_once_per_machine(own_folder, monkeypatch):
    packed_linear.panels_faster.cache_clear()
    ratios = []
    measure = packed_linear._panel_ratio

    def spy(rows, k, n, other):
        ratios.append((other, measure(rows, k, n, other)))
        return ratios[-1][1]

    monkeypatch.setattr(packed_linear, "_panel_ratio", spy)
    first = packed_linear.panels_faster(4, 64, 48)
    others = {"onednn", "mkl"} if torch._C.has_mkl else {"onednn"}
    assert {o for o, _ in ratios} == others and all(0 < r < float("inf") for _, r in ratios)
    assert first == all(r < packed_linear.PANEL_MARGIN for _, r in ratios)
    packed_linear.panels_faster.cache_clear()  # a new process: read back, not timed
    assert packed_linear.panels_faster(4, 64, 48) is first and len(ratios) == len(others)
    packed_linear.panels_faster.cache_clear()


@pytest.mark.parametrize("autotune_on, rows, weight, template", [
    (True, 2, (64, 128), True),  # a few rows by a small weight: the template's
    (True, 16, (64, 128), False),  # ATen's rows: panels may take them
    (True, 4, (512, 1024), False),  # benchmarked rows: panels may take them
    (False, 2, (64, 128), False),  # no template without max-autotune
])
def test_panels_leave_the_templates_gemms_alone(autotune_on, rows, weight, template):
    from torch._inductor import config

    with config.patch(max_autotune=autotune_on, max_autotune_gemm=autotune_on):
        assert packed_linear._template_wins(rows, *weight) is template


def test_a_measurement_is_taken_once_per_shape():
    packed_linear.onednn_faster.cache_clear()
    first = packed_linear.onednn_faster(4, 32, 16)
    assert isinstance(first, bool)
    assert packed_linear.onednn_faster(4, 32, 16) is first
    assert packed_linear.onednn_faster.cache_info().hits == 1


@pytest.fixture
def own_folder(tmp_path, monkeypatch):
    """Run-time packing answers written down in a folder of this test's own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cached = (packed_linear.runtime_min_rows, packed_linear._panel_rows)  # before a test pins one
    for f in cached:
        f.cache_clear()
    yield tmp_path
    for f in cached:
        f.cache_clear()


@pytest.mark.parametrize("ratios, least", [
    ((1.5, 0.8, 0.8, 0.8, 0.8), 2),
    ((0.8, 1.5, 0.8, 0.8, 0.8), 4),  # from where oneDNN does not lose above
    ((0.8, 0.8, 0.8, 0.8, 0.8), 1),
    ((0.8, 0.8, 0.8, 0.8, 1.5), None),  # loses at the most rows measured: never
    ((1.5,) * 5, None),
    # Near ties (within the margin either way) decide nothing:
    ((1.5, 0.8, 0.8, 0.85, 0.91), 2),  # a tie at 64 rows keeps the wins below it
    ((1.5, 0.8, 1.05, 0.8, 0.8), 2),  # as does one between wins
    ((1.5, 0.95, 0.8, 0.8, 0.8), 2),  # from the first count where oneDNN is not slower
    ((1.5, 1.05, 0.95, 0.8, 0.8), 4),
    ((0.95, 1.0, 1.05, 0.95, 1.0), None),  # ties only: aten's linear stays
])
def test_run_time_packing_starts_where_onednn_pays_and_stops_losing(
        own_folder, monkeypatch, ratios, least):
    answers = dict(zip(packed_linear.RUNTIME_ROWS, ratios))
    monkeypatch.setattr(packed_linear, "_runtime_ratio", lambda rows, k, n: answers[rows])
    assert packed_linear.runtime_min_rows(32, 16) == least


def test_the_two_kernels_batches_take_turns(monkeypatch):
    """A slow stretch of the machine must fall on both kernels' timings, not on all of
    one's: their batches alternate, and the best batch of each counts."""
    monkeypatch.setattr(packed_linear, "BUDGET_S", 0.0)  # one call a batch
    order = []
    clock = iter(range(10_000))
    monkeypatch.setattr(packed_linear.time, "perf_counter", lambda: next(clock))
    seconds = packed_linear._paired_seconds(lambda: order.append("a"), lambda: order.append("b"))
    timed = order[4:]  # after two calibration calls each
    assert order[:4] == ["a", "a", "b", "b"]
    assert timed == ["a", "b"] * packed_linear.ROUNDS
    assert seconds == (1, 1)  # each batch read one tick of the fake clock


def test_the_run_time_measurement_is_taken_once_per_machine(own_folder, monkeypatch):
    measured = []

    def ratio(rows, k, n):
        measured.append(rows)
        return 0.5 if rows >= 4 else 2.0

    monkeypatch.setattr(packed_linear, "_runtime_ratio", ratio)
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == len(packed_linear.RUNTIME_ROWS)
    packed_linear.runtime_min_rows.cache_clear()  # as a new process starts
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == len(packed_linear.RUNTIME_ROWS)  # read back, not measured
    packed_linear.runtime_min_rows.cache_clear()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == 2 * len(packed_linear.RUNTIME_ROWS)
    packed_linear.runtime_min_rows.cache_clear()
    other_isa = "DEFAULT" if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other_isa)  # ATen's copy
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == 3 * len(packed_linear.RUNTIME_ROWS)
    packed_linear.runtime_min_rows.cache_clear()
    monkeypatch.setattr(packed_linear, "_kernels_id", lambda: "another build")  # our kernels
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == 4 * len(packed_linear.RUNTIME_ROWS)
    packed_linear.runtime_min_rows.cache_clear()  # the same again: read back
    assert packed_linear.runtime_min_rows(32, 16) == 4
    assert len(measured) == 4 * len(packed_linear.RUNTIME_ROWS)


def test_the_kernels_build_is_read_from_the_library():
    from dynamo_sizebackend import _C

    first = packed_linear._kernels_id()
    assert len(first) == 64 and first == packed_linear._kernels_id()
    with open(_C.__file__, "rb") as f:
        assert first == hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("min_rows, ratios, most, asked", [
    # The panels against what runs otherwise at each count: aten below oneDNN's rows.
    (4, (0.5, 0.5, 0.5, 0.5, 0.5), 64, ["aten", "aten", "onednn", "onednn", "onednn"]),
    (None, (0.5, 0.5, 0.5, 0.5, 0.5), 64, ["aten"] * 5),
    (2, (0.5, 0.6, 0.8, 0.97, 0.5), 4, ["aten", "onednn", "onednn", "onednn"]),  # stops at a loss
    (2, (0.96, 0.5, 0.5, 0.5, 0.5), 0, ["aten"]),  # not a win by the margin at 1 row: never
])
def test_run_time_panels_run_up_to_the_rows_they_win_at(own_folder, monkeypatch, min_rows, ratios,
                                                        most, asked):
    answers = dict(zip(packed_linear.RUNTIME_ROWS, ratios))
    others = []

    def ratio(rows, k, n, kernel, other):
        assert kernel == "panels"
        others.append(other)
        return answers[rows]

    monkeypatch.setattr(packed_linear, "runtime_min_rows", lambda k, n: min_rows)
    monkeypatch.setattr(packed_linear, "_ratio", ratio)
    assert packed_linear.runtime_panel_rows(32, 16) == most
    assert others == asked
    packed_linear._panel_rows.cache_clear()  # as a new process starts: read back
    assert packed_linear.runtime_panel_rows(32, 16) == most and len(others) == len(asked)
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    assert packed_linear.runtime_panel_rows(32, 16) == 0


def test_a_run_time_panel_measurement_is_a_real_ratio(own_folder, monkeypatch):
    timed = []
    measure = packed_linear._ratio

    def spy(rows, k, n, kernel, other):
        timed.append((rows, kernel, other, measure(rows, k, n, kernel, other)))
        return timed[-1][-1]

    monkeypatch.setattr(packed_linear, "runtime_min_rows", lambda k, n: None)
    monkeypatch.setattr(packed_linear, "_ratio", spy)
    most = packed_linear.runtime_panel_rows(64, 48)
    assert timed and all(0 < r < float("inf") for *_, r in timed)
    wins = [rows for rows, _, _, r in timed if r < packed_linear.PANEL_MARGIN]
    assert most == (wins[-1] if wins else 0) and wins == [r for r, *_ in timed][:len(wins)]


_CHILD = """
import sys, time
import torch
from dynamo_sizebackend._torch import packed_linear

index = int(sys.argv[1])

def ratio(rows, k, n):  # each process would answer differently on its own
    time.sleep(0.05)
    return 0.5 if index == 0 else 2.0

packed_linear._runtime_ratio = ratio
print(packed_linear.runtime_min_rows(32, 16))
"""


def test_processes_starting_together_agree(own_folder):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(own_folder)}
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(i)], env=env,
                                 stdout=subprocess.PIPE, text=True) for i in range(3)]
    answers = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0
        answers.append(out.strip())
    assert len(set(answers)) == 1 and answers[0] in ("1", "None"), answers


@pytest.mark.inductor
@torch.no_grad()
def test_real_defaults_compile_what_this_cpu_measured(real_defaults, own_folder, monkeypatch):
    """Nothing pinned, as a user runs it: the run-time rows are timed on this CPU (the
    two kernels in turns) and the rule's answer for those very ratios is what the general
    piece compiles; the frozen size's GEMMs are timed too. Which answer a CPU gives is
    its own: the test checks that the answer measured is the one used, whatever it is."""
    ratios, timed = {}, []
    measure = packed_linear._runtime_ratio

    def spy(rows, k, n):
        timed.append((rows, k, n))
        ratios[rows, k, n] = measure(rows, k, n)
        return ratios[rows, k, n]

    monkeypatch.setattr(packed_linear, "_runtime_ratio", spy)
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256)).eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [4], "cache_dir": None})
    x = torch.randn(3, 256)  # not listed: the general piece runs
    torch._dynamo.decorators.mark_unbacked(x, 0)
    out, code = run_and_get_code(compiled, x)
    torch.testing.assert_close(out, model(x))

    shapes = [(256, 1024), (1024, 256)]  # K x N of each linear
    assert sorted(timed) == sorted((rows, k, n) for rows in packed_linear.RUNTIME_ROWS
                                   for k, n in shapes)
    assert all(0 < r < float("inf") for r in ratios.values()), ratios
    answers = {(k, n): packed_linear._least_rows([ratios[rows, k, n]
                                                  for rows in packed_linear.RUNTIME_ROWS])
               for k, n in shapes}
    # A general linear calls the op where oneDNN pays from some rows or the panels do
    # up to some (that answer read back: measured once per machine).
    packed = sum(answers[s] is not None or packed_linear.runtime_panel_rows(*s) > 0
                 for s in shapes)
    # The size-4 piece froze its weights (no run-time packing there): the general piece's
    # linears alone call the op, one per shape the rule packs.
    assert "\n".join(code).count("torch.ops.sizebackend.packed_linear.default(") == packed
    assert sum(packed_linear.DECISIONS.values()) == 2  # the frozen size's two GEMMs
    # Each of them runs panel_linear exactly where this machine measured it faster (4
    # rows by these weights is not the C++ template's, so the panels were timed).
    panels = sum(packed_linear.panels_faster(4, k, n) for k, n in shapes)
    assert packed_linear.DECISIONS["panels"] == panels
    assert "\n".join(code).count("torch.ops.sizebackend.panel_linear.default(") == panels

    packed_linear.runtime_min_rows.cache_clear()  # as a new process starts: read back
    assert {s: packed_linear.runtime_min_rows(*s) for s in shapes} == answers
    assert len(timed) == len(packed_linear.RUNTIME_ROWS) * len(shapes)
    for size in (4, 5, 3):
        y = torch.randn(size, 256)
        torch.testing.assert_close(compiled(y), model(y))
    assert sb.stats().compiles == {"dynamic": 1, "4": 1}
    assert sb.stats().fallbacks == {}


@pytest.mark.inductor
@torch.no_grad()
@pytest.mark.parametrize("built", ["normally", "under inference_mode"])
def test_panels_in_a_hugging_face_model_then_reloaded(real_defaults, monkeypatch, tmp_path, built):
    """The defaults with every static GEMM on ``panel_linear`` (pinned: on its own this
    tiny model's decode GEMMs are the C++ template's): a Llama, ``generate()`` as README
    recipe 1 runs it, tokens equal eager's; then a new checkpoint loaded in place: the
    frozen sizes see it and follow it. Built under ``inference_mode`` nothing is frozen
    (counted), so nothing is packed for the panels either, and tokens still follow."""
    pytest.importorskip("transformers")
    from ..models.test_hf_generate import counting_forward, generate, prompt, tiny_llama

    monkeypatch.setattr(packed_linear, "panels_faster", lambda rows, k, n: True)
    monkeypatch.setattr(packed_linear, "_template_wins", lambda rows, k, n: False)
    monkeypatch.setattr(packed_linear, "DECISIONS", type(packed_linear.DECISIONS)())
    if built == "normally":
        model = tiny_llama()
    else:
        with torch.inference_mode():
            model = tiny_llama()
    # Batch 1 first: Dynamo traces a first call static, the batch symbol (and with it
    # the frozen size-2 pieces) comes with the second batch size.
    scenario = [prompt(1, 0), prompt(2, 0)]
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    model.forward = counting_forward(model, {"compile_sizes": [2], "cache_dir": str(tmp_path)})
    for inputs, want in zip(scenario, expected):
        assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    assert sb.stats().calls.get("2", 0) >= 1
    inputs = scenario[1]
    if built == "normally":
        assert packed_linear.DECISIONS["panels"] >= 4  # decode's q, k, v, o, MLP, head
        assert set(packed_linear.DECISIONS) == {"panels"}
    else:
        assert packed_linear.DECISIONS == {}
        assert sb.stats().fallbacks.get("inference_tensors_not_frozen", 0) >= 1

    torch.manual_seed(1)
    fresh = {k: torch.randn_like(v) * 0.02 for k, v in model.state_dict().items()}
    reference = tiny_llama()
    reference.load_state_dict(fresh)
    if built == "normally":
        model.load_state_dict(fresh)
    else:
        with torch.inference_mode():
            model.load_state_dict(fresh)
    want = generate(reference, inputs, cache_implementation="static")
    assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    if built == "normally":
        assert sb.stats().fallbacks.get("frozen_weights", 0) >= 1
