"""torch.distributed's group-name registry (private in torch 2.13: ``_resolve_process_group``).

A functional collective in a graph names its process group by a string
(``_c10d_functional.all_reduce(x, "sum", "0")``); which ranks that name stands for is
known only to the process that created the group. The artifact cache needs it: the
same name can mean another group in another run (another world size, a subgroup
created in another order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx


def group_identity(group_name: str) -> str | None:
    """``"<name>:size=<n>:ranks=[...]"`` for a process group registered in this process,
    ``None`` when torch.distributed is not initialized or knows no such group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return None
    return f"{group_name}:size={group.size()}:ranks={dist.get_process_group_ranks(group)}"


def group_names(gm: torch.fx.GraphModule) -> set[str]:
    """Every process-group name the ops of ``gm`` (and of its subgraphs) take: their
    arguments called ``group_name`` in the op schema (functional collectives)."""
    names = set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            target = node.target if node.op == "call_function" else None
            # Dynamo's graphs call the packet, AOTAutograd's an overload.
            if isinstance(target, torch._ops.OpOverloadPacket):
                target = getattr(target, "default", None)
            if not isinstance(target, torch._ops.OpOverload):
                continue
            for i, argument in enumerate(target._schema.arguments):
                if argument.name != "group_name":
                    continue
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                if isinstance(value, str):
                    names.add(value)
    return names
