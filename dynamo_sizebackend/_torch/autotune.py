"""Fewer GEMM candidates to benchmark where measurement says which one wins.

On CPU, max-autotune offers two candidates for each GEMM of a frozen piece: Inductor's
C++ GEMM template and ATen's (oneDNN packed) linear. Benchmarking them is most of a
cold sized compile's extra cost: each C++ candidate is built with gcc to be timed
(about 2.6 s each on this machine), once per distinct GEMM shape and size. Measured on
this machine (1 thread, every candidate's time, ``benchmarks/bench_tuning.py
--winners``; the built-in Llama ``small`` at sizes 2-16 and a d-256 SDPA transformer at
32-256 rows): the template won every GEMM of at most 4 rows, by 2.2-5.6x; ATen won
every GEMM of 16 rows or more, by 1.2-2.4x; at 8 rows each won some. So with
``prune_autotune`` (the default) a GEMM of at most :data:`TEMPLATE_ONLY_MAX_ROWS` rows
keeps only the template candidates, one of :data:`ATEN_ONLY_MIN_ROWS` rows or more only
ATen's, and those between are benchmarked as before; a single candidate left is taken
without benchmarking (Inductor's own rule). Only CPU choices with both kinds present are
touched; GPU choices never.

Installed as one of Inductor's autotune preprocessing functions
(``select_algorithm.add_preprocessing_fn``), active only on a thread inside
:func:`pruning` (a sized compile of this backend): other ``torch.compile`` users in the
process keep Inductor's full search.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any

from .hooks import ThreadScopedHook

TEMPLATE_ONLY_MAX_ROWS = 4
ATEN_ONLY_MIN_ROWS = 16
#: The config key that asks for pruning (stripped before Inductor sees the config; a
#: piece key includes it, so pruned and unpruned compiles never share an artifact).
OPTION = "sizebackend_prune_autotune"

#: Decisions taken, by outcome (``"template"``, ``"aten"``: pruned to that kind;
#: ``"both"``: benchmarked as Inductor would): what tests and ``--winners`` read.
DECISIONS: Counter[str] = Counter()

def _rows(choice: Any) -> int | None:
    """The output rows (all dims but the last) of a GEMM choice, ``None`` if symbolic."""
    try:
        size = list(choice.layout.size)
        if getattr(choice.layout.device, "type", None) != "cpu" or len(size) < 2:
            return None
        return math.prod(int(s) for s in size[:-1])
    except (AttributeError, TypeError, ValueError):
        return None


def _is_aten(choice: Any) -> bool:
    from torch._inductor.select_algorithm import ExternKernelCaller

    return isinstance(getattr(choice, "_wrapped", choice), ExternKernelCaller)


def prune(choices: list[Any]) -> list[Any]:
    """The candidates worth benchmarking (see the module docstring)."""
    if not _HOOK.active or len(choices) < 2:
        return choices
    aten = [c for c in choices if _is_aten(c)]
    template = [c for c in choices if not _is_aten(c)]
    if not aten or not template:
        return choices
    rows = _rows(choices[0])
    if rows is None:
        return choices
    if rows <= TEMPLATE_ONLY_MAX_ROWS:
        DECISIONS["template"] += 1
        return template
    if rows >= ATEN_ONLY_MIN_ROWS:
        DECISIONS["aten"] += 1
        return aten
    DECISIONS["both"] += 1
    return choices


def _install() -> None:
    from torch._inductor import select_algorithm

    select_algorithm.add_preprocessing_fn(prune)


_HOOK = ThreadScopedHook(_install)


def pruning(on: bool) -> contextlib.AbstractContextManager[None]:
    """Prune this thread's autotune candidates inside the block when ``on``."""
    return _HOOK.scope(on)


def split(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``options`` without this module's key, and whether it asks for pruning."""
    rest = {k: v for k, v in options.items() if k != OPTION}
    return rest, bool(options.get(OPTION))
