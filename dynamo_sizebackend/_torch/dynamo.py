"""Dynamo's private surface: placeholder metadata, exception types, the compile lock,
float-specialization restarts, compile sessions, the recompile-limit event and marking an
unbacked batch dim (torch 2.13).

Why private: Dynamo records each placeholder's fake value and source only in
``node.meta`` (``example_value``, ``grapharg``); the restart that specializes a float and
the compile-session flag have no public spelling, and Dynamo announces that it gave up
on a frame only through its own logger (see :func:`on_recompile_limit`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
import torch.fx


#: Dynamo's own reentrant ``compile_lock``. It serializes Inductor compiles, artifact
#: saves and loads (see :func:`.inductor.standalone_compile`): torch documents
#: ``CacheArtifactManager``'s state as "protected by the compile_lock", Dynamo holds it
#: while compiling a frame (so our general compiles run under it already) and Inductor
#: takes it for backward graphs; a lock of our own next to it could deadlock against a
#: background compile.
from torch._dynamo.convert_frame import compile_lock as COMPILE_LOCK  # noqa: E402


#: How Dynamo's graphs spell ``linear`` (``F.linear`` arrives as the C++ builtin).
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def placeholder_example(node: torch.fx.Node) -> Any:
    """The fake value Dynamo traced this placeholder with (FakeTensor, SymInt or int)."""
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def is_user_input(node: torch.fx.Node) -> bool:
    """True when the placeholder is an argument of the traced call, not a parameter or
    buffer that Dynamo lifted from an ``nn.Module`` (those sit under a module source)."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return True
    while source is not None:
        kind = type(source).__name__
        if "NNModule" in kind or "ParamBuffer" in kind or kind == "AttrSource":
            return False
        if kind == "LocalSource":
            return bool(getattr(source, "is_input", True))
        source = getattr(source, "base", None)
    return True


def is_parameter_or_buffer(node: torch.fx.Node) -> bool:
    """True only when the placeholder is an ``nn.Parameter`` or a registered buffer of an
    ``nn.Module``: its source goes through a module's ``_parameters`` or ``_buffers``
    (Dynamo's ``UnspecializedParamBufferSource`` when it inlines modules, torch 2.13).

    Narrower than ``not is_user_input(node)`` on purpose: a plain tensor attribute
    (``self.cache = t``, ``state.acc`` of an argument) is not a user input either, but
    the caller owns it and may replace it between calls; CUDA-graph capture must not
    treat it as a fixed address (see ``runtime/cudagraphs.py``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None:
        if "ParamBuffer" in type(source).__name__:
            return True
        if getattr(source, "member", None) in ("_parameters", "_buffers"):
            return True
        source = getattr(source, "base", None)
    return False


def argument_order_key(node: torch.fx.Node) -> tuple[int, ...]:
    """Sort key placing a user-input placeholder at its position in the traced function's
    signature. Dynamo orders placeholders by first use, not by argument order, so this
    reads the local's name from the placeholder's source and looks it up in the root
    frame's argument names (``x`` of ``forward(self, scale, x)`` sorts after ``scale``;
    ``args[1]`` after ``args[0]``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    indices: list[int] = []
    while source is not None and type(source).__name__ != "LocalSource":
        index = getattr(source, "index", None)
        if isinstance(index, int):
            indices.insert(0, index)
        source = getattr(source, "base", None)
    if source is None:
        return (1 << 30,)
    ctx = torch._guards.TracingContext.try_get()
    codes = getattr(ctx, "traced_code", None) or []
    if codes:
        code = codes[0]
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + 2]
        if source.local_name in names:
            return (names.index(source.local_name), *indices)
    return (1 << 29, *indices)


def user_error_base() -> type:
    """Dynamo wraps backend exceptions in ``BackendCompilerFailed`` except those deriving
    from ``ShortenTraceback``; deriving from it lets a user error reach the caller as the
    ``ValueError`` it is."""
    from torch._dynamo.exc import ShortenTraceback

    return ShortenTraceback


def dynamo_control_flow() -> tuple[type, ...]:
    """Exceptions Dynamo uses to steer compilation (e.g. restart analysis with a float
    specialized). A backend must let them through, never treat them as failures."""
    from torch._dynamo import exc

    return tuple(
        getattr(exc, name)
        for name in ("TensorifyScalarRestartAnalysis", "RestartAnalysis", "SkipFrame")
        if hasattr(exc, name)
    )


def attribute_float_symbols(graph: torch.fx.Graph) -> dict[str, str]:
    """Float symbols (``zf0``: the source each came from) of the graph's Python float
    inputs that Dynamo read from an attribute, a global or a container, as opposed to a
    frame argument: ``L['self'].eps`` is listed, ``L['temperature']`` is not. Dynamo
    passes such a float as a 0-d tensor whose ``item_memo`` holds the symbol."""
    from torch._dynamo.source import LocalSource

    found = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        if arg is None or memo is None or not getattr(arg, "pass_arg_as_tensor", False):
            continue
        if isinstance(arg.source, LocalSource):
            continue
        symbol = getattr(memo.node._expr, "name", None)  # the symbol, not a replacement
        if symbol is not None:
            found[symbol] = arg.source.name
    return found


