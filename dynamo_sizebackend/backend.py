"""The ``sizebackend`` Dynamo backend: split, compile per size, hand back a Runner.

Registered through the ``torch_dynamo_backends`` entry point (see setup.py). This module
must not call ``register_backend`` itself: torch loads the entry point lazily and would
then see the name twice ("duplicate name").
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import logging
import threading
import weakref
from typing import Any

import torch
import torch.fx

from . import compat, cudagraphs, padding
from .cache import FirstOutput, returns_one_value
from .cache import for_options as piece_cache_for
from .compiler import CompiledPiece, compile_piece, make_adaptor, size_key
from .dispatch import Program, Runner, generated_forward
from .options import OptionError, SizeBackendOptions, parse_options
from .progress import CompileProgress
from .shapes import ConcreteInputs, find_batch
from .splitting import OpMatcher, SplitGraph, pieces_return_floats, split
from .stats import COUNTERS

log = logging.getLogger(__name__)


class SizeCompileError(compat.user_error_base()):  # a RuntimeError
    """A piece failed to compile and ``strict=True`` asked for an error instead of a
    fallback. Reaches the caller as itself (not wrapped by Dynamo); ``__cause__`` is the
    compiler's own exception."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.first_useful_frame = None


class _Recorder(torch.fx.Interpreter):
    """Runs the split graph on Dynamo's fake inputs and records each piece's inputs."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.inputs: dict[str, tuple[Any, ...]] = {}

    def call_module(self, target, args, kwargs):
        self.inputs[target] = args
        return super().call_module(target, args, kwargs)


class GraphCompiler:
    """Compiles one Dynamo graph into a :class:`Runner`; keeps nothing after that except
    what lazy and background compiles of listed sizes need."""

    def __init__(self, options: SizeBackendOptions, graph_id: int):
        self.options = options
        self.graph_id = graph_id
        self.adaptor = make_adaptor(options)
        self.cache = piece_cache_for(options)  # None for the eager adaptor
        self.progress = CompileProgress(f"sizebackend graph {graph_id}")
        self._warned: set[str] = set()
        self._factory = None

    def _fallback(self, key: str, what: str, error: Exception, uncompiled: bool = False) -> None:
        """Count and log (once per graph and size) a failed compile, or raise under
        ``strict``. ``uncompiled``: the piece will run as is (a general or static
        compile failed); otherwise the size is served by the general pieces."""
        # Inductor's errors can carry a whole IR dump; the first line says what failed.
        lines = str(error).strip().splitlines() or [""]
        brief = lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")
        if self.options.strict:
            raise SizeCompileError(
                f"sizebackend: graph {self.graph_id}: {what} failed to compile for size {key} "
                f"({type(error).__name__}: {brief}); strict=True turns this fallback into an error"
            ) from error
        COUNTERS.add_keyed("fallbacks", key)
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "sizebackend: graph %d: %s failed to compile for size %s (%s: %s); %s",
                self.graph_id, what, key, type(error).__name__, brief,
                "running it uncompiled" if uncompiled else "serving that size with the general pieces",
            )

    def _compile(self, name: str, gm, inputs, size, key, fake_mode=None) -> CompiledPiece:
        compiled = compile_piece(
            self.adaptor, gm, list(inputs), size, key=key, fake_mode=fake_mode,
            debug_dir=self.options.debug_dir, debug_name=f"graph{self.graph_id}_{name}",
            cache=self.cache,
        )
        self.progress.step()
        artifact = compiled.artifact if isinstance(compiled, FirstOutput) else compiled
        direct = compat.direct_call(artifact, returns_one=returns_one_value(gm), slow=compiled)
        return direct or compiled

    def compile_general(self, sg: SplitGraph, inputs: dict[str, tuple], key: str) -> Program:
        pieces: dict[str, CompiledPiece] = {}
        counted_before = COUNTERS.snapshot().compiles.get(key, 0)
        for piece in sg.pieces:
            sub = getattr(sg.gm, piece.name)
            if piece.is_split_op:
                pieces[piece.name] = sub.forward
                continue
            try:
                pieces[piece.name] = self._compile(piece.name, sub, inputs[piece.name], None, key)
            except compat.dynamo_control_flow():
                # Dynamo restarts analysis and sends a new graph; this attempt never ran.
                now = COUNTERS.snapshot().compiles.get(key, 0)
                COUNTERS.add_keyed("compiles", key, counted_before - now)
                raise
            except Exception as e:  # counted, logged, visible in stats; strict raises
                self._fallback(key, piece.name, e, uncompiled=True)
                pieces[piece.name] = sub.forward
        return Program(key, pieces)

    def compile_size(
        self,
        sg: SplitGraph,
        inputs: dict[str, tuple],
        symbol,
        size: int,
        general: Program,
        graph_inputs: list[Any],
    ) -> Program | None:
        """Specialized pieces for ``size``, or ``None`` if any piece failed (the size is
        then served by the general pieces: a half-specialized program buys nothing).

        Other symbolic dims stay symbolic, but Inductor may still decide on them (a slice
        length, a reduction strategy) using the values they had when Dynamo traced, and
        record those decisions as guards in the fresh ShapeEnv. Dynamo never sees those
        guards (it checks the general pieces' ones), and with the batch fixed a decision
        can differ from the general one: ``x.flatten(0, 1)[:64]`` traced at 3x20 admits
        4x10, yet the size-4 compile at seq 20 bakes in a slice of 64 rows. So the
        program carries a check of its own guards (``graph_inputs``: the graph's
        placeholder fakes) and a call that breaks them runs the general pieces.
        """
        key = size_key(size)
        concrete = ConcreteInputs(symbol, size)
        pieces: dict[str, CompiledPiece] = {}
        for piece in sg.pieces:
            if piece.is_split_op:
                pieces[piece.name] = getattr(general, piece.name)
                continue
            sub = getattr(sg.gm, piece.name)
            try:
                example = concrete.convert(inputs[piece.name])
                pieces[piece.name] = self._compile(
                    piece.name, sub, example, size, key, fake_mode=concrete.fake_mode
                )
            except Exception as e:  # counted, logged, visible in stats; strict raises
                self._fallback(key, piece.name, e)
                return None
        check = None
        if compat.added_guards(concrete.fake_mode):
            try:
                source, check = compat.guard_checker(
                    concrete.fake_mode, concrete.convert(graph_inputs)
                )
            except Exception as e:  # a guard we cannot check: never run the size unchecked
                self._fallback(key, "the shape-guard check", e)
                return None
            log.info(
                "sizebackend: graph %d: size %d pieces assume %s; calls that break it run "
                "the general pieces", self.graph_id, size, source,
            )
        if self.options.cudagraphs:
            pieces = self._capture_pieces(sg, pieces, size)
        return Program(key, pieces, check=check, clone_outputs=self.options.cudagraphs)

    def _capture_pieces(self, sg: SplitGraph, pieces: dict, size: int) -> dict:
        """Wrap each compiled piece of ``size`` for capture/replay (split ops stay eager).
        Inputs that are parameters or buffers (not user inputs) are never copied."""
        factory = self.graph_factory()
        stable = cudagraphs.StablePointers()
        split_ops = {p.name for p in sg.pieces if p.is_split_op}
        wrapped = dict(pieces)
        for node in sg.gm.graph.nodes:
            if node.op != "call_module" or node.target in split_ops:
                continue
            static = frozenset(
                i for i, a in enumerate(node.args)
                if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                and not compat.is_user_input(a)  # split_module keeps placeholder meta
            )
            wrapped[node.target] = cudagraphs.CudaGraphPiece(
                pieces[node.target], size, factory, stable, self.options.cudagraph_warmups, static
            )
        return wrapped

    def graph_factory(self):
        """One capture memory pool per Dynamo graph."""
        if self._factory is None:
            self._factory = cudagraphs.CudaGraphFactory()
        return self._factory

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Runner:
        batch = find_batch(gm, self.options.batch_dim)
        sg = split(gm, OpMatcher(self.options.splitting_ops))

        fakes = [compat.placeholder_example(n) for n in gm.graph.nodes if n.op == "placeholder"]
        fake_mode = compat.graph_fake_mode(fakes)
        if self.options.compiler != "eager" and pieces_return_floats(sg):
            floats = compat.float_symbol_names(fake_mode)
            log.info(
                "sizebackend: graph %d: a piece returns a symbolic float; asking Dynamo to "
                "trace again with floats %s as constants", self.graph_id, sorted(floats),
            )
            compat.restart_with_floats_specialized(floats)  # returns if that was done already
        if self.options.compiler != "eager":
            # A float read from an attribute (a norm's eps) is model config, not a call
            # argument: as a constant from the first trace on, the pieces traced in a
            # cold process and in a warm one are the same, and so are their cache keys.
            # Left symbolic, Inductor specializes it during a real compile (Dynamo then
            # traces again) but not when its cache holds the graph, so a warm process
            # traced different pieces and recompiled them.
            floats = compat.attribute_float_symbols(gm)
            if floats:
                log.info(
                    "sizebackend: graph %d: asking Dynamo to trace again with the float "
                    "attributes %s as constants", self.graph_id, sorted(floats.values()),
                )
                compat.restart_with_floats_specialized(set(floats))
        recorder = _Recorder(sg.gm)
        with fake_mode:
            recorder.run(*fakes)

        forward = generated_forward(sg.gm)
        static = batch is None or batch.symbol is None
        if static:  # pieces specialized for the one size this graph was traced at
            key = str(batch.static_size) if batch is not None else "static"
        else:
            key = "dynamic"
        self.progress.expect(len(sg.compiled_pieces), f"{key} shape")
        general = self.compile_general(sg, recorder.inputs, key)
        # Counted only now: Dynamo may restart analysis from inside the first compile.
        COUNTERS.add("graphs")
        COUNTERS.add("pieces", len(sg.compiled_pieces))
        COUNTERS.add("splits", len(sg.pieces) - len(sg.compiled_pieces))
        if static:
            log.info("sizebackend: graph %d has no symbolic batch size; compiled once", self.graph_id)
            return Runner(forward, general, {}, None, 0)

        symbol = batch.symbol
        lower, upper = compat.symbol_range(fake_mode, symbol)
        wanted = cudagraphs.effective_compile_sizes(self.options)
        sizes = [n for n in wanted if n >= lower and (upper is None or n <= upper)]
        if len(sizes) < len(wanted):
            log.info(
                "sizebackend: graph %d: sizes %s are outside the batch range [%s, %s] this graph "
                "can see (Dynamo sends them to graphs of their own); not compiling them here",
                self.graph_id, sorted(set(wanted) - set(sizes)), lower, upper,
            )

        def compile_size(size: int) -> Program | None:
            return self.compile_size(sg, recorder.inputs, symbol, size, general, fakes)

        def compile_size_later(size: int) -> Program | None:  # lazy and background modes
            with compat.compile_session():
                return compile_size(size)

        mode = self.options.compile_mode
        by_size: dict[int, Program] = {}
        if mode == "eager":
            self.progress.expect(len(sg.compiled_pieces) * len(sizes), f"sizes {sizes}")
            for size in sizes:
                program = compile_size(size)
                if program is not None:
                    by_size[size] = program
            self.progress.close()  # a size that failed leaves steps unused
        runner = Runner(
            forward, general, by_size, batch.arg_index, batch.dim,
            pending=set(sizes) if mode == "lazy" else None, compile_size=compile_size_later,
            pad=self._pad_plan(gm, fakes, symbol, sizes),
        )
        if mode == "background" and sizes:
            _start_background(runner, sizes, compile_size_later)
        return runner


    def _pad_plan(self, gm, fakes, symbol, sizes) -> padding.PadPlan | None:
        if not self.options.pad_to_size or not sizes:
            return None
        mutated = padding.mutated_inputs(gm)
        if mutated:
            log.warning(
                "sizebackend: graph %d writes its inputs %s in place; pad_to_size would write "
                "a padded copy, so this graph runs unlisted sizes unpadded", self.graph_id, mutated,
            )
            COUNTERS.add_keyed("fallbacks", "pad_to_size")
            return None
        output = next(n for n in gm.graph.nodes if n.op == "output")
        outs = [compat.placeholder_example(o) if isinstance(o, torch.fx.Node) else o
                for o in output.args[0]]
        return padding.plan(fakes, outs, symbol, sizes)


_LIVE_JOBS: "weakref.WeakSet[_BackgroundJob]" = weakref.WeakSet()


class _BackgroundJob(threading.Thread):
    """Compiles listed sizes one by one and publishes each as it is ready."""

    def __init__(self, runner: Runner, sizes: list[int], compile_size):
        super().__init__(name="sizebackend-background-compile", daemon=True)
        self.runner = runner
        self.sizes = sizes
        self.compile_size = compile_size
        self.cancelled = threading.Event()
        self.grad_enabled = torch.is_grad_enabled()  # grad mode is thread-local

    def run(self) -> None:
        with torch.set_grad_enabled(self.grad_enabled):
            for size in self.sizes:
                if self.cancelled.is_set():
                    return
                try:
                    program = self.compile_size(size)
                except SizeCompileError as e:  # strict: no caller here, so the next call raises
                    self.runner.fail(e)
                    return
                if program is not None and not self.cancelled.is_set():
                    self.runner.publish(size, program)


def _start_background(runner: Runner, sizes: list[int], compile_size) -> None:
    job = _BackgroundJob(runner, sizes, compile_size)
    _LIVE_JOBS.add(job)
    runner.background = job
    job.start()


def _stop_background_jobs() -> None:
    """At exit Python stops daemon threads wherever they are; one inside an Inductor
    compile aborts the process ("terminate called without an active exception", exit
    status 134). Cancel the jobs and wait for the size each is compiling.

    Registered like ``concurrent.futures`` registers its own shutdown (Python's
    ``threading._register_atexit``), and after it, so it runs first: Inductor's
    compile still has its thread pools while the last size finishes.
    """
    jobs = [job for job in list(_LIVE_JOBS) if job.is_alive()]
    for job in jobs:
        job.cancelled.set()
    if jobs:
        log.info("sizebackend: waiting for %d background compile(s) to stop", len(jobs))
    for job in jobs:
        job.join()


getattr(threading, "_register_atexit", atexit.register)(_stop_background_jobs)


_graph_counter = iter(range(1 << 62))


def sizebackend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None, mode: Any = None
):
    """Dynamo backend entry point: ``torch.compile(m, backend="sizebackend", options=...)``."""
    if mode not in (None, "default"):
        raise OptionError(
            f"sizebackend does not take torch.compile(mode=...); pass Inductor settings as "
            f"options={{'inductor_options': {{...}}}} (got mode={mode!r})"
        )
    opts = parse_options(options)
    if opts.cudagraphs and not cudagraphs.cuda_available():
        raise OptionError(
            "sizebackend option 'cudagraphs': CUDA graphs need a CUDA device and none is "
            "available (got True)"
        )
    return GraphCompiler(opts, next(_graph_counter))(gm, example_inputs)


def _reset() -> None:
    """Called by ``torch._dynamo.reset()``: stop background compiles of dropped graphs."""
    for job in list(_LIVE_JOBS):
        job.cancelled.set()


sizebackend.reset = _reset  # type: ignore[attr-defined]
