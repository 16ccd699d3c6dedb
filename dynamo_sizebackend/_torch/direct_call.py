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
A piece that writes an input in place or returns a view of one (a KV-cache write, the
cache slice handed on to attention: one per layer of a Hugging Face decode step) runs
AOT's own generated wrapper around Inductor's ``call``, so its epilogue (version bumps,
copy-backs, views rebuilt) stays AOT's. Measured 2026-12-05 on this machine, a one-op
graph: 7.0 us through the artifact, 3.4 us on that path (2.2 us for a pass-through
graph); the layers cost less here than on the machine of the figures above.

Off switch: the option ``direct_calls=False``, or ``SIZEBACKEND_DIRECT_CALLS=0`` in the
environment (read when the options are parsed).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


#: Names the generated AOT runtime wrapper of a pass-through inference graph uses: read
#: grad mode, call, normalize the outputs to a list, check their count, mark dynamic
#: dims. Input mutations (``_apply_mutations_``, ``_increment_version_``), aliased outputs
#: (``_replay_aliases_``), autocast (``_DisableAutocast_``) or a joint graph add names
#: outside this set.
_PASS_THROUGH_NAMES = frozenset({
    "torch", "is_grad_enabled", "_C", "_set_grad_enabled", "isinstance", "tuple", "list",
    "len", "AssertionError", "_mark_dynamic_",
})

#: What AOT's generated wrapper adds around the call for an inference graph that writes
#: its inputs or returns views of them (a KV-cache write, the cache slice passed on to
#: attention): bump the written inputs' version counters, copy back the writes the graph
#: did not keep, rebuild aliased outputs as views of their inputs. The generated wrapper
#: takes the function it calls as an argument, so such a piece runs that wrapper itself,
#: around Inductor's ``call``: AOT's own epilogue, without the layers above it.
_EPILOGUE_NAMES = frozenset({"_increment_version_", "_apply_mutations_", "_replay_aliases_"})


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


_FREEZING_WRAPPER = "fw_compiler_freezing.<locals>.wrapper"


@dataclass(frozen=True)
class _Layers:
    wrapper: Callable[..., Any]
    """AOT's generated runtime wrapper (its code tells whether it does anything)."""
    inner: Any
    """The ``CompiledFxGraph`` whose ``current_callable`` is Inductor's ``call``."""
    params: tuple[Any, ...]
    """What AOT prepends to the arguments: the piece's lifted parameters and buffers
    (a frozen piece's weights; empty otherwise)."""
    preserved: tuple[int, ...] | None
    """Of AOT's full argument list, the positions Inductor's freezing wrapper passes on
    (the others were frozen into constants); ``None``: all of them."""


def _aot_layers(artifact: Any) -> _Layers | None:
    """The layers under a ``standalone_compile`` artifact (fresh or read from disk,
    frozen or not) that a direct call must reproduce, or ``None`` where they are not
    the ones this module knows."""
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.standalone_compile import CacheCompiledArtifact

    def unwrap(fn):
        while isinstance(fn, SerializableCompiledFunction):  # AOT cache hits add one
            fn = fn.compiled_fn
        return fn

    def qualname(fn) -> str | None:
        return getattr(getattr(fn, "__code__", None), "co_qualname", None)

    if type(artifact) is not CacheCompiledArtifact:
        return None
    fn = artifact._compiled_fn
    params: tuple[Any, ...] = ()
    for _ in range(len(_OUTER_LAYERS) + 2):
        fn = unwrap(fn)
        if qualname(fn) == _RUNTIME_WRAPPER:
            break
        if qualname(fn) not in _OUTER_LAYERS:
            return None
        cells = _cells(fn)
        if cells.get("params_buffers_flat"):
            if params:
                return None  # two layers prepend arguments: not a piece of ours
            params = tuple(cells["params_buffers_flat"])
        if "spec" in cells and not cells["spec"].is_leaf():
            return None  # a nested output structure: not a piece of split_module's
        fn = cells.get("compiled_fn", cells.get("fn"))
    else:
        return None
    cells = _cells(fn)
    wrapper, inner = cells.get("_codegen_runtime_wrapper"), unwrap(cells.get("_inner_compiled_fn"))
    preserved = None
    if qualname(inner) == _FREEZING_WRAPPER:
        frozen = _cells(inner)
        inner, preserved = frozen.get("optimized_function"), frozen.get("preserved_arg_indices")
        if preserved is None or any(frozen.get("unwrapped_args_offsets") or [0]):
            return None  # tensor subclasses unwrapped into several arguments
        preserved = tuple(preserved)
    elif params:
        return None  # lifted parameters that were not frozen: AOT's full path
    if wrapper is None or not isinstance(inner, CompiledFxGraph):
        return None
    return _Layers(wrapper, inner, params, preserved)


def generated_code(artifact: Any) -> str | None:
    """The Python module Inductor generated for ``artifact`` (for ``debug_dir``)."""
    layers = _aot_layers(artifact)
    return getattr(layers.inner, "source_code", None) if layers else None


def generated_path(artifact: Any) -> str | None:
    """Where Inductor wrote that module (in its cache folder), ``None`` if unknown."""
    layers = _aot_layers(artifact)
    call = getattr(layers.inner, "current_callable", None) if layers else None
    return getattr(getattr(call, "__code__", None), "co_filename", None)


