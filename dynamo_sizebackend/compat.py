"""Every private torch API the backend touches, in one place (written against torch 2.13).

Why each is here:
- Dynamo records each placeholder's fake value and source only in ``node.meta``; there is
  no public accessor (``example_value``, ``grapharg``).
- ``torch._inductor.standalone_compile`` is the documented precompile entry point, but it
  lives under a private module path.
- Building fake example inputs for a concrete size needs ``FakeTensorMode`` and
  ``ShapeEnv``.
- The debug dump of Inductor's generated code and the direct calls into it
  (:func:`direct_call`) walk AOTAutograd's and Inductor's wrapper objects.
- The artifact cache saves and loads ``CompiledArtifact`` (``torch._inductor``), and its
  key reads the ShapeEnv (symbol ranges, guards) and Inductor's config dump.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.fx

TORCH_VERSION = torch.__version__


def _compile_lock():
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


#: Serializes Inductor compiles, artifact saves and loads (see :func:`standalone_compile`).
#: Dynamo's own reentrant ``compile_lock``: torch documents ``CacheArtifactManager``'s
#: state as "protected by the compile_lock", Dynamo holds it while compiling a frame (so
#: our general compiles run under it already) and Inductor takes it for backward graphs;
#: a lock of our own next to it could deadlock against a background compile.
INDUCTOR_LOCK = _compile_lock()


def placeholder_example(node: torch.fx.Node) -> Any:
    """The fake value Dynamo traced this placeholder with (FakeTensor, SymInt or int)."""
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def is_user_input(node: torch.fx.Node) -> bool:
    """True when the placeholder is an argument of the traced call, not a parameter or
    buffer that Dynamo lifted from an ``nn.Module`` (those sit under a module source)."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return True
    while source is not None:
        kind = type(source).__name__
        if "NNModule" in kind or "ParamBuffer" in kind or kind == "AttrSource":
            return False
        if kind == "LocalSource":
            return bool(getattr(source, "is_input", True))
        source = getattr(source, "base", None)
    return True


