"""What the backend did, where torch's own tools look: ``TORCH_TRACE`` and the profiler.

- **Structured trace** (``TORCH_TRACE=<dir>``, read with tlparse): :func:`artifact`
  writes a JSON artifact into torch's structured log, beside Dynamo's and Inductor's
  entries of the same frame (``sizebackend_split``: a graph's pieces, split ops and
  sizes; ``sizebackend_piece``: one piece compile, its size, outcome and seconds;
  ``sizebackend_fallback``: a fallback and its reason). Free when ``TORCH_TRACE`` is
  unset: torch's trace logger has no handler then and the payload is never built.
- **Profiler** (``torch.profiler.profile``): :func:`profiling` says whether a profiler
  runs (the flag torch keeps for fast Python checks); the runner then calls a
  program whose pieces are wrapped in ranges named ``sizebackend/g<graph>/<piece>/<size>``
  (:func:`ranged`). Without a profiler the cost is that one flag read per graph call.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch


def artifact(name: str, payload: Callable[[], Mapping[str, Any]]) -> None:
    """A ``TORCH_TRACE`` artifact ``name`` whose JSON payload ``payload()`` builds (only
    when a trace is being written). Compiles outside Dynamo's (a background or lazy
    size) carry no frame id; torch then records where the call came from."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: dict(payload()),
        expect_trace_id=False,
    )


def profiling() -> bool:
    """Whether a ``torch.profiler``/``torch.autograd.profiler`` profile is running."""
    return torch.autograd.profiler._is_profiler_enabled


def range_name(graph_id: int, piece: str, key: str) -> str:
    """``sizebackend/g0/piece3/size4`` (``.../dynamic`` for the general pieces)."""
    index = piece.removeprefix("submod_")
    label = f"piece{index}" if index.isdigit() else piece
    return f"sizebackend/g{graph_id}/{label}/{key if key == 'dynamic' else 'size' + key}"


def ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` inside a profiler range ``name``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return call
