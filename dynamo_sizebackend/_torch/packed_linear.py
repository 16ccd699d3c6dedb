"""Which packed linear a frozen sized piece calls: oneDNN's or MKL's, by measurement.

When Inductor freezes a float32 linear on an x86 CPU it packs the weight for one of two
libraries (``fx_passes/mkldnn_fusion.py``): MKL (``mkl._mkl_linear``) where the row count
is a static number and the compile is JIT, oneDNN (``mkldnn._linear_pointwise``) where
the rows are symbolic or the compile is AOT. A listed size's pieces are static, so JIT
they get MKL's and stored as packages oneDNN's. Which is faster depends on the CPU, by
a lot:

- 2026-12-05 (this kind of machine, an earlier CPU): at 39 rows the JIT pieces (MKL)
  beat the packages (oneDNN) by about 15% of a Llama ``small`` step.
- 2026-12-06 (AMD family 26, AVX-512): MKL's sgemm is 1.5-4x slower than oneDNN's at 2-64
  rows (K x N from 256 x 256 to 512 x 8192, one thread; e.g. 16 x 256 x 1024: 110 us
  against 52 us); only at one row does MKL win (12 us against 21 us at 256 x 768). A
  d-256 SDPA transformer's size-4 pieces ran at 1888 us per call JIT against 1106 us
  for torch's own frozen ``specialize_on`` graph (oneDNN's).

So inside this backend's sized compiles every static float32 GEMM shape (rows, K, N) is
timed once per process with both libraries on random data (the threads the process
runs with), and oneDNN's packing is taken where it is faster by :data:`MARGIN`, else
torch's own choice stands. ``SIZEBACKEND_PACKED_LINEAR=torch`` leaves every choice to
torch. Other callers of Inductor in the process are not touched (a thread-scoped hook,
like ``_torch/autotune.py``'s). A frozen piece is never served from Inductor's FX graph
cache (it skips graphs with frozen constants), so a choice is never read back stale.

A third kernel for those static GEMMs, ours (``sizebackend::panel_linear``,
``csrc/panel_linear.cpp``): a weight packed at compile time in panels of 16 columns and
register tiles of a few rows, which at 1 to 32 rows runs in 0.4-0.9x oneDNN's time on
the AMD EPYC family 25. A GEMM takes it where it is measured under :data:`PANEL_MARGIN` of
both libraries (:func:`panels_faster`, once per machine), except where max-autotune's
C++ template wins anyway (:func:`_template_wins`). ``SIZEBACKEND_PANEL_LINEAR=0``
switches it off alone.

The same question for the pieces that are not frozen (``compile/linears.py``): from how
many rows oneDNN's GEMM on a weight packed at run time beats aten's unpacked ``linear``
(:func:`runtime_min_rows`). That answer is part of the piece's graph (an argument of
``sizebackend::packed_linear``), so a piece compiled on another CPU, or with another
answer, has another cache key.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections import Counter
from typing import Any, Callable

import torch

from ..filelock import lock_within, write_atomically
from .hooks import ThreadScopedHook

log = logging.getLogger(__name__)

#: oneDNN is taken where it runs in less than this share of MKL's time: a near tie
#: keeps torch's choice, so timing noise cannot flip a decision from run to run.
MARGIN = 0.9
#: ``panel_linear`` is taken where it runs in less than this share of both libraries'
#: time. Nearer 1 than :data:`MARGIN`: the answer is written down once per machine, so
#: noise cannot flip it from run to run, and where it ties the choice costs little.
PANEL_MARGIN = 0.95
#: Seconds of calls per kernel and shape in one batch when timing.
BUDGET_S = 0.005
#: Batches per kernel and shape; the best one counts.
ROUNDS = 5

#: Decisions taken in this process, by library (``"onednn"``, ``"mkl"``): what tests read.
DECISIONS: Counter[str] = Counter()


def enabled() -> bool:
    return os.environ.get("SIZEBACKEND_PACKED_LINEAR", "measure") != "torch"


def _paired_seconds(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[float, float]:
    """Seconds per call of each: the best of :data:`ROUNDS` batches of about
    :data:`BUDGET_S` each, the two kernels' batches taking turns, so that a slow stretch
    of a shared machine (another process, a frequency change) falls on both rather than
    on all batches of one (one kernel's batches run back to back gave ratios off by 30%
    now and then: 2026-12-07, AMD EPYC family 25)."""
    def per_batch(call):
        call()
        start = time.perf_counter()
        call()
        once = max(time.perf_counter() - start, 1e-7)
        return max(1, min(1000, int(BUDGET_S / once)))

    counts = per_batch(first), per_batch(second)
    best = [float("inf"), float("inf")]
    for _ in range(ROUNDS):
        for i, call in enumerate((first, second)):
            start = time.perf_counter()
            for _ in range(counts[i]):
                call()
            best[i] = min(best[i], (time.perf_counter() - start) / counts[i])
    return best[0], best[1]


@functools.lru_cache(maxsize=None)
def onednn_faster(rows: int, k: int, n: int) -> bool:
    """Whether oneDNN's packed linear runs ``rows x k`` by a ``k x n`` float32 weight in
    under :data:`MARGIN` of MKL's time on this CPU (measured once per shape)."""
    # Called inside a compile: real tensors, outside its fake mode.
    with torch.utils._python_dispatch._disable_current_modes():
        return _measure(rows, k, n)


