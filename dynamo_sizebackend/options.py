"""Options: one frozen, validated dataclass and the parser that builds it.

``torch.compile(..., options=...)`` hands the backend either a dict or, in the form the
vLLM seed introduced on its command line, a string holding a Python dict literal
(``"{'compile_sizes': [1, 2, 4]}"``). Both go through :func:`parse_options`, which rejects
unknown keys (naming the nearest valid one) instead of dropping them: a typo in
``compile_size`` must never silently compile nothing.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import devices
from ._torch import dynamo, inductor

log = logging.getLogger(__name__)

#: SDPA as Dynamo records it (the Python function), the ATen overloads it decomposes
#: to on CPU and CUDA that we know of in torch 2.13, and our own op.
DEFAULT_SPLITTING_OPS: tuple[str, ...] = (
    "torch.nn.functional.scaled_dot_product_attention",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "sizebackend::attention",
)

#: The Inductor patches sized pieces get by default, per device type, chosen by
#: measurement (benchmarks/bench_tuning.py; README "Per-size tuning"):
#: - cpu: constant (frozen) weights plus max-autotune with the C++ GEMM template, which
#:   needs constant weights; on the built-in Llama listed sizes ran at 0.60-0.72x of
#:   torch.compile(dynamic=False). Freezing alone (mkl-packed linears) was slower at
#:   small batches, cpp_wrapper did not help the Llama (4% on an SDPA model, and
#:   longer compiles), max-autotune without freezing changes nothing (the template
#:   never applies). Linears of one input (q/k/v, gate/up) are concatenated into one
#:   GEMM: 0.92x / 0.83x the time at 8 / 16 rows, and fewer GEMMs to autotune
#:   (2026-12-06).
#: - cuda: what vLLM compiles its single sizes with (max-autotune, coordinate descent).
#: Both keep Inductor's autotune tables and stats off stderr.
STORE_FROZEN = (True, False, "worker", "inline")

SIZED_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "cpp.enable_concat_linear": True,
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False},
    "cuda": {"max_autotune": True, "coordinate_descent_tuning": True,
             "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False},
}

#: vLLM's capture sizes: 1, 2, 4 and every multiple of 8 up to 256.
DEFAULT_CUDAGRAPH_SIZES: tuple[int, ...] = (1, 2, 4) + tuple(range(8, 257, 8))

#: A size above this is almost certainly a mistake (a token count typed as a byte count).
MAX_SIZE = 1 << 20

COMPILERS = ("inductor", "eager")
COMPILE_MODES = ("eager", "lazy", "background")


def _default_cache_dir() -> str | None:
    env = os.environ.get("SIZEBACKEND_CACHE_DIR")
    if env is not None:
        return None if env.lower() in ("", "none", "off") else env
    return os.path.join(os.path.expanduser("~"), ".cache", "dynamo_sizebackend")


def _default_direct_calls() -> bool:
    return os.environ.get("SIZEBACKEND_DIRECT_CALLS", "1").lower() not in ("0", "false", "off", "no")


def _default_sized() -> Mapping[str, Any] | None:
    text = os.environ.get("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "auto").strip()
    if text.lower() in ("", "auto", "none"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise OptionError(
            f"SIZEBACKEND_SIZED_INDUCTOR_OPTIONS is not 'auto' or a Python dict literal: "
            f"{text!r} ({e})"
        ) from None
    return value


def _inductor_patches(key: str, patches: Any) -> dict[str, Any]:
    """``patches`` checked against Inductor's config (entry names and types), with
    torch.compile's spelling "max-autotune" turned into the entry "max_autotune"."""
    if not isinstance(patches, Mapping) or not all(isinstance(k, str) for k in patches):
        raise _fail(key, patches, "must be a dict of str keys")
    for name, value in patches.items():
        problem = inductor.inductor_option_problem(name, value)
        if problem is not None:
            raise _fail(key, patches, f"entry {name!r}={value!r}: {problem}")
    return {k.replace("-", "_"): v for k, v in patches.items()}


