"""Runtime dispatch: per call, read the batch size and run the matching set of pieces.

The split graph's forward is generated once as plain Python (FX codegen) and bound to a
*program*: an object whose ``submod_N`` attributes are the compiled pieces for one runtime
size (or the general ones). A call is then: read one dim, one dict lookup, one counter
bump, and the generated forward; no FX interpreter on the hot path. A compile that
finishes later (lazy/background) publishes a new program with one dict assignment.

Concurrency: programs are never mutated after they are published (a program whose
pieces the package worker builds is replaced by a new one, ``compile/swap.py``), and a call of
uncaptured pieces touches no state of the runner but counters (which lock), so
concurrent calls of one runner need no lock of the runner's. Captured programs
(``cudagraphs``) are different: their pieces copy inputs into fixed buffers, replay into
fixed output buffers that the sizes of the graph share (its memory pools), and count
warm-ups and record captures as they go (see ``runtime/cudagraphs.py``). Two such calls
at once would read each other's inputs and outputs, so the runner holds one lock of its
own from a captured program's first piece until its outputs are cloned; concurrent
callers of a captured graph are safe, and take turns. The lock orders the host only:
the device order between callers on different streams is the graph factory's (a call
on another stream first waits for the previous call's, ``runtime/graph_factory.py``).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

import torch.fx

from .._torch import observe
from .cudagraphs import clone_outputs
from .padding import PadPlan
from ..stats import COUNTERS

log = logging.getLogger(__name__)


class Program:
    """The pieces of one runtime size, bound to the split graph's generated forward.

    ``check(args)``, when set, tells whether a call's arguments satisfy the shape guards
    the size's compiles assumed (see ``GraphCompiler.compile_size``); ``None``: no guards.
    """

    def __init__(
        self,
        key: str,
        pieces: Mapping[str, Callable[..., Any]],
        check: Callable[[tuple[Any, ...]], bool] | None = None,
        clone_outputs: bool = False,
        frozen: Any = None,
        chain: Callable[[tuple[Any, ...]], Any] | None = None,
        swap: Any = None,
    ):
        self.key = key
        self.chain = chain  # runtime/chain.py: the whole forward in one C++ call
        self.swap = swap  # compile/swap.PackageSwap: pieces the package worker is building
        self.check = check
        self.frozen = frozen  # compile/freeze.FrozenWeights of a size compiled with constant weights
        self.clone_outputs = clone_outputs  # captured: CUDA-graph replays overwrite their outputs
        self.pieces = dict(pieces)  # by piece name, as bound below
        for name, fn in pieces.items():
            setattr(self, name, fn)

    def profiled(self, graph_id: int) -> "Program":
        """This program with every piece in a profiler range (``_torch/observe.py``),
        made once; what the runner calls while a profiler runs."""
        ranged = self.__dict__.get("_profiled")
        if ranged is None:
            pieces = {name: observe.ranged(observe.range_name(graph_id, name, self.key), fn)
                      for name, fn in self.pieces.items()}
            ranged = Program(self.key, pieces, self.check, self.clone_outputs, self.frozen)
            self._profiled = ranged
        return ranged

    def weights_changed(self, args: tuple[Any, ...]) -> bool:
        """Whether a tensor frozen into these pieces is not what ``args`` pass at its
        position any more (replaced, new storage, written), or the program was retired."""
        return self.frozen is not None and not self.frozen.unchanged(args)


def generated_forward(split_gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``forward(program, *args)`` of ``split_gm`` as a plain function."""
    code = split_gm.graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<sizebackend split graph {id(split_gm):x}>", "exec"), namespace)
    return namespace["forward"]


