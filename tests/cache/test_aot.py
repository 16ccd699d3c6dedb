"""Frozen sized pieces stored as AOTInductor packages (issue 18): a restart loads them,
other weights never load a stale one, a damaged one is rebuilt, and what cannot be a
package stays on the JIT path, counted.

Real Inductor and AOTInductor compiles of ``MLP`` (one piece, no attention); each test
caches into its own ``tmp_path``. A "restart" is what a new process starts without:
Dynamo's graphs and the in-memory table of pieces (tests/cache/test_store.py runs real
processes).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.app import cli
from dynamo_sizebackend.cache import store
from dynamo_sizebackend.cache.store import DiskCache

from ..nets import MLP, compile_sb

pytestmark = [pytest.mark.inductor, pytest.mark.usefixtures("no_shared_pieces")]

FREEZE = {"compile_sizes": [4], "sized_inductor_options": {"freezing": True}, "store_frozen": "inline"}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _restart():
    torch._dynamo.reset()
    store.forget_shared()


def _kinds(root) -> dict[str, int]:
    entries, unreadable = DiskCache(str(root)).entries()
    assert unreadable == 0
    kinds: dict[str, int] = {}
    for entry in entries:
        kinds[entry.kind] = kinds.get(entry.kind, 0) + 1
    return kinds


def _x(n: int) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(n))


def _run(model, cache_dir, **options):
    """Compile ``model`` and call it at size 3 (general pieces) and 4 (frozen): outputs."""
    compiled = compile_sb(model, cache_dir=str(cache_dir), **{**FREEZE, **options})
    outs = {}
    for n in (3, 4):
        outs[n] = compiled(_x(n))
        torch.testing.assert_close(outs[n], model(_x(n)), **TOL)
    return compiled, outs


@torch.no_grad()
def test_a_restart_loads_the_frozen_piece_and_new_weights_never_load_a_stale_one(tmp_path):
    torch.manual_seed(0)
    model = MLP().eval()
    # Cold: the general piece (JIT artifact) and the frozen size-4 piece (AOT package).
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_misses=2, cache_hits=0, cache_skips={}):
        _, cold = _run(model, tmp_path)
    assert _kinds(tmp_path) == {"jit": 1, "aot": 1}

    _restart()  # loads both, compiles nothing; the same code, so the same bits
    with sb.expect(compiles={}, cache_hits=2, cache_misses=0, calls={"dynamic": 1, 4: 1}):
        _, warm = _run(model, tmp_path)
    assert torch.equal(warm[4], cold[4]) and torch.equal(warm[3], cold[3])

    # A model of the same shapes with other weights (another checkpoint): the package
    # holds the old weights, so its key differs; the general piece (no weights) loads.
    _restart()
    torch.manual_seed(1)
    other = MLP().eval()
    with sb.expect(compiles={4: 1}, cache_hits=1, cache_misses=1):
        _, new = _run(other, tmp_path)
    assert not torch.allclose(new[4], cold[4])
    assert _kinds(tmp_path) == {"jit": 1, "aot": 2}

    # Weights written in place after the package loaded: seen by the frozen check, the
    # size compiles again (not frozen: the tensor changed once), still right.
    _restart()
    compiled, _ = _run(model, tmp_path)
    model.a.weight.mul_(2.0)
    with sb.expect(fallbacks={"frozen_weights": 1}, compiles={4: 1}):
        torch.testing.assert_close(compiled(_x(4)), model(_x(4)), **TOL)


@torch.no_grad()
def test_a_package_that_does_not_load_is_rebuilt(tmp_path, caplog):
    torch.manual_seed(0)
    model = MLP().eval()
    _run(model, tmp_path)
    (entry,) = [e for e in DiskCache(str(tmp_path)).entries()[0] if e.kind == "aot"]
    key = entry.path.rsplit("/", 1)[1].removesuffix(store.SUFFIX)
    # A well-formed entry (header and checksum match) whose package is garbage.
    DiskCache(str(tmp_path)).write(key, b"not a package", torch="x", size="4", piece="p", kind="aot")
    _restart()
    with sb.expect(cache_skips={"corrupt": 1}, compiles={4: 1}, cache_hits=1, cache_misses=1):
        _run(model, tmp_path)
    assert "does not load" in caplog.text
    _restart()  # replaced by a good one
    with sb.expect(compiles={}, cache_hits=2):
        _run(model, tmp_path)


@torch.no_grad()
def test_what_cannot_be_a_package_compiles_on_the_jit_path(tmp_path):
    torch.manual_seed(0)
    model = MLP().eval()
    # Turned off: the frozen piece compiles on the JIT path, counted, not stored.
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_skips={"frozen": 1}):
        _run(model, tmp_path, store_frozen=False)
    assert _kinds(tmp_path) == {"jit": 1}

    # A second symbolic dim (dynamic=True makes the middle dim symbolic too): the size-4
    # piece keeps it, AOTInductor would need export's dynamic shapes: the JIT path.
    _restart()
    compiled = compile_sb(model, cache_dir=str(tmp_path / "b"), **FREEZE)
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_skips={"frozen": 1}):
        for n in (3, 4):
            x = torch.randn(n, 5, 16)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert _kinds(tmp_path / "b") == {"jit": 1}


def test_cache_info_shows_each_kind(tmp_path, capsys):
    disk = DiskCache(str(tmp_path))
    disk.write("a", b"x" * 1000, torch="2.13.0", size="dynamic", piece="p", kind="jit")
    disk.write("b", b"y" * 3000, torch="2.13.0", size="4", piece="p", kind="aot")
    disk.write("c", b"z" * 2000, torch="2.13.0", size="2", piece="p", kind="aot")
    disk.write("d", b"w" * 100, torch="2.13.0", size="4", piece="p")  # written before kinds: jit
    assert cli.main(["cache", "info", "--json", "--dir", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    kinds = info["by_kind"]
    assert {k: (row["entries"], row["sizes"]) for k, row in kinds.items()} == {
        "jit": (2, {"dynamic": 1, "4": 1}), "aot": (2, {"4": 1, "2": 1})}
    assert kinds["aot"]["bytes"] == sum(DiskCache(str(tmp_path)).entries()[0][i].bytes for i in (1, 2))
    assert "weights" in kinds["aot"]["holds"]
    assert cli.main(["cache", "info", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "aot: 2 entries" in text and "(by size: 2: 1, 4: 1)" in text
    assert "jit: 2 entries" in text


@torch.no_grad()
def test_an_aot_compile_leaves_later_keys_alone(tmp_path):
    # AOTInductor writes its device facts into the config dict it finds; were that the
    # global default, every later key in the process would change (a warm process that
    # loads its packages instead would then miss every JIT piece compiled after them).
    from dynamo_sizebackend._torch import inductor

    gm = torch.fx.symbolic_trace(MLP())
    before = inductor.compile_environment_key(gm, [_x(2)])
    inductor.aot_compile_package(MLP(), [_x(2)], {"freezing": True}, str(tmp_path / "m.pt2"))
    assert torch._inductor.config.aot_inductor.metadata == {}
    assert inductor.compile_environment_key(gm, [_x(2)]) == before


class _Writer(torch.nn.Module):
    """Writes its result into a cache tensor the caller passes (as a KV cache update)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, cache):
        y = self.lin(x)
        cache[: x.shape[0]].copy_(y)
        return y * 2


