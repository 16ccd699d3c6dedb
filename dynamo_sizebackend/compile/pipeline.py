"""One Dynamo graph through the stages: batch symbol, split, general compile, one
compile per listed size, a :class:`~..runtime.runner.Runner` handed back.

The order matters in two places:
- floats are specialized (a Dynamo restart) before anything is compiled, so a restart
  never wastes a compile;
- graphs, pieces and splits are counted only after the general compile: Dynamo may
  restart analysis from inside it, and that attempt's graph is thrown away.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.fx

from .. import _torch
from .._torch import direct_call, dynamo, observe, shape_env
from ..cache import aot
from ..cache.store import FirstOutput, returns_one_value
from ..cache.store import for_options as piece_cache_for
from ..options import SizeBackendOptions
from ..runtime import chain, cudagraphs, padding
from ..runtime.runner import Program, Runner, generated_forward
from ..stats import COUNTERS
from . import background, cpu_sdpa, floats, freeze, guards, linears, rows
from . import swap as swap_
from .adaptor import (
    CompiledPiece,
    CompilerAdaptor,
    compile_piece,
    make_adaptor,
    size_key,
)
from .batch import ConcreteInputs, find_batch
from .failures import Fallbacks
from .progress import CompileProgress
from .split import OpMatcher, SplitGraph, split

log = logging.getLogger(__name__)


class _Recorder(torch.fx.Interpreter):
    """Runs the split graph on Dynamo's fake inputs and records each piece's inputs, and
    which of them the piece writes in place: those whose version counter the fake run
    bumped (a write through a view of an input counts too, the view shares the counter)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.inputs: dict[str, tuple[Any, ...]] = {}
        self.mutated: dict[str, frozenset[int]] = {}

    def call_module(self, target, args, kwargs):
        self.inputs[target] = args
        before = [_torch.tensor_version(a) if isinstance(a, torch.Tensor) else None for a in args]
        out = super().call_module(target, args, kwargs)
        self.mutated[target] = frozenset(
            i for i, (a, v) in enumerate(zip(args, before))
            if v is not None and _torch.tensor_version(a) != v
        )
        return out


def _served_since(before) -> tuple[int, int, int]:
    """Pieces compiled, loaded from ``cache_dir`` and reused since the counters were
    ``before`` (a :meth:`Counters.snapshot`)."""
    now = COUNTERS.snapshot()
    return (sum(now.compiles.values()) - sum(before.compiles.values()),
            now.cache_hits - before.cache_hits, now.reused - before.reused)


def _log_summary(what: str, pieces: int, before, start: float, ok: bool) -> None:
    """One INFO line for a compile of ``pieces`` pieces begun at ``start`` with the
    counters ``before``: seconds, and how many were compiled, loaded or reused
    (``TORCH_LOGS="+dynamo_sizebackend"`` shows it; DEBUG adds a line per piece)."""
    if not log.isEnabledFor(logging.INFO):
        return
    compiled, loaded, reused = _served_since(before)
    log.info("sizebackend: %s: %d pieces in %.2fs (%d compiled, %d loaded, %d reused)%s",
             what, pieces, time.perf_counter() - start, compiled, loaded, reused,
             "" if ok else "; failed, served by the general pieces")


