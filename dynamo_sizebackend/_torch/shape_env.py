"""Fake tensors and the ShapeEnv: fake modes, symbols, their ranges, hints and guards
(torch 2.13).

Why private: building fake example inputs for one concrete size needs
``FakeTensorMode`` and ``ShapeEnv``; a SymInt's expression (``node.expr``), a symbol's
value range and the guards a compile added have no public accessor. The artifact
cache's key reads the same facts.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


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


def is_fake(value: Any) -> bool:
    return isinstance(value, torch._subclasses.FakeTensor)


def sym_expr(value: Any):
    """The sympy expression behind a SymInt/SymFloat/SymBool."""
    return value.node.expr


def _hints(env) -> dict:
    """The ShapeEnv's table of the values its backed symbols had when traced
    (``backed_var_to_val`` since torch 2.13, ``var_to_val`` before)."""
    table = getattr(env, "backed_var_to_val", None)
    return table if table is not None else env.var_to_val


def hint_of_symbol(value: Any, symbol) -> int:
    """The concrete value Dynamo saw for one free symbol of ``value``'s expression.

    An unbacked symbol (``mark_unbacked``: ``u0``) has none; it gets the hint Inductor
    plans with for it (``mark_unbacked(..., hint_override=N)``, else Inductor's
    ``unbacked_symint_fallback``)."""
    env = value.node.shape_env
    table = _hints(env)
    if symbol in table:
        return int(table[symbol])
    override = getattr(env, "var_to_hint_override", {}).get(symbol)
    if override is not None:
        return int(override)
    from torch._inductor import config as inductor_config

    return int(inductor_config.unbacked_symint_fallback)


def is_unbacked(symbol) -> bool:
    """A symbol Dynamo made for ``mark_unbacked`` (or a data-dependent size)."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return symbol_is_type(symbol, SymT.UNBACKED_INT)


def value_range(shape_env, symbol) -> tuple[int | None, int | None]:
    """The values ``symbol`` may take in ``shape_env`` (``None``: unbounded that way).
    With 0/1 specialization a batch symbol starts at 2: sizes 0 and 1 arrive as graphs
    of their own."""
    vr = shape_env.var_to_range.get(symbol)
    if vr is None:
        return None, None

    def finite(bound) -> int | None:
        return int(bound) if getattr(bound, "is_Integer", False) else None

    return finite(vr.lower), finite(vr.upper)


def symbol_range(value: Any, symbol) -> tuple[int | None, int | None]:
    """:func:`value_range` of a free symbol of ``value`` (a SymInt) in its own ShapeEnv."""
    return value_range(value.node.shape_env, symbol)


def symbol_hint_override(value: Any, symbol) -> int | None:
    """The size Inductor is told to plan ``symbol`` for (``mark_unbacked(...,
    hint_override=N)``), or ``None``."""
    override = getattr(value.node.shape_env, "var_to_hint_override", {}).get(symbol)
    return None if override is None else int(override)


def added_guards(fake_mode) -> bool:
    """True when compiling in ``fake_mode`` (a fresh one, see :func:`new_fake_mode`) made
    decisions that hold only for some values of its symbols (guards, or symbols replaced
    by an expression or a constant)."""
    env = fake_mode.shape_env
    return bool(env.guards or env.replacements)


def guard_checker(fake_mode, placeholders: Sequence[Any]) -> tuple[str, Callable[[Sequence[Any]], bool]]:
    """A check of ``fake_mode``'s shape guards against a call's real arguments.

    ``placeholders`` are fakes of the graph's inputs made in ``fake_mode``, in argument
    order; the returned ``check(args)`` tells whether ``args`` satisfy every guard the
    compiles in that mode added. Uses the ShapeEnv's guard printer, the one the AOT and
    FX-graph caches use to re-check a cached artifact (``produce_guards_expression``).
    """
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    env = fake_mode.shape_env
    source = env.produce_guards_expression(list(placeholders), ignore_static=True)
    if not source:
        return "True", lambda args: True
    code = compile(source, "<sizebackend size guards>", "eval")
    names = [f"t{i}" for i in range(len(placeholders))]

    def check(args: Sequence[Any]) -> bool:
        return bool(eval(code, SYMPY_INTERP, {"L": dict(zip(names, args))}))

    return source, check


def shape_env_state(values: Sequence[Any]) -> tuple[int, int, int] | None:
    """How much the ShapeEnv of ``values`` knows: (guards, runtime asserts, replacements).

    A compile that grows it made decisions valid only for some sizes; an artifact loaded
    from disk or shared with another piece would skip adding them, so such an artifact
    must be neither cached nor shared (see ``cache.PieceCache``)."""
    env = _shape_env(values)
    if env is None:
        return None
    asserts = sum(len(v) for v in env.deferred_runtime_asserts.values())
    return len(env.guards), asserts, len(env.replacements)


def _shape_env(values: Sequence[Any]):
    for value in values:
        if isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode.shape_env:
            return value.fake_mode.shape_env
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return value.node.shape_env
    return None


def shape_guards_text(values: Sequence[Any]) -> str:
    """What the ShapeEnv of ``values`` assumes about them, written by input position
    (``L['t0'].size()[0] >= 2 and L['t1'] == L['t0'].size()[1]``): the same printer the
    FX graph cache uses to decide whether a cached graph fits (``produce_guards_expression``).
    Inductor may rely on any of these facts, so an artifact fits only where they hold."""
    env = _shape_env(values)
    if env is None:
        return ""
    return env.produce_guards_expression(list(values), ignore_static=True) or ""


def constant_float(value: Any) -> float | None:
    """The value of a SymFloat that the ShapeEnv has pinned to a constant (a float input
    specialized while tracing, under a Dynamo guard), else ``None``."""
    if not isinstance(value, torch.SymFloat):
        return None
    expr = value.node.expr  # with the ShapeEnv's replacements applied
    return float(expr) if expr.is_number else None


def float_symbol_names(fake_mode) -> set[str]:
    """Names of the float symbols (``zf0``...) of the graph's ShapeEnv: Python floats that
    Dynamo turned into graph inputs (``specialize_float=False``) instead of constants.
    All of them, as Inductor's ``tensorify_python_scalars`` pass collects them: a float
    that was specialized while tracing no longer names its symbol in the graph."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return {str(s) for s in _hints(fake_mode.shape_env) if symbol_is_type(s, SymT.FLOAT)}