def restart_with_floats_specialized(names: set[str]) -> None:
    """Ask Dynamo to trace the frame again with the floats ``names`` as constants, the
    way Inductor's own ``tensorify_python_scalars`` pass does when a float cannot stay
    symbolic (raises ``TensorifyScalarRestartAnalysis``). Returns without raising when
    every name was already specialized once, so a frame cannot restart forever."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    fresh = sorted(n for n in names if not TensorifyState.should_specialize(n))
    if not fresh:
        return
    for name in fresh:
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


_FLOAT_HOOK_INSTALLED = False


def specialize_attribute_floats_when(applies: Callable[[Any], bool]) -> None:
    """Make Dynamo trace the attribute floats of a frame as constants in its first
    trace, for frames whose compiler ``applies(compiler_fn)`` to (installed once per
    process; Dynamo's own ``compiler_fn``, as ``OutputGraph`` holds it, is passed).

    How: Dynamo turns the floats that ``TensorifyState`` names into constants (under a
    guard) when it finishes the frame's graph, before the backend sees it
    (``OutputGraph.remove_tensorify_specialized_graphargs``, torch 2.13); until then a
    float is symbolic in both traces. Naming the attribute floats there gives the graph
    that :func:`restart_with_floats_specialized` gets only from a second trace."""
    global _FLOAT_HOOK_INSTALLED
    if _FLOAT_HOOK_INSTALLED:
        return
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.symbolic_convert import TensorifyState

    finish = OutputGraph.remove_tensorify_specialized_graphargs

    def remove_tensorify_specialized_graphargs(self: Any) -> None:
        if applies(getattr(self, "compiler_fn", None)):
            found = attribute_float_symbols(self.graph)
            for name in found:
                TensorifyState.specialize(name)
            if found:
                _log.info("sizebackend: float attributes %s traced as constants",
                         sorted(found.values()))
        finish(self)

    OutputGraph.remove_tensorify_specialized_graphargs = remove_tensorify_specialized_graphargs
    _FLOAT_HOOK_INSTALLED = True


@contextlib.contextmanager
def compile_session():
    """Wrap a compile the backend starts on its own, outside Dynamo's (a lazy size on
    first sight, a size in background mode), the way Dynamo wraps its own compiles.

    Why both parts matter: Inductor's AOT trace (``make_fx``) sets FX's process-global
    "symbolic tracing" flag and patches ``nn.Module.__call__`` for every thread. Any
    call into torch.compile'd code on another thread meanwhile raises "Detected that you
    are using FX to symbolically trace a dynamo-optimized function", unless the
    process-global compile-session flag is also set, which Dynamo does around its own
    compiles (torch 2.13: ``torch.compiler._compile_session_context``). In background
    mode without it most calls made during the compile failed. That flag is saved and
    restored, not counted, so two sessions must never overlap: Dynamo's ``compile_lock``
    keeps this one from overlapping any Dynamo compile or another of ours (it is
    re-entrant, so a lazy compile inside a Dynamo compile on the same thread is fine).
    """
    with COMPILE_LOCK, torch.compiler._compile_session_context():
        yield


def static_shapes_forced() -> bool:
    """Whether Dynamo is tracing under ``torch.compile(dynamic=False)``: it patches
    ``automatic_dynamic_shapes`` off (with ``assume_static_by_default``) for the frame,
    so every batch size is traced as a static graph of its own and none is symbolic."""
    config = torch._dynamo.config
    return not config.automatic_dynamic_shapes and config.assume_static_by_default


# --- Dynamo giving up on a frame -------------------------------------------------------

#: The logger of ``torch/_dynamo/convert_frame.py`` and the start of the one warning
#: ``_compile`` emits when ``exceeds_recompile_limit`` is true (torch 2.13, line ~1994):
#: ``log.warning("torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason:
#: %s\n...", limit_type, getattr(config, limit_type), format_func_info(code),
#: recompile_reason, troubleshooting_url)``.
_CONVERT_FRAME_LOGGER = "torch._dynamo.convert_frame"
_log = logging.getLogger(__name__)
_LIMIT_WARNING = "torch._dynamo hit config."


@dataclass(frozen=True)
class RecompileLimitHit:
    """Dynamo refused to compile a frame again: from now on the frame's code runs only
    the graphs already in its cache, and every call that matches none runs eager."""

    limit: str
    """The config that was exceeded: ``"recompile_limit"`` (per code object) or
    ``"accumulated_recompile_limit"``."""
    value: Any
    """That config's value when it was hit."""
    function: str | None
    """The frame's code as :func:`frame_label` spells it; ``None`` when the warning's
    arguments did not have the expected shape (a torch version that words it otherwise)."""
    reason: str | None
    """Dynamo's last recompile reason (the guard that failed), when it gave one."""