class GraphCompiler:
    """Compiles one Dynamo graph into a :class:`Runner`; keeps nothing after that except
    what lazy and background compiles of listed sizes need."""

    def __init__(self, options: SizeBackendOptions, graph_id: int):
        self.options = options
        self.graph_id = graph_id
        self.adaptor: CompilerAdaptor | None = None  # per graph: its device picks the sized defaults
        self.cache = piece_cache_for(options)  # None for the eager adaptor
        self.progress = CompileProgress(f"sizebackend graph {graph_id}")
        self.fallbacks = Fallbacks(graph_id, options.strict)
        self._factory = None
        self._mutated: dict[str, frozenset[int]] = {}  # per piece, inputs it writes in place
        self._freezable: dict[str, freeze.Freezable] = {}  # see compile/freeze.py
        self._unfrozen: dict[str, freeze.Freezable] = {}  # changed once: inputs since
        self._packable: set[str] = set()  # weights an unfrozen piece's linears may pack (linears.py)
        self._runner: weakref.ref[Runner] | None = None

    def _compile(self, name: str, gm, inputs, size, key, fake_mode=None, keep=None,
                 sent: dict[str, aot.Sent] | None = None) -> CompiledPiece:
        """One piece, traced (``sizebackend_piece`` under ``TORCH_TRACE``: its size, how
        it was served and the seconds); see :meth:`_compile_piece`."""
        before, start = COUNTERS.snapshot(), time.perf_counter()
        compiled, artifact = self._compile_piece(name, gm, inputs, size, key, fake_mode, keep, sent)
        seconds = time.perf_counter() - start

        def payload() -> dict[str, Any]:
            _, loaded, reused = _served_since(before)
            outcome = "cache_hit" if loaded else "reused" if reused else "compiled"
            return {"graph": self.graph_id, "piece": name, "size": key, "outcome": outcome,
                    "frozen": keep is not None, "seconds": round(seconds, 4),
                    "package": isinstance(artifact, aot.AotPiece),
                    "output_code": direct_call.generated_path(artifact)}

        observe.artifact("sizebackend_piece", payload)
        return compiled

    def _compile_piece(self, name: str, gm, inputs, size, key, fake_mode, keep,
                       sent: dict[str, aot.Sent] | None = None) -> tuple[CompiledPiece, Any]:
        """The piece to call, and what compiled it (the Inductor artifact, an AOT
        package; for the trace). ``keep``: ``gm`` is a frozen copy of the piece that takes only the arguments
        at these positions. Torch cannot save a frozen JIT compile, so with the disk
        cache on it is compiled ahead of time instead and stored (``cache/aot.py``);
        where it cannot be, it compiles on the JIT path, not cached
        (``cache_skips["frozen"]``). A piece handed to the package worker compiles on
        the JIT path too, and is noted in ``sent`` (``compile/swap.py``)."""
        if keep is not None:
            stored = self._stored_frozen(name, gm, inputs, size, key, keep)
            if stored is None:
                COUNTERS.add_keyed("cache_skips", "frozen")
            elif isinstance(stored, aot.Sent):  # the worker stores it, the JIT path serves
                if sent is not None:
                    sent[name] = stored
            else:
                self.progress.step()
                return stored, stored
        compiled = compile_piece(
            self.adaptor, gm, list(inputs), size, key=key, fake_mode=fake_mode,
            debug_dir=self.options.debug_dir, debug_name=f"graph{self.graph_id}_{name}",
            cache=self.cache if keep is None else None,
        )
        self.progress.step()
        slow = compiled if keep is None else freeze.drop_args(compiled, keep)
        artifact = compiled.artifact if isinstance(compiled, FirstOutput) else compiled
        if not self.options.direct_calls:
            return slow, artifact
        direct = direct_call.direct_call(
            artifact, returns_one=returns_one_value(gm), slow=slow, keep=keep
        )
        return direct or slow, artifact

    def _stored_frozen(self, name: str, gm, inputs, size, key, keep) -> CompiledPiece | None:
        """The frozen piece as an AOT package (loaded or compiled and stored), or
        ``None`` where it cannot be one (see ``cache/aot.py``)."""
        mode = self.options.frozen_store_mode()
        if (
            self.cache is None
            or mode is None
            or self._mutated.get(name)  # AOT packages would need export's mutation handling
        ):
            return None
        return aot.compile_or_load(
            self.cache, gm, inputs, keep, size, self.adaptor.config_for(size), key=key,
            name=f"graph{self.graph_id}_{name}", build=not background.on_background_thread(),
            mode=mode,
        )

    def _frozen_now(self, args: tuple[Any, ...] | None) -> dict[str, freeze.Freezable]:
        """What a size compiled now freezes: nothing unless its Inductor config asks for
        it and grad mode is off (Inductor freezes only graphs without backward); the
        tensors of the call that triggered the compile where there is one (a parameter
        replaced since the trace is frozen as it is now)."""
        if not self._freezable or torch.is_grad_enabled():
            return {}
        frozen = dict(self._freezable)  # a copy: the runner may unfreeze names meanwhile
        if args is not None:
            for name, f in frozen.items():
                live = args[f.index]
                if live is not f.tensor and isinstance(live, torch.Tensor) and not live.is_inference():
                    frozen[name] = freeze.Freezable(f.index, live)
        return frozen

    def never_freeze(self, names: list[str], args: tuple[Any, ...]) -> None:
        """Inputs whose frozen value changed after a size was compiled: every size
        compiled from now on takes them as inputs (one recompile per size and change),
        until :func:`.freeze.weights_updated` names their module (:meth:`refreeze`)."""
        for name in names:
            f = self._freezable.pop(name, None)
            if f is not None:  # kept with the tensor of the call that changed it
                self._unfrozen[name] = freeze.Freezable(f.index, args[f.index])

    def refreeze(self, tensors: set[int] | None) -> int:
        """``weights_updated``: the inputs :meth:`never_freeze` took out whose tensors are
        among ``tensors`` (ids; all, for ``None``) may be frozen again; every sized
        program of this graph is retired so that they are. Returns how many were."""
        names = [n for n, f in self._unfrozen.items() if tensors is None or id(f.tensor) in tensors]
        for name in names:
            self._freezable[name] = self._unfrozen.pop(name)
        runner = self._runner() if self._runner is not None else None
        return runner.retire_sizes() if names and runner is not None else 0

    def compile_general(self, sg: SplitGraph, inputs: dict[str, tuple], key: str) -> Program:
        pieces: dict[str, CompiledPiece] = {}
        counted_before = COUNTERS.snapshot().compiles.get(key, 0)
        packed = 0
        for piece in sg.pieces:
            sub = getattr(sg.gm, piece.name)
            if piece.is_split_op:
                pieces[piece.name] = sub.forward
                continue
            try:
                compiled, count = self._packed_linears(sg, piece.name, sub)
                pieces[piece.name] = self._compile(piece.name, compiled, inputs[piece.name], None, key)
                packed += count
            except dynamo.dynamo_control_flow():
                # Dynamo restarts analysis and sends a new graph; this attempt never ran.
                now = COUNTERS.snapshot().compiles.get(key, 0)
                COUNTERS.add_keyed("compiles", key, counted_before - now)
                raise
            except Exception as e:  # counted, logged, visible in stats; strict raises
                self.fallbacks.record(key, piece.name, e, uncompiled=True)
                pieces[piece.name] = sub.forward
        linears.log_packed(self.graph_id, key, packed)
        return Program(key, pieces)

    def _packed_linears(self, sg: SplitGraph, name: str, sub: torch.fx.GraphModule
                        ) -> tuple[torch.fx.GraphModule, int]:
        """``sub``, or a copy whose linears run on weights packed at run time
        (:mod:`.linears`) and how many: only while grad mode is off, as for freezing."""
        if not self._packable or torch.is_grad_enabled():
            return sub, 0
        return linears.pack(sub, linears.piece_inputs_of(sg.gm, name, self._packable))

    def compile_size(
        self,
        sg: SplitGraph,
        inputs: dict[str, tuple],
        symbol,
        size: int,
        general: Program,
        graph_inputs: list[Any],
        args: tuple[Any, ...] | None = None,
        session: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    ) -> Program | None:
        """:meth:`_compile_size`, with its INFO line (seconds, what was compiled or
        loaded)."""
        before, start = COUNTERS.snapshot(), time.perf_counter()
        program = self._compile_size(sg, inputs, symbol, size, general, graph_inputs, args, session)
        _log_summary(f"graph {self.graph_id}: size {size}", len(sg.compiled_pieces), before,
                     start, ok=program is not None)
        return program

    def _compile_size(
        self,
        sg: SplitGraph,
        inputs: dict[str, tuple],
        symbol,
        size: int,
        general: Program,
        graph_inputs: list[Any],
        args: tuple[Any, ...] | None = None,
        session: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    ) -> Program | None:
        """Specialized pieces for ``size``, or ``None`` if any piece failed (the size is
        then served by the general pieces: a half-specialized program buys nothing).
        The program checks the shape guards its compiles added (:mod:`.guards`) and,
        where it froze tensors, that they did not change (:class:`.freeze.FrozenWeights`,
        recorded before the first piece compiles). ``args``: the call that asked for the
        size (lazy mode, a retired size), whose tensors are the ones to freeze.
        ``session``: held around each piece's compile, not the whole size (a compile
        the backend starts itself holds Dynamo's compile lock, so a graph Dynamo traces
        meanwhile waits for one piece at most, not for every piece of the size)."""
        key = size_key(size)
        concrete = ConcreteInputs(symbol, size)
        frozen_now = self._frozen_now(args)
        constants = {name: f.tensor for name, f in frozen_now.items()}
        plans, frozen_names = {}, []
        for piece in sg.compiled_pieces:
            plan = freeze.freeze_piece(sg.gm, piece.name, constants) if constants else None
            plans[piece.name] = plan
            if plan is not None:
                frozen_names += [n for n in plan[2] if n not in frozen_names]
        # Recorded before anything compiles: a write during the compile is seen.
        frozen = freeze.FrozenWeights(frozen_names, frozen_now) if frozen_names else None
        pieces: dict[str, CompiledPiece] = {}
        sent: dict[str, aot.Sent] = {}
        packed = 0
        for piece in sg.pieces:
            if piece.is_split_op:
                pieces[piece.name] = getattr(general, piece.name)
                continue
            sub, keep = getattr(sg.gm, piece.name), None
            piece_inputs = inputs[piece.name]
            plan = plans[piece.name]
            if plan is not None:
                sub, keep, _ = plan
                piece_inputs = [piece_inputs[i] for i in keep]
            else:  # weights as inputs: their linears may run packed (linears.py)
                sub, count = self._packed_linears(sg, piece.name, sub)
                packed += count
            try:
                example = concrete.convert(piece_inputs)
                with session():
                    pieces[piece.name] = self._compile(
                        piece.name, sub, example, size, key, fake_mode=concrete.fake_mode,
                        keep=keep, sent=sent,
                    )
            except Exception as e:  # counted, logged, visible in stats; strict raises
                self.fallbacks.record(key, piece.name, e)
                return None
        try:
            check = guards.size_check(concrete.fake_mode, concrete.convert(graph_inputs))
        except Exception as e:  # a guard we cannot check: never run the size unchecked
            self.fallbacks.record(key, "the shape-guard check", e)
            return None
        if check is not None:
            log.info(
                "sizebackend: graph %d: size %d pieces assume %s; calls that break it run "
                "the general pieces", self.graph_id, size, check[0],
            )
        linears.log_packed(self.graph_id, f"size-{size}", packed)
        captured = cudagraphs.captures_size(self.options, size)
        if captured:
            pieces = self._captured(sg, pieces, size)

        def program(pieces: dict[str, CompiledPiece], swap: swap_.PackageSwap | None = None) -> Program:
            run = chain.try_build(sg.gm, pieces, sg.split_op_names, self.graph_id, key) \
                if self.options.direct_calls and not captured else None
            return Program(key, pieces, check=check and check[1], clone_outputs=captured,
                           frozen=frozen, chain=run, swap=swap)

        if sent and not captured:
            return program(pieces, swap_.PackageSwap(
                sent, lambda loaded: program({**pieces, **loaded}), self.graph_id, key))
        return program(pieces)

    def _captured(self, sg: SplitGraph, pieces: dict[str, CompiledPiece], size: int) -> dict:
        """``pieces`` wrapped for CUDA-graph capture at ``size``."""
        if self._factory is None:  # one capture memory pool per Dynamo graph
            self._factory = cudagraphs.CudaGraphFactory()
        return cudagraphs.capture_pieces(
            sg.gm, sg.split_op_names, pieces, size, self._factory, self.options.cudagraph_warmups,
            mutated=self._mutated,
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Runner:
        batch = find_batch(gm, self.options.batch_dim)
        sg = split(gm, OpMatcher(self.options.splitting_ops))
        device = _device_type(example_inputs)
        if device == "cpu":
            cpu_sdpa.swap(sg, self.graph_id)
        size_one = self._listed_size_one(batch, device)
        self.adaptor = make_adaptor(
            self.options, device, tuned=not self._rows_stay_symbolic(gm, batch, device, size_one))
        # Sized pieces that would compile exactly like these (eager, {}, rows untuned):
        # nothing to gain.
        size_one = size_one and self.adaptor.config_for(1) != self.adaptor.config_for(None)
        freezes = bool(self.adaptor.config_for(0).get("freezing"))
        if freezes or (device == "cpu" and self.options.compiler != "eager"):
            weights, inference = freeze.freezable_inputs(gm, example_inputs)
            self._packable = set(weights) if device == "cpu" else set()
            if freezes:
                self._freezable = weights
                if inference:
                    freeze.not_frozen_inference(self.graph_id, inference)

        fakes = [dynamo.placeholder_example(n) for n in gm.graph.nodes if n.op == "placeholder"]
        fake_mode = shape_env.graph_fake_mode(fakes)
        if self.options.compiler != "eager":
            floats.specialize_if_needed(gm, sg, fake_mode, self.graph_id)
        recorder = _Recorder(sg.gm)
        with fake_mode:
            recorder.run(*fakes)
        self._mutated = recorder.mutated

        forward = generated_forward(sg.gm)
        static = batch is None or batch.symbol is None
        if static:  # pieces specialized for the one size this graph was traced at
            key = str(batch.static_size) if batch is not None else "static"
        else:
            key = "dynamic"
        sizes = [1] if size_one else [] if static else self._sizes_in_range(fake_mode, batch.symbol)
        observe.artifact("sizebackend_split", lambda: {
            "graph": self.graph_id, "shape": key, "sizes": sizes,
            "compile_mode": self.options.compile_mode,
            "pieces": [{"name": p.name, "split_op": p.is_split_op} for p in sg.pieces],
            "split_ops": sorted(self.options.splitting_ops),
        })
        self.progress.expect(len(sg.compiled_pieces), f"{key} shape")
        before, start = COUNTERS.snapshot(), time.perf_counter()
        general = self.compile_general(sg, recorder.inputs, key)
        _log_summary(f"graph {self.graph_id}: {len(sg.pieces)} pieces "
                     f"({len(sg.pieces) - len(sg.compiled_pieces)} split ops), {key} shape",
                     len(sg.compiled_pieces), before, start, ok=True)
        # Counted only now: Dynamo may restart analysis from inside the first compile.
        COUNTERS.add("graphs")
        COUNTERS.add("pieces", len(sg.compiled_pieces))
        COUNTERS.add("splits", len(sg.pieces) - len(sg.compiled_pieces))
        if static and not size_one:
            log.info("sizebackend: graph %d has no symbolic batch size; compiled once", self.graph_id)
            if self.options.compile_sizes and dynamo.static_shapes_forced():
                _warn_sizes_unused(self.options.compile_sizes)
            size = batch.static_size if batch is not None else None
            if cudagraphs.captures_size(self.options, size):  # e.g. size 1, 0/1-specialized
                general = Program(key, self._captured(sg, general.pieces, size), clone_outputs=True)
            return Runner(forward, general, {}, None, 0, graph_id=self.graph_id)
        if size_one:
            log.info("sizebackend: graph %d is batch 1's graph of its own (0/1 specialization) "
                     "and 1 is a listed size: its size-1 pieces compile with the sized options, "
                     "the ones just compiled serve while they do or if they fail", self.graph_id)

        symbol = batch.symbol

        def compile_size(size: int, args: tuple[Any, ...] | None = None) -> Program | None:
            return self.compile_size(sg, recorder.inputs, symbol, size, general, fakes, args)

        def compile_size_later(size: int, args: tuple[Any, ...] | None = None) -> Program | None:
            # lazy and background modes, retired sizes
            return self.compile_size(sg, recorder.inputs, symbol, size, general, fakes, args,
                                     session=dynamo.compile_session)

        mode = self.options.compile_mode
        by_size: dict[int, Program] = {}
        if mode == "eager":
            self.progress.expect(len(sg.compiled_pieces) * len(sizes), f"sizes {sizes}")
            for size in sizes:
                program = compile_size(size)
                if program is not None:
                    by_size[size] = program
            self.progress.close()  # a size that failed leaves steps unused
        pad = None
        if self.options.pad_to_size and sizes and not size_one:
            pad = padding.plan_for_graph(gm, fakes, symbol, sizes, self.graph_id)
        runner = Runner(
            forward, general, by_size, batch.arg_index, batch.dim,
            pending=set(sizes) if mode == "lazy" else None, compile_size=compile_size_later,
            pad=pad, never_freeze=self.never_freeze, graph_id=self.graph_id,
        )
        if self._freezable:
            self._runner = weakref.ref(runner)
            freeze.track(self)
        if mode == "background" and sizes:
            background.start(runner, sizes, compile_size_later)
        return runner

    def _listed_size_one(self, batch, device: str) -> bool:
        """Whether this is batch 1's static graph (Dynamo's 0/1 specialization of a backed
        batch, the first call's graph at batch 1) with 1 a listed size: Dynamo keeps
        sending batch 1 here, never to the dynamic graph, so its size-1 pieces get the
        sized options as a listed size does there. CPU only (a captured size 1 on CUDA
        stays as it was, untested here); never under ``dynamic=False``, where every size
        is a static graph of its own (see :func:`_warn_sizes_unused`)."""
        return (device == "cpu" and batch is not None and batch.symbol is None
                and batch.static_size == 1 and 1 in self.options.compile_sizes
                and not dynamo.static_shapes_forced())

    def _rows_stay_symbolic(self, gm: torch.fx.GraphModule, batch, device: str,
                            size_one: bool = False) -> bool:
        """Whether the CPU default tuning is dropped for this graph's listed sizes: its
        GEMMs keep a symbolic row count once the batch is a number (:mod:`.rows`).
        Only the measured default is overridden, never options the user gave."""
        if (device != "cpu" or self.options.compiler == "eager" or batch is None
                or (batch.symbol is None and not size_one)
                or self.options.sized_inductor_options is not None):
            return False
        gemms = rows.symbolic_rows(gm, batch.symbol)
        if gemms and rows.frozen_pays(gm, batch.symbol):
            log.info("sizebackend: graph %d: %d GEMMs keep a symbolic row count at every "
                     "listed size; frozen they run oneDNN's packed GEMM, measured faster "
                     "on this CPU than MKL's: its listed sizes keep the CPU tuning",
                     self.graph_id, len(gemms))
            return False
        if gemms:
            rows.untuned_for_rows(self.graph_id, gemms)
        return bool(gemms)

    def _sizes_in_range(self, fake_mode, symbol) -> list[int]:
        """The listed sizes this graph's batch symbol can take (Dynamo sends the others,
        sizes 0 and 1 under 0/1 specialization, to graphs of their own)."""
        lower, upper = shape_env.value_range(fake_mode.shape_env, symbol)
        lower = lower or 0
        wanted = self.options.compile_sizes
        sizes = [n for n in wanted if n >= lower and (upper is None or n <= upper)]
        if len(sizes) < len(wanted):
            log.info(
                "sizebackend: graph %d: sizes %s are outside the batch range [%s, %s] this graph "
                "can see (Dynamo sends them to graphs of their own); not compiling them here%s",
                self.graph_id, sorted(set(wanted) - set(sizes)), lower, upper,
                "; mark the batch dim with torch._dynamo.decorators.mark_unbacked(x, 0) on the "
                "first call to serve size 1 from this graph"
                if 1 in wanted and lower == 2 and not shape_env.is_unbacked(symbol) else "",
            )
        return sizes


_warned_static = False


def _warn_sizes_unused(sizes: tuple[int, ...]) -> None:
    """Once per process: under ``dynamic=False`` no graph has a symbolic batch, so
    ``compile_sizes`` can never be used (each size is its own static graph)."""
    global _warned_static
    if _warned_static:
        return
    _warned_static = True
    message = (
        f"sizebackend: torch.compile(dynamic=False) traces every batch size as a static graph "
        f"of its own, so compile_sizes {list(sizes)} are unused (and Dynamo recompiles per "
        f"size up to its recompile_limit); leave dynamic=None and mark the batch dim with "
        f"mark_unbacked(x, 0), or pass dynamic=True"
    )
    log.warning("%s", message)  # both channels: Dynamo may filter Python warnings
    warnings.warn(message, stacklevel=2)


def _device_type(example_inputs: list[Any]) -> str:
    """Where the graph runs: the device of its first tensor input (``"cpu"`` without one)."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"