def _argument_builder(layers: _Layers, keep: Sequence[int] | None) -> Callable[[tuple], list]:
    """How a call's arguments become the list Inductor's ``call`` takes: the caller's
    arguments at ``keep`` (all: ``None``) after AOT's prepended ``params``, then only
    the positions the freezing wrapper keeps."""
    if layers.preserved is None and keep is None:
        return list
    n = len(layers.params)
    preserved = layers.preserved if layers.preserved is not None else range(n + len(keep or ()))
    sources = []  # ("param", value) or ("arg", caller position), in Inductor's order
    for j in preserved:
        if j < n:
            sources.append((True, layers.params[j]))
        else:
            sources.append((False, keep[j - n] if keep is not None else j - n))
    if not any(is_param for is_param, _ in sources):
        positions = tuple(i for _, i in sources)
        return lambda args: [args[i] for i in positions]
    return lambda args: [value if is_param else args[value] for is_param, value in sources]


def direct_call(
    artifact: Any,
    *,
    returns_one: bool,
    slow: Callable[..., Any] | None = None,
    keep: Sequence[int] | None = None,
) -> Callable[..., Any] | None:
    """A callable equal to ``slow(*args)`` (default: ``artifact(*args)``) that calls
    Inductor's generated code directly, or ``None`` when ``artifact`` (a fresh or loaded
    ``standalone_compile`` result) is not a pass-through inference graph.

    ``returns_one``: the compiled graph returns one value rather than a tuple; AOT
    returns a list either way, and ``slow`` returns that value itself. ``keep``: the
    artifact takes only the caller's arguments at these positions (a frozen piece, see
    ``compile/freeze.py``; ``slow`` then takes them all).
    The first call and every call with grad mode on go through ``slow`` (the artifact's
    first call runs AOT's one-time custom-op analysis and Inductor's autotune-cache
    bookkeeping; with grad on, AOT turns grad off around the call). After that a call is
    Inductor's ``call(arguments)`` plus the dynamic-dim marks AOT puts on outputs.
    """
    layers = _aot_layers(artifact)
    if layers is None:
        return None
    wrapper, inner = layers.wrapper, layers.inner
    names = set(wrapper.__code__.co_names) - {n for n in wrapper.__code__.co_names
                                              if n.startswith("_dyn_dims_")}
    if not names <= _PASS_THROUGH_NAMES | _EPILOGUE_NAMES:
        return None
    if not getattr(inner, "_boxed_call", False):
        return None
    if names & _EPILOGUE_NAMES:
        return _through_epilogue(artifact, layers, returns_one, slow, keep)
    marks = [
        (int(name[len("_dyn_dims_"):]), value)
        for name, value in wrapper.__globals__.items()
        if name.startswith("_dyn_dims_")
    ] if "_mark_dynamic_" in names else []
    mark = wrapper.__globals__.get("_mark_dynamic_")
    arguments = _argument_builder(layers, keep)
    run: list[Callable[[list[Any]], Any]] = []

    def fast(args: tuple[Any, ...]) -> Any:
        outs = run[0](arguments(args))
        if type(outs) is not list:
            outs = list(outs)
        for i, dims in marks:
            mark(outs[i], dims)
        return outs[0] if returns_one else outs

    return _fast_after_first_call(slow or artifact, inner, run, fast)


def _fast_after_first_call(slow: Callable[..., Any], inner: Any, run: list[Callable[..., Any]],
                           fast: Callable[[tuple[Any, ...]], Any]) -> Callable[..., Any]:
    """``slow(*args)`` for the first call (after which ``run`` holds Inductor's ``call``)
    and for calls with grad mode on; ``fast(args)`` for every other call."""
    grad_enabled = torch.is_grad_enabled

    def call(*args: Any) -> Any:
        if not run or grad_enabled():
            out = slow(*args)
            if not run and inner.current_callable is not None:
                run.append(inner.current_callable)
            return out
        return fast(args)

    return call


def _through_epilogue(
    artifact: Any,
    layers: _Layers,
    returns_one: bool,
    slow: Callable[..., Any] | None,
    keep: Sequence[int] | None,
) -> Callable[..., Any]:
    """:func:`direct_call` for a graph whose AOT wrapper has an epilogue (see
    :data:`_EPILOGUE_NAMES`): that generated wrapper, given AOT's full argument list (the
    lifted parameters, then the caller's arguments at ``keep``), with Inductor's ``call``
    as the function it calls (behind the freezing wrapper's selection of arguments, when
    there is one) in place of the layers ``CompiledFxGraph.__call__`` adds."""
    wrapper, inner, preserved = layers.wrapper, layers.inner, layers.preserved
    params = list(layers.params)
    if keep is None:
        full = (lambda args: params + list(args)) if params else list
    else:
        positions = tuple(keep)
        full = lambda args: params + [args[i] for i in positions]
    run: list[Callable[[list[Any]], Any]] = []

    if preserved is None:
        def compiled(arguments: list[Any]) -> Any:
            return run[0](arguments)
    else:
        def compiled(arguments: list[Any]) -> Any:
            return run[0]([arguments[i] for i in preserved])

    def nothing() -> None:
        return None

    def fast(args: tuple[Any, ...]) -> Any:
        outs = wrapper(compiled, contextlib.nullcontext, nothing, full(args))
        return outs[0] if returns_one else outs

    return _fast_after_first_call(slow or artifact, inner, run, fast)
