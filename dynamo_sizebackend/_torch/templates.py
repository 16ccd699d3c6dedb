"""Inductor's Jinja kernel templates, parsed once per process instead of once per use.

Why: on CPU, every GEMM of a tuned sized piece renders Inductor's C++ GEMM template,
and each render parses its Jinja sources again (``KernelTemplate._template_from_string``
calls ``jinja2.Environment.from_string`` on every call, torch 2.13). Profiled on a cold
start of the built-in Llama (``tiny``, 2 layers, sized 2, 4, 8): 923 parses (12 distinct sources) took 13.7 s
of the sized compiles' 74 s under cProfile, though the sources repeat: the same
template text for every GEMM shape and size. A parsed ``jinja2.Template`` is immutable
and ``render`` takes all its data as arguments, so one parse per distinct source gives
the same code.

Installed by replacing that static method with a memoizing one (there is no hook for
it), active only on a thread inside :func:`memoized` (a sized compile of this
backend); every other caller in the process gets Inductor's own path. The memo holds at
most :data:`LIMIT` sources (templates whose text is built per call would otherwise
grow it without bound).
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

from .hooks import ThreadScopedHook

LIMIT = 256

_memo: OrderedDict[str, Any] = OrderedDict()
_memo_lock = threading.Lock()
#: Parses and memo hits on threads inside :func:`memoized` (what tests read).
COUNTS = {"parsed": 0, "reused": 0}


def _install() -> None:
    from torch._inductor.codegen.common import KernelTemplate

    parse = KernelTemplate._template_from_string

    def from_string(source: str) -> Any:
        if not _HOOK.active:
            return parse(source)
        with _memo_lock:
            template = _memo.get(source)
            if template is not None:
                _memo.move_to_end(source)
                COUNTS["reused"] += 1
                return template
        template = parse(source)
        if template is not None:  # None: jinja2 missing, Inductor's own answer
            with _memo_lock:
                COUNTS["parsed"] += 1
                _memo[source] = template
                while len(_memo) > LIMIT:
                    _memo.popitem(last=False)
        return template

    KernelTemplate._template_from_string = staticmethod(from_string)


_HOOK = ThreadScopedHook(_install)


def memoized(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Parse each distinct template source once on this thread inside the block."""
    return _HOOK.scope(on)
