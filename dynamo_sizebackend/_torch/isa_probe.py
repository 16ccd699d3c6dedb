"""Inductor's vector-ISA probe, remembered per machine: one less second per process start.

Why: before Inductor builds or loads its first C++ kernel in a process it picks the
vector ISA (``cpu_vec_isa.valid_vec_isa_list``, torch 2.13). For every ISA the CPU's
flags allow, it builds a small library once (kept in its cache folder) and then, in
*every* process, starts a fresh Python interpreter that ``dlopen``s it
(``VecISA._probe_load``), so that a compiler and CPU that disagree kill a child, not
the caller. On this machine that is 3 children and 1.1 s of a 5.6 s warm restart of the
built-in Llama (cProfile: ``subprocess._wait`` under ``valid_vec_isa_list``), paid by
``torch.compile``'s own warm restart as much as by ours.

The child's answer depends on the library it loads, the CPU, and how the child is
started; none of them changes between two processes on one machine. So a successful
probe is written down under a key of exactly those (the library's bytes, the ISA and
its flags, the CPU's model and flags and the kernel release, the Python and torch that
start the child, the loader path, the probe script) in
``<Inductor cache>/sizebackend/isa_probe/``, and a later process with the same key
takes the answer instead of starting the child. A failed or timed-out probe is never
written down (it may be load, not the CPU): the next process probes again. Other
platforms than Linux, or a CPU description that cannot be read, probe as torch does.

Active while any thread is inside :func:`remembered` (the backend's key, compile and
load steps; the first of them in a process is where Inductor probes, once: the result
is cached in the process by torch). ``SIZEBACKEND_REMEMBER_ISA_PROBE=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys

from ..filelock import write_atomically
from .hooks import ProcessScopedHook

log = logging.getLogger("dynamo_sizebackend")

#: Probes answered from the folder and probes run and written down (what tests read).
COUNTS = {"remembered": 0, "probed": 0}


def cpu_fields() -> dict[str, str]:
    """Model name, vendor, family, model and flags of the first CPU in ``/proc/cpuinfo``
    (Linux); ``{}`` where there is none to read."""
    if not sys.platform.startswith("linux"):
        return {}
    wanted = ("model name", "flags", "vendor_id", "cpu family", "model")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                name, _, value = line.partition(":")
                name = name.strip()
                if name in wanted:
                    found[name] = value.strip()
    except OSError:
        return {}
    return found


def _cpu_description() -> str | None:
    """:func:`cpu_fields` as one text, or ``None`` without the flags."""
    found = cpu_fields()
    if "flags" not in found:
        return None
    return "\n".join(f"{k}={found[k]}" for k in sorted(found))


def probe_key(isa, library: str, env: dict[str, str], script: str) -> str | None:
    """The key a probe of ``library`` for ``isa`` is remembered under; ``None`` where it
    cannot be made (no CPU description, the library unreadable)."""
    import torch

    cpu = _cpu_description()
    if cpu is None:
        return None
    h = hashlib.sha256()
    try:
        with open(library, "rb") as f:
            h.update(f.read())
    except OSError:
        return None
    for part in (str(isa), repr(isa.build_arch_flags()), repr(isa.build_macro()), cpu,
                 platform.release(), platform.machine(), sys.executable, sys.version,
                 torch.__version__, os.path.dirname(torch.__file__),
                 env.get("LD_LIBRARY_PATH", ""), env.get("LD_PRELOAD", ""), script):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def _folder() -> str:
    from .inductor import inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "sizebackend", "isa_probe")


def _install() -> None:
    from torch._inductor import cpu_vec_isa

    base = cpu_vec_isa.VecISA
    probe = base._probe_load

    def remembering_probe(self, output_path: str) -> bool:
        if not _HOOK.active:
            return probe(self, output_path)
        try:  # torch 2.13's names; another torch without them probes as torch does
            key = probe_key(self, output_path, self._build_probe_env(), base._avx_py_load)
        except Exception as e:  # noqa: BLE001 - never fail the probe for our bookkeeping
            log.debug("sizebackend: vector ISA probe not remembered (%s)", e)
            key = None
        if key is None:
            return probe(self, output_path)
        mark = os.path.join(_folder(), key)
        if os.path.exists(mark):
            COUNTS["remembered"] += 1
            log.debug("sizebackend: vector ISA %s: probe of %s remembered (%s)", self,
                      output_path, mark)
            return True
        ok = probe(self, output_path)
        if ok:
            COUNTS["probed"] += 1
            _write_mark(mark)
        return ok

    base._probe_load = remembering_probe


def _write_mark(mark: str) -> None:
    """Create ``mark`` atomically; a folder that cannot be written only costs the next
    process its probe."""
    try:
        write_atomically(mark, "loaded\n")
    except OSError as e:
        log.debug("sizebackend: cannot remember the vector ISA probe in %s (%s)", mark, e)


_HOOK = ProcessScopedHook(_install)


def remembered(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside the block, Inductor's ISA probes are answered from (and written to) the
    folder the module docstring names (unless ``SIZEBACKEND_REMEMBER_ISA_PROBE=0``)."""
    return _HOOK.scope(on and os.environ.get("SIZEBACKEND_REMEMBER_ISA_PROBE", "1") != "0")