class OptionError(ValueError, dynamo.user_error_base()):
    """A bad option. A ``ValueError`` that Dynamo passes through to the caller unwrapped."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.first_useful_frame = None


def _fail(key: str, value: Any, why: str) -> OptionError:
    return OptionError(f"sizebackend option {key!r}: {why} (got {value!r})")


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True is never a batch size.
    return isinstance(value, int) and not isinstance(value, bool)


def _sizes(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _fail(key, value, "must be a list of positive ints")
    for size in value:
        if not _is_int(size) or size <= 0:
            raise _fail(key, value, f"every size must be a positive int, {size!r} is not")
        if size > MAX_SIZE:
            raise _fail(key, value, f"size {size} is larger than the maximum {MAX_SIZE}")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class SizeBackendOptions:
    """Validated options of one ``torch.compile(backend="sizebackend")`` call."""

    compile_sizes: tuple[int, ...] = ()
    """Batch sizes to compile specialized pieces for; sorted and de-duplicated."""

    splitting_ops: tuple[str, ...] = DEFAULT_SPLITTING_OPS
    """Ops to split the graph at (``ns::op``, ``ns::op.overload`` or a Python qualified
    name). They run eagerly between the compiled pieces."""

    batch_dim: tuple[int, int] | None = None
    """``(input_index, dim)``: the batch dim is ``dim`` of the ``input_index``-th tensor
    argument of the traced function. ``None``: dim 0 of the first argument whose dim 0 is
    symbolic."""

    compiler: str = "inductor"
    """``"inductor"`` or ``"eager"`` (pieces run uncompiled; for debugging and tests)."""

    inductor_options: Mapping[str, Any] = field(default_factory=dict)
    """Inductor config patches applied to every piece compile (scoped, never global)."""

    sized_inductor_options: Mapping[str, Any] | None = field(default_factory=_default_sized)
    """Inductor config patches for the pieces of a listed size only, applied on top of
    ``inductor_options`` (the general pieces never see them). ``None``: the measured
    default of the graph's device, :data:`SIZED_DEFAULTS` (on CPU constant weights and
    the C++ GEMM template, on CUDA max-autotune with coordinate descent); ``{}``: sized
    pieces compile with exactly the general pieces' settings. Default: ``None``, or the
    dict literal in ``SIZEBACKEND_SIZED_INDUCTOR_OPTIONS`` (``auto`` for ``None``)."""

    compile_mode: str = "eager"
    """When specialized pieces are compiled: ``"eager"`` when the graph arrives,
    ``"lazy"`` on the first call of that size, ``"background"`` in a thread while the
    general pieces serve."""

    cudagraphs: bool = False
    """Capture CUDA graphs per piece and size (GPU only)."""

    cudagraph_sizes: tuple[int, ...] = DEFAULT_CUDAGRAPH_SIZES
    """Sizes to capture, among the compile sizes (and the size a static graph was traced
    at, e.g. 1 under 0/1 specialization). A compile size not listed here is still
    compiled and runs at its own size, uncaptured (the seed dropped it); sizes listed
    here only are not compiled, so never captured."""

    cudagraph_warmups: int = 1
    """Plain runs of a piece per size and input signature before it is captured (>= 1:
    the first run of a shape may allocate, autotune or initialize libraries, none of
    which a capture may do)."""

    pad_to_size: bool = False
    """Pad a batch up to the next listed size and slice outputs back. Only valid for
    models whose batch rows are independent."""

    strict: bool = False
    """Raise when a size fails to compile instead of serving it with the general pieces."""

    cache_dir: str | None = field(default_factory=_default_cache_dir)
    """On-disk artifact cache; ``None`` disables it (identical pieces are still compiled
    once per process and shared). See ``cache/store.py``."""

    store_frozen: bool | str = True
    """With ``cache_dir`` set: sized pieces whose weights are frozen are compiled ahead
    of time with AOTInductor and stored, weights included, so that a restart loads them
    instead of compiling them again (``cache/aot.py``; torch cannot save a frozen JIT
    compile). Costs disk (one copy of the frozen weights per listed size).
    ``True`` or ``"worker"``: a piece that misses is compiled on the JIT path to serve
    at once and its package built by a worker process meanwhile
    (``cache/package_worker.py``); ``"inline"``: built in this process before the size
    serves; ``False``: they compile on the JIT path at every start, never stored."""

    prune_autotune: bool = True
    """On CPU, with max-autotune in the sized options: benchmark only the GEMM
    candidates that can win (``_torch/autotune.py``: measured, the C++ template always
    wins at <= 4 rows and ATen at >= 16, so only sizes between benchmark both). A cold
    compile then builds far fewer candidates; ``False``: Inductor's full search."""

    debug_dir: str | None = None
    """Write each piece's graph and generated code here. Turns the artifact cache and the
    sharing of identical pieces off, so that every piece is compiled and written."""

    direct_calls: bool = field(default_factory=_default_direct_calls)
    """Call Inductor's generated code directly after a piece's first call, skipping
    AOTAutograd's per-call Python layers (``_torch/direct_call.py``; only for pieces it
    can prove need none of them), and run a listed size whose pieces are all AOT
    packages as one C++ call (``runtime/chain.py``). ``False`` always takes the full
    path, piece by piece from Python. Default: on, unless ``SIZEBACKEND_DIRECT_CALLS=0``."""

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("compile_sizes", _sizes("compile_sizes", self.compile_sizes))
        set_("cudagraph_sizes", _sizes("cudagraph_sizes", self.cudagraph_sizes))

        ops = self.splitting_ops
        if isinstance(ops, str) or not isinstance(ops, (list, tuple)):
            raise _fail("splitting_ops", ops, "must be a list of op names")
        for op in ops:
            if not isinstance(op, str) or not op.strip():
                raise _fail("splitting_ops", ops, f"every entry must be an op name, {op!r} is not")
        set_("splitting_ops", tuple(dict.fromkeys(ops)))

        bd = self.batch_dim
        if bd is not None:
            if (
                not isinstance(bd, (list, tuple))
                or len(bd) != 2
                or not all(_is_int(v) and v >= 0 for v in bd)
            ):
                raise _fail("batch_dim", bd, "must be None or [input_index, dim] of two ints >= 0")
            set_("batch_dim", (bd[0], bd[1]))

        if self.compiler not in COMPILERS:
            raise _fail("compiler", self.compiler, f"must be one of {list(COMPILERS)}")
        if self.compile_mode not in COMPILE_MODES:
            raise _fail("compile_mode", self.compile_mode, f"must be one of {list(COMPILE_MODES)}")
        set_("inductor_options", _inductor_patches("inductor_options", self.inductor_options))
        if self.sized_inductor_options is not None:
            set_("sized_inductor_options",
                 _inductor_patches("sized_inductor_options", self.sized_inductor_options))
        if self.compiler == "eager":  # Inductor never runs: its patches would be dropped
            if self.inductor_options:
                raise _fail("inductor_options", self.inductor_options,
                            "has no effect with compiler='eager' (pieces run uncompiled); "
                            "drop it or use compiler='inductor'")
            sized = self.sized_inductor_options
            if sized and sized != _default_sized():  # a process default is never an error
                raise _fail("sized_inductor_options", sized,
                            "has no effect with compiler='eager' (pieces run uncompiled); "
                            "drop it or use compiler='inductor'")
        if not any(type(self.store_frozen) is type(v) and self.store_frozen == v for v in STORE_FROZEN):
            raise _fail("store_frozen", self.store_frozen,
                        "must be True, False, 'worker' or 'inline'")
        for name in ("cudagraphs", "pad_to_size", "strict", "direct_calls", "prune_autotune"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "must be True or False")
        if not _is_int(self.cudagraph_warmups) or self.cudagraph_warmups < 1:
            raise _fail("cudagraph_warmups", self.cudagraph_warmups, "must be an int >= 1")
        if self.cudagraphs and self.compile_mode == "background":
            raise _fail(
                "compile_mode", self.compile_mode,
                "'background' cannot be combined with cudagraphs=True: a compile on another "
                "thread while a graph is captured has never been checked on a GPU; use "
                "'eager' or 'lazy'",
            )
        for name in ("cache_dir", "debug_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise _fail(name, value, "must be a path or None")
            if value is not None:
                set_(name, os.path.expanduser(str(value)))

    def sized_options_for(self, device_type: str) -> dict[str, Any]:
        """The Inductor patches of sized pieces on ``device_type`` (``"cpu"``, ``"cuda"``),
        on top of ``inductor_options``: ``sized_inductor_options``, or the device's
        measured default when it is ``None``."""
        if self.sized_inductor_options is not None:
            return dict(self.sized_inductor_options)
        return dict(SIZED_DEFAULTS.get(device_type, {}))

    def frozen_store_mode(self) -> str | None:
        """How frozen sized pieces are stored: ``"worker"``, ``"inline"`` or ``None``."""
        if self.store_frozen is False:
            return None
        return "worker" if self.store_frozen is True else self.store_frozen

    def __hash__(self) -> int:  # inductor_options is a dict; hash what defines code
        return hash(self.code_key())

    def code_key(self) -> str:
        """The options that change generated code, as a stable string (cache keys)."""
        return repr((self.compiler, sorted(self.inductor_options.items()), self.splitting_ops))


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SizeBackendOptions))


