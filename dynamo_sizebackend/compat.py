"""Every private torch API the backend touches, in one place (written against torch 2.13).

Why each is here:
- Dynamo records each placeholder's fake value and source only in ``node.meta``; there is
  no public accessor (``example_value``, ``grapharg``).
- ``torch._inductor.standalone_compile`` is the documented precompile entry point, but it
  lives under a private module path.
- Building fake example inputs for a concrete size needs ``FakeTensorMode`` and
  ``ShapeEnv``.
- The debug dump of Inductor's generated code reads ``PyCodeCache``, which has no public
  equivalent.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx

TORCH_VERSION = torch.__version__


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


def graph_fake_mode(values: Sequence[Any]):
    """The fake mode Dynamo traced the graph in (the one of its placeholders' fakes).

    Not ``TracingContext.fake_mode``: Dynamo hands backends a fresh mode that only shares
    the ShapeEnv, and the fakes recorded in ``node.meta`` belong to the tracing one.
    """
    for value in values:
        if isinstance(value, torch._subclasses.FakeTensor):
            return value.fake_mode
    return torch._guards.detect_fake_mode(list(values))


def new_fake_mode():
    """A fresh fake mode with its own ShapeEnv, for compiling one concrete size."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def new_symint(fake_mode, name: str, hint: int) -> torch.SymInt:
    """A fresh backed SymInt in ``fake_mode``'s ShapeEnv (for dims other than the batch)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env = fake_mode.shape_env
    sym = env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(sym, hint=hint)


def symint_from_expr(fake_mode, expr, hint: int) -> torch.SymInt:
    return fake_mode.shape_env.create_symintnode(expr, hint=hint)


def hint_of(value: Any) -> int:
    """The concrete value Dynamo saw for a SymInt."""
    node = value.node
    hint = node.hint if node.has_hint() else node.shape_env.size_hint(node.expr)
    return int(hint)


def hint_of_symbol(value: Any, symbol) -> int:
    """The concrete value Dynamo saw for one free symbol of ``value``'s expression."""
    env = value.node.shape_env
    table = getattr(env, "backed_var_to_val", None)
    return int((table if table is not None else env.var_to_val)[symbol])


def symbol_range(fake_mode, symbol) -> tuple[int, int | None]:
    """The values Dynamo's guards allow for ``symbol`` (with 0/1 specialization the batch
    symbol starts at 2: sizes 0 and 1 arrive as graphs of their own)."""
    vr = fake_mode.shape_env.var_to_range.get(symbol)
    if vr is None:
        return 0, None
    def finite(bound) -> int | None:
        return int(bound) if getattr(bound, "is_Integer", False) else None

    return finite(vr.lower) or 0, finite(vr.upper)


def standalone_compile(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    *,
    from_graph: bool,
    inductor_options: dict[str, Any],
    fake_mode=None,
):
    """Inductor-compile ``gm``. ``from_graph``: keep the symbolic shapes of the fakes
    recorded in the graph; otherwise specialize on ``example_inputs`` (made in
    ``fake_mode``)."""
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    if from_graph:
        return torch._inductor.standalone_compile(
            gm, example_inputs, dynamic_shapes="from_graph", options=options
        )
    return torch._inductor.standalone_compile(
        gm,
        example_inputs,
        dynamic_shapes="from_example_inputs",
        options=options,
        fake_mode=fake_mode,
    )


def in_tracing_context() -> bool:
    ctx = torch._guards.TracingContext.try_get()
    return ctx is not None and ctx.fake_mode is not None


def loaded_code_paths() -> list[str]:
    """Files of the Python modules Inductor has loaded so far (its generated code)."""
    from torch._inductor.codecache import PyCodeCache

    return [m.__file__ for m in list(PyCodeCache.modules) if getattr(m, "__file__", None)]


def split_module(gm: torch.fx.GraphModule, callback: Callable[[torch.fx.Node], int]):
    from torch.fx.passes.split_module import split_module as _split

    return _split(gm, gm, callback, keep_original_order=True)


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