@torch.no_grad()
def test_a_piece_that_writes_an_input_is_never_a_package(tmp_path):
    # torch 2.13's AOTInductor with freezing returns the right outputs but drops the
    # write to the input (checked by hand: the cache stayed zero). So such a piece
    # compiles on the JIT path, and the write happens.
    torch.manual_seed(0)
    model = _Writer().eval()
    # Only the batch dim dynamic: the cache's shape is static, so the write is the one
    # reason the size-4 piece is not packaged.
    compiled = torch.compile(model, backend="sizebackend",
                             options={**FREEZE, "cache_dir": str(tmp_path)})
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_skips={"frozen": 1}):
        for n in (3, 4):
            x = _x(n)
            if n == 3:
                torch._dynamo.mark_dynamic(x, 0)
            got, want = torch.zeros(8, 16), torch.zeros(8, 16)
            torch.testing.assert_close(compiled(x, got), model(x, want), **TOL)
            torch.testing.assert_close(got, want, **TOL)
            assert got[:n].abs().sum() > 0
    assert _kinds(tmp_path) == {"jit": 1}


def _serve_until_size_4(compiled, model):
    """Call at size 4 until the background thread has published it."""
    import time

    deadline = time.monotonic() + 300
    served = sb.stats().calls.get("4", 0)
    while sb.stats().calls.get("4", 0) == served:
        torch.testing.assert_close(compiled(_x(4)), model(_x(4)), **TOL)
        assert time.monotonic() < deadline, "background compile never finished"
        time.sleep(0.05)
    return compiled(_x(4))