def frame_label(code: CodeType) -> str:
    """A code object spelled the way Dynamo names it in the recompile-limit warning:
    ``'forward' (/path/model.py:12)``."""
    return f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"


def traced_frame_label() -> str | None:
    """The :func:`frame_label` of the frame Dynamo is compiling now (the root of the
    trace: ``TracingContext.traced_code[0]``), or ``None`` outside a Dynamo compile."""
    ctx = torch._guards.TracingContext.try_get()
    codes = getattr(ctx, "traced_code", None) or []
    return frame_label(codes[0]) if codes else None


class _RecompileLimitFilter(logging.Filter):
    """Sees every record of Dynamo's ``convert_frame`` logger, reports the recompile-limit
    warning to a callback and lets every record through unchanged."""

    def __init__(self, callback: Callable[[RecompileLimitHit], None]):
        super().__init__()
        self.callback = callback

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_LIMIT_WARNING):
            args = record.args if isinstance(record.args, tuple) else ()
            # Both limits end in "recompile_limit"; an unexpected argument counts as that.
            limit = args[0] if args and str(args[0]).endswith("recompile_limit") else None
            limit = str(limit or "recompile_limit")
            function = args[2] if len(args) > 2 and isinstance(args[2], str) else None
            reason = args[3] if len(args) > 3 and isinstance(args[3], str) else None
            hit = RecompileLimitHit(limit, args[1] if len(args) > 1 else None, function, reason)
            try:
                self.callback(hit)
            except Exception:  # noqa: BLE001  (see below)
                # Raised here, it would surface inside Dynamo's frame conversion (a
                # warnings filter set to "error" does that) instead of at the caller.
                _log.exception("sizebackend: handling %s failed", hit)
        return True


def on_recompile_limit(callback: Callable[[RecompileLimitHit], None]) -> None:
    """Call ``callback`` each time Dynamo stops compiling a frame because it hit
    ``config.recompile_limit`` or ``config.accumulated_recompile_limit``. Idempotent:
    a second call with the same callback installs nothing (the backend calls this while
    Dynamo holds :data:`COMPILE_LOCK`, so two calls never race to install it twice).

    Why a log filter: torch 2.13 has no hook for this event. In ``convert_frame._compile``
    the check ``exceeds_recompile_limit(cache_size, compile_id)`` runs *before*
    ``compile_inner`` installs the ``torch._dynamo.callback`` handlers, so
    ``on_compile_start``/``on_compile_end`` never see it; what follows is an
    ``Unsupported`` ("Dynamo recompile limit exceeded") that only bumps
    ``torch._dynamo.utils.counters["unimplemented"]`` and sets the frame's strategy to
    ``RUN_ONLY``. Those counters could be polled, but only when someone asks (no call of
    ours happens after the hit: Dynamo stops calling the backend for that code and the
    eager calls bypass our runner), ``torch._dynamo.reset()`` clears them and their key
    names no function. The ``log.warning`` just before is emitted at the moment of the
    hit, once per code object (``RUN_ONLY`` keeps Dynamo from trying that code again), and
    its arguments name the limit and the function. A ``logging.Filter`` on that logger
    (not a handler: ``torch._logging`` replaces the handlers of ``torch._dynamo``, never
    the filters of its child loggers) sees the record before any handler formats it.

    Limitation: a logger silenced below WARNING (``TORCH_LOGS="-dynamo"``,
    ``torch._logging.set_logs(dynamo=logging.ERROR)``) creates no record, so the hit goes
    unseen. The callback runs inside Dynamo's frame conversion: what it raises is logged,
    not propagated.
    """
    logger = logging.getLogger(_CONVERT_FRAME_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, _RecompileLimitFilter) and existing.callback == callback:
            return
    logger.addFilter(_RecompileLimitFilter(callback))


# --- An unbacked batch dim -------------------------------------------------------------


def batch_unbacked(tensor: torch.Tensor) -> bool:
    """Whether dim 0 of ``tensor`` is marked unbacked (``mark_unbacked``) already."""
    return 0 in getattr(tensor, "_dynamo_unbacked_indices", ())


def mark_batch_unbacked(tensor: torch.Tensor, shape_id: str) -> None:
    """Mark dim 0 of ``tensor`` unbacked, at least 1, and one symbol with every other dim
    marked with ``shape_id`` (Dynamo adds a runtime check that they are equal).

    Why private: torch 2.13 has ``mark_unbacked`` only in ``torch._dynamo.decorators``,
    and records the mark only as tensor attributes (``_dynamo_unbacked_indices``, which
    :func:`batch_unbacked` reads).
    """
    torch._dynamo.decorators.mark_unbacked(tensor, 0, shape_id=shape_id, min=1)
