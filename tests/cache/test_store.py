"""The artifact cache: keys, disk entries, identical pieces compiled once, other processes.

Inductor tests use ``MLP`` (one piece, no attention) wherever one piece proves the point;
each test caches into its own ``tmp_path`` so counts do not depend on test order.
"""
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import dynamo_sizebackend as sb
import dynamo_sizebackend.compile.pipeline as backend
from dynamo_sizebackend import _torch
from dynamo_sizebackend.app import cli
from dynamo_sizebackend.cache import store as cache
from dynamo_sizebackend.compile import progress
from dynamo_sizebackend.cache.store import DiskCache
from dynamo_sizebackend.cache.key import piece_key

from ..nets import MLP, TinyTransformer, batch, compile_sb
from ..spies import count_float_restarts

pytestmark = pytest.mark.usefixtures("no_shared_pieces")

REPO = Path(__file__).resolve().parents[2]


def _restart():
    """What a new process starts without: Dynamo's graphs and the shared pieces."""
    torch._dynamo.reset()
    cache.forget_shared()


def _mlp_inductor(tmp_path, **options):
    torch.manual_seed(0)
    model = MLP().eval()
    options = {"compile_sizes": [], "compiler": "inductor", "cache_dir": str(tmp_path), **options}
    return model, compile_sb(model, **options)


def _spy_pieces(monkeypatch) -> list:
    """Record what the real compile_piece is asked to compile (and still compile it)."""
    seen = []
    real = backend.compile_piece

    def spy(adaptor, gm, inputs, size, **kw):
        seen.append((size, gm, list(inputs)))
        return real(adaptor, gm, inputs, size, **kw)

    monkeypatch.setattr(backend, "compile_piece", spy)
    return seen


# --- keys (eager adaptor: no Inductor) --------------------------------------------------


@torch.no_grad()
def test_identical_layers_share_a_key_and_nothing_else_does(monkeypatch):
    seen = _spy_pieces(monkeypatch)
    compile_sb(TinyTransformer(layers=4).eval(), compile_sizes=[4], compiler="eager")(batch(3))
    # 4 attention calls split the graph into 5 pieces: [layer 0 up to attention, 0->1,
    # 1->2, 2->3, layer 3 after attention + final norm]. Piece 0->1 also takes the width
    # layer 0 read from the input's shape, so only 1->2 and 2->3 are the same code (with
    # other weights): 4 distinct keys for the general shape, 4 others for size 4.
    keys = {size: [piece_key(gm, inputs, size, "opts") for s, gm, inputs in seen if s == size]
            for size in (None, 4)}
    assert [len(keys[None]), len(keys[4])] == [5, 5]
    for size in (None, 4):
        assert len(set(keys[size])) == 4 and keys[size][2] == keys[size][3]
    assert not set(keys[None]) & set(keys[4])

    size, gm, inputs = seen[2]
    key = keys[None][2]
    assert piece_key(gm, inputs, size, "opts") == key  # stable
    assert piece_key(gm, inputs, size, "other opts") != key
    with torch.enable_grad():
        assert piece_key(gm, inputs, size, "opts") != key
    # Code built with AOT kernels' checks as Inductor writes them is another entry.
    with monkeypatch.context() as patch:
        patch.setenv("SIZEBACKEND_AOT_TORCH_CHECK", "0")
        assert piece_key(gm, inputs, size, "opts") != key
    # So is code built without panel_linear in place of the libraries' GEMMs.
    with monkeypatch.context() as patch:
        patch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
        assert piece_key(gm, inputs, size, "opts") != key
    assert piece_key(gm, inputs, size, "opts") == key
    monkeypatch.setattr(_torch, "TORCH_VERSION", "0.0.0+elsewhere")
    assert piece_key(gm, inputs, size, "opts") != key


