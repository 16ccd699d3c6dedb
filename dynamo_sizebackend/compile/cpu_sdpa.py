"""The SDPA between a CPU graph's pieces runs ``sizebackend::sdpa``.

A split op runs as a plain op call between compiled pieces. For SDPA on the CPU that is
ATen's flash kernel, built for long sequences: for a serving step's few tokens it spends
most of its time setting up (``csrc/sdpa.cpp``). :func:`swap` points every split op that
calls ``F.scaled_dot_product_attention`` (or ``aten::scaled_dot_product_attention``) at
``torch.ops.sizebackend.sdpa``: the same schema, the same results and output layout,
a direct kernel for the small calls and ATen's for the rest, so the pieces around it see
no difference and their cache keys do not change. Only the split ops change: an SDPA a
piece computes (``splitting_ops`` without it) stays Inductor's.

Off with ``SIZEBACKEND_CPU_SDPA=0`` (read when a graph is compiled).
"""
from __future__ import annotations

import logging
import os

import torch

from .. import ops  # noqa: F401  (registers sizebackend::sdpa)
from .._torch import dynamo
from .split import SplitGraph

log = logging.getLogger(__name__)

#: What an SDPA split op's node calls: Dynamo records ``F.scaled_dot_product_attention``
#: as its binding, ``torch._C._nn.scaled_dot_product_attention``.
_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)


def enabled() -> bool:
    return os.environ.get("SIZEBACKEND_CPU_SDPA", "1") != "0"


def _plain_tensors(node: torch.fx.Node) -> bool:
    """Every tensor the call takes was traced as a dense, strided, non-nested tensor (a
    nested or sparse SDPA stays ATen's: the op's kernel reads strides)."""
    values = [*node.args, *node.kwargs.values()]
    for value in values:
        if not isinstance(value, torch.fx.Node):
            continue
        example = dynamo.placeholder_example(value)
        if not isinstance(example, torch.Tensor) or example.is_nested \
                or example.layout != torch.strided:
            return False
    return True


def swap(sg: SplitGraph, graph_id: int) -> int:
    """Point ``sg``'s SDPA split ops at ``sizebackend::sdpa`` (in place); returns how
    many. Call only for a CPU graph."""
    if not enabled():
        return 0
    swapped = 0
    for piece in sg.pieces:
        if not piece.is_split_op:
            continue
        sub = getattr(sg.gm, piece.name)
        changed = False
        for node in sub.graph.nodes:
            if node.op == "call_function" and any(node.target is t for t in _SDPA) \
                    and _plain_tensors(node):
                node.target = torch.ops.sizebackend.sdpa.default
                changed = True
                swapped += 1
        if changed:
            sub.recompile()
    if swapped:
        log.debug("sizebackend: graph %d: %d SDPA calls between pieces run sizebackend::sdpa",
                  graph_id, swapped)
    return swapped
