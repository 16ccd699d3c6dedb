"""Constant weights for sized pieces: what lets Inductor specialize their matmuls.

A fixed batch size alone buys little on CPU: the linears are the same aten GEMMs the
general pieces call. What a static piece *can* have that a general one cannot use as
well is a compile that treats the weights as constants (Inductor's ``freezing``): it
prepacks them and, with ``max_autotune`` and the ``CPP`` GEMM backend, benchmarks its
C++ GEMM template (which needs a constant weight) against aten for each matmul at that
batch size. Measured on the built-in Llama: listed sizes at 0.60-0.72x of
``torch.compile(dynamic=False)`` (see benchmarks/bench_tuning.py).

In a split graph the parameters reach every piece as graph inputs (Dynamo lifts them),
so freezing them needs a copy of the piece whose parameter inputs are ``get_attr``
nodes on the real tensors: AOTAutograd lifts a GraphModule's parameters and buffers
(``params_flat``), and Inductor's freezing turns those into constants. The compiled
piece takes the remaining arguments only; :func:`drop_args` adapts it to the split
graph's call.

What is frozen, exactly: a graph input that is an ``nn.Parameter`` or a registered
buffer of an ``nn.Module`` (its Dynamo source goes through ``_parameters`` or
``_buffers``: the compiled module's, a global module's, an argument module's), that
the graph does not write in place, that is not an inference tensor, and whose position
never changed before in this graph (below). Never frozen: user inputs, plain tensor
attributes (``self.t = torch.ones(3)``), tensors reached through an argument's or a
global's attributes (``ctx.bias``, a Hugging Face cache's ``cumulative_length``), KV
caches the graph fills, and everything while grad mode is on (Inductor freezes only
graphs without backward).

Hazard, and how it is handled: a frozen piece holds the values of the moment it was
compiled, so a tensor changed afterwards would leave the sized pieces computing with
the old values while the general ones see the new: results that depend on the batch
size. :class:`FrozenWeights` records, *before* the size compiles (a write during the
compile is seen), each frozen tensor's object, storage, data pointer, offset and
version counter, and the runner checks them against the arguments of every call of the
sized program (``csrc/frozen_guard.cpp``, a few ns per tensor):

- a parameter or buffer replaced (``m.w = nn.Parameter(...)``, ``load_state_dict(sd,
  assign=True)``, ``m.buf = t``): Dynamo passes the new object at that position;
- new storage (``m.w.data = t``); an in-place write (``m.w.mul_(2)``,
  ``load_state_dict``, an optimizer step, a write through a view: views share the
  counter).

A change retires the size's programs (``fallbacks["frozen_weights"]``, a warning the
first time per graph) and the size compiles again on that call, with each changed
tensor as an input from then on: a buffer the model's eager code writes every step
costs one recompile per size, not one per call.

Not detectable: a write through ``.data`` (``w.data.copy_(t)``; ``.data`` has a version
counter of its own) and writes to inference tensors (no counter at all, which is why
they are not frozen: ``fallbacks["inference_tensors_not_frozen"]``). After such a
write call :func:`weights_updated`: the frozen programs that hold the module's tensors
compile again, frozen with the new values. The same call after a change the check did
see (a checkpoint reload) lets the module's changed tensors be frozen again.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx

from .. import _C
from .._torch import dynamo, shape_env
from ..runtime.padding import mutated_inputs
from . import failures

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Freezable:
    """A graph input that sized pieces may freeze."""

    index: int
    """Its position among the graph's placeholders: where the runner's arguments hold it."""
    tensor: torch.Tensor
    """The tensor it was traced with."""


def freezable_inputs(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> tuple[dict[str, Freezable], list[str]]:
    """What sized pieces of ``gm`` may freeze, by placeholder name (see the module
    docstring), and the names of the parameters and buffers left out only because they
    are inference tensors."""
    written = set(mutated_inputs(gm))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found, inference = {}, []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if (
            not isinstance(value, torch.Tensor)
            or shape_env.is_fake(value)
            or not dynamo.is_parameter_or_buffer(node)
            or node.name in written
        ):
            continue
        if value.is_inference():
            inference.append(node.name)
        else:
            found[node.name] = Freezable(index, value)
    return found, inference


def not_frozen_inference(graph_id: int, names: list[str]) -> None:
    """Counted per graph (``fallbacks["inference_tensors_not_frozen"]``), a warning once
    per process: inference tensors have no version counter, so an in-place write to one
    could never be seen; such a graph's sized pieces take them as inputs."""
    failures.tell_once(
        "inference_tensors_not_frozen", log,
        "sizebackend: graph %d: %d parameters and buffers are inference tensors "
        "(made under torch.inference_mode()), which record no writes, so the sized pieces "
        "do not freeze them and run slower; build the model outside inference_mode (calling "
        "it under inference_mode is fine) to have them frozen", graph_id, len(names),
    )


