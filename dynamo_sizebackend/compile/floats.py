"""Python floats in the graph: which ones Dynamo must trace as constants.

Two cases need floats specialized before anything is compiled (the eager adaptor needs
neither):
- a float read from an attribute, global or container (a norm's eps): model config, not
  a call argument. Left symbolic, Inductor specializes it during a real compile (Dynamo
  then traces again) but not when its cache holds the graph, so a warm process traced
  different pieces than a cold one and recompiled them. As a constant from the first
  trace on, both trace the same pieces, with the same cache keys. The backend names
  these floats to Dynamo while it finishes the frame's first trace
  (:func:`.._torch.dynamo.specialize_attribute_floats_when`, installed by
  ``backend.py``), so they cost no second trace; :func:`specialize_if_needed` asks for
  a restart only when that hook did not see the frame (a wrapper of the backend it does
  not recognise);
- a piece returns a symbolic float (Inductor cannot return a SymFloat from a graph):
  Dynamo traces again with every float specialized (rare; one more trace).
Frame-argument floats stay symbolic: a new value never recompiles.

Why a piece cannot keep an attribute float symbolic when ``torch.compile``'s whole graph
can (torch 2.13): Inductor's ``tensorify_python_scalars`` pass turns a graph's float
math into 0-d tensor math, then specializes every float symbol of the ShapeEnv that this
graph did not tensorify (its last loop, over ``backed_var_to_val``). Our pieces share
Dynamo's ShapeEnv, so compiling the first piece specializes the eps of every later
layer and restarts Dynamo: measured on the built-in Llama (2 layers) with the
specialization turned off, the frame was traced three times (36, 32, then 31 inputs) and
the warm process recompiled 3 of 10 pieces. ``torch.compile``'s one graph tensorifies
them all and keeps them as inputs, which Dynamo then wraps in a tensor on every call;
as constants they cost nothing per call. Until 2026-12-05 the backend got them by a
restart from inside its first compile (one more trace at every start, about 0.5 s on
that Llama); Dynamo specializes the floats ``TensorifyState`` names only when it
finishes a trace, so naming them in the first trace yields the same graph.
"""
from __future__ import annotations

import logging

import torch.fx

from .._torch import dynamo, shape_env
from .split import SplitGraph, pieces_return_floats

log = logging.getLogger(__name__)


def specialize_if_needed(gm: torch.fx.GraphModule, sg: SplitGraph, fake_mode, graph_id: int) -> None:
    """Raise Dynamo's restart exception when floats must become constants; return when
    none must, or when they already were once (a frame cannot restart forever)."""
    if pieces_return_floats(sg):
        floats = shape_env.float_symbol_names(fake_mode)
        log.info(
            "sizebackend: graph %d: a piece returns a symbolic float; asking Dynamo to "
            "trace again with floats %s as constants", graph_id, sorted(floats),
        )
        dynamo.restart_with_floats_specialized(floats)
    attributes = dynamo.attribute_float_symbols(gm.graph)
    if attributes:
        log.info(
            "sizebackend: graph %d: asking Dynamo to trace again with the float "
            "attributes %s as constants", graph_id, sorted(attributes.values()),
        )
        dynamo.restart_with_floats_specialized(set(attributes))
