"""Dynamo's private surface: placeholder metadata, exception types, the compile lock,
float-specialization restarts and compile sessions (torch 2.13).

Why private: Dynamo records each placeholder's fake value and source only in
``node.meta`` (``example_value``, ``grapharg``); the restart that specializes a float and
the compile-session flag have no public spelling.
"""
from __future__ import annotations

import contextlib
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


def attribute_float_symbols(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Float symbols (``zf0``: the source each came from) of the graph's Python float
    inputs that Dynamo read from an attribute, a global or a container, as opposed to a
    frame argument: ``L['self'].eps`` is listed, ``L['temperature']`` is not. Dynamo
    passes such a float as a 0-d tensor whose ``item_memo`` holds the symbol."""
    from torch._dynamo.source import LocalSource

    found = {}
    for node in gm.graph.nodes:
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