def freeze_piece(
    split_gm: torch.fx.GraphModule, name: str, constants: dict[str, torch.Tensor]
) -> tuple[torch.fx.GraphModule, list[int], list[str]] | None:
    """A copy of piece ``name`` of ``split_gm`` whose freezable inputs (``constants``,
    by top-level placeholder name) are ``get_attr`` nodes on the real tensors:
    ``(piece, kept argument positions, names of the frozen inputs)``, or ``None`` when
    the piece takes none of them. ``split_gm`` and its piece are not mutated."""
    sub = getattr(split_gm, name)
    call = next(n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    # split_module passes each piece its inputs in the order of its placeholders.
    assert len(placeholders) == len(call.args), (name, len(placeholders), len(call.args))
    frozen = {
        i: a.name for i, a in enumerate(call.args)
        if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in constants
    }
    if not frozen:
        return None
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(sub.graph, copies))
    root = torch.nn.Module()
    for node in graph.nodes:  # attributes the piece already reads stay where they are
        if node.op == "get_attr":
            _set_path(root, node.target, _get_path(sub, node.target))
    for i, placeholder in enumerate(placeholders):
        if i not in frozen:
            continue
        copy = copies[placeholder]
        target = f"_sb_frozen_{i}"
        with graph.inserting_before(copy):
            attr = graph.get_attr(target)
        attr.meta = dict(copy.meta)
        copy.replace_all_uses_with(attr)
        graph.erase_node(copy)
        tensor = constants[frozen[i]]
        if isinstance(tensor, torch.nn.Parameter):
            root.register_parameter(target, tensor)
        else:
            root.register_buffer(target, tensor)
    graph.lint()
    piece = torch.fx.GraphModule(root, graph, class_name=type(sub).__name__)
    keep = [i for i in range(len(placeholders)) if i not in frozen]
    return piece, keep, list(frozen.values())


def _get_path(module: torch.nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set_path(root: torch.nn.Module, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    if isinstance(value, torch.nn.Parameter):
        root.register_parameter(last, value)
    elif isinstance(value, torch.Tensor):
        root.register_buffer(last, value)
    else:
        setattr(root, last, value)


def drop_args(compiled: Callable[..., Any], keep: Sequence[int]) -> Callable[..., Any]:
    """``compiled`` (which takes the arguments at ``keep``) called with all of them."""
    keep = tuple(keep)

    def call(*args: Any) -> Any:
        return compiled(*[args[i] for i in keep])

    return call


class FrozenWeights:
    """The frozen tensors of one sized program, recorded when it is made (before its
    pieces compile). ``unchanged(args)`` is the per-call check (one C++ call)."""

    def __init__(self, names: Sequence[str], frozen: dict[str, Freezable]):
        self.names = tuple(names)
        self.positions = tuple(frozen[n].index for n in self.names)  # in the runner's args
        self._guard = _C.FrozenGuard(list(self.positions), [frozen[n].tensor for n in self.names])
        self.unchanged: Callable[[tuple[Any, ...]], bool] = self._guard.unchanged
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __len__(self) -> int:
        return len(self.names)

    def changed(self, args: tuple[Any, ...]) -> list[str]:
        """The names of the frozen inputs that ``args`` no longer match (empty when the
        program was retired by :func:`weights_updated` and nothing else changed)."""
        return [self.names[i] for i in self._guard.changed(args)]

    def holds_any(self, tensors: Iterable[torch.Tensor]) -> bool:
        return any(self._guard.holds(t) for t in tensors)

    def retire(self) -> None:
        """From now on ``unchanged`` is false: the program compiles again when next called."""
        self._guard.retire()

    @property
    def retired(self) -> bool:
        return self._guard.retired


# Every FrozenWeights alive, and every graph compiler that freezes, for weights_updated
# (held weakly: a retired program, a graph Dynamo dropped, dies).
_LIVE: weakref.WeakSet[FrozenWeights] = weakref.WeakSet()
_GRAPHS: weakref.WeakSet[Any] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def track(graph: Any) -> None:
    """Register a graph compiler with a ``refreeze(tensor_ids | None) -> int`` method."""
    with _LIVE_LOCK:
        _GRAPHS.add(graph)


def weights_updated(module: torch.nn.Module | None = None) -> int:
    """Tell the backend that tensors it may have frozen changed in a way it cannot see
    (a write through ``.data``, an in-place write under ``torch.inference_mode`` to a
    tensor made there, a write from C++): every frozen sized program that holds a
    parameter or buffer of ``module`` (of any module, when ``None``) is retired, and its
    size compiles again on its next call, frozen with the current values. Returns how
    many programs were retired.

    Changes the backend sees by itself (replacement, new storage, in-place writes on
    the tensor or a view of it) need no call; but each such change makes the tensor an
    input of the sized pieces from then on (one recompile, however often it changes).
    This call also lifts that for the module's tensors: after a checkpoint reload, it
    has the sizes frozen again, with the new values. It also drops every weight copy
    packed at run time for the unfrozen pieces' linears (``compile/linears.py``), of
    any module: each is packed again, from the current values, at its next call."""
    tensors = None
    if module is not None:
        tensors = list(module.parameters()) + list(module.buffers())
    with _LIVE_LOCK:
        live, graphs = list(_LIVE), list(_GRAPHS)
    ids = None if tensors is None else {id(t) for t in tensors}
    retired = sum(graph.refreeze(ids) for graph in graphs)
    _C.clear_packed_linears()  # linears packed at run time (compile/linears.py) pack again
    for frozen in live:
        if not frozen.retired and (tensors is None or frozen.holds_any(tensors)):
            frozen.retire()
            retired += 1
    log.info("sizebackend: weights_updated(%s): %d sized programs retired",
             type(module).__name__ if module is not None else "", retired)
    return retired
