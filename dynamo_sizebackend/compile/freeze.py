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

Hazard, and how it is handled: a frozen piece holds the weights' values of the moment
it was compiled. A weight changed in place afterwards (``load_state_dict``, an optimizer
step) or replaced (``module.weight.data = ...``) would leave the sized pieces computing
with the old values while the general ones see the new: results that depend on the
batch size. :class:`FrozenWeights` records each frozen tensor's version counter and
address, and the runner checks them before each call of a frozen program; a change
retires the program (counted in ``fallbacks["frozen_weights"]``, logged once) and the
size is compiled again, with the new values, on its next call.

Not frozen: tensors the graph writes in place (a KV cache the attention op fills) and
anything that is a user input. Freezing only happens with grad mode off while the size
compiles (Inductor's rule: a frozen graph has no backward).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx

from .. import _torch
from .._torch import dynamo, shape_env
from ..runtime.padding import mutated_inputs


def freezable_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The real tensors behind ``gm``'s parameter and buffer placeholders (by
    placeholder name) that the graph does not write: what sized pieces may freeze."""
    written = set(mutated_inputs(gm))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for node, value in zip(placeholders, example_inputs):
        if (
            isinstance(value, torch.Tensor)
            and not shape_env.is_fake(value)
            and not dynamo.is_user_input(node)
            and node.name not in written
        ):
            found[node.name] = value
    return found


def freeze_piece(
    split_gm: torch.fx.GraphModule, name: str, constants: dict[str, torch.Tensor]
) -> tuple[torch.fx.GraphModule, list[int], list[torch.Tensor]] | None:
    """A copy of piece ``name`` of ``split_gm`` whose freezable inputs (``constants``,
    by top-level placeholder name) are ``get_attr`` nodes on the real tensors:
    ``(piece, kept argument positions, frozen tensors)``, or ``None`` when the piece
    takes none of them. ``split_gm`` and its piece are not mutated."""
    sub = getattr(split_gm, name)
    call = next(n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    # split_module passes each piece its inputs in the order of its placeholders.
    assert len(placeholders) == len(call.args), (name, len(placeholders), len(call.args))
    frozen = {
        i: constants[a.name] for i, a in enumerate(call.args)
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
        tensor = frozen[i]
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
    """The frozen tensors of one sized program, and what they were when compiled."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        unique = {id(t): t for t in tensors}
        self._tensors = tuple(unique.values())
        self._seen = tuple((_torch.tensor_version(t), t.data_ptr()) for t in self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def changed(self) -> bool:
        """Whether any frozen tensor was written in place or given new storage since."""
        for tensor, seen in zip(self._tensors, self._seen):
            if (_torch.tensor_version(tensor), tensor.data_ptr()) != seen:
                return True
        return False
