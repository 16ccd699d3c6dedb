"""The ``sizebackend`` Dynamo backend: ``torch.compile(m, backend="sizebackend", options=...)``.

Registered through the ``torch_dynamo_backends`` entry point (see setup.py). This module
must not call ``register_backend`` itself: torch loads the entry point lazily and would
then see the name twice ("duplicate name"). The stages live in :mod:`.compile` (graph
to pieces) and :mod:`.runtime` (pieces to calls).
"""
from __future__ import annotations

from typing import Any

import torch.fx

from .compile import background
from .compile.failures import SizeCompileError
from .compile.pipeline import GraphCompiler
from .options import check_options
from .runtime import recompile_limit

__all__ = ["sizebackend", "SizeCompileError"]

_graph_counter = iter(range(1 << 62))


def sizebackend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None, mode: Any = None
):
    """Dynamo backend entry point: ``torch.compile(m, backend="sizebackend", options=...)``."""
    opts = check_options(options, mode=mode)
    recompile_limit.WATCH.note_compiling_frame()
    return GraphCompiler(opts, next(_graph_counter))(gm, example_inputs)


def _reset() -> None:
    """Called by ``torch._dynamo.reset()``: stop background compiles of dropped graphs
    and forget the frames the recompile-limit watch knew."""
    background.cancel_all()
    recompile_limit.WATCH.reset()


sizebackend.reset = _reset  # type: ignore[attr-defined]
