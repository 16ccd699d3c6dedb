"""Which SymInt is the batch size, and fake example inputs for one concrete size.

A Dynamo graph may carry several symbols (with ``dynamic=True`` every dim is symbolic).
Only the batch symbol is specialized per listed size; every other symbol stays symbolic in
the sized pieces, re-created in a fresh ShapeEnv, so a sized piece is valid for every
value of the other dims that the general piece is valid for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
import torch.fx

from .._torch import dynamo, shape_env
from ..options import OptionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchInfo:
    """Where a graph's batch size lives.

    ``arg_index``/``dim``: read the runtime batch as ``args[arg_index].shape[dim]``.
    ``symbol``: the sympy symbol of that dim, or ``None`` when the graph is static.
    """

    arg_index: int
    dim: int
    symbol: sympy.Symbol | None
    static_size: int | None = None


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _as_symbol(value: Any) -> sympy.Symbol | None:
    if isinstance(value, torch.SymInt):
        expr = shape_env.sym_expr(value)
        if isinstance(expr, sympy.Symbol):
            return expr
    return None


def find_batch(gm: torch.fx.GraphModule, batch_dim: tuple[int, int] | None) -> BatchInfo | None:
    """Locate the batch dim of ``gm``; ``None`` if the graph has no tensor input at all.

    User inputs are the tensor arguments of the traced function, in signature order.
    Default: dim 0 of the first user input whose dim 0 is a plain symbol; then of any
    tensor input (parameters included); else the graph is static.
    ``batch_dim=(i, d)``: dim ``d`` of the ``i``-th user tensor input.
    """
    nodes = _placeholders(gm)
    tensors = [
        (i, n, dynamo.placeholder_example(n))
        for i, n in enumerate(nodes)
        if isinstance(dynamo.placeholder_example(n), torch.Tensor)
    ]
    users = sorted(
        (t for t in tensors if dynamo.is_user_input(t[1])),
        key=lambda t: dynamo.argument_order_key(t[1]),
    )
    if batch_dim is not None:
        index, dim = batch_dim
        if index >= len(users):
            raise OptionError(
                f"sizebackend option 'batch_dim': input index {index} is out of range, the "
                f"graph has {len(users)} tensor inputs (got {list(batch_dim)!r})"
            )
        arg_index, _, value = users[index]
        if dim >= value.dim():
            raise OptionError(
                f"sizebackend option 'batch_dim': input {index} has {value.dim()} dims, "
                f"no dim {dim} (got {list(batch_dim)!r})"
            )
        size = value.shape[dim]
        symbol = _as_symbol(size)
        if symbol is None and not isinstance(size, int):
            raise OptionError(
                f"sizebackend option 'batch_dim': dim {dim} of input {index} is {size}, not "
                f"a plain batch size (got {list(batch_dim)!r})"
            )
        return BatchInfo(arg_index, dim, symbol, None if symbol is not None else int(size))

    for group in (users, tensors):
        for arg_index, _, value in group:
            if value.dim() > 0 and _as_symbol(value.shape[0]) is not None:
                return BatchInfo(arg_index, 0, _as_symbol(value.shape[0]))
    for arg_index, _, value in users or tensors:
        if value.dim() > 0:
            return BatchInfo(arg_index, 0, None, int(value.shape[0]))
    return None


class ConcreteInputs:
    """Fake example inputs for one runtime size, in a fresh fake mode.

    The batch symbol becomes ``size``; any other symbol becomes a fresh symbol of the new
    ShapeEnv (one per original symbol, so dims that were equal stay equal).
    """

    def __init__(self, batch_symbol: sympy.Symbol, size: int):
        self.batch_symbol = batch_symbol
        self.size = size
        self.fake_mode = shape_env.new_fake_mode()
        self._symbols: dict[sympy.Symbol, sympy.Expr] = {batch_symbol: sympy.Integer(size)}

    def _int(self, value: Any) -> Any:
        if not isinstance(value, torch.SymInt):
            return value
        expr = shape_env.sym_expr(value)
        # The batch's hint is ``size``: an unbacked batch (``mark_unbacked``) has none.
        hints = {
            s: self.size if s == self.batch_symbol else shape_env.hint_of_symbol(value, s)
            for s in expr.free_symbols
        }
        for sym in expr.free_symbols:
            if sym not in self._symbols:
                fresh = shape_env.new_symint(self.fake_mode, f"sb_{sym}", hints[sym])
                self._symbols[sym] = shape_env.sym_expr(fresh)
        new = expr.xreplace(self._symbols)
        if new.is_Integer:
            return int(new)
        hint = int(expr.xreplace(hints))
        return shape_env.symint_from_expr(self.fake_mode, new, hint)

    def _one(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(
                [self._int(s) for s in value.shape],
                [self._int(s) for s in value.stride()],
                dtype=value.dtype,
                device=value.device,
                requires_grad=value.requires_grad,
            )
        if isinstance(value, (tuple, list)):  # a tuple-returning op's result, passed whole
            return type(value)(self._one(v) for v in value)
        return self._int(value)

    def convert(self, values: Sequence[Any]) -> list[Any]:
        """``values`` for this size; tuples and lists are converted item by item (a
        symbolic fake left inside one would carry the general symbols into the size's
        compile, and its guards could not be checked)."""
        with self.fake_mode:
            return [self._one(value) for value in values]
