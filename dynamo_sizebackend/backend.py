"""The ``sizebackend`` Dynamo backend: ``torch.compile(m, backend="sizebackend", options=...)``.

Registered through the ``torch_dynamo_backends`` entry point (see setup.py). This module
must not call ``register_backend`` itself: torch loads the entry point lazily and would
then see the name twice ("duplicate name"). The stages live in :mod:`.compile` (graph
to pieces) and :mod:`.runtime` (pieces to calls).
"""
from __future__ import annotations

from typing import Any

import torch.fx

from ._torch import dynamo
from .compile import background
from .compile.failures import SizeCompileError
from .compile.pipeline import GraphCompiler
from .options import check_options, parse_options
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


def _compiles_with_constant_floats(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` for a frame is this backend set to compile with
    Inductor: its frames get their attribute floats as constants in the first trace
    (``compile/floats.py``). Dynamo wraps the backend (``WrapBackendDebug``, then
    ``torch.compile``'s wrapper holding ``options``); the chain is walked to it. A
    wrapper it does not know leaves the frame to the restart in ``compile/floats.py``."""
    kwargs: dict[str, Any] = {}
    fn = compiler_fn
    for _ in range(8):
        if fn is sizebackend:
            break
        kwargs = getattr(fn, "kwargs", None) or getattr(fn, "keywords", None) or kwargs
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "func", None))  # the last: functools.partial(sizebackend, ...)
        if fn is None:
            return False
    else:
        return False
    try:
        opts = parse_options(kwargs.get("options"))
    except Exception:  # the backend raises the user's error itself, with context
        return False
    return opts.compiler != "eager"


dynamo.specialize_attribute_floats_when(_compiles_with_constant_floats)


def _reset() -> None:
    """Called by ``torch._dynamo.reset()``: stop background compiles of dropped graphs
    and forget the frames the recompile-limit watch knew."""
    background.cancel_all()
    recompile_limit.WATCH.reset()


sizebackend.reset = _reset  # type: ignore[attr-defined]
