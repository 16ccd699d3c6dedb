"""Inductor's GEMM template candidates built with the precompiled header its kernels use.

Why: to benchmark a C++ GEMM template candidate (max-autotune on CPU, the sized pieces'
default at 5 to 15 rows, see :mod:`.autotune`), Inductor builds it as a module of its
own through ``CppCodeCache`` (``CppBenchmarkRequest.precompile``, torch 2.13), whose
builds get no precompiled header (``CppCodeCache._get_uncompiled_header`` returns
``None``; only the Python-binding kernel modules get one), although every candidate's
source starts with ``#include <torch/csrc/inductor/cpp_prefix.h>``, the header those
kernel modules precompile. gcc then parses that header (ATen's vectorized headers)
again for every candidate. Logged with a gcc wrapper on a cold start of the built-in
Llama (``tiny``, 2 layers, sizes 1, 2, 4, 8): 12 candidate builds of about 3.5 s each
against about 1.6 s for a kernel module with the header precompiled. With this hook
(Inductor's own ``_precompile_header``, keyed by the candidates' own command line, so
one more header build per cache folder) the size-8 compile took 18.0 and 29.9 s against
27.8 and 41.0 s without, alternated processes on empty caches (a shared, loaded
machine). The code built is the same: the precompiled header is the header the
source includes first, built with the same flags, and gcc falls back to parsing it
if the two ever disagree.

Active while any thread is inside :func:`precompiled` (a sized compile of this
backend holds Dynamo's compile lock, so no other ``torch.compile`` compiles meanwhile);
the candidates are built on Inductor's precompile thread pool, hence process-wide.
"""
from __future__ import annotations

import contextlib

from .hooks import ProcessScopedHook

#: Candidate builds given the header while active (what tests read).
COUNTS = {"given": 0}


def _install() -> None:
    from torch._inductor import codecache

    base = codecache.CppCodeCache
    header_of = base._get_uncompiled_header.__func__

    def uncompiled_header(cls, device: str) -> str | None:
        if cls is base and _HOOK.active:
            header = codecache._get_cpp_prefix_header(device)
            if header:
                COUNTS["given"] += 1
            return header
        return header_of(cls, device)

    base._get_uncompiled_header = classmethod(uncompiled_header)


_HOOK = ProcessScopedHook(_install)


def precompiled(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Build Inductor's benchmark candidates with the precompiled header inside the
    block."""
    return _HOOK.scope(on)