def _swapped(get, set_, value):
    """``set_(value)`` for the block, then the value ``get()`` gave before."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _matmul_precision(precision):
    # Then restored flag by flag: set_float32_matmul_precision("highest") writes "ieee"
    # where the process started with "none", another state (and another key).
    flags = [torch.backends, torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    before = torch.get_float32_matmul_precision(), [f.fp32_precision for f in flags]
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        for f, value in zip(flags, before[1]):
            f.fp32_precision = value


def _deterministic(warn_only):
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _private_inductor_config():
    from torch._inductor import config

    # A private entry (leading "_"), left out by save_config_portable()'s default.
    with config.patch(_use_fp64_for_unbacked_floats=not config._use_fp64_for_unbacked_floats):
        yield


def _autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield


# Each changes what Inductor generates or how the code runs (the thread count: a piece
# compiled for 1 thread has no `#pragma omp`, one for 2 has them), and each is a factor
# of Inductor's or AOTAutograd's own cache key.
_FACTORS = {
    "threads": lambda: _swapped(torch.get_num_threads, torch.set_num_threads,
                                1 if torch.get_num_threads() != 1 else 2),
    "default_dtype": lambda: _swapped(torch.get_default_dtype, torch.set_default_dtype,
                                      torch.float64),
    "matmul_high": lambda: _matmul_precision("high"),
    "matmul_medium": lambda: _matmul_precision("medium"),
    "deterministic": lambda: _deterministic(False),
    "deterministic_warn_only": lambda: _deterministic(True),
    "private_inductor_config": _private_inductor_config,
    "autocast": _autocast,
}


@pytest.mark.parametrize("factor", list(_FACTORS))
@torch.no_grad()
def test_each_compile_environment_factor_changes_the_key(monkeypatch, factor):
    """A setting Inductor's own cache keys on makes a miss (a recompile), never a hit
    with code built for another setting."""
    import contextlib

    seen = _spy_pieces(monkeypatch)
    compile_sb(MLP().eval(), compiler="eager")(torch.randn(3, 16))
    [(size, gm, inputs)] = seen
    key = piece_key(gm, inputs, size, "opts")
    assert key is not None and piece_key(gm, inputs, size, "opts") == key
    if factor == "matmul_medium":  # apart from "high" too, not only from the default
        with contextlib.contextmanager(_FACTORS["matmul_high"])():
            high = piece_key(gm, inputs, size, "opts")
        with contextlib.contextmanager(_FACTORS[factor])():
            assert piece_key(gm, inputs, size, "opts") not in (key, high)
    with contextlib.contextmanager(_FACTORS[factor])():
        changed = piece_key(gm, inputs, size, "opts")
    assert changed is not None and changed != key
    assert piece_key(gm, inputs, size, "opts") == key  # back as before: the same key


@torch.no_grad()
def test_a_setting_inductor_cannot_hash_gives_no_key(monkeypatch):
    """A custom pass that is a plain function (no ``uuid()``): Inductor bypasses its own
    cache, and the piece gets no key (compiled every time, never shared)."""
    from torch._inductor import config

    seen = _spy_pieces(monkeypatch)
    compile_sb(MLP().eval(), compiler="eager")(torch.randn(3, 16))
    [(size, gm, inputs)] = seen
    assert piece_key(gm, inputs, size, "opts") is not None
    with config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert piece_key(gm, inputs, size, "opts") is None


# --- disk entries -----------------------------------------------------------------------


def test_concurrent_writers_never_show_a_torn_entry(tmp_path):
    disk = DiskCache(str(tmp_path))
    payloads = [bytes([i]) * (200_000 + i) for i in range(4)]
    errors, reads = [], []

    def write(payload):
        for _ in range(20):
            disk.write("k", payload, torch="t", size="dynamic", piece="p")

    def read():
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                reads.append(disk.read("k"))
            except cache.CorruptEntry as e:
                errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {r for r in reads if r is not None} <= set(payloads)
    assert disk.read("k") in payloads
    assert sorted(os.listdir(disk.folder)) == ["k" + cache.SUFFIX]  # no temp file left


def test_cli_info_and_clear(tmp_path, capsys):
    disk = DiskCache(str(tmp_path))
    disk.write("a", b"x" * 1000, torch="2.13.0", size="dynamic", piece="p")
    disk.write("b", b"y" * 500, torch="2.13.0", size="4", piece="p")
    disk.write("c", b"z" * 100, torch="2.12.0", size="4", piece="p")
    Path(disk.path("d")).write_bytes(b"not an entry")

    assert cli.main(["cache", "info", "--json", "--dir", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 3 and info["unreadable"] == 1
    assert {v: row["entries"] for v, row in info["by_torch_version"].items()} == {
        "2.13.0": 2, "2.12.0": 1}
    assert info["bytes"] == sum(os.path.getsize(disk.path(k)) for k in "abc")

    assert cli.main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 4 files" in capsys.readouterr().out
    # The module entry point, as a user runs it.
    run = subprocess.run(
        [sys.executable, "-m", "dynamo_sizebackend", "cache", "info", "--dir", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, check=True,
    )
    assert "entries: 0" in run.stdout


# --- progress bar -----------------------------------------------------------------------


@torch.no_grad()
def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    model = TinyTransformer(layers=4).eval()  # 5 pieces: enough for a bar
    compile_sb(model, compile_sizes=[4], compiler="eager")(batch(3))
    assert "sizebackend graph" not in capsys.readouterr().err  # pytest's stderr is no tty

    torch._dynamo.reset()
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    compile_sb(model, compile_sizes=[4], compiler="eager")(batch(3))
    err = capsys.readouterr().err
    assert "sizebackend graph" in err and "dynamic shape" in err and "sizes [4]" in err


# --- Inductor ---------------------------------------------------------------------------


@pytest.mark.inductor
@torch.no_grad()
def test_identical_layers_compile_once(tmp_path):
    model = TinyTransformer(layers=4).eval()
    compiled = compile_sb(model, compiler="inductor", cache_dir=str(tmp_path))
    # 5 pieces, of which 1->2 and 2->3 are identical (see the key test, which shows the
    # same for a listed size): 4 compiles, 1 reuse, 4 entries written.
    with sb.expect(pieces=5, compiles={"dynamic": 4}, reused=1, cache_misses=4,
                   cache_hits=0, cache_skips={}):
        out = compiled(batch(3))
    torch.testing.assert_close(out, model(batch(3)))
    for size in (2, 5):  # the shared piece serves both layers at every size
        torch.testing.assert_close(compiled(batch(size, seq=3)), model(batch(size, seq=3)))
    assert len(DiskCache(str(tmp_path)).entries()[0]) == 4


@pytest.mark.inductor
@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "payload torch rejects"])
@torch.no_grad()
def test_damaged_entry_is_recompiled_and_replaced(tmp_path, damage, caplog):
    model, compiled = _mlp_inductor(tmp_path)
    x = torch.randn(4, 16)
    with sb.expect(cache_misses=1, compiles={"dynamic": 1}):
        compiled(x)
    disk = DiskCache(str(tmp_path))
    [entry], _ = disk.entries()
    data = Path(entry.path).read_bytes()
    if damage == "truncated":
        Path(entry.path).write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        Path(entry.path).write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    else:  # checksum fine, but not an artifact torch can load
        key = Path(entry.path).name[: -len(cache.SUFFIX)]
        disk.write(key, b"garbage" * 100, torch=_torch.TORCH_VERSION, size="dynamic", piece="p")

    _restart()
    _, compiled = _mlp_inductor(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dynamo_sizebackend.cache.store"):
        with sb.expect(cache_skips={"corrupt": 1}, cache_misses=1, cache_hits=0,
                       compiles={"dynamic": 1}):
            out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert len([r for r in caplog.records if "recompiling" in r.getMessage()]) == 1

    _restart()  # the entry was replaced by a sound one
    _, compiled = _mlp_inductor(tmp_path)
    with sb.expect(cache_hits=1, cache_misses=0, compiles={}, cache_skips={}):
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.inductor
@torch.no_grad()
def test_changed_options_or_torch_version_miss(tmp_path, monkeypatch, capsys):
    x = torch.randn(4, 16)
    runs = [
        ({}, {"cache_misses": 1}),
        ({}, {"cache_hits": 1}),
        ({"inductor_options": {"epilogue_fusion": False}}, {"cache_misses": 1}),
        ({"inductor_options": {"epilogue_fusion": False}}, {"cache_hits": 1}),
    ]
    for options, counts in runs:
        _restart()
        model, compiled = _mlp_inductor(tmp_path, **options)
        with sb.expect(**{"cache_hits": 0, "cache_misses": 0, **counts}):
            torch.testing.assert_close(compiled(x), model(x))

    _restart()
    monkeypatch.setattr(_torch, "TORCH_VERSION", "2.13.0+elsewhere")
    model, compiled = _mlp_inductor(tmp_path)
    with sb.expect(cache_misses=1, cache_hits=0, compiles={"dynamic": 1}):
        torch.testing.assert_close(compiled(x), model(x))

    cli.main(["cache", "info", "--json", "--dir", str(tmp_path)])
    by_version = json.loads(capsys.readouterr().out)["by_torch_version"]
    assert {v: row["entries"] for v, row in by_version.items()} == {
        torch.__version__: 2, "2.13.0+elsewhere": 1}


@pytest.mark.inductor
@torch.no_grad()
def test_background_and_lazy_modes_with_the_cache(tmp_path):
    x4 = torch.randn(4, 16)

    def serve_until_size_4_swaps_in(compiled, model):
        deadline = time.monotonic() + 120
        while sb.stats().calls.get("4", 0) == 0:
            torch.testing.assert_close(compiled(x4), model(x4))  # right before and after
            assert time.monotonic() < deadline, "background compile never finished"
            time.sleep(0.05)

    # Cold: the general piece compiles first, size 4 in the background thread.
    model, compiled = _mlp_inductor(tmp_path, compile_sizes=[4], compile_mode="background")
    serve_until_size_4_swaps_in(compiled, model)
    assert sb.stats().compiles == {"dynamic": 1, "4": 1}
    assert sb.stats().cache_misses == 2

    # Warm: the background thread loads size 4 from disk instead.
    _restart()
    sb.reset_stats()
    model, compiled = _mlp_inductor(tmp_path, compile_sizes=[4], compile_mode="background")
    serve_until_size_4_swaps_in(compiled, model)
    assert (sb.stats().compiles, sb.stats().cache_hits) == ({}, 2)

    # Lazy: size 4 is loaded on first sight.
    _restart()
    model, compiled = _mlp_inductor(tmp_path, compile_sizes=[4], compile_mode="lazy")
    with sb.expect(cache_hits=1, calls={"dynamic": 1}):
        compiled(torch.randn(3, 16))
    with sb.expect(cache_hits=1, compiles={}, calls={"4": 1}):
        torch.testing.assert_close(compiled(x4), model(x4))


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import dynamo_sizebackend as sb
    from tests.nets import MLP

    cache_dir, out_path = sys.argv[1:]
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "cache_dir": cache_dir,
                                      "sized_inductor_options": {"freezing": True}})
    outs = {}
    with torch.no_grad():
        for size in (4, 3):
            x = torch.randn(size, 16, generator=torch.Generator().manual_seed(size))
            outs[size] = compiled(x)
            torch.testing.assert_close(outs[size], model(x))
    torch.save(outs, out_path)
    print(json.dumps(sb.stats().to_dict()))
""")


