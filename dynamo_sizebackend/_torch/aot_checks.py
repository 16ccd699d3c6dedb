"""The checks in AOTInductor's C++ kernels written as ``TORCH_CHECK``, as JIT kernels have them.

Why: a C++ kernel's checks come from ``CppKernel.assert_function`` (torch 2.13,
``codegen/cpp.py``): ``TORCH_CHECK`` for a JIT kernel, ``AOTI_TORCH_CHECK`` in AOT mode.
The two fail alike (``aoti_torch_check`` calls the same ``c10::detail::torchCheckFail``
that throws ``c10::Error``), but only ``TORCH_CHECK`` tells gcc that the failing branch
is unlikely and never returns (``C10_UNLIKELY``, a ``[[noreturn]]`` callee);
``AOTI_TORCH_CHECK`` is a plain ``if`` around a call gcc must assume returns, with the
message built inline. The C++ GEMM template puts one in its micro-kernel's dispatch
(``"Unsupported block_m"``), and that is enough to change gcc's inlining: measured on a
frozen 256 x 1024 linear at 4 rows (the template's 4 x 32 micro-kernel, one thread),
the AOT build called the micro-kernel out of line and stored its 8 accumulators to the
stack on every step of the K loop (``objdump``: 8 ``vmovaps %zmm, (%rsp)`` per FMA
group), 35-40 us per call against 26-28 us for the JIT build of the same source; the
same kernel source with ``TORCH_CHECK`` in place of ``AOTI_TORCH_CHECK``, built with the
AOT command, inlines it and keeps the accumulators in registers.

A package still links against libtorch (``-ltorch -ltorch_cpu``; the loader opens it
with ``RTLD_NOW``, so an unresolved ``torchCheckFail`` would fail the load, not a
check), and a ``c10::Error`` thrown inside ``run`` becomes the runner's error as
``aoti_torch_check``'s does. Only kernel code changes; the wrapper's own checks stay
``AOTI_TORCH_CHECK``.

Active on the thread inside :func:`torch_checks` (the backend's AOT compile of a piece);
every other AOT compile in the process gets Inductor's own choice.
``SIZEBACKEND_AOT_TORCH_CHECK=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import os

from .hooks import ThreadScopedHook

#: Kernel check macros chosen as ``TORCH_CHECK`` in AOT mode (what tests read).
COUNTS = {"replaced": 0}


def _install() -> None:
    from torch._inductor.codegen.cpp import CppKernel

    original = CppKernel.assert_function

    def assert_function(self) -> str:
        chosen = original.fget(self)
        if chosen == "AOTI_TORCH_CHECK" and _HOOK.active:
            COUNTS["replaced"] += 1
            return "TORCH_CHECK"
        return chosen

    CppKernel.assert_function = property(assert_function)


_HOOK = ThreadScopedHook(_install)


def enabled() -> bool:
    return os.environ.get("SIZEBACKEND_AOT_TORCH_CHECK", "1") != "0"


def torch_checks(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """AOT-mode C++ kernels rendered on this thread inside the block check with
    ``TORCH_CHECK``."""
    return _HOOK.scope(on and enabled())
