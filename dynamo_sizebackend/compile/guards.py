"""The shape guards a size's compiles assumed, as a check its program runs per call.

Other symbolic dims stay symbolic in the sized pieces, but Inductor may still decide on
them (a slice length, a reduction strategy) using the values they had when Dynamo
traced, and record those decisions as guards in the size's fresh ShapeEnv. Dynamo never
sees those guards (it checks the general pieces' ones), and with the batch fixed a
decision can differ from the general one: ``x.flatten(0, 1)[:64]`` traced at 3x20 admits
4x10, yet the size-4 compile at seq 20 bakes in a slice of 64 rows. So the program
carries a check of its own guards, and a call that breaks them runs the general pieces.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .._torch import shape_env

Check = Callable[[Sequence[Any]], bool]


def size_check(fake_mode, graph_inputs: Sequence[Any]) -> tuple[str, Check] | None:
    """``(source, check)`` for the guards compiles in ``fake_mode`` added, or ``None``
    when they added none. ``graph_inputs``: the graph's placeholder fakes made in
    ``fake_mode``, in argument order. Raises when a guard cannot be checked: the size
    must then never run unchecked."""
    if not shape_env.added_guards(fake_mode):
        return None
    return shape_env.guard_checker(fake_mode, graph_inputs)