def _start_child(tmp_path, name):
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "cache"), str(tmp_path / f"{name}.pt")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finish(child) -> dict:
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.inductor
def test_processes_share_one_folder(tmp_path):
    # Three processes (a server's workers) start at once on one empty folder and compile
    # the MLP: one piece, general (a JIT artifact) + size 4 (frozen: an AOT package).
    # Between them each artifact is compiled exactly once (the per-key lock); the others
    # wait and load it. A fourth process then compiles nothing.
    first = [_start_child(tmp_path, name) for name in "abc"]
    results = [_finish(child) for child in first]
    for stats in results:
        assert stats["cache_hits"] + stats["cache_misses"] == 2, stats
        assert sum(stats["compiles"].values()) == stats["cache_misses"], stats
        assert stats["cache_skips"] == {} and stats["fallbacks"] == {}, stats
    assert sum(s["cache_misses"] for s in results) == 2, results
    assert sum(s["cache_hits"] for s in results) == 4, results
    entries, unreadable = DiskCache(str(tmp_path / "cache")).entries()
    assert (sorted(e.kind for e in entries), unreadable) == (["aot", "jit"], 0)
    assert not [n for n in os.listdir(entries[0].path.rsplit("/", 1)[0]) if n.endswith(".tmp")]

    stats = _finish(_start_child(tmp_path, "d"))
    assert (stats["cache_hits"], stats["cache_misses"], stats["compiles"]) == (2, 0, {}), stats
    assert stats["calls"] == {"4": 1, "dynamic": 1}

    outs = [torch.load(tmp_path / f"{n}.pt") for n in "abcd"]
    for size in (4, 3):  # the same code, so the same bits
        assert all(torch.equal(outs[0][size], o[size]) for o in outs[1:])


