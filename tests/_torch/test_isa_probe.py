"""_torch.isa_probe: Inductor's vector-ISA probe (a child Python per ISA, per process)
is run once per machine and library; later processes take the written-down answer and
start no child, and pick the same ISAs. Each case is a fresh process: torch caches the
probe's result for the life of a process."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dynamo_sizebackend._torch import isa_probe

#: Every script's start: counts the Python children it starts (the probes).
_COUNT_CHILDREN = r"""
import json, subprocess, sys
from dynamo_sizebackend._torch import isa_probe

children = []
real_run = subprocess.run
def counting_run(cmd, *args, **kwargs):
    if isinstance(cmd, (list, tuple)) and cmd and cmd[0] == sys.executable:
        children.append(cmd)
    return real_run(cmd, *args, **kwargs)
subprocess.run = counting_run
"""

#: Inductor's probe alone, inside the hook's scope.
_CHILD = _COUNT_CHILDREN + r"""
from torch._inductor import cpu_vec_isa

if sys.argv[1] == "failing":  # every child fails to load its library
    cpu_vec_isa.VecISA._probe_load = lambda self, path: False
with isa_probe.remembered():
    isas = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"isas": isas, "counts": isa_probe.COUNTS, "children": len(children)}))
"""

#: A user's process: a small model through the backend with its real defaults (the
#: suite's SIZEBACKEND_SIZED_INDUCTOR_OPTIONS removed: size 2 frozen and autotuned).
_BACKEND_CHILD = _COUNT_CHILDREN + r"""
import torch
import dynamo_sizebackend as sb

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
compiled = torch.compile(model.eval(), backend="sizebackend", dynamic=True,
                         options={"compile_sizes": [2], "cache_dir": sys.argv[1]})
with torch.no_grad():
    for n in (3, 2):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), model(x))
sb.wait_for_packages()
s = sb.stats()
print(json.dumps({"counts": isa_probe.COUNTS, "children": len(children),
                  "compiles": s.compiles, "cache_hits": s.cache_hits}))
"""


def _probe_in_child(inductor_dir, arg="normal", script=_CHILD, **env):
    """``script``'s last line of JSON, run with ``arg`` (``_CHILD``: its mode;
    ``_BACKEND_CHILD``: its cache_dir)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), **env)
    env.pop("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", None)  # the real defaults
    done = subprocess.run([sys.executable, "-c", script, arg], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def _built(tmp_path_factory):
    """An Inductor cache folder holding the probe libraries (built once: gcc, seconds per
    ISA) and no written-down answer; what the first probing process of the module saw."""
    folder = tmp_path_factory.mktemp("isa_built")
    return folder, _probe_in_child(folder, SIZEBACKEND_REMEMBER_ISA_PROBE="0")


@pytest.fixture
def inductor_dir(_built, tmp_path):
    """A copy of the built folder: libraries there, nothing remembered yet."""
    copy = tmp_path / "inductor"
    shutil.copytree(_built[0], copy)
    assert _marks(copy) == []
    return copy


def _marks(inductor_dir):
    folder = inductor_dir / "sizebackend" / "isa_probe"
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_second_process_takes_the_answer_and_starts_no_child(inductor_dir):
    first = _probe_in_child(inductor_dir)
    if not first["isas"]:
        pytest.skip("this CPU has no vector ISA for Inductor to probe")
    # The first process probed each ISA its CPU allows in a child of its own...
    assert first["children"] >= len(first["isas"])
    assert first["counts"] == {"remembered": 0, "probed": first["children"]}
    assert len(_marks(inductor_dir)) == first["children"]
    # ...the second takes every answer and picks the same ISAs, in the same order.
    second = _probe_in_child(inductor_dir)
    assert second["isas"] == first["isas"]
    assert second["children"] == 0
    assert second["counts"] == {"remembered": first["children"], "probed": 0}


@pytest.mark.inductor
def test_through_the_backend_with_its_real_defaults(_built, inductor_dir, tmp_path):
    """As a user runs it: a cold process compiles (the general pieces and the frozen,
    autotuned size 2) and probes once; its restart loads and starts no probe child."""
    if not _built[1]["isas"]:
        pytest.skip("this CPU has no vector ISA for Inductor to probe")
    cache = str(tmp_path / "sizebackend")
    cold = _probe_in_child(inductor_dir, cache, script=_BACKEND_CHILD)
    assert cold["compiles"] == {"dynamic": 1, "2": 1}
    assert cold["counts"] == {"remembered": 0, "probed": cold["children"]}
    assert cold["children"] >= len(_built[1]["isas"])
    warm = _probe_in_child(inductor_dir, cache, script=_BACKEND_CHILD)
    assert warm["compiles"] == {} and warm["cache_hits"] == 2
    assert warm["children"] == 0
    assert warm["counts"] == {"remembered": cold["children"], "probed": 0}


def test_failed_probe_is_not_written_down(inductor_dir):
    failed = _probe_in_child(inductor_dir, "failing")
    assert failed["isas"] == []
    assert failed["counts"] == {"remembered": 0, "probed": 0}
    assert _marks(inductor_dir) == []
    # The next process probes again (the failure may have been load, not the CPU).
    again = _probe_in_child(inductor_dir)
    assert again["counts"]["remembered"] == 0
    assert again["children"] == again["counts"]["probed"]


def test_switched_off_by_environment(_built, inductor_dir):
    first = _built[1]  # the fixture's process ran with the switch off
    if not first["isas"]:
        pytest.skip("this CPU has no vector ISA for Inductor to probe")
    second = _probe_in_child(inductor_dir, SIZEBACKEND_REMEMBER_ISA_PROBE="0")
    assert _marks(inductor_dir) == []
    assert second["isas"] == first["isas"]
    assert second["children"] == first["children"] >= 1
    assert second["counts"] == {"remembered": 0, "probed": 0}


class _Isa:
    def __init__(self, name, flags):
        self.name, self.flags = name, flags

    def __str__(self):
        return self.name

    def build_arch_flags(self):
        return self.flags

    def build_macro(self):
        return [f"CPU_CAPABILITY_{self.name.upper()}"]


@pytest.mark.skipif(isa_probe._cpu_description() is None, reason="no /proc/cpuinfo flags")
def test_key_is_the_library_the_isa_and_the_loader(tmp_path):
    library = tmp_path / "probe.so"
    library.write_bytes(b"\x7fELF one")
    env = {"LD_LIBRARY_PATH": "/torch/lib"}
    key = isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(library), env, "script")
    assert key == isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(library), env, "script")
    others = [
        isa_probe.probe_key(_Isa("avx512", "-mavx2"), str(library), env, "script"),
        isa_probe.probe_key(_Isa("avx2", "-mavx512f"), str(library), env, "script"),
        isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(library), {"LD_LIBRARY_PATH": "/x"},
                            "script"),
        isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(library), env, "another script"),
    ]
    library.write_bytes(b"\x7fELF two")
    others.append(isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(library), env, "script"))
    assert None not in others and len({key, *others}) == 1 + len(others)
    assert isa_probe.probe_key(_Isa("avx2", "-mavx2"), str(tmp_path / "gone.so"), env,
                               "script") is None
