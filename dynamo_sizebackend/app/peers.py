"""What a user would pick instead of this backend, configured the way it must be
(issue 19), for ``sizebackend bench``:

- ``specialize``: torch's own per-size specialization, one Dynamo trace with the token
  dim dynamic and ``specialize_on`` one predicate per listed size
  (``torch._dynamo.mark_dynamic(ids, 0, specialize_on=[...])``): the whole graph
  compiled once generally and once per listed size;
- ``specialize-tuned``: the same with the CPU tuning the backend applies to its sized
  pieces (frozen weights + max-autotune with the C++ GEMM template);
- ``dynamic-tuned``: ``torch.compile(dynamic=True)`` with that tuning.

Three things a user trips over, handled here: Inductor freezes a ``torch.compile``
graph only when ``torch._inductor.config.freezing`` is set while the compile runs (not
through ``options=``), so the tuned variants set it around their warm-up, which makes
every compile; two ``torch.compile`` wrappers with equal options share Dynamo's cache
entries on one model, so each variant's options differ (a harmless entry of its own);
and the marking has to be on the first call's tensors, the one Dynamo traces.

``specialize-tuned`` does not run as torch 2.13 ships it: Dynamo compiles a
specialization lazily, at the first call of that size, after it has cleared its own
``param_name_to_source`` (``OutputGraph.cleanup``), so the graph reaches AOTAutograd
with ``_param_name_to_source = None`` and ``_try_get_metadata_from_dynamo`` raises
``TypeError: argument of type 'NoneType' is not iterable`` whenever it has parameters to
look up, which freezing gives it. The bench runs it through :class:`KeepSources`:
Inductor itself, with the mapping the general compile of the same graph saw put back
(a workaround for torch's bug, not a change to what is compiled; ``keep_sources=False``
shows the failure).

Proof that a tuned variant froze and autotuned: Inductor's autotune feedback during its
warm-up, by op name (``packed_linear``, ``linear_unary``, ``linear_binary`` exist only for prepacked,
i.e. frozen, weights).
"""
from __future__ import annotations

from collections import Counter
import weakref
from typing import Any, Callable

import torch

from .._torch.dynamo import is_user_input

PEERS = ("specialize", "specialize-tuned", "dynamic-tuned")
#: Autotuned ops that exist only for prepacked weights, which only freezing makes
#: (Inductor's freezing passes pack linears for MKL/oneDNN and fuse them).
_PREPACKED = ("packed_linear", "linear_unary", "linear_binary")
_TUNING = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
           "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
#: One distinct (default-valued) entry per variant: equal options would share Dynamo's
#: cache entries with another variant compiled on the same model.
_OWN = {"specialize": {"epilogue_fusion": True}, "specialize-tuned": {"epilogue_fusion": True},
        "dynamic-tuned": {"pattern_matcher": True}}


class PeerForward:
    """A peer variant's forward: marks the first call's tokens (``specialize*``, or
    every peer with ``batch_only``) and holds the tuned variants' freezing while
    :attr:`warming`."""

    def __init__(self, name: str, model: torch.nn.Module, sizes: list[int], compiler: str = "inductor",
                 keep_sources: bool = True, batch_only: bool = False):
        self.name = name
        self.sizes = list(sizes)
        # batch_only: dim 0 of the first call's tokens (and of the other arguments that
        # have it) is the only dynamic dim (default dynamic=None and mark_dynamic), not
        # every dim (dynamic=True): for inputs with more dims than the batch, as a user
        # who tunes would mark them (symbolic GEMM rows defeat the frozen weights' gain,
        # see compile/rows.py), and for models with float attributes, which dynamic=True
        # traces as symbolic inputs (the bench's specialize peers, app/bench.py).
        dynamic = None if batch_only else True
        self.marked = not (name.startswith("specialize") or batch_only)
        self.keep_sources: KeepSources | None = None
        self.symbolic: list[list[bool]] = []  # compiler="eager": per graph, its first input's dims
        if compiler == "eager":  # logic checks: a backend callable of its own, no codegen
            self.tuned = False
            self.compiled = torch.compile(model, dynamic=dynamic, backend=self._record)
        else:
            self.tuned = name.endswith("-tuned")
            options = {**(_TUNING if self.tuned else {}), **_OWN[name]}
            if keep_sources and name == "specialize-tuned":
                self.keep_sources = KeepSources(options)
                self.compiled = torch.compile(model, dynamic=dynamic, backend=self.keep_sources)
            else:
                self.compiled = torch.compile(model, dynamic=dynamic, options=options)
        self.warming = True
        self.autotuned: Counter[str] = Counter()

    def __call__(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if not self.marked:
            specialize = [_equals(n) for n in self.sizes] if self.name.startswith("specialize") else None
            torch._dynamo.mark_dynamic(ids, 0, specialize_on=specialize)
            for t in rest:  # the other per-token inputs (positions, slots) share the dim
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == ids.shape[0]:
                    torch._dynamo.mark_dynamic(t, 0)
            self.marked = True
        if not (self.tuned and self.warming):
            return self.compiled(ids, *rest)
        from torch._inductor import config, select_algorithm

        def saw(timings: Any, name: str, *_: Any) -> None:
            self.autotuned[name] += 1

        select_algorithm.add_feedback_saver(saw)
        try:
            with config.patch(freezing=True):
                return self.compiled(ids, *rest)
        finally:
            select_algorithm.clear_feedback_savers()

    def _record(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The logic-check backend: runs the graph as traced, noting which dims of its
        first tensor argument Dynamo made symbolic."""
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and is_user_input(node):
                self.symbolic.append([isinstance(d, torch.SymInt) for d in value.shape])
                break
        return gm.forward

    def evidence(self) -> dict[str, Any]:
        """What the bench prints and writes for this variant."""
        if not self.tuned:
            return {}
        found = {"autotuned_ops": dict(self.autotuned),
                 "frozen": froze(self.autotuned)}
        if self.keep_sources is not None:
            found["sources_restored"] = self.keep_sources.restored
        return found


class KeepSources:
    """Inductor as ``torch.compile(options=...)`` runs it, for a graph whose
    ``specialize_on`` compiles come after Dynamo dropped its parameter sources (torch
    2.13): the general compile's mapping is kept per graph and put back on a later
    compile of the same graph that arrives without one."""

    def __init__(self, options: dict[str, Any]):
        self.options = dict(options)
        self.kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> its sources
        self.restored = 0  # compiles that needed the mapping put back

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        sources = getattr(gm, "_param_name_to_source", None)
        if sources is not None:
            self.kept[gm] = dict(sources)
        elif gm in self.kept:
            gm._param_name_to_source = self.kept[gm]
            self.restored += 1
        return compile_fx(gm, example_inputs, config_patches=self.options)


def froze(autotuned: dict[str, int]) -> bool:
    """Whether a compile that autotuned these ops (by name, with counts) had frozen
    weights: some of them exist only for prepacked linears."""
    return any(autotuned.get(op, 0) for op in _PREPACKED)


def _equals(n: int) -> Callable[[int], bool]:
    return lambda b: b == n
