"""Direct calls into Inductor's compiled code, skipping AOTAutograd's per-call layers
(torch 2.13; the most version-sensitive code in the package).

A ``standalone_compile`` artifact is called through about eight Python layers (the
artifact, a tuple-unflatten wrapper, Dynamo's ``disable``, AOTAutograd's forward, its
runtime wrapper and invoker, ``CompiledFxGraph.__call__``) before Inductor's own
``call(args)``. For a whole-graph compile that is paid once per call; split at every
attention op it is paid per piece: 10 to 25 us each on a 2-core CPU, the bulk of
sizebackend's gap to ``torch.compile(dynamic=False)`` in benchmarks/bench_latency.py.
For an inference graph those layers do nothing a piece needs after its first call, so
:func:`direct_call` skips them, but only when it can prove that from the objects
themselves; anything it does not recognize keeps the full path (slower, still correct).

Off switch: the option ``direct_calls=False``, or ``SIZEBACKEND_DIRECT_CALLS=0`` in the
environment (read when the options are parsed).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


#: Names the generated AOT runtime wrapper of a pass-through inference graph uses: read
#: grad mode, call, normalize the outputs to a list, check their count, mark dynamic
#: dims. Input mutations (``_apply_mutations_``), aliased outputs (``_replay_aliases_``),
#: autocast (``_DisableAutocast_``) or a joint graph add names outside this set.
_PASS_THROUGH_NAMES = frozenset({
    "torch", "is_grad_enabled", "_C", "_set_grad_enabled", "isinstance", "tuple", "list",
    "len", "AssertionError", "_mark_dynamic_",
})


#: The layers between a ``CacheCompiledArtifact`` and AOT's runtime wrapper, by the
#: qualified name of their code (not ``__qualname__``, which ``functools.wraps`` copies).
_OUTER_LAYERS = {
    "make_graph_return_tuple.<locals>.wrapper",
    "DisableContext.__call__.<locals>._fn",
    "aot_module_simplified.<locals>.forward",
    "CacheCompiledArtifact._load_impl.<locals>.<lambda>",  # an artifact read from disk
}


_RUNTIME_WRAPPER = "_create_runtime_wrapper.<locals>.runtime_wrapper"


def _cells(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def _aot_layers(artifact: Any) -> tuple[Callable[..., Any], Any] | None:
    """AOT's generated runtime wrapper and the ``CompiledFxGraph`` it calls, found
    under a ``standalone_compile`` artifact (fresh or read from disk), or ``None``
    where the layers are not the ones this module knows."""
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.standalone_compile import CacheCompiledArtifact

    if type(artifact) is not CacheCompiledArtifact:
        return None
    fn = artifact._compiled_fn
    for _ in range(len(_OUTER_LAYERS) + 2):
        while isinstance(fn, SerializableCompiledFunction):  # AOT cache hits add one
            fn = fn.compiled_fn
        qualname = getattr(getattr(fn, "__code__", None), "co_qualname", None)
        if qualname == _RUNTIME_WRAPPER:
            break
        if qualname not in _OUTER_LAYERS:
            return None
        cells = _cells(fn)
        if cells.get("params_buffers_flat"):
            return None  # AOT prepends lifted parameters: not a piece of ours
        if "spec" in cells and not cells["spec"].is_leaf():
            return None  # a nested output structure: not a piece of split_module's
        fn = cells.get("compiled_fn", cells.get("fn"))
    else:
        return None
    cells = _cells(fn)
    wrapper, inner = cells.get("_codegen_runtime_wrapper"), cells.get("_inner_compiled_fn")
    while isinstance(inner, SerializableCompiledFunction):
        inner = inner.compiled_fn
    if wrapper is None or not isinstance(inner, CompiledFxGraph):
        return None
    return wrapper, inner


def generated_code(artifact: Any) -> str | None:
    """The Python module Inductor generated for ``artifact`` (for ``debug_dir``)."""
    layers = _aot_layers(artifact)
    return getattr(layers[1], "source_code", None) if layers else None


def direct_call(
    artifact: Any, *, returns_one: bool, slow: Callable[..., Any] | None = None
) -> Callable[..., Any] | None:
    """A callable equal to ``slow(*args)`` (default: ``artifact(*args)``) that calls
    Inductor's generated code directly, or ``None`` when ``artifact`` (a fresh or loaded
    ``standalone_compile`` result) is not a pass-through inference graph.

    ``returns_one``: the compiled graph returns one value rather than a tuple; AOT
    returns a list either way, and ``slow`` returns that value itself.
    The first call and every call with grad mode on go through ``slow`` (the artifact's
    first call runs AOT's one-time custom-op analysis and Inductor's autotune-cache
    bookkeeping; with grad on, AOT turns grad off around the call). After that a call is
    Inductor's ``call(list(args))`` plus the dynamic-dim marks AOT puts on outputs.
    """
    layers = _aot_layers(artifact)
    if layers is None:
        return None
    wrapper, inner = layers
    names = set(wrapper.__code__.co_names)
    if not names <= _PASS_THROUGH_NAMES | {n for n in names if n.startswith("_dyn_dims_")}:
        return None
    if not getattr(inner, "_boxed_call", False):
        return None
    marks = [
        (int(name[len("_dyn_dims_"):]), value)
        for name, value in wrapper.__globals__.items()
        if name.startswith("_dyn_dims_")
    ] if "_mark_dynamic_" in names else []
    mark = wrapper.__globals__.get("_mark_dynamic_")
    slow = slow or artifact
    grad_enabled = torch.is_grad_enabled
    run: list[Callable[[list[Any]], Any]] = []

    def call(*args: Any) -> Any:
        if not run or grad_enabled():
            out = slow(*args)
            if not run and inner.current_callable is not None:
                run.append(inner.current_callable)
            return out
        outs = run[0](list(args))
        if type(outs) is not list:
            outs = list(outs)
        for i, dims in marks:
            mark(outs[i], dims)
        return outs[0] if returns_one else outs

    return call
