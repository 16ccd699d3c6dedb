"""A sized program run as one C++ call: no Python between its pieces.

Split at attention, a listed size runs its pieces one after another, and the split
graph's generated forward pays Python for each: the piece's wrapper, a Python tensor for
every value it hands on, a Python op call per attention. On a CPU whose pieces are
AOTInductor packages that is most of what the split costs against one whole-graph
compile (profile in the README's performance section). When every compiled piece of a
program is a package run by torch's CPU container runner (``cache/aot.py``,
``_torch/aoti.py``) and every split op is one call of a registered op,
:func:`build` turns the split graph into a plan for ``_C.Chain`` (``csrc/chain.cpp``):
which call arguments to read, which runner or op each step calls with which values,
where each result goes, when each value is dropped. The runner then calls the chain
instead of the generated forward; the tensors and the order of the calls are the same.

A split op is one call of an op the dispatcher knows: a registered op (ours, or a
user's, with a C++ or a Python kernel), or a torch binding of one ATen op
(``F.scaled_dot_product_attention``). Anything else (a JIT-compiled piece, a split op
that is a Python function, a graph node the plan does not know, a profiler running,
CUDA-graph capture) keeps the generated forward.
Off with the option ``direct_calls=False`` (``SIZEBACKEND_DIRECT_CALLS=0``), which also
turns off ``_torch/direct_call.py``'s shortcuts.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Collection, Mapping

import torch
import torch.fx

from .. import _C
from .._torch import aoti, dynamo

log = logging.getLogger(__name__)

#: Constants an op step may take as they are (converted by the op's schema).
_CONSTANTS = (bool, int, float, str, type(None))


class NotChained(Exception):
    """Why a program keeps the generated forward (logged at DEBUG)."""


def _package_step(piece: Any) -> tuple[Any, tuple[int, ...], Any]:
    """The package (the chain runs its runner and holds it, which keeps its constants),
    argument positions and outputs (``cache.aot.Outputs``) of an AOT piece."""
    from ..cache.aot import AotPiece  # cache imports runtime modules

    if not isinstance(piece, AotPiece):
        raise NotChained(f"a piece is not an AOT package ({type(piece).__name__})")
    if piece.outputs is None:
        raise NotChained("a package's outputs are not one tensor or a tuple of tensors")
    if not isinstance(piece.package, aoti.AlignedCpuPackage):
        raise NotChained("a package runs on torch's loader, not the container runner")
    return piece.package, piece.positions, piece.outputs


def _op_call(piece: Any) -> tuple[torch._ops.OpOverload, list[Any], torch.fx.Node]:
    """The one op a split-op submodule calls: the op, its schema-ordered arguments (FX
    nodes of the submodule or constants) and the node."""
    sub = getattr(piece, "__self__", None)
    if not isinstance(sub, torch.fx.GraphModule) or getattr(piece, "__func__", None) is None \
            or piece.__name__ != "forward":
        raise NotChained(f"a split op is not a graph's forward ({type(piece).__name__})")
    calls = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    op = calls[0].target if len(calls) == 1 and calls[0].op == "call_function" else None
    op = _builtin_op(op) or op
    if isinstance(op, torch._ops.OpOverloadPacket) and len(op.overloads()) == 1:
        op = getattr(op, op.overloads()[0])  # as traced from torch.ops.ns.name(...)
    if not isinstance(op, torch._ops.OpOverload):
        raise NotChained("a split op's graph is not one call of an op overload")
    node = calls[0]
    out = next(iter(reversed(sub.graph.nodes))).args[0]
    if out is not node:
        raise NotChained("a split op's graph does not return its op's result")
    schema = op._schema
    if any(not isinstance(r.type, torch.TensorType) for r in schema.returns) or not schema.returns:
        raise NotChained(f"{op} returns a non-tensor")
    names = {arg.name for arg in schema.arguments}
    if len(node.args) > len(schema.arguments) or not set(node.kwargs) <= names:
        raise NotChained(f"{op}: the call does not bind to its schema")
    values = []
    for j, arg in enumerate(schema.arguments):
        if j < len(node.args):
            values.append(node.args[j])
        elif arg.name in node.kwargs:
            values.append(node.kwargs[arg.name])
        elif arg.has_default_value():
            values.append(arg.default_value)
        else:
            raise NotChained(f"{op}: argument {arg.name} missing")
    return op, values, node


#: Modules of torch's Python bindings, whose functions call the ATen op of their name.
_BINDINGS = ("torch._C._nn", "torch._C._VariableFunctions", "torch", "torch._C._linalg",
             "torch._C._special", "torch._C._fft")


def _builtin_op(target: Any) -> Any:
    """The ATen op packet a torch binding calls (``F.scaled_dot_product_attention`` is
    recorded by Dynamo as ``torch._C._nn.scaled_dot_product_attention``), or ``None``.
    Only a packet of one overload: the binding cannot have picked another."""
    if type(target).__name__ != "builtin_function_or_method" \
            or getattr(target, "__module__", None) not in _BINDINGS:
        return None
    packet = getattr(torch.ops.aten, target.__name__, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket) or len(packet.overloads()) != 1:
        return None
    return packet


class _Planner:
    def __init__(self) -> None:
        self.slots = 0
        self.value: dict[torch.fx.Node, Any] = {}  # node -> slot, ("call", position) or [slots]
        self.steps: list[list[Any]] = []
        self.reads: list[list[int]] = []  # per step, the slots it reads
        self.inputs: list[tuple[int, int]] = []

    def new_slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def slot_of(self, node: Any) -> int:
        v = self.value.get(node) if isinstance(node, torch.fx.Node) else None
        if not isinstance(v, int):
            raise NotChained(f"{node} is not a tensor the plan holds")
        return v


def build(split_gm: torch.fx.GraphModule, pieces: Mapping[str, Callable[..., Any]],
          split_ops: Collection[str]) -> Any:
    """``_C.Chain`` for ``pieces`` bound to ``split_gm``'s graph (``split_ops``: the
    names of the pieces that are split ops); raises :class:`NotChained` where the
    program needs the generated forward."""
    p = _Planner()
    position = 0
    output: Any = None
    for node in split_gm.graph.nodes:
        if node.op == "placeholder":
            example = dynamo.placeholder_example(node)
            if isinstance(example, torch.Tensor):
                slot = p.new_slot()
                p.inputs.append((position, slot))
                p.value[node] = slot
            else:
                p.value[node] = ("call", position)
            position += 1
        elif node.op == "call_module":
            if node.kwargs:
                raise NotChained(f"{node.target} is called with keywords")
            piece = pieces.get(node.target)
            if piece is None:
                raise NotChained(f"no piece {node.target}")
            if node.target not in split_ops:
                package, positions, outputs = _package_step(piece)
                reads = [p.slot_of(node.args[i]) for i in positions]
                outs = [-1] * outputs.count
                if outputs.kind == "one":
                    outs[0] = p.value[node] = p.new_slot()
                else:
                    p.value[node] = outs
                p.steps.append(["package", package, reads, outs])
                p.reads.append(reads)
            else:
                op, values, op_node = _op_call(piece)
                placeholders = [n for n in op_node.graph.nodes if n.op == "placeholder"]
                outer = dict(zip(placeholders, node.args))
                args, reads = [], []
                for v in values:
                    if isinstance(v, torch.fx.Node):
                        if v not in outer:
                            raise NotChained(f"{op}: an argument is not an input of its graph")
                        held = p.value.get(outer[v]) if isinstance(outer[v], torch.fx.Node) else None
                        if isinstance(held, int):
                            args.append(("slot", held))
                            reads.append(held)
                        elif isinstance(held, tuple):
                            args.append(held)
                        else:
                            raise NotChained(f"{op}: an argument the plan does not hold")
                    elif isinstance(v, _CONSTANTS):
                        args.append(("constant", v))
                    else:
                        raise NotChained(f"{op}: a constant of type {type(v).__name__}")
                count = len(op._schema.returns)
                outs = [p.new_slot() for _ in range(count)]
                p.value[node] = outs[0] if count == 1 else outs
                p.steps.append(["op", (op._schema.name, op._overloadname if
                                       op._overloadname != "default" else ""), args, outs])
                p.reads.append(reads)
        elif node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            outs = p.value.get(source)
            if not isinstance(outs, list) or not isinstance(index, int):
                raise NotChained(f"{node}: getitem of something not a step's outputs")
            if outs[index] < 0:
                outs[index] = p.new_slot()
            p.value[node] = outs[index]
        elif node.op == "output":
            output = node.args[0]
        else:
            raise NotChained(f"{node.op} {node.target} in the split graph")
    as_tuple = isinstance(output, (tuple, list))
    result = [p.slot_of(n) for n in (output if as_tuple else [output])]
    # Each slot is dropped after its last reader (never a result).
    last: dict[int, int] = {}
    for i, reads in enumerate(p.reads):
        for s in reads:
            last[s] = i
    release: list[list[int]] = [[] for _ in p.steps]
    for s, i in last.items():
        if s not in result:
            release[i].append(s)
    steps = [(kind, target, args, outs, release[i])
             for i, (kind, target, args, outs) in enumerate(p.steps)]
    return _C.Chain(p.slots, p.inputs, steps, result, as_tuple)


def try_build(split_gm: torch.fx.GraphModule, pieces: Mapping[str, Callable[..., Any]],
              split_ops: Collection[str], graph_id: int, key: str) -> Any:
    """:func:`build`, or ``None`` with the reason at DEBUG."""
    try:
        chain = build(split_gm, pieces, split_ops)
    except NotChained as e:
        log.debug("sizebackend: graph %d: size %s runs its pieces from Python: %s", graph_id, key, e)
        return None
    log.debug("sizebackend: graph %d: size %s runs as one C++ chain of %d steps", graph_id, key,
              len(chain))
    return chain
