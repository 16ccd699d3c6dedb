"""Python floats in the graph: which ones Dynamo must trace again as constants.

Two cases make the backend ask Dynamo to restart analysis with floats specialized,
before anything is compiled (the eager adaptor needs neither):
- a piece returns a symbolic float (Inductor cannot return a SymFloat from a graph);
- a float read from an attribute, global or container (a norm's eps): model config, not
  a call argument. Left symbolic, Inductor specializes it during a real compile (Dynamo
  then traces again) but not when its cache holds the graph, so a warm process traced
  different pieces than a cold one and recompiled them. As a constant from the first
  trace on, both trace the same pieces, with the same cache keys.
Frame-argument floats stay symbolic: a new value never recompiles.
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
    attributes = dynamo.attribute_float_symbols(gm)
    if attributes:
        log.info(
            "sizebackend: graph %d: asking Dynamo to trace again with the float "
            "attributes %s as constants", graph_id, sorted(attributes.values()),
        )
        dynamo.restart_with_floats_specialized(set(attributes))
