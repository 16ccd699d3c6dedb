"""Split a Dynamo graph at attention (and other named) ops into pieces.

The result is ``[piece, split op, piece, ...]`` as submodules of a new GraphModule whose
forward calls them in the original order. Keeping the original node order matters:
a split op such as ``sizebackend::attention`` writes its KV cache in place, so moving a
node across it could read a cache before it is written.
"""
from __future__ import annotations

import importlib
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx

from .._torch import dynamo, fx, shape_env
from ..options import OptionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """One submodule of the split graph, and why it exists."""

    name: str
    """Attribute name of the submodule in the split GraphModule (``submod_N``)."""
    is_split_op: bool
    """True for a split op (run eagerly); False for a piece that gets compiled."""
    reason: str
    """The splitting-op name that matched, or ``"between split ops"``."""


@dataclass(frozen=True)
class SplitGraph:
    gm: torch.fx.GraphModule
    pieces: tuple[Piece, ...]

    @property
    def compiled_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if not p.is_split_op)

    @property
    def split_op_names(self) -> frozenset[str]:
        """The submodule names of the split ops (run eagerly, never compiled)."""
        return frozenset(p.name for p in self.pieces if p.is_split_op)


def _resolve_python(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


class OpMatcher:
    """Decides whether an FX node calls one of ``splitting_ops``.

    Names are resolved up front so that a typo is an error when the graph arrives, not a
    model that silently never splits.
    """

    def __init__(self, names: tuple[str, ...]):
        self._packets: dict[str, str] = {}  # "ns::op" -> name as given
        self._overloads: dict[tuple[str, str], str] = {}  # ("ns::op", overload) -> name
        self._objects: dict[int, str] = {}  # id(python callable) -> name
        for name in names:
            if "::" in name:
                ns, _, rest = name.partition("::")
                op, _, overload = rest.partition(".")
                try:
                    packet = getattr(getattr(torch.ops, ns), op)
                    if overload:
                        getattr(packet, overload)
                except (AttributeError, RuntimeError):
                    raise OptionError(
                        f"sizebackend option 'splitting_ops': no op {name!r} is registered "
                        f"(is its library loaded?) (got {name!r})"
                    ) from None
                if overload:
                    self._overloads[(f"{ns}::{op}", overload)] = name
                else:
                    self._packets[f"{ns}::{op}"] = name
            else:
                try:
                    obj = _resolve_python(name)
                except (ImportError, AttributeError):
                    raise OptionError(
                        f"sizebackend option 'splitting_ops': cannot resolve Python name "
                        f"{name!r} (got {name!r})"
                    ) from None
                self._objects[id(obj)] = name
                # Dynamo records torch.* Python ops by their builtin; keep both spellings.
                self._objects[id(getattr(obj, "__wrapped__", obj))] = name

    def match(self, node: torch.fx.Node) -> str | None:
        if node.op != "call_function":
            return None
        names = fx.op_names(node.target)
        if names is None:
            return self._objects.get(id(node.target))
        qual, overload = names
        return self._overloads.get((qual, overload)) or self._packets.get(qual)


def _inline_constant_floats(
    gm: torch.fx.GraphModule, partition_of: dict[torch.fx.Node, int]
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, int]]:
    """Pass a SymFloat whose value Dynamo has pinned (a guarded constant) to other
    partitions as the plain float, not as a piece output (see :func:`pieces_return_floats`).

    Works on a copy when there is anything to change; ``gm`` is not mutated.
    """
    def crossing(graph: torch.fx.Graph, where: dict[torch.fx.Node, int]):
        for node in graph.nodes:
            value = shape_env.constant_float(dynamo.placeholder_example(node))
            if value is None or node not in where:
                continue
            for user in list(node.users):
                if user.op != "output" and where.get(user) != where[node]:
                    yield node, user, value

    if next(crossing(gm.graph, partition_of), None) is None:
        return gm, partition_of
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    where = {copies[node]: part for node, part in partition_of.items()}
    for node, user, value in list(crossing(graph, where)):
        user.replace_input_with(node, value)
    return torch.fx.GraphModule(gm, graph), where


def _getitem_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node ``node`` indexes when it is ``operator.getitem(that, i)``."""
    if node.op == "call_function" and node.target is operator.getitem and node.args:
        source = node.args[0]
        return source if isinstance(source, torch.fx.Node) else None
    return None


def split(gm: torch.fx.GraphModule, matcher: OpMatcher) -> SplitGraph:
    """Split ``gm`` (not mutated) at every node ``matcher`` accepts.

    Each split op gets a partition of its own; the nodes between two split ops form one
    piece. A graph without split ops becomes a single piece. A ``getitem`` of a split op's
    result (``torch.split``, ``chunk``... return tuples) goes with the split op, so that
    pieces take tensors, never the tuple.
    """
    partition_of: dict[torch.fx.Node, int] = {}
    reasons: dict[int, str] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = _getitem_source(node)
        if source is not None and partition_of.get(source) in reasons:
            partition_of[node] = partition_of[source]  # also a getitem of such a getitem
            continue
        op = matcher.match(node)
        if op is not None:
            current += 1
            partition_of[node] = current
            reasons[current] = op
            current += 1
        else:
            partition_of[node] = current

    gm, partition_of = _inline_constant_floats(gm, partition_of)
    split_gm = fx.split_module(gm, lambda node: partition_of[node])
    pieces = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        reason = reasons.get(index)
        pieces.append(Piece(node.target, reason is not None, reason or "between split ops"))
    log.debug("split into %d pieces: %s", len(pieces), [p.name for p in pieces])
    return SplitGraph(split_gm, tuple(pieces))


def pieces_return_floats(sg: SplitGraph) -> bool:
    """True when a compiled piece returns a SymFloat.

    A Python float Dynamo kept symbolic (GPT-2's attention ``scaling`` becomes
    ``scaling_tensor.item()``, its GELU ``math.sqrt(2 / math.pi)`` a ``_sym_sqrt`` node)
    can be computed in one piece and used by the next piece or by a split op. Inductor
    cannot return a SymFloat from a graph (it fails with an assertion on the output
    list). Floats Dynamo already pinned to a value are passed on as constants by
    :func:`split`; any left here must be specialized by tracing again.
    """
    for piece in sg.compiled_pieces:
        for node in getattr(sg.gm, piece.name).graph.nodes:
            if node.op != "output":
                continue
            outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for value in outputs:
                if isinstance(value, torch.fx.Node) and isinstance(
                    dynamo.placeholder_example(value), torch.SymFloat
                ):
                    return True
    return False