_NORM_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import dynamo_sizebackend as sb
    from tests.nets import NormNet, batch

    torch.manual_seed(0)
    model = NormNet().eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "cache_dir": sys.argv[1]})
    with torch.no_grad():
        for size in (4, 3):
            torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    print(json.dumps(sb.stats().to_dict()))
""")


@pytest.mark.inductor
def test_warm_start_with_a_float_attribute_compiles_nothing(tmp_path):
    # The model's eps is a float attribute. Dynamo lifts it into a graph input; left
    # symbolic, Inductor specializes it during a real compile (Dynamo traces again) but
    # not on an Inductor cache hit, so a warm process used to trace other pieces and
    # recompile them. Both processes share Inductor's cache folder (the env of the run).
    def run() -> dict:
        child = subprocess.run(
            [sys.executable, "-c", _NORM_CHILD, str(tmp_path / "cache")],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        return json.loads(child.stdout.strip().splitlines()[-1])

    cold = run()
    # 1 attention -> 2 pieces, general + size 4: 4 artifacts, all compiled.
    assert cold["cache_misses"] == 4 and cold["cache_hits"] == 0, cold
    warm = run()
    assert (warm["cache_hits"], warm["cache_misses"], warm["compiles"]) == (4, 0, {}), warm
    assert warm["calls"] == {"4": 1, "dynamic": 1}


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-6
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x, scale: float):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


@pytest.mark.inductor
@pytest.mark.parametrize("defaults", ["suite", "real"])
@torch.no_grad()
def test_float_attributes_become_constants_float_arguments_stay_symbolic(caplog, monkeypatch,
                                                                         defaults):
    if defaults == "real":  # the CPU default: sized pieces frozen and autotuned
        monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")
    restarts = count_float_restarts(monkeypatch)
    model = _Scaled()
    compiled = compile_sb(model, compile_sizes=[2], cache_dir=None)
    with caplog.at_level(logging.INFO, logger="dynamo_sizebackend"):
        for size, scale in ((2, 0.5), (3, 0.7), (2, 0.9)):
            x = torch.randn(size, 4, 8)
            torch.testing.assert_close(compiled(x, scale), model(x, scale))
    said = [r.getMessage() for r in caplog.records if "float attributes" in r.getMessage()]
    assert len(said) == 1 and "eps" in said[0] and "scale" not in said[0], said
    # Constants from the first trace: Dynamo never traced the frame a second time.
    assert restarts == [] and "trace again" not in caplog.text
    # One graph for three scales: the argument stayed a symbolic input, no recompiles.
    assert sb.stats().graphs == 1 and sb.stats().calls == {"2": 2, "dynamic": 1}


def test_cli_text_and_json_name_the_same_folders(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    DiskCache(str(tmp_path)).write("a", b"x", torch="2.13.0", size="4", piece="p")
    cli.main(["cache", "info", "--json", "--dir", str(tmp_path)])
    info = json.loads(capsys.readouterr().out)
    assert info["cache_dir"] == info["dir"] == str(tmp_path)
    assert info["folder"] == DiskCache(str(tmp_path)).folder
    cli.main(["cache", "info", "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert f"cache_dir: {info['cache_dir']}\n" in text and f"folder: {info['folder']}\n" in text

    cli.main(["cache", "clear", "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "removed 1 files" in text
    assert f"Inductor's own cache is left alone: {tmp_path / 'inductor'}" in text
    cli.main(["cache", "clear", "--json", "--dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out)["inductor_cache_kept"] == str(tmp_path / "inductor")


def test_cli_version_and_bench_help():
    import dynamo_sizebackend

    run = subprocess.run([sys.executable, "-m", "dynamo_sizebackend", "--version"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stdout.strip() == f"dynamo_sizebackend {dynamo_sizebackend.__version__} (torch {torch.__version__})"
    run = subprocess.run([sys.executable, "-m", "dynamo_sizebackend", "bench", "--help"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    help_text = " ".join(run.stdout.split())  # argparse wraps to the terminal width
    assert "T is the number of tokens in one model call" in help_text
    assert "(default: None)" not in help_text
    assert "most frequent T of the schedule --num-compile-sizes" in help_text  # no 2nd default
    assert "(default: 4)" in help_text  # --num-compile-sizes
