"""Linears of unfrozen pieces on weights packed at run time (``sizebackend::packed_linear``).

A piece compiled with its weights as inputs (every general piece; a sized piece whose
options do not freeze, or compiled while grad mode is on) gets aten's float32 GEMM from
Inductor, which on x86 is MKL's unpacked sgemm. On some CPUs that is far slower than
oneDNN's GEMM on a packed weight, the kernel a frozen piece runs. Measured 2026-12-06
(AMD family 26, AVX-512, one thread; aten ``linear`` against oneDNN packed, us):

    K x N          1 row        3 rows        24 rows        256 rows
    256 x 1024     16 / 23      40 / 24       134 / 65       1204 / 528
    2048 x 512     50 / 57      138 / 54      549 / 217      4918 / 2087
    512 x 8192    232 / 184     667 / 192     2323 / 842    20759 / 8462

so a general piece's GEMMs ran 2-5x slower than the tuned peers' frozen general graph,
at every unlisted size. Packing needs the values, which a compile with weights as inputs
never sees, so the pieces call ``sizebackend::packed_linear`` instead: it packs each
weight at its first call, keeps the copy while the weight is unchanged (same tensor,
storage and version counter, ``csrc/packed_linear.cpp``) and packs again after an
in-place write, with no recompile.

Which linears: ``linear(x, w, b)`` on the CPU whose weight is a parameter or buffer the
graph does not write (what :func:`.freeze.freezable_inputs` finds; never an inference
tensor, which records no writes), float32 and 2-D, compiled with grad mode off, and whose
shape ``(K, N)`` the op runs faster from some row count on
(:func:`.._torch.packed_linear.runtime_min_rows`, measured once per shape and process;
calls with fewer rows run aten's ``linear`` inside the op). Calls of 1 to
:func:`.._torch.packed_linear.runtime_panel_rows` rows run ``sizebackend::panel_linear``
(the frozen pieces' few-row GEMM) on a second copy, packed in panels at its first such
call under the same check, where that is measured faster than what would run otherwise
(``SIZEBACKEND_PANEL_LINEAR=0``: never). Where the measurements find neither (MKL's
sgemm is fast on the CPU) the graph is left as it is, keeping Inductor's own fusions.
``SIZEBACKEND_PACKED_LINEAR=torch`` leaves every linear alone.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
import torch.fx

from .._torch import dynamo, packed_linear

log = logging.getLogger(__name__)

def piece_inputs_of(split_gm: torch.fx.GraphModule, name: str, names: Iterable[str]) -> set[str]:
    """The placeholders of piece ``name`` that receive one of the top-level inputs
    ``names`` (split_module passes each piece its inputs in placeholder order)."""
    names = set(names)
    call = next(n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name)
    placeholders = [n for n in getattr(split_gm, name).graph.nodes if n.op == "placeholder"]
    return {
        p.name for p, a in zip(placeholders, call.args)
        if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in names
    }


#: ``min_rows`` of a linear whose oneDNN copy never pays (the panels' alone do).
NEVER = 1 << 62


def pack(
    piece: torch.fx.GraphModule,
    weights: set[str],
    min_rows: Callable[[int, int], int | None] | None = None,
    panel_rows: Callable[[int, int], int] | None = None,
) -> tuple[torch.fx.GraphModule, int]:
    """A copy of ``piece`` whose linears on the placeholders ``weights`` call
    ``sizebackend::packed_linear`` where ``min_rows(K, N)`` gives a row count (default:
    :func:`.._torch.packed_linear.runtime_min_rows`) or ``panel_rows(K, N)`` a positive
    one (default: :func:`.._torch.packed_linear.runtime_panel_rows`), and how many it
    rewrote; ``piece`` itself when none (it is never mutated)."""
    if not weights or not packed_linear.enabled():
        return piece, 0
    min_rows = min_rows or packed_linear.runtime_min_rows
    panel_rows = panel_rows or packed_linear.runtime_panel_rows
    plans = []
    for node in piece.graph.nodes:
        found = _linear(node, weights)
        if found is None:
            continue
        n, k = _example(found[1]).shape
        try:
            rows = min_rows(int(k), int(n))
            panels = panel_rows(int(k), int(n))
        except Exception as e:  # a kernel that will not run here: aten's linear stays
            log.debug("linear %s x %s not measured (%s): left to aten", k, n, e)
            rows, panels = None, 0
        if rows is not None or panels > 0:
            plans.append((node, found, NEVER if rows is None else rows, panels))
    if not plans:
        return piece, 0
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(piece.graph, copies))
    for node, (x, w, b), rows, panels in plans:
        copy = copies[node]
        args = (copies[x], copies[w], copies[b] if isinstance(b, torch.fx.Node) else None, rows,
                panels)
        with graph.inserting_before(copy):
            packed = graph.call_function(torch.ops.sizebackend.packed_linear.default, args)
        packed.meta = dict(copy.meta)
        copy.replace_all_uses_with(packed)
        graph.erase_node(copy)
    graph.lint()
    return torch.fx.GraphModule(piece, graph, class_name=type(piece).__name__), len(plans)


def _linear(node: torch.fx.Node, weights: set[str]) -> tuple[Any, Any, Any] | None:
    """``(x, w, b)`` of a float32 CPU ``linear`` node on one of ``weights``, else ``None``."""
    if node.op != "call_function" or node.target not in dynamo.LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    w = node.kwargs.get("weight", args[1])
    b = node.kwargs.get("bias", args[2])
    if not (isinstance(w, torch.fx.Node) and w.op == "placeholder" and w.name in weights):
        return None
    if b is not None and not isinstance(b, torch.fx.Node):
        return None
    tensors = [_example(v) for v in (x, w) + ((b,) if b is not None else ())]
    if any(t is None or t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    w_value = tensors[1]
    if w_value.dim() != 2 or any(not isinstance(d, int) for d in w_value.shape):
        return None
    if b is not None and tensors[2].dim() != 1:
        return None
    return x, w, b


def _example(node: Any) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def log_packed(graph_id: int, key: str, count: int) -> None:
    if count:
        log.info("sizebackend: graph %d: %d linears of the %s pieces run on weights packed "
                 "at run time for oneDNN or panel_linear, over the rows where each was "
                 "measured faster on this CPU than aten's GEMM", graph_id, count, key)