def parse_options(options: Any) -> SizeBackendOptions:
    """Build :class:`SizeBackendOptions` from ``None``, a dict, or a dict-literal string.

    Strings are read with :func:`ast.literal_eval`, never ``eval``.
    """
    if isinstance(options, SizeBackendOptions):
        return options
    if options is None:
        return SizeBackendOptions()
    if isinstance(options, str):
        try:
            parsed = ast.literal_eval(options.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            raise OptionError(
                f"sizebackend options string is not a Python dict literal: {options!r} ({e})"
            ) from None
        options = parsed
    if not isinstance(options, Mapping):
        raise OptionError(
            f"sizebackend options must be a dict or a string holding a dict literal, "
            f"got {type(options).__name__}: {options!r}"
        )
    for key in options:
        if key not in OPTION_NAMES:
            near = difflib.get_close_matches(str(key), OPTION_NAMES, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise OptionError(
                f"sizebackend: unknown option {key!r}{hint} Valid options: {', '.join(OPTION_NAMES)}"
            )
    return SizeBackendOptions(**options)


def check_options(options: Any = None, *, mode: Any = None) -> SizeBackendOptions:
    """Everything the backend checks before its first compile, callable at startup.

    :func:`parse_options` plus what depends on this process and on ``torch.compile``'s
    own arguments: ``mode`` (``torch.compile(mode=...)``; the backend takes none, and
    ``"reduce-overhead"`` is spelled ``options={"cudagraphs": True}`` here) and
    ``cudagraphs=True`` without a CUDA device. The backend runs this same check on the
    first graph, so a server that calls it before warming up fails at startup with the
    error it would otherwise meet at the first call::

        opts = sb.check_options({"compile_sizes": [1, 2, 4, 8]})
        compiled = torch.compile(model, backend="sizebackend", options=opts)
    """
    if mode not in (None, "default"):
        raise OptionError(
            f"sizebackend does not take torch.compile(mode=...) (got mode={mode!r}); use "
            f"mode=None (Hugging Face: CompileConfig(mode=None), its default is "
            f"'reduce-overhead'), put Inductor settings in options={{'inductor_options': "
            f"{{...}}}} and ask for CUDA graphs with options={{'cudagraphs': True}} "
            f"(piecewise: attention runs between the graphs)"
        )
    opts = parse_options(options)
    if opts.cudagraphs and not devices.cuda_available():
        raise _fail("cudagraphs", True, "CUDA graphs need a CUDA device and none is available")
    uncaptured = uncaptured_sizes(opts)
    if uncaptured:  # the backend checks every graph's options: said once per graph
        log.info(
            "sizebackend: compile_sizes %s are not in cudagraph_sizes: compiled and run at "
            "their own size, without CUDA graphs", list(uncaptured),
        )
    return opts


def uncaptured_sizes(options: SizeBackendOptions) -> tuple[int, ...]:
    """Compile sizes that are compiled but never captured: with cudagraphs on, those not
    in ``cudagraph_sizes``.

    Such a size is *kept*: compiled and run at its own size, uncaptured. It is not padded
    up to a capture size: padding is only valid for models whose batch rows are
    independent, which is what ``pad_to_size`` asks the user to promise. (The seed
    dropped such sizes, so they ran on the general pieces, uncaptured and unspecialized:
    strictly worse.)"""
    if not options.cudagraphs:
        return ()
    capture = set(options.cudagraph_sizes)
    return tuple(n for n in options.compile_sizes if n not in capture)
