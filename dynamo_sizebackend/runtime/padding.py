"""``pad_to_size``: run an unlisted batch on the pieces of the next larger listed size.

Valid only for models whose batch rows are independent (no reduction or attention across
the batch dim): padded rows are zeros, their outputs are computed and thrown away. The
plan is read once per graph from the fake values Dynamo recorded: which inputs carry the
batch symbol in which dim, which SymInt inputs *are* the batch symbol, which outputs to
slice back.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
import torch.fx
import torch.nn.functional as F

from .._torch import dynamo, fx, shape_env
from ..stats import COUNTERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PadPlan:
    tensor_dims: tuple[tuple[int, int], ...]
    """``(arg_index, dim)`` of every input dim that is exactly the batch symbol."""
    symint_args: tuple[int, ...]
    """Indices of SymInt inputs that are the batch symbol itself (passed as ints)."""
    output_dims: tuple[tuple[int, int], ...]
    """``(output_index, dim)`` of every output dim that is exactly the batch symbol."""
    output_symints: tuple[int, ...]
    """Indices of outputs that are the batch size itself."""
    targets: tuple[int, ...]
    """Sizes a batch may be padded to, ascending."""

    def target_for(self, size: int) -> int | None:
        """The smallest target >= ``size``, or ``None`` if the batch is larger than all."""
        i = bisect.bisect_left(self.targets, size)
        return self.targets[i] if i < len(self.targets) else None

    def pad(self, args: Sequence[Any], size: int, target: int) -> list[Any]:
        out = list(args)
        extra = target - size
        for i, dim in self.tensor_dims:
            t = out[i]
            # F.pad counts from the last dim, two entries (before, after) per dim.
            spec = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
            out[i] = F.pad(t, spec)
        for i in self.symint_args:
            out[i] = target
        return out

    def unpad(self, outputs: Any, size: int) -> Any:
        if not self.output_dims and not self.output_symints:
            return outputs
        outs = list(outputs)
        for i, dim in self.output_dims:
            outs[i] = outs[i].narrow(dim, 0, size)
        for i in self.output_symints:
            outs[i] = size
        return type(outputs)(outs) if isinstance(outputs, tuple) else outs


def _is(value: Any, symbol: sympy.Symbol) -> bool:
    return isinstance(value, torch.SymInt) and shape_env.sym_expr(value) == symbol


def plan(
    placeholder_values: Sequence[Any],
    output_values: Sequence[Any],
    symbol: sympy.Symbol,
    targets: Sequence[int],
) -> PadPlan:
    tensor_dims, symints, outs, out_ints = [], [], [], []
    for i, v in enumerate(placeholder_values):
        if isinstance(v, torch.Tensor):
            tensor_dims += [(i, d) for d, s in enumerate(v.shape) if _is(s, symbol)]
        elif _is(v, symbol):
            symints.append(i)
    for i, v in enumerate(output_values):
        if isinstance(v, torch.Tensor):
            outs += [(i, d) for d, s in enumerate(v.shape) if _is(s, symbol)]
        elif _is(v, symbol):
            out_ints.append(i)
    return PadPlan(
        tuple(tensor_dims), tuple(symints), tuple(outs), tuple(out_ints), tuple(sorted(set(targets)))
    )


def mutated_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders the graph writes in place. Padding copies its inputs, so such a
    write would land on the copy and the caller would never see it."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        for user in node.users:
            if _writes(user, node):
                found.append(node.name)
                break
    return found


def _writes(user: torch.fx.Node, arg: torch.fx.Node) -> bool:
    by_schema = fx.writes_argument(user, arg)
    if by_schema is not None:
        return by_schema
    target = user.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name == "setitem"
    return in_place and (user.args[:1] == (arg,) or user.kwargs.get("out") is arg)


def plan_for_graph(gm: torch.fx.GraphModule, fakes: Sequence[Any], symbol: sympy.Symbol,
                   sizes: Sequence[int], graph_id: int) -> PadPlan | None:
    """The pad plan of one Dynamo graph, or ``None`` (counted in
    ``fallbacks["pad_to_size"]``) when the graph writes an input in place: padding
    copies its inputs, so the write would land on the copy."""
    mutated = mutated_inputs(gm)
    if mutated:
        log.warning(
            "sizebackend: graph %d writes its inputs %s in place; pad_to_size would write "
            "a padded copy, so this graph runs unlisted sizes unpadded", graph_id, mutated,
        )
        COUNTERS.add_keyed("fallbacks", "pad_to_size")
        return None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [dynamo.placeholder_example(o) if isinstance(o, torch.fx.Node) else o
            for o in output.args[0]]
    return plan(fakes, outs, symbol, sizes)
