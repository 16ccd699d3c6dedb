import os
import tempfile

# Before torch's Inductor reads it: every test run compiles into a folder of its own.
_RUN_DIR = tempfile.mkdtemp(prefix="sizebackend-tests-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_RUN_DIR, "inductor"))
os.environ.setdefault("SIZEBACKEND_CACHE_DIR", os.path.join(_RUN_DIR, "sizebackend"))
# Sized pieces compile like the general ones unless a test asks for tuning: the CPU
# default (constant weights + max-autotune) benchmarks every GEMM shape with gcc builds,
# minutes per model on 2 cores. tests/compile/test_tuning.py checks the tuned path.
os.environ.setdefault("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "{}")

import pytest  # noqa: E402
import torch  # noqa: E402

import dynamo_sizebackend as sb  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with no cached graphs and zeroed counters."""
    torch._dynamo.reset()
    sb.reset_stats()
    yield
    torch._dynamo.reset()
    # No package build outlives its test (the real defaults hand frozen pieces to the
    # worker process): it would share the cores with the next test and write into a
    # tmp_path pytest removes.
    left = sb.wait_for_packages(timeout=900).pending
    assert left == 0, f"{left} package build(s) still running after 900 s"


@pytest.fixture
def real_defaults(monkeypatch):
    """The sized options a user gets (the measured default of the device), not the
    suite's ``{}`` above."""
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path


@pytest.fixture
def no_shared_pieces():
    """No piece served from the in-process table of compiled pieces: it is held weakly,
    so a piece an earlier test still keeps alive would turn this test's compiles into
    ``reused``."""
    from dynamo_sizebackend.cache import store

    store.forget_shared()
    yield
    store.forget_shared()


@pytest.fixture
def runners(monkeypatch, no_shared_pieces):
    """Every Runner the backend makes in the test, and how often a package piece runs
    from Python (``AotPiece.__call__``) rather than inside a chain."""
    from dynamo_sizebackend.cache import aot
    from dynamo_sizebackend.runtime import runner

    made: list[runner.Runner] = []
    init = runner.Runner.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(runner.Runner, "__init__", record)
    calls = {"pieces": 0}
    piece_call = aot.AotPiece.__call__

    def counted(self, *args):
        calls["pieces"] += 1
        return piece_call(self, *args)

    monkeypatch.setattr(aot.AotPiece, "__call__", counted)
    return made, calls