def argument_order_key(node: torch.fx.Node) -> tuple[int, ...]:
    """Sort key placing a user-input placeholder at its position in the traced function's
    signature. Dynamo orders placeholders by first use, not by argument order, so this
    reads the local's name from the placeholder's source and looks it up in the root
    frame's argument names (``x`` of ``forward(self, scale, x)`` sorts after ``scale``;
    ``args[1]`` after ``args[0]``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    indices: list[int] = []
    while source is not None and type(source).__name__ != "LocalSource":
        index = getattr(source, "index", None)
        if isinstance(index, int):
            indices.insert(0, index)
        source = getattr(source, "base", None)
    if source is None:
        return (1 << 30,)
    ctx = torch._guards.TracingContext.try_get()
    codes = getattr(ctx, "traced_code", None) or []
    if codes:
        code = codes[0]
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + 2]
        if source.local_name in names:
            return (names.index(source.local_name), *indices)
    return (1 << 29, *indices)


def graph_fake_mode(values: Sequence[Any]):
    """The fake mode Dynamo traced the graph in (the one of its placeholders' fakes).

    Not ``TracingContext.fake_mode``: Dynamo hands backends a fresh mode that only shares
    the ShapeEnv, and the fakes recorded in ``node.meta`` belong to the tracing one.
    """
    for value in values:
        if isinstance(value, torch._subclasses.FakeTensor):
            return value.fake_mode
    return torch._guards.detect_fake_mode(list(values))


def new_fake_mode():
    """A fresh fake mode with its own ShapeEnv, for compiling one concrete size."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def new_symint(fake_mode, name: str, hint: int) -> torch.SymInt:
    """A fresh backed SymInt in ``fake_mode``'s ShapeEnv (for dims other than the batch)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env = fake_mode.shape_env
    sym = env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(sym, hint=hint)


def symint_from_expr(fake_mode, expr, hint: int) -> torch.SymInt:
    return fake_mode.shape_env.create_symintnode(expr, hint=hint)


def hint_of_symbol(value: Any, symbol) -> int:
    """The concrete value Dynamo saw for one free symbol of ``value``'s expression."""
    env = value.node.shape_env
    table = getattr(env, "backed_var_to_val", None)
    return int((table if table is not None else env.var_to_val)[symbol])


def symbol_range(fake_mode, symbol) -> tuple[int, int | None]:
    """The values Dynamo's guards allow for ``symbol`` (with 0/1 specialization the batch
    symbol starts at 2: sizes 0 and 1 arrive as graphs of their own)."""
    vr = fake_mode.shape_env.var_to_range.get(symbol)
    if vr is None:
        return 0, None
    def finite(bound) -> int | None:
        return int(bound) if getattr(bound, "is_Integer", False) else None

    return finite(vr.lower) or 0, finite(vr.upper)


def standalone_compile(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    *,
    from_graph: bool,
    inductor_options: dict[str, Any],
    fake_mode=None,
):
    """Inductor-compile ``gm``. ``from_graph``: keep the symbolic shapes of the fakes
    recorded in the graph; otherwise specialize on ``example_inputs`` (made in
    ``fake_mode``).

    One compile at a time per process (:data:`INDUCTOR_LOCK`): ``standalone_compile``
    records the artifact it returns in class-level state (``CacheArtifactManager``,
    swapped in and out by ``with_fresh_cache``) and applies ``config_patches`` to
    Inductor's global config, so two compiles in two threads (a background compile
    while Dynamo compiles another graph) could save one piece's code as the other's,
    and the artifact cache would then serve it to every later process.
    """
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    with INDUCTOR_LOCK:
        if from_graph:
            return torch._inductor.standalone_compile(
                gm, example_inputs, dynamic_shapes="from_graph", options=options
            )
        return torch._inductor.standalone_compile(
            gm,
            example_inputs,
            dynamic_shapes="from_example_inputs",
            options=options,
            fake_mode=fake_mode,
        )


def in_tracing_context() -> bool:
    ctx = torch._guards.TracingContext.try_get()
    return ctx is not None and ctx.fake_mode is not None


def split_module(gm: torch.fx.GraphModule, callback: Callable[[torch.fx.Node], int]):
    from torch.fx.passes.split_module import split_module as _split

    return _split(gm, gm, callback, keep_original_order=True)


def user_error_base() -> type:
    """Dynamo wraps backend exceptions in ``BackendCompilerFailed`` except those deriving
    from ``ShortenTraceback``; deriving from it lets a user error reach the caller as the
    ``ValueError`` it is."""
    from torch._dynamo.exc import ShortenTraceback

    return ShortenTraceback


def dynamo_control_flow() -> tuple[type, ...]:
    """Exceptions Dynamo uses to steer compilation (e.g. restart analysis with a float
    specialized). A backend must let them through, never treat them as failures."""
    from torch._dynamo import exc

    return tuple(
        getattr(exc, name)
        for name in ("TensorifyScalarRestartAnalysis", "RestartAnalysis", "SkipFrame")
        if hasattr(exc, name)
    )


def inductor_option_problem(key: str, value: Any) -> str | None:
    """Why ``torch._inductor.config`` would not take ``key=value``, or ``None`` if it would.

    The same rule torch.compile applies to ``options=`` with the Inductor backend: the key
    must name a config entry and the value must be of its declared type (generic types
    are not checked). Without this, a typo would surface as every piece failing to
    compile, i.e. as a model that silently runs uncompiled.
    """
    import typing

    from torch._inductor import config

    current = config.get_config_copy()
    name = key.replace("-", "_")
    if name not in current:
        return "no such Inductor config entry"
    declared = config.get_type(name)
    if typing.get_origin(declared) is None and isinstance(declared, type):
        if not isinstance(value, declared):
            return f"must be of type {declared.__name__}"
    return None


def added_guards(fake_mode) -> bool:
    """True when compiling in ``fake_mode`` (a fresh one, see :func:`new_fake_mode`) made
    decisions that hold only for some values of its symbols (guards, or symbols replaced
    by an expression or a constant)."""
    env = fake_mode.shape_env
    return bool(env.guards or env.replacements)


def guard_checker(fake_mode, placeholders: Sequence[Any]) -> tuple[str, Callable[[Sequence[Any]], bool]]:
    """A check of ``fake_mode``'s shape guards against a call's real arguments.

    ``placeholders`` are fakes of the graph's inputs made in ``fake_mode``, in argument
    order; the returned ``check(args)`` tells whether ``args`` satisfy every guard the
    compiles in that mode added. Uses the ShapeEnv's guard printer, the one the AOT and
    FX-graph caches use to re-check a cached artifact (``produce_guards_expression``).
    """
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    env = fake_mode.shape_env
    source = env.produce_guards_expression(list(placeholders), ignore_static=True)
    if not source:
        return "True", lambda args: True
    code = compile(source, "<sizebackend size guards>", "eval")
    names = [f"t{i}" for i in range(len(placeholders))]

    def check(args: Sequence[Any]) -> bool:
        return bool(eval(code, SYMPY_INTERP, {"L": dict(zip(names, args))}))

    return source, check


# --- Artifact cache (piece_key.py, cache.py) -------------------------------------------
# ``CompiledArtifact.save/load`` is the documented way to persist a standalone_compile
# result, but lives under ``torch._inductor``; the key reads symbols' value ranges from
# the ShapeEnv and Inductor's config, neither of which has a public accessor.


def is_fake(value: Any) -> bool:
    return isinstance(value, torch._subclasses.FakeTensor)


def sym_expr(value: Any):
    """The sympy expression behind a SymInt/SymFloat/SymBool."""
    return value.node.expr


def sym_range(value: Any, symbol) -> tuple[int | None, int | None]:
    """The values ``symbol`` (a free symbol of ``value``) may take in its ShapeEnv."""
    vr = value.node.shape_env.var_to_range.get(symbol)
    if vr is None:
        return None, None

    def finite(bound) -> int | None:
        return int(bound) if getattr(bound, "is_Integer", False) else None

    return finite(vr.lower), finite(vr.upper)


def shape_env_state(values: Sequence[Any]) -> tuple[int, int, int] | None:
    """How much the ShapeEnv of ``values`` knows: (guards, runtime asserts, replacements).

    A compile that grows it made decisions valid only for some sizes; an artifact loaded
    from disk or shared with another piece would skip adding them, so such an artifact
    must be neither cached nor shared (see ``cache.PieceCache``)."""
    env = _shape_env(values)
    if env is None:
        return None
    asserts = sum(len(v) for v in env.deferred_runtime_asserts.values())
    return len(env.guards), asserts, len(env.replacements)


def _shape_env(values: Sequence[Any]):
    for value in values:
        if isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode.shape_env:
            return value.fake_mode.shape_env
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return value.node.shape_env
    return None


def shape_guards_text(values: Sequence[Any]) -> str:
    """What the ShapeEnv of ``values`` assumes about them, written by input position
    (``L['t0'].size()[0] >= 2 and L['t1'] == L['t0'].size()[1]``): the same printer the
    FX graph cache uses to decide whether a cached graph fits (``produce_guards_expression``).
    Inductor may rely on any of these facts, so an artifact fits only where they hold."""
    env = _shape_env(values)
    if env is None:
        return ""
    return env.produce_guards_expression(list(values), ignore_static=True) or ""


def _stable_repr(value: Any) -> str:
    """``repr`` that is the same in every process (sets sorted), or ``TypeError``."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ",".join(_stable_repr(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(_stable_repr(v) for v in value)) + ")"
    if isinstance(value, dict):
        items = sorted((_stable_repr(k), _stable_repr(v)) for k, v in value.items())
        return "dict(" + ",".join(f"{k}:{v}" for k, v in items) + ")"
    uuid = getattr(value, "uuid", None)  # Inductor's CustomGraphPass protocol
    if callable(uuid):
        return f"uuid:{uuid()!r}"
    raise TypeError(f"no stable text for {type(value).__name__}")


def compile_config_fingerprint() -> str | None:
    """Inductor's and AOTAutograd's global configs as stable text, or ``None`` when a
    setting (a custom pass without ``uuid()``) cannot be written stably.

    ``save_config_portable`` leaves out what does not change code (trace and cache
    settings), as the FX graph cache does; the custom passes it also leaves out do change
    code, so they are added back by their ``uuid()``."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    parts = []
    try:
        for config in (inductor_config, functorch_config):
            portable = config.save_config_portable()
            for name, value in sorted(config.get_config_copy().items()):
                if name in portable:
                    parts.append(f"{name}={_stable_repr(value)}")
                elif "custom" in name and "pass" in name and value is not None:
                    parts.append(f"{name}={_stable_repr(value)}")
    except TypeError:
        return None
    return "\n".join(parts)


def save_artifact(artifact: Any, path: str) -> None:
    """Write a ``standalone_compile`` result to ``path`` (torch's own binary format)."""
    with INDUCTOR_LOCK:
        artifact.save(path=path, format="binary")


def load_artifact(path: str) -> Callable[..., Any]:
    """Read back what :func:`save_artifact` wrote. Torch checks its own build key and
    raises (``AssertionError``, ``RuntimeError``...) on any mismatch or damage."""
    with INDUCTOR_LOCK:  # loading fills the same class-level caches a compile records into
        return torch._inductor.CompiledArtifact.load(path=path, format="binary")


def constant_float(value: Any) -> float | None:
    """The value of a SymFloat that the ShapeEnv has pinned to a constant (a float input
    specialized while tracing, under a Dynamo guard), else ``None``."""
    if not isinstance(value, torch.SymFloat):
        return None
    expr = value.node.expr  # with the ShapeEnv's replacements applied
    return float(expr) if expr.is_number else None


def float_symbol_names(fake_mode) -> set[str]:
    """Names of the float symbols (``zf0``...) of the graph's ShapeEnv: Python floats that
    Dynamo turned into graph inputs (``specialize_float=False``) instead of constants.
    All of them, as Inductor's ``tensorify_python_scalars`` pass collects them: a float
    that was specialized while tracing no longer names its symbol in the graph."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    env = fake_mode.shape_env
    table = getattr(env, "backed_var_to_val", None)
    table = table if table is not None else env.var_to_val
    return {str(s) for s in table if symbol_is_type(s, SymT.FLOAT)}


def attribute_float_symbols(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Float symbols (``zf0``: the source each came from) of the graph's Python float
    inputs that Dynamo read from an attribute, a global or a container, as opposed to a
    frame argument: ``L['self'].eps`` is listed, ``L['temperature']`` is not. Dynamo
    passes such a float as a 0-d tensor whose ``item_memo`` holds the symbol."""
    from torch._dynamo.source import LocalSource

    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        if arg is None or memo is None or not getattr(arg, "pass_arg_as_tensor", False):
            continue
        if isinstance(arg.source, LocalSource):
            continue
        symbol = getattr(memo.node._expr, "name", None)  # the symbol, not a replacement
        if symbol is not None:
            found[symbol] = arg.source.name
    return found


def restart_with_floats_specialized(names: set[str]) -> None:
    """Ask Dynamo to trace the frame again with the floats ``names`` as constants, the
    way Inductor's own ``tensorify_python_scalars`` pass does when a float cannot stay
    symbolic (raises ``TensorifyScalarRestartAnalysis``). Returns without raising when
    every name was already specialized once, so a frame cannot restart forever."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    fresh = sorted(n for n in names if not TensorifyState.should_specialize(n))
    if not fresh:
        return
    for name in fresh:
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


@contextlib.contextmanager
def compile_session():
    """Wrap a compile the backend starts on its own, outside Dynamo's (a lazy size on
    first sight, a size in background mode), the way Dynamo wraps its own compiles.

    Why both parts matter: Inductor's AOT trace (``make_fx``) sets FX's process-global
    "symbolic tracing" flag and patches ``nn.Module.__call__`` for every thread. Any
    call into torch.compile'd code on another thread meanwhile raises "Detected that you
    are using FX to symbolically trace a dynamo-optimized function", unless the
    process-global compile-session flag is also set, which Dynamo does around its own
    compiles (torch 2.13: ``torch.compiler._compile_session_context``). In background
    mode without it most calls made during the compile failed. That flag is saved and
    restored, not counted, so two sessions must never overlap: Dynamo's ``compile_lock``
    keeps this one from overlapping any Dynamo compile or another of ours (it is
    re-entrant, so a lazy compile inside a Dynamo compile on the same thread is fine).
    """
    from torch._dynamo.convert_frame import compile_lock

    with compile_lock, torch.compiler._compile_session_context():
        yield


# --- Direct calls into Inductor's compiled code (compiler.py) ---------------------------
# A ``standalone_compile`` artifact is called through about eight Python layers (the
# artifact, a tuple-unflatten wrapper, Dynamo's ``disable``, AOTAutograd's forward, its
# runtime wrapper and invoker, ``CompiledFxGraph.__call__``) before Inductor's own
# ``call(args)``. For a whole-graph compile that is paid once per call; split at every
# attention op it is paid per piece: 10 to 25 us each on this CPU, the bulk of
# sizebackend's gap to ``torch.compile(dynamic=False)`` in benchmarks/bench_latency.py.
# For an inference graph those layers do nothing a piece needs after its first call,
# so :func:`direct_call` skips them, but only when it can prove that from the objects
# themselves; anything it does not recognize keeps the full path.

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
