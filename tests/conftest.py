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