@torch.no_grad()
def test_the_background_thread_loads_packages_but_never_builds_one(tmp_path):
    # torch's AOT compile sets process-wide is_compiling/is_exporting flags for its
    # whole duration, which change what the serving thread's compiled code does
    # ("inline" only: the worker's builds run in a process of their own).
    torch.manual_seed(0)
    model = MLP().eval()
    background = {"compile_mode": "background", "cache_dir": str(tmp_path), **FREEZE}
    compiled = compile_sb(model, **background)
    with sb.expect(cache_skips={"frozen": 1}, compiles={"dynamic": 1, 4: 1}):
        _serve_until_size_4(compiled, model)
    assert _kinds(tmp_path) == {"jit": 1}  # the size-4 piece compiled, not stored

    _restart()  # an eager start stores the package...
    _run(model, tmp_path)
    assert _kinds(tmp_path) == {"jit": 1, "aot": 1}
    _restart()  # ...which a background start then loads
    compiled = compile_sb(model, **background)
    with sb.expect(compiles={}, cache_hits=2):
        _serve_until_size_4(compiled, model)


@pytest.mark.parametrize("mode", ["eager", "background"])
@torch.no_grad()
def test_by_default_the_package_is_built_by_a_worker_while_the_jit_piece_serves(tmp_path, mode):
    """The real default (``store_frozen=True``): the cold start's size 4 is served by a
    JIT compile at once, the worker process stores its package, the restart loads it.
    A background start stores it too (the worker's AOT compile cannot touch the
    serving thread's process-wide flags)."""
    torch.manual_seed(0)
    model = MLP().eval()
    options = {**FREEZE, "store_frozen": True, "compile_mode": mode, "cache_dir": str(tmp_path)}
    before = sb.wait_for_packages()
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_misses=2, cache_hits=0, cache_skips={}):
        compiled = compile_sb(model, **options)
        torch.testing.assert_close(compiled(_x(3)), model(_x(3)), **TOL)
        cold = _serve_until_size_4(compiled, model)
    done = sb.wait_for_packages(timeout=300)
    assert (done.pending, done.failed - before.failed) == (0, 0), done.errors
    assert done.stored - before.stored == 1
    assert _kinds(tmp_path) == {"jit": 1, "aot": 1}

    # The running process takes the package on its next call of size 4, once.
    with sb.expect(compiles={}, cache_hits=1, cache_misses=0, calls={4: 1}):
        torch.testing.assert_close(compiled(_x(4)), model(_x(4)), **TOL)
    with sb.expect(compiles={}, cache_hits=0, calls={4: 1}):
        torch.testing.assert_close(compiled(_x(4)), model(_x(4)), **TOL)

    _restart()
    with sb.expect(compiles={}, cache_hits=2, cache_misses=0):
        compiled = compile_sb(model, **options)
        torch.testing.assert_close(compiled(_x(3)), model(_x(3)), **TOL)
        warm = _serve_until_size_4(compiled, model)
    torch.testing.assert_close(warm, cold, **TOL)


def test_the_worker_takes_on_the_state_the_piece_key_hashes():
    """The package is the code its key names: thread count and precision travel."""
    from dynamo_sizebackend.cache import package_worker

    threads = torch.get_num_threads()
    state = package_worker._runtime_state()
    assert state["threads"] == threads
    assert state["aot_torch_check"] is True
    try:
        package_worker._apply({**state, "threads": 1, "aot_torch_check": False})
        assert torch.get_num_threads() == 1
        assert os.environ["SIZEBACKEND_AOT_TORCH_CHECK"] == "0"
    finally:
        package_worker._apply(state)
        os.environ.pop("SIZEBACKEND_AOT_TORCH_CHECK", None)
    assert package_worker._runtime_state() == state


def test_the_worker_starts_quietly_and_ends_with_its_parent():
    """The worker's program, as the parent starts it: nothing on stderr (``-m`` of a
    module the package's ``__init__`` imports made runpy warn on every start), and it
    exits 0 once the parent's end of the socket closes."""
    import socket
    import subprocess
    import sys

    from dynamo_sizebackend.cache import package_worker

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-c", package_worker._WORKER_MAIN, str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    theirs.close()
    mine.close()
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err) == (0, "", "")
