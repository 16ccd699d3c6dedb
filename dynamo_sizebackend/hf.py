"""One Dynamo graph family for every batch size of a Hugging Face ``generate()``.

``model.forward = dynamo_sizebackend.hf.compile_forward(model, {"compile_sizes": [1, 2, 4]})``
compiles ``model.forward`` with the backend (README recipe 1) and, before every call,
marks the batch dim *unbacked* on each tensor that carries it, so that Dynamo never
guards on the batch value: batch 1 is no longer a static graph of its own (Dynamo's 0/1
specialization of a backed size, compiled with the general, untuned options) but one of
the listed sizes inside the same graph. What each part of the marking is for:

- one ``shape_id`` for all of them, and ``min=1``. A plain ``mark_unbacked(t, 0)`` per
  tensor makes each its own symbol with a range open at 0, and the SDPA integration
  (``transformers/integrations/sdpa_attention.py``) breaks the graph at every layer:
  the attention call combines tensors whose batches are different symbols ("Could not
  guard on data-dependent expression Eq(u2, u1)"), and the ``-1`` in ``attn_output
  .reshape(attn_output.shape[0], -1, q_length, ...)`` needs the batch times the other
  dims not to be 0 ("... Ne(48*u1, 0)"). The shared id makes the batch one symbol; ``min=1``,
  the batch's true bound, settles the ``-1`` by itself (measured: with ``min=1`` alone
  only the ``Eq`` breaks remain; with the shared id alone, none in this model).
- every call, the cache included. ``StaticCache`` allocates its tensors lazily, inside
  the first (prefill) call, so they are inputs only from the second call on. Left
  unmarked they are guarded on their batch, and each batch gets decode graphs of its
  own. They live across calls: a tensor marked already is skipped (the per-call cost
  is a look at each cache tensor, about 14 us for 32 layers). The cache comes as the
  keyword ``cache`` (transformers 5.x), or ``past_key_values`` in older versions; its
  per-layer ``layers[i].keys`` / ``.values`` have the batch in dim 0.
- ``position_ids`` (like every other tensor) only when its dim 0 is the batch: a
  ``[1, S]`` one at a larger batch is a broadcast and stays unmarked. At batch 1 it is
  marked: ``generate()`` passes one row per sequence, and left unmarked there it made
  the graph traced at batch 1 static in ``position_ids``, so when batch 1 came first
  the next batch brought 2 graphs more (5, not 3). A caller who later broadcasts a
  ``[1, S]`` at a larger batch fails that graph's guard and gets a graph of its own.

The batch is dim 0 of ``input_ids`` (or of the first positional tensor) or, without it,
of ``inputs_embeds``; a call with neither is passed on unmarked. Tensors whose dim 0 is
not the batch are left alone. Nothing here imports transformers: the keywords and the
cache are read by name.

Measured with a 1-layer Llama, ``compiler="eager"``, ``compile_sizes=[1, 2, 4]``,
``generate()`` (5 new tokens, static cache) at batches 2, 1, 4, 3 and a left-padded 3:
3 graphs instead of recipe 1's 7, no graph breaks, every forward call served, batch 1
under ``stats().calls["1"]``, tokens equal eager (``tests/models/test_hf_unbacked.py``).
Plain ``mark_unbacked(t, 0)``: 18 graphs; ``min=1`` without the shared id: 23; both up
to Dynamo's recompile limit, the later calls eager. The cache left unmarked: 5 graphs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._torch.dynamo import batch_unbacked, mark_batch_unbacked

#: The one ``shape_id`` of every batch dim marked here: all of them are one symbol.
BATCH_SHAPE_ID = "sizebackend.hf.batch"
#: Keyword inputs that carry the batch in dim 0, when their dim 0 is the batch's size.
_BATCH_KWARGS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")
_CACHE_KWARGS = ("cache", "past_key_values")


def compile_forward(model: torch.nn.Module, options: dict | str | None = None,
                    **compile_kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(model.forward, backend="sizebackend", options=options,
    **compile_kwargs)``, wrapped so that every call marks its batch dim unbacked (see
    the module docstring). Assign the result to ``model.forward``.

    The wrapper counts its calls (``.calls``) and the tensors it marked (``.marked``):
    compare ``.calls`` with ``sum(stats().calls.values())`` to see that every forward
    call ran on the backend's graphs.
    """
    compiled = torch.compile(model.forward, backend="sizebackend", options=options,
                             **compile_kwargs)

    # wraps: generate() reads forward's signature to choose the keywords it passes.
    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        forward.calls += 1
        forward.marked += mark_batch(args, kwargs)
        return compiled(*args, **kwargs)

    forward.calls = 0
    forward.marked = 0
    return forward


def mark_batch(args: tuple, kwargs: dict[str, Any]) -> int:
    """Mark dim 0 unbacked on the call's tensors that carry the batch; returns how many
    were marked now (tensors marked before, such as the cache's, are not counted)."""
    batch = _batch(args, kwargs)
    if batch is None:
        return 0
    tensors = [kwargs.get(name) for name in _BATCH_KWARGS]
    if args:
        tensors.append(args[0])
    for name in _CACHE_KWARGS:
        for layer in getattr(kwargs.get(name), "layers", ()):
            tensors += (getattr(layer, "keys", None), getattr(layer, "values", None))
    marked = 0
    for t in tensors:
        # The cheap test first: after the first calls most tensors are a marked cache.
        if isinstance(t, torch.Tensor) and not batch_unbacked(t) and t.dim() > 0 \
                and t.shape[0] == batch:
            mark_batch_unbacked(t, BATCH_SHAPE_ID)
            marked += 1
    return marked


def _batch(args: tuple, kwargs: dict[str, Any]) -> int | None:
    for value in (kwargs.get("input_ids"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None