def _measure(rows: int, k: int, n: int) -> bool:
    return _ratio(rows, k, n, "onednn", "mkl") < MARGIN


#: How :func:`_ratio` calls each kernel on ``(x, weight, bias, rows)``, the weight N x K
#: (what the packing ops take); each returns the zero-argument call to time.
def _onednn_call(x, weight, bias, rows):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _mkl_call(x, weight, bias, rows):
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return lambda: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _aten_call(x, weight, bias, rows):
    return lambda: torch.nn.functional.linear(x, weight, bias)


def _panels_call(x, weight, bias, rows):
    packed, n = torch.ops.sizebackend.pack_panels(weight), weight.shape[0]
    return lambda: torch.ops.sizebackend.panel_linear(x, packed, bias, n)


_KERNELS = {
    "onednn": ("oneDNN packed", _onednn_call),
    "mkl": ("MKL packed", _mkl_call),
    "aten": ("aten unpacked", _aten_call),
    "panels": ("panel_linear", _panels_call),
}


def _ratio(rows: int, k: int, n: int, kernel: str, other: str) -> float:
    """``kernel``'s time over ``other``'s (names of :data:`_KERNELS`) for ``rows x k`` by
    a ``k x n`` float32 weight (random data, the process's threads; timed in turns)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    with torch.no_grad():
        t_other, t_kernel = _paired_seconds(_KERNELS[other][1](x, weight, bias, rows),
                                            _KERNELS[kernel][1](x, weight, bias, rows))
    log.debug("linear %d x %d x %d: %s %.1f us, %s %.1f us", rows, k, n, _KERNELS[kernel][0],
              t_kernel * 1e6, _KERNELS[other][0], t_other * 1e6)
    return t_kernel / t_other


#: Row counts at which :func:`runtime_min_rows` times a weight shape.
RUNTIME_ROWS = (1, 2, 4, 16, 64)


@functools.lru_cache(maxsize=None)
def runtime_min_rows(k: int, n: int) -> int | None:
    """The fewest rows from which ``sizebackend::packed_linear`` (oneDNN's GEMM on a
    weight packed once) pays for a ``k x n`` float32 linear against aten's unpacked
    ``linear``, by :func:`_least_rows`'s rule on both kernels' times at each count of
    :data:`RUNTIME_ROWS`; ``None`` where it never does. A near tie decides nothing there:
    a tie at 64 rows cannot cancel clear wins at 2 to 16, nor a 0.85-0.93 at 2 rows move
    the start to 4 (measured 2026-12-07 on an AMD EPYC family 25, one thread: 256 x 768
    ran at 0.79-0.93 / 0.81 / 0.85 of aten's time at 2 / 4 / 16 rows and at 0.88 to 0.93
    at 64; the rule before asked for a win by the margin at every count from the
    threshold up and answered ``None`` in 9 measurements of 10).

    Measured once per machine, not per process: the answer is part of the piece's graph,
    so processes that share a cache folder must agree on it, or a server's workers
    starting together (each timing on cores the others load) would compile different
    pieces, miss each other's cache entries and run different code. The first process
    to ask measures under a lock and writes the answer down in
    ``<Inductor cache>/sizebackend/linear_rows/``, keyed by the CPU, torch, the thread
    count and the rule; the others wait for it and read it. Where that folder cannot be
    used, each process measures for itself."""
    if not torch.backends.mkldnn.is_available():
        return None
    return _remembered(k, n, "", "min_rows", lambda v: v is None or _is_int(v),
                       lambda: _measure_min_rows(k, n))


_MISSING = object()
#: Seconds a process waits for another one's measurement before measuring itself.
LOCK_WAIT_S = 120.0


def _measure_min_rows(k: int, n: int) -> int | None:
    with torch.utils._python_dispatch._disable_current_modes():
        ratios = [_runtime_ratio(rows, k, n) for rows in RUNTIME_ROWS]
    return _least_rows(ratios)


#: What :func:`_least_rows` asks, part of the key its answers are written down under.
RULE = "a win by MARGIN with no loss over 1/MARGIN above; from the first count not lost"


def _least_rows(ratios: list[float]) -> int | None:
    """Where run-time packing starts, from oneDNN's time over aten's at each count of
    :data:`RUNTIME_ROWS` (``ratios``): of the counts above the highest one where oneDNN
    loses by more than ``1 / MARGIN`` (all of them where it never does), the fewest rows
    at which it is not slower (under 1.0), provided it wins by :data:`MARGIN` at one of
    them at least; else ``None``. The threshold falls where the two kernels tie, so a
    noisy measurement moves it only between counts where the choice costs nothing."""
    least, pays = None, False
    for rows, ratio in zip(reversed(RUNTIME_ROWS), reversed(ratios)):
        if ratio > 1 / MARGIN:
            break
        pays = pays or ratio < MARGIN
        if ratio < 1.0:
            least = rows
    return least if pays else None


@functools.cache
def _kernels_id() -> str:
    """The build of our kernels (a hash of the extension library, read once a process):
    answers written down by another build, whose panel kernel may be faster or slower,
    are measured again (the AVX2 copy of 2026-12-07 ran 12x faster than the one before)."""
    import hashlib

    from .. import _C

    h = hashlib.sha256()
    try:
        with open(_C.__file__, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except (OSError, AttributeError):
        return "unknown"
    return h.hexdigest()


def _remembered_path(k: int, n: int, what: str = "") -> str | None:
    """Where the answer for ``k x n`` on this machine is written down (``what``: which
    question, empty for :func:`runtime_min_rows`'s); ``None`` without a CPU description
    to key it on. The key holds what decides the timings: the CPU, torch, the thread
    count, ATen's CPU capability (``ATEN_CPU_CAPABILITY`` picks aten's kernels and our
    panels' copy), our kernels' build and the rule's constants."""
    import hashlib

    from .inductor import inductor_cache_dir
    from .isa_probe import _cpu_description

    cpu = _cpu_description()
    if cpu is None:
        return None
    h = hashlib.sha256()
    for part in (cpu, torch.__version__, str(torch.get_num_threads()),
                 torch.backends.cpu.get_cpu_capability(), _kernels_id(), str(RUNTIME_ROWS),
                 str(MARGIN), str(PANEL_MARGIN), RULE, str(BUDGET_S), str(ROUNDS), f"{k}x{n}"):
        h.update(b"\0" + part.encode())
    if what:
        h.update(b"\0" + what.encode())
    return os.path.join(inductor_cache_dir(), "sizebackend", "linear_rows", h.hexdigest())


@contextlib.contextmanager
def _machine_lock(path: str):
    """An exclusive ``flock`` on ``path`` (released by the OS however its holder exits),
    waited for up to :data:`LOCK_WAIT_S`; without it (a folder that cannot hold the
    file, a holder that takes too long) the block runs unlocked."""
    fd = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not lock_within(fd, LOCK_WAIT_S):
            log.info("sizebackend: another process has measured %s for over %.0f s; "
                     "measuring here too", path, LOCK_WAIT_S)
    except OSError as e:
        log.debug("sizebackend: no lock for %s (%s)", path, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _remembered(k: int, n: int, what: str, name: str, valid: Callable[[Any], bool],
                measure: Callable[[], Any]) -> Any:
    """The answer to ``what`` (empty for :func:`runtime_min_rows`'s) for ``k x n`` on this
    machine: read back where another process wrote a ``valid`` one down under ``name``,
    else measured under the lock and written down (measured here alone where there is
    no folder to write it in)."""
    path = _remembered_path(k, n, what)
    if path is None:
        return measure()
    with _machine_lock(path + ".lock"):
        found = _read_answer(path, name)
        if found is not _MISSING and valid(found):
            return found
        value = measure()
        _write_answer(path, name, value)
        return value


def _read_answer(path: str, name: str) -> Any:
    """The value written under ``name`` at ``path``, or :data:`_MISSING`."""
    try:
        with open(path) as f:
            return json.load(f)[name]
    except (OSError, ValueError, KeyError, TypeError):
        return _MISSING


def _write_answer(path: str, name: str, value: Any) -> None:
    try:
        write_atomically(path, json.dumps({name: value}))
    except OSError as e:
        log.debug("sizebackend: cannot write down %s (%s)", path, e)


def _runtime_ratio(rows: int, k: int, n: int) -> float:
    return _ratio(rows, k, n, "onednn", "aten")


def runtime_panel_rows(k: int, n: int) -> int:
    """Up to how many rows ``sizebackend::packed_linear`` runs a ``k x n`` float32 linear
    with ``panel_linear`` (on a copy packed in panels at run time) rather than what it
    would run otherwise (oneDNN from :func:`runtime_min_rows` rows, aten's ``linear``
    below): the largest count of :data:`RUNTIME_ROWS` up to which the panels take under
    :data:`PANEL_MARGIN` of the other kernel's time at every count, 0 where they do not
    at 1 row or are switched off (``SIZEBACKEND_PANEL_LINEAR=0``). Measured once per
    machine and written down as :func:`runtime_min_rows` is, for the same reason: the
    answer is part of the piece's graph."""
    return _panel_rows(k, n) if panels_enabled() else 0


@functools.lru_cache(maxsize=None)
def _panel_rows(k: int, n: int) -> int:
    min_rows = runtime_min_rows(k, n)
    return _remembered(k, n, f"panel rows, oneDNN from {min_rows}", "panel_rows",
                       lambda v: _is_int(v) and v >= 0, lambda: _measure_panel_rows(k, n, min_rows))


def _measure_panel_rows(k: int, n: int, min_rows: int | None) -> int:
    most = 0
    with torch.utils._python_dispatch._disable_current_modes():
        for rows in RUNTIME_ROWS:
            other = "onednn" if min_rows is not None and rows >= min_rows else "aten"
            if _ratio(rows, k, n, "panels", other) >= PANEL_MARGIN:
                break
            most = rows
    return most


def _install() -> None:
    from torch._inductor.fx_passes import mkldnn_fusion

    op_class = getattr(mkldnn_fusion, "CpuMkldnnDeviceOp", None)
    if op_class is None:  # torch built without oneDNN: nothing is packed for it
        return
    torch_pack_weight, torch_pack_linear = op_class.pack_linear_weight, op_class.pack_linear
    reorder = torch.ops.mkldnn._reorder_linear_weight
    panels = torch.ops.sizebackend.pack_panels.default

    def pack_linear_weight(self, graph, is_lp_weight, transpose_weight_node, batch_size):
        kernel = _kernel_for(transpose_weight_node, batch_size) if PACKING.active and not is_lp_weight else None
        if kernel == "panels":  # folded into a constant with the other packed weights
            return graph.create_node("call_function", panels, args=(transpose_weight_node,))
        if kernel == "onednn":
            return graph.create_node("call_function", reorder, args=(transpose_weight_node, batch_size))
        return torch_pack_weight(self, graph, is_lp_weight, transpose_weight_node, batch_size)

    def pack_linear(self, graph, is_lp_weight, batch_size, input, packed_weight_node, bias):
        if PACKING.active and packed_weight_node.target is panels:
            n = packed_weight_node.args[0].args[0].meta["val"].shape[1]  # permute(K x N weight)
            return graph.create_node("call_function", torch.ops.sizebackend.panel_linear.default,
                                     (input, packed_weight_node, bias, int(n)))
        if PACKING.active and packed_weight_node.target is reorder:  # packed for oneDNN
            return graph.create_node("call_function", torch.ops.mkldnn._linear_pointwise.default,
                                     (input, packed_weight_node, bias, "none", [], ""))
        return torch_pack_linear(self, graph, is_lp_weight, batch_size, input, packed_weight_node, bias)

    op_class.pack_linear_weight, op_class.pack_linear = pack_linear_weight, pack_linear


def onednn_wins(rows: Any, k: Any, n: Any, dtype: torch.dtype) -> bool | None:
    """Whether a GEMM of ``rows`` x ``k`` by a ``k x n`` weight of ``dtype`` runs faster
    on oneDNN's packed linear than on MKL's (:func:`onednn_faster`); ``None`` where that
    is not measured: rows not a number, a weight not float32, no MKL to compare with, or
    a kernel that will not run here."""
    if not isinstance(rows, int) or dtype != torch.float32 or not torch._C.has_mkl:
        return None
    try:
        return onednn_faster(rows, int(k), int(n))
    except Exception as e:
        log.debug("packed linear %d x %s x %s not measured (%s)", rows, k, n, e)
        return None


def _kernel_for(transpose_weight_node: Any, batch_size: Any) -> str | None:
    """Which packed GEMM a static float32 GEMM of ``batch_size`` rows by the weight under
    ``transpose_weight_node`` (the ``K x N`` operand of the matched ``mm``) is to run:
    ``"panels"`` (``sizebackend::panel_linear``) where it is measured faster than the
    library torch's packing would otherwise call, ``"onednn"`` where torch would take
    MKL and oneDNN is faster, ``None`` for torch's own choice (counted in
    :data:`DECISIONS`)."""
    from torch._inductor.virtualized import V

    weight = transpose_weight_node.args[0] if transpose_weight_node.args else None
    value = getattr(weight, "meta", {}).get("val")
    if value is None or value.dim() != 2:
        return None
    k, n = (int(d) for d in value.shape)
    # The panels first, alike in a JIT compile and a package's: measured against both
    # libraries, so neither's answer (nor whether torch has MKL) changes the choice.
    if not _template_wins(batch_size, k, n) and panels_win(batch_size, k, n, value.dtype):
        DECISIONS["panels"] += 1
        return "panels"
    if V.aot_compilation:  # torch packs for oneDNN there already
        DECISIONS["onednn"] += 1
        return None
    faster = onednn_wins(batch_size, k, n, value.dtype)
    if faster is None:  # torch's own choice: oneDNN already, or nothing to compare
        return None
    DECISIONS["onednn" if faster else "mkl"] += 1
    return "onednn" if faster else None


def _template_wins(rows: Any, k: int, n: int) -> bool:
    """Whether max-autotune is on in this compile and the GEMM is one where Inductor's C++
    GEMM template won every measurement (``autotune.decide``: a few rows by a small
    weight). ``panel_linear`` is not one of autotune's candidates, so it is not put in
    the template's place: measured on an AMD EPYC family 25 (2026-12-07, one thread, a
    frozen 256 x 1024 -> 1024 x 256 MLP at a listed size), the template's pieces ran 1
    and 2 rows in 0.84x and 0.75x the time of ``panel_linear``'s, 4 rows alike, and 8
    rows (where autotune benchmarks both libraries) in 1.52x."""
    from torch._inductor import config

    from . import autotune

    if not (config.max_autotune or config.max_autotune_gemm) or not isinstance(rows, int):
        return False
    return autotune.decide(rows, k * n) == "template"


def panels_enabled() -> bool:
    return os.environ.get("SIZEBACKEND_PANEL_LINEAR", "1") != "0"


#: Rows above which :func:`panels_win` does not time ``panel_linear`` (it has no cache
#: blocking for many rows; 64 rows already ran at 0.86-1.02x oneDNN's time).
PANEL_MAX_ROWS = 256


def panels_win(rows: Any, k: int, n: int, dtype: torch.dtype) -> bool:
    """Whether ``sizebackend::panel_linear`` runs ``rows x k`` by a ``k x n`` float32
    weight in under :data:`PANEL_MARGIN` of the time of both libraries' packed linears on this
    CPU (:func:`panels_faster`); ``False`` where not measured (off, rows not a number or
    over :data:`PANEL_MAX_ROWS`, not float32, a kernel that will not run)."""
    if (not panels_enabled() or not isinstance(rows, int) or not 1 <= rows <= PANEL_MAX_ROWS
            or dtype != torch.float32):
        return False
    try:
        return panels_faster(rows, k, n)
    except Exception as e:
        log.debug("panel linear %d x %d x %d not measured (%s)", rows, k, n, e)
        return False


@functools.lru_cache(maxsize=None)
def panels_faster(rows: int, k: int, n: int) -> bool:
    """The measurement :func:`panels_win` reads: ``panel_linear``'s time under
    :data:`PANEL_MARGIN` of oneDNN's packed linear and of MKL's (where torch has MKL), each
    pair timed in turns.

    Against both, whichever a compile would otherwise call, so that a JIT piece (MKL or
    oneDNN) and the package built from the same piece (oneDNN) decide alike; and once
    per machine, like :func:`runtime_min_rows` (written down under a lock, read by the
    other processes): a server's processes, the package worker among them, then run one
    kernel per shape, so the JIT piece a size serves first and the package that replaces
    it give the same bits, whichever process built what."""
    return _remembered(k, n, f"panels at {rows} rows", "panels", lambda v: isinstance(v, bool),
                       lambda: _measure_panels(rows, k, n))


def _measure_panels(rows: int, k: int, n: int) -> bool:
    with torch.utils._python_dispatch._disable_current_modes():
        others = ("onednn", "mkl") if torch._C.has_mkl else ("onednn",)
        return all(_panel_ratio(rows, k, n, other) < PANEL_MARGIN for other in others)


def _panel_ratio(rows: int, k: int, n: int, other: str) -> float:
    """``panel_linear``'s time over ``other``'s (``"onednn"`` or ``"mkl"``: that
    library's packed linear)."""
    return _ratio(rows, k, n, "panels", other)


PACKING = ThreadScopedHook(_install)


def measured(on: bool = True):
    """The scope of a sized compile: static GEMMs packed for the faster library."""
    return PACKING.scope(on and enabled())
