"""Whether a graph's listed sizes can use the CPU tuning: the row count of its GEMMs.

The CPU default for sized pieces (frozen weights + max-autotune, ``SIZED_DEFAULTS``)
pays when a listed size makes every GEMM's row count a number: Inductor then prepacks
the weight for that M and the C++ template is built for it. A graph traced with other
symbolic dims in its activations (``torch.compile(dynamic=True)`` on inputs of shape
``[batch, seq, dim]``: ``seq`` is symbolic too) keeps ``batch x seq`` rows symbolic in
every sized piece, and there freezing loses. Measured 2026-12-05 (4 SDPA blocks,
d 256, seq 4, 1 thread, ``dynamic=True``, ratio to stock ``torch.compile(dynamic=True)``
at listed sizes 2 / 4 / 8): the default 1.185 / 1.205 / 1.123, freezing alone 1.300 /
1.145 / 1.094, untuned (``{}``) 1.012 / 1.000 / 1.000. Such a graph's sized pieces are
therefore compiled untuned (counted, logged: :func:`untuned_for_rows`); marking only
the batch dim (``mark_dynamic``/``mark_unbacked``) keeps the rows static and the
tuning on. Only the measured default is overridden: ``sized_inductor_options`` given
explicitly is used as given.

That measurement is one CPU's. Frozen symbolic rows run oneDNN's packed GEMM, the
unfrozen ones MKL's (``_torch/packed_linear.py``), and on the 2026-12-06 CPU (AMD
family 26) oneDNN's runs 1.5-4x faster, so there torch's own frozen ``specialize_on``
outran these untuned pieces (bench_hf: its prefill graph). So where every such GEMM is
a float32 ``linear`` whose oneDNN GEMM is measured faster than MKL's at the traced
rows (:func:`frozen_pays`), the tuning stays on.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from .._torch import dynamo, packed_linear
from . import failures

log = logging.getLogger(__name__)

#: Dynamo-graph calls whose first argument is a GEMM's activation (rows x K).
_GEMMS = {*dynamo.LINEARS, torch.matmul, torch.mm, torch.addmm, operator.matmul}
_GEMM_METHODS = {"matmul", "mm", "__matmul__"}


def symbolic_rows(gm: torch.fx.GraphModule, batch_symbol) -> list[str]:
    """The GEMMs of ``gm`` with a model weight (a parameter or buffer: what freezing
    turns into a constant) whose row count (every activation dim but the last) depends
    on a symbol other than ``batch_symbol``, as ``"name: rows"``; empty if none.
    Activation x activation products (attention scores) are not counted: freezing does
    not touch them. ``gm`` is only read."""
    return [f"{node.name}: {rows}" for node, rows, _ in _symbolic_gemms(gm, batch_symbol)]


def frozen_pays(gm: torch.fx.GraphModule, batch_symbol) -> bool:
    """Whether, on this CPU, every GEMM :func:`symbolic_rows` names runs faster frozen
    than not: each is a float32 ``linear`` whose weight freezing would pack for oneDNN
    (symbolic rows), and oneDNN's packed GEMM measured faster than MKL's (what the
    unfrozen ``linear`` runs) at the rows the graph was traced with
    (:func:`.._torch.packed_linear.onednn_faster`). ``False`` where any is not, cannot
    be measured, or the measurement is switched off: the rule above stands."""
    if not packed_linear.enabled():
        return False
    found = _symbolic_gemms(gm, batch_symbol)
    for node, rows, weight in found:
        hint = getattr(getattr(rows, "node", None), "hint", None)
        if (node.target not in dynamo.LINEARS
                or not isinstance(weight, torch.Tensor) or weight.dim() != 2):
            return False
        n, k = weight.shape
        if not packed_linear.onednn_wins(hint, k, n, weight.dtype):
            return False
    return bool(found)


def _symbolic_gemms(gm: torch.fx.GraphModule, batch_symbol) -> list[tuple[torch.fx.Node, Any, Any]]:
    """``(node, rows, weight example)`` of every GEMM :func:`symbolic_rows` names (the
    example Dynamo traced the weight node with, ``None`` where it recorded none)."""
    found = []
    for node in gm.graph.nodes:
        if not _is_gemm(node) or not node.args:
            continue
        act, weight = (node.args[1], node.args[2]) if node.target is torch.addmm else node.args[:2]
        if not _is_model_tensor(weight):  # activation x activation: no weight to freeze
            continue
        value = dynamo.placeholder_example(act) if isinstance(act, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        rows = 1
        for s in value.shape[:-1]:
            rows = rows * s
        free = getattr(rows, "node", None)
        symbols = free.expr.free_symbols if free is not None else set()
        if symbols - {batch_symbol}:
            found.append((node, rows, dynamo.placeholder_example(weight)))
    return found


def _is_model_tensor(node) -> bool:
    """A parameter or buffer (what freezing would make a constant), possibly transposed
    or viewed on its way to the GEMM."""
    while isinstance(node, torch.fx.Node):
        if node.op == "get_attr":
            return True
        if node.op == "placeholder":
            return not dynamo.is_user_input(node)
        if node.op == "call_method" and node.target in ("t", "transpose", "permute", "view", "reshape") \
                or node.op == "call_function" and node.target in (torch.t, torch.transpose, torch.permute):
            node = node.args[0]
            continue
        return False
    return False


def _is_gemm(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _GEMMS
    return node.op == "call_method" and node.target in _GEMM_METHODS


def untuned_for_rows(graph_id: int, gemms: list[str]) -> None:
    """Counted per graph (``fallbacks["sized_untuned_symbolic_rows"]``), a warning once
    per process, INFO after: the graph's listed sizes compile like its general pieces."""
    failures.tell_once(
        "sized_untuned_symbolic_rows", log,
        "sizebackend: graph %d: %d GEMMs keep a symbolic row count at every listed "
        "size (%s), where frozen weights run slower than none; its listed sizes compile "
        "without the CPU tuning. The other symbols come from dynamic=True or from a dim "
        "Dynamo saw change; where the batch is the only dim that varies, mark it alone "
        "(torch._dynamo.mark_dynamic(x, 0) or mark_unbacked) to have them tuned",
        graph_id, len(gemms), ", ".join(gemms[:3]) + (", ..." if len(gemms) > 3 else ""),
    )
