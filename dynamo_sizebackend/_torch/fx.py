"""FX and op-overload internals: splitting a graph, and what an op node calls and
writes (torch 2.13).

Why private: ``split_module`` lives under ``torch.fx.passes`` (not covered by FX's
backward-compatibility promise), and an op node's target is a ``torch._ops.OpOverload``
whose schema (``_schema``) is the only record of which arguments it writes in place.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx


def is_op(target: Any) -> bool:
    """An ATen or custom op, overload or packet (``torch.ops.ns.op[.overload]``)."""
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def op_names(target: Any) -> tuple[str, str | None] | None:
    """``("ns::op", overload)`` of an op overload, ``("ns::op", None)`` of a packet,
    ``None`` for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, None
    return None


def writes_argument(node: torch.fx.Node, arg: torch.fx.Node) -> bool | None:
    """Whether the op ``node`` calls writes ``arg`` in place, by the op's schema
    (``Tensor(a!)``); ``None`` when ``node`` does not call an op overload."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for i, a in enumerate(target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if value is arg and a.alias_info is not None and a.alias_info.is_write:
            return True
    return False


def split_module(gm: torch.fx.GraphModule, callback: Callable[[torch.fx.Node], int]):
    from torch.fx.passes.split_module import split_module as _split

    return _split(gm, gm, callback, keep_original_order=True)