class Runner:
    """The callable handed back to Dynamo for one graph.

    ``by_size`` maps a listed size to its program once it is compiled; ``pending`` holds
    listed sizes still to compile (lazy mode), compiled on first sight by ``compile_size``
    while the triggering call waits. One size compiles at a time per runner (compiles are
    serialized process-wide anyway, by Dynamo's compile lock): a call that finds a pending
    size while another compile of this runner runs, of that size or of another, runs
    ``general`` rather than queue behind it, and a pending size stays pending until a call
    finds the runner free. Any other size runs ``general``.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        general: Program,
        by_size: dict[int, Program],
        arg_index: int | None,
        dim: int,
        pending: set[int] | None = None,
        compile_size: Callable[[int, tuple[Any, ...] | None], Program | None] | None = None,
        pad: PadPlan | None = None,
        never_freeze: Callable[[list[str], tuple[Any, ...]], None] | None = None,
        graph_id: int = 0,
    ):
        self._forward = forward
        self._general = general
        self._by_size = by_size
        self._arg_index = arg_index
        self._dim = dim
        self._pending = pending or set()
        self._compile_size = compile_size
        self._pad = pad
        self._never_freeze = never_freeze
        self._graph_id = graph_id
        self._warned_frozen = False
        self._lock = threading.Lock()  # pending and by_size changes (held briefly)
        self._compiling = threading.Lock()  # held by the one lazy compile in flight
        self._replaying = threading.Lock()  # held by the one call of a captured program
        self._error: BaseException | None = None
        self._guard_misses: set[int] = set()
        self._seen: set[int] = set()  # sizes called once: their dispatch was logged
        self.background: threading.Thread | None = None

    def publish(self, size: int, program: Program) -> None:
        """Make ``program`` serve ``size`` from the next call on (atomic under the GIL)."""
        self._by_size[size] = program

    def fail(self, error: BaseException) -> None:
        """A compile after this runner was handed out failed under ``strict=True``: every
        call from now on raises it (a background thread has no caller to raise to)."""
        self._error = error

    def _compile_pending(self, size: int, args: tuple[Any, ...] | None = None) -> Program:
        # Never waits: a compile in flight (of this size or another) means general for now.
        if not self._compiling.acquire(blocking=False):
            return self._by_size.get(size) or self._general
        try:
            with self._lock:
                program = self._by_size.get(size)
                claimed = program is None and size in self._pending
                if claimed:
                    self._pending.discard(size)
            if claimed:
                try:
                    program = self._compile_size(size, args) if self._compile_size else None
                except Exception as e:  # strict: raised here and on every later call
                    self.fail(e)
                    raise
                if program is not None:
                    self._by_size[size] = program
        finally:
            self._compiling.release()
        return program or self._general

    def _retire(self, size: int, program: Program, args: tuple[Any, ...]) -> Program:
        """A tensor frozen into ``size``'s pieces changed since they were recorded (or
        :func:`~..compile.freeze.weights_updated` retired them): they would compute with
        the old values. Drop them; the size compiles again right now (it is pending from
        here on), with each changed tensor as an input from now on."""
        changed = program.frozen.changed(args)
        if changed:
            COUNTERS.add_keyed("fallbacks", "frozen_weights")
            observe.artifact("sizebackend_fallback", lambda: {
                "graph": self._graph_id, "size": str(size), "what": "frozen_weights",
                "changed": list(changed)})
            if self._never_freeze is not None:
                self._never_freeze(changed, args)
            log.log(
                logging.INFO if self._warned_frozen else logging.WARNING,
                "sizebackend: graph %d: %s, frozen into the size-%d pieces, changed after "
                "they were compiled (replaced, given new storage or written in place); "
                "compiling size %d again with %s as inputs from now on", self._graph_id,
                ", ".join(changed), size, size, "it" if len(changed) == 1 else "them",
            )
            self._warned_frozen = True
        else:
            log.info("sizebackend: graph %d: size %d retired by weights_updated(); "
                     "compiling it again", self._graph_id, size)
        with self._lock:
            if self._by_size.get(size) is program:
                self._drop(size, program)
        return self._compile_pending(size, args) if self._compile_size else self._general

    def retire_sizes(self) -> int:
        """Drop every sized program; each size compiles again when next called (see
        ``GraphCompiler.refreeze``). Returns how many were dropped."""
        with self._lock:
            programs = list(self._by_size.items())
            for size, program in programs:
                self._drop(size, program)
        return len(programs)

    def _drop(self, size: int, program: Program) -> None:
        """``size`` stops running ``program`` and compiles again when next called (the
        caller holds ``_lock``). Its frozen record is retired too, so that
        ``weights_updated`` does not count it a second time."""
        del self._by_size[size]
        self._pending.add(size)
        if program.frozen is not None:
            program.frozen.retire()

    def _swap(self, size: int, program: Program) -> Program:
        """The package worker answered for every piece of ``size`` it was building: from
        this call on, ``size`` runs a program of the stored packages (``compile/swap.py``),
        if ``program`` is still the one published."""
        swapped = program.swap.build()
        if swapped is None:
            return program
        with self._lock:
            if self._by_size.get(size) is not program:  # retired meanwhile
                return program
            self._by_size[size] = swapped
        return swapped

    def _guard_miss(self, size: int, program: Program) -> Program:
        if size not in self._guard_misses:
            self._guard_misses.add(size)
            log.info(
                "sizebackend: a batch of %d breaks a shape guard its specialized pieces were "
                "compiled under; such calls run the general pieces", size,
            )
        return self._general

    def __call__(self, *args: Any) -> Any:
        if self._error is not None:
            raise self._error
        program = self._general
        if self._arg_index is not None:
            size = args[self._arg_index].shape[self._dim]
            program = self._by_size.get(size)
            if program is None:
                program = self._compile_pending(size, args) if size in self._pending else self._general
            elif program.weights_changed(args):
                program = self._retire(size, program, args)
            elif program.check is not None and not program.check(args):
                program = self._guard_miss(size, program)
            elif program.swap is not None and program.swap.due():
                program = self._swap(size, program)
            if program is self._general and self._pad is not None:
                return self._padded(args, size)
            if size not in self._seen:
                self._first_call(size, program)
        COUNTERS.add_keyed("calls", program.key)
        if observe.profiling():  # one flag read per call when no profiler runs
            program = program.profiled(self._graph_id)
        if program.clone_outputs:
            with self._replaying:
                return clone_outputs(self._forward(program, *args))
        if program.chain is not None:
            return program.chain(args)
        return self._forward(program, *args)

    def _first_call(self, size: int, program: Program) -> None:
        """The dispatch decision for a size's first call, at DEBUG (one set lookup per
        call otherwise)."""
        self._seen.add(size)
        if log.isEnabledFor(logging.DEBUG):
            why = ("its own pieces" if program is not self._general else
                   "the general pieces (pending or compiling)" if size in self._pending else
                   "the general pieces (not a listed size, or its compile failed)")
            log.debug("sizebackend: graph %d: first call of size %d runs %s (key %s)",
                      self._graph_id, size, why, program.key)

    def _padded(self, args: tuple[Any, ...], size: int) -> Any:
        """``pad_to_size``: run on the next larger listed size's pieces, slice back."""
        target = self._pad.target_for(size)
        program = self._by_size.get(target) if target is not None else None
        if program is not None and program.weights_changed(args):
            program = self._retire(target, program, args)
            program = None if program is self._general else program
        elif program is not None and program.swap is not None and program.swap.due():
            program = self._swap(target, program)
        padded = self._pad.pad(args, size, target) if program is not None else None
        if program is None or (program.check is not None and not program.check(tuple(padded))):
            COUNTERS.add_keyed("calls", self._general.key)
            return self._forward(self._general, *args)
        COUNTERS.add_keyed("calls", program.key)
        if observe.profiling():
            program = program.profiled(self._graph_id)
        if program.clone_outputs:
            with self._replaying:
                return clone_outputs(self._pad.unpad(self._forward(program, *padded), size))
        if program.chain is not None:
            return self._pad.unpad(program.chain(tuple(padded)), size)
        return self._pad.unpad(self._forward(program, *padded), size)
