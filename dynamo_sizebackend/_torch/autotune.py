"""Fewer GEMM candidates to benchmark where measurement says which one wins.

On CPU, max-autotune offers two candidates for each GEMM of a frozen piece: Inductor's
C++ GEMM template and ATen's (oneDNN packed) linear. Benchmarking them is most of a
cold sized compile's extra cost: each C++ candidate is built with gcc to be timed
(about 2.6 s each on this machine, 1.6 s with the precompiled header), once per
distinct GEMM shape and size. Measured on this machine (every candidate's time,
``benchmarks/bench_tuning.py --winners``):

- 2026-12-04, Llama ``small`` at 2-16 rows, a d-256 SDPA transformer at 32-256 rows:
  the template won every GEMM of at most 4 rows, by 2.2-5.6x; ATen every GEMM of 16
  rows or more, by 1.2-2.4x; at 8 rows each won some.
- 2026-12-05 (another machine of this kind), single frozen linears, K x N up to
  512 x 8192 (a Hugging Face Llama's ``lm_head``): at 1-2 rows the template won every
  weight of up to 1408 x 512 (0.7 M elements) by 1.5-3.9x, but at 1 row ATen won the
  512 x 8192 one by 1.49x (the template won it at 2 rows by 1.22x); at 4 rows the
  template won weights of up to 512 x 512 by 1.26-1.35x (and 256 x 128, 256 x 256 of
  Llama ``small`` by 1.5-2.5x) while ATen won 512 x 1408, 1408 x 512 and 512 x 8192 by
  1.18-1.24x (and 256 x 512, 256 x 1024 by 1.07-1.22x). The 4-row rule of the first
  measurement (template only) lost on those. At 8 rows the template won every weight of
  at most 256 x 128 (32 K elements; the built-in Llama ``tiny``'s, 64 x 32 to 64 x 256)
  by 1.5-4.8x: ATen's packed linear costs about 14 us per call at these sizes whatever
  the weight, the template's cost follows the work; 256 x 256 went either way (template
  1.95x in one run, ATen 1.12x in another).

So with ``prune_autotune`` (the default) a GEMM keeps only the template candidates where
every measurement had it win by a wide margin (:data:`TEMPLATE_ONLY`: at most 2 rows and
a weight of at most 2**20 elements, 4 rows and 2**16, or 8 rows and 2**15), only ATen's at
:data:`ATEN_ONLY_MIN_ROWS` rows or more, and is benchmarked as before everywhere else;
a single candidate left is taken without benchmarking (Inductor's own rule). Only CPU
choices with both kinds present are touched; GPU choices never.

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

#: ``(rows, weight elements)``: a GEMM of at most that many rows and a K x N weight of at
#: most that many elements keeps only the template candidates.
TEMPLATE_ONLY = ((2, 1 << 20), (4, 1 << 16), (8, 1 << 15))
ATEN_ONLY_MIN_ROWS = 16
#: The config key that asks for pruning (stripped before Inductor sees the config; a
#: piece key includes it, so pruned and unpruned compiles never share an artifact).
OPTION = "sizebackend_prune_autotune"

#: Decisions taken, by outcome (``"template"``, ``"aten"``: pruned to that kind;
#: ``"both"``: benchmarked as Inductor would): what tests and ``--winners`` read.
DECISIONS: Counter[str] = Counter()

def _shape(choice: Any) -> tuple[int, int | None] | None:
    """``(rows, K x N)`` of a CPU GEMM choice: its output rows (all dims but the last) and
    its weight's elements (``None`` where K cannot be read); ``None`` if symbolic."""
    try:
        size = list(choice.layout.size)
        if getattr(choice.layout.device, "type", None) != "cpu" or len(size) < 2:
            return None
        rows = math.prod(int(s) for s in size[:-1])
    except (AttributeError, TypeError, ValueError):
        return None
    try:  # the activation is the first input, [..., K]
        k = int(choice.input_nodes[0].get_size()[-1])
        return rows, k * int(size[-1])
    except (AttributeError, IndexError, TypeError, ValueError):
        return rows, None


def decide(rows: int, weight: int | None) -> str:
    """``"template"``, ``"aten"`` or ``"both"`` (benchmark) for a GEMM of ``rows`` rows
    and a weight of ``weight`` elements (``None``: unknown)."""
    if rows >= ATEN_ONLY_MIN_ROWS:
        return "aten"
    if weight is not None and any(rows <= r and weight <= w for r, w in TEMPLATE_ONLY):
        return "template"
    return "both"


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
    shape = _shape(choices[0])
    if shape is None:
        return choices
    decision = decide(*shape)
    DECISIONS[decision] += 1
    return {"template": template, "aten": aten, "both": choices}[decision]


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
