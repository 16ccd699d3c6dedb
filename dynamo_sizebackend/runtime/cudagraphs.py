"""Piecewise CUDA graphs: capture each compiled piece per size and input signature,
replay it after.

Attention (the split ops) is never captured: it runs eagerly between the graphs.

What a capture is keyed by. A graph replays exactly the kernels it recorded, with the
shapes, strides and Python scalars of its capture baked in. A piece of a size may still
see other shapes (a symbolic sequence length) and other int arguments, so each piece
keys its captures by the *signature* of its arguments: for every tensor its shape and
stride (for a parameter or buffer its address and shape), for everything else its type
and value (dtype and device are guarded by Dynamo). A new signature gets its own warm-up runs and capture, up to
:data:`MAX_CAPTURES` per piece and size; past that it runs uncaptured. Why not refuse
pieces with symbols other than the batch: in serving, sequence lengths change every
call, and keying keeps a bounded set of hot shapes on graphs instead of none.

Inputs a piece writes in place (a KV cache the caller keeps, ``acc.add_(1)``) are not
copied either: a copy would take the write, and the caller's tensor would never see it.
The capture reads and writes them at their own address, and that address is part of
the signature, so a replay only ever writes the very tensor the call passed; a call that
passes another tensor there gets a capture of its own (a static KV cache passes the same
tensors every call: one capture).

What is never captured (the piece runs as compiled, counted once per piece in
``fallbacks[<key>]`` and logged once per size):
- ``cudagraph_grad_mode``: a call with grad mode on and an input that requires grad. A
  replay returns detached buffers: no autograd history;
- ``cudagraph_device``: a call with a tensor on another device than the graphs' (a CPU
  tensor's value would be baked into the graph as a kernel argument);
- ``cudagraph_signature``: an argument with no hashable value to key by;
- ``cudagraph_captures``: a signature past the :data:`MAX_CAPTURES` of the piece;
- ``cudagraph_capture_failed``: the capture raised (a synchronizing op, say).

Memory and addresses, the hazards this module exists for:
- the captures of one graph share memory pools: a capture call of a size (the call in
  which some of its pieces are captured) allocates in one pool, and no two capture calls
  of one size share a pool, while calls of different sizes do (the rule and why:
  :class:`.graph_factory.GraphFactory`). The pieces of a size reuse each other's dead
  blocks, sizes reuse each other's, and a pool holds as much as the largest capture call
  it served;
- a replay reads its inputs from the addresses seen at capture. A user tensor or an
  attention output arrives at a fresh address each call: it is copied into the capture's
  own static buffer (a clone made at capture, never a tensor the caller owns). An output
  of an earlier captured piece of the same size lives at a fixed pool address and is
  not copied. Only real parameters, registered buffers and inputs the piece writes are
  read in place; their address is part of the signature, so a replaced weight
  (``.data = ...``) gets a new capture instead of a replay that reads freed memory;
- a replay writes its outputs into the same buffers every time, so the runner clones the
  graph's final outputs before handing them to the caller.

What a capture owns and what it borrows. It owns its static input buffers (clones,
outside every pool) and, only while its capture call runs, its outputs: the capture
call hands the *owning* outputs on down the forward, so while the later pieces of that
call are captured the pool sees exactly the tensors the forward still needs as live and
reuses only blocks the forward is done with. After the call the pieces keep weak
references (``ops.weak_ref``: same memory, not owned) to their outputs and to the
earlier pieces' outputs they read (*borrowed* blocks), so memory does not grow with
pieces x sizes; the blocks go back to their pool (a private pool keeps them while its
graphs live), where a later capture of the same pool may be handed them. That is safe
because such a capture is of another size, whose calls never read these blocks:
- a replay call runs the pieces of one size in capture order, every piece rewriting its
  blocks before a later piece reads them, so what a weak reference shows is always the
  current call's value. Two pieces whose outputs share a block were captured in one
  call, where their values were never live at once; they are not in a later call either
  (the same forward, the same order). Nothing in a pool outlives a call: the runner
  clones the final outputs, static input buffers are outside the pools, and attention
  runs eagerly between the pieces, allocating outside them;
- a piece that replays while an earlier one ran uncaptured or replayed another capture
  finds its borrowed input at another address and copies it into the borrowed block:
  in this call no capture allocates in that block's pool (it already served this
  size), and the pieces of that capture call that share the block are not live now
  (above), so the copy overwrites nothing anyone will read;
- replays of different sizes (or signatures) of one graph overwrite each other's
  blocks and buffers: fine one call after another, wrong if two calls run at once. The
  runner serializes the calls of its captured programs (one lock per runner, see
  ``runtime/runner.py``) on the host, and the factory on the device: a call on another
  stream than the previous call waits for that stream first.
No caller-visible tensor is ever in a pool: the caller gets clones, and the only pool
tensors the forward holds are the current call's.
Without ``weak_ref`` in the loaded extension (a stale build) pieces keep owning
references: correct, memory grows as before; counted in ``fallbacks["weak_ref"]``.

Captures and other threads: captures record on a private stream of the factory with
``capture_error_mode="thread_local"`` (the caller's stream would record what other
threads enqueue on it meanwhile; thread-local mode keeps other threads' CUDA calls from
invalidating the capture) and run under Dynamo's compile lock, taken without waiting:
while another thread compiles (a Dynamo compile, a lazy size), the call runs
uncaptured and the capture waits for a later call. ``compile_mode="background"`` with
cudagraphs is refused by the options: it has not run on a GPU yet.

Capture and replay go through a small ``GraphFactory`` (:mod:`.graph_factory`) so that
the planning logic is tested on CPU with a simulator that has a CUDA graph's buffer,
pool and stream semantics.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Collection, Sequence

import torch
import torch.fx

from .. import ops
from .._torch import dynamo
from ..options import SizeBackendOptions
from ..stats import COUNTERS
from .graph_factory import CudaGraphFactory, GraphFactory, SimulatedGraphFactory  # noqa: F401
from .graph_factory import map_tensors as _map_tensors
from .graph_factory import tensors_of as _tensors

log = logging.getLogger(__name__)

#: Captures one piece keeps per size, one per input signature. Each holds a copy of the
#: piece's user inputs and a graph; a ninth shape runs uncaptured.
MAX_CAPTURES = 8


def captures_size(options: SizeBackendOptions, size: int | None) -> bool:
    """Whether the pieces of ``size`` (a listed size, or the one size a static graph was
    traced at) are captured."""
    return options.cudagraphs and size is not None and size in options.cudagraph_sizes


@functools.cache
def _weak_refs_supported() -> bool:
    """Decided (and, if not, logged) once per process."""
    if ops.has_weak_ref():
        return True
    log.warning(
        "sizebackend: the loaded _C has no weak_ref op (a stale build?): captured pieces "
        "keep their outputs alive, so CUDA-graph memory grows with pieces x sizes; rebuild "
        "with `pip install --no-build-isolation -e .`"
    )
    return False


def _weak(values: Any) -> Any:
    """Non-owning views of the tensors in ``values`` (detached: a replay records no
    autograd history); the values themselves where the extension lacks ``weak_ref``."""
    if not _weak_refs_supported():
        return values
    return _map_tensors(lambda t: ops.weak_ref(t.detach()), values)


class StablePointers:
    """State the captured pieces of one size share: the addresses their outputs live at
    (inputs found there need no copy on replay) and the fallbacks already logged."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()
        self.logged: set[str] = set()


def plan_copies(
    captured: Sequence[Any], args: Sequence[Any], static: frozenset[int] = frozenset()
) -> list[int]:
    """Indices of tensor ``args`` whose address differs from the captured buffer. A
    static input (parameter, buffer) is never among them: it is read in place, and its
    address is part of the capture's signature."""
    return [
        i
        for i, (buf, arg) in enumerate(zip(captured, args))
        if isinstance(buf, torch.Tensor) and i not in static and buf.data_ptr() != arg.data_ptr()
    ]


_TENSOR, _STATIC, _VALUE = 0, 1, 2


def arg_kinds(args: Sequence[Any], static: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """How :func:`signature` keys each position (fixed per piece: its FX call site)."""
    return tuple(
        _STATIC if i in static else _TENSOR if isinstance(a, torch.Tensor) else _VALUE
        for i, a in enumerate(args)
    )


def signature(args: Sequence[Any], kinds: tuple[int, ...]) -> tuple | None:
    """What a capture of a piece called with ``args`` bakes in: a tensor's shape and
    stride, the address (with shape and stride) of an input read in place, any other value with its
    type (1, 1.0 and True hash alike). ``None`` when a value cannot be keyed.

    Not dtype or device: Dynamo guards them on the graph's inputs and every other input
    of a piece follows from those; the device is checked once per signature (below).
    This runs on every call of every captured piece, so it stays this small."""
    parts: list[Any] = []
    add = parts.append  # flat: each position's kind, hence its parts, is fixed
    try:
        for a, k in zip(args, kinds):
            if k == _TENSOR:
                add(a.shape)
                add(a.stride())
            elif k == _STATIC:
                add(a.data_ptr())
                add(a.shape)
                add(a.stride())
            else:
                add(a if type(a) is int else (type(a), a))
        sig = tuple(parts)
        hash(sig)
    except (TypeError, AttributeError):  # an unhashable value; a tensor where none was
        return None
    return sig


class _Capture:
    """One recorded graph of a piece: its input buffers and the outputs it rewrites."""

    __slots__ = ("buffers", "graph", "outputs")

    def __init__(self, graph: Any, buffers: list[Any], outputs: Any):
        self.graph, self.buffers, self.outputs = graph, buffers, outputs


class CudaGraphPiece:
    """One compiled piece at one size: per input signature ``warmups`` plain runs, one
    capture, then replays. Not thread-safe on its own: the runner serializes calls.

    ``prepares``: the first captured piece of its size (FX runs the pieces in node
    order, so it runs first in every call of the size): it tells the factory that a
    call starts (stream order, the call's pool) and its captures do the once-per-batch
    ``gc`` and ``empty_cache``; the later pieces of the size skip them."""

    def __init__(
        self,
        fn: Callable[..., Any],
        size: int,
        factory: GraphFactory,
        stable: StablePointers,
        warmups: int,
        static_inputs: frozenset[int] = frozenset(),
        prepares: bool = True,
        capture_lock: Any = None,
    ):
        self.fn = fn
        self.size = size
        self.factory = factory
        self.stable = stable
        self.warmups = warmups
        self.static_inputs = static_inputs  # parameters, buffers, written inputs: read in place
        self.prepares = prepares
        self.capture_lock = capture_lock if capture_lock is not None else dynamo.COMPILE_LOCK
        self._kinds: tuple[int, ...] | None = None
        self.captures: dict[tuple, _Capture] = {}
        self._warmups_left: dict[tuple, int] = {}
        self._refused: dict[Any, str] = {}  # signature -> fallback key
        self._counted: set[str] = set()
        self.copies = 0

    # The latest capture's parts (tests, debugging).
    @property
    def graph(self) -> Any:
        return self._latest().graph if self.captures else None

    @property
    def buffers(self) -> list[Any]:
        return self._latest().buffers if self.captures else []

    @property
    def outputs(self) -> Any:
        return self._latest().outputs if self.captures else None

    def _latest(self) -> _Capture:
        return next(reversed(self.captures.values()))

    def _fallback(self, key: str, why: str) -> None:
        """Counted once per piece, logged once per size."""
        if key not in self._counted:
            self._counted.add(key)
            COUNTERS.add_keyed("fallbacks", key)
        if key not in self.stable.logged:
            self.stable.logged.add(key)
            log.warning("sizebackend: size-%d pieces run without CUDA graphs when %s (%s)",
                        self.size, why, key)

    def __call__(self, *args: Any) -> Any:
        if self.prepares:  # the first captured piece of the size: a call starts
            self.factory.begin_call(self.size)
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            self._fallback("cudagraph_grad_mode", "called with grad mode on")
            return self.fn(*args)
        if self._kinds is None or len(self._kinds) != len(args):
            self._kinds = arg_kinds(args, self.static_inputs)
        sig = signature(args, self._kinds)
        capture = self.captures.get(sig) if sig is not None else None
        if capture is not None:
            for i in plan_copies(capture.buffers, args, self.static_inputs):
                capture.buffers[i].copy_(args[i])
                self.copies += 1
            capture.graph.replay()
            return capture.outputs
        return self._first_sight(sig, args)

    def _refusal(self, sig: tuple | None, args: Sequence[Any]) -> tuple[str, str] | None:
        if sig is None:
            return "cudagraph_signature", "an argument cannot be keyed"
        device = self.factory.device_type
        if any(isinstance(a, torch.Tensor) and a.device.type != device for a in args):
            return "cudagraph_device", f"an input is not on {device}"
        if len(self.captures) >= MAX_CAPTURES:
            return "cudagraph_captures", f"a piece sees more than {MAX_CAPTURES} input signatures"
        return None

    def _first_sight(self, sig: tuple | None, args: Sequence[Any]) -> Any:
        if sig in self._refused:
            return self.fn(*args)
        if sig not in self._warmups_left:
            refusal = self._refusal(sig, args)
            if refusal is not None:
                self._fallback(*refusal)
                if len(self._refused) < 4 * MAX_CAPTURES:  # else re-checked per call
                    self._refused[sig] = refusal[0]
                return self.fn(*args)
            if len(self._warmups_left) >= 4 * MAX_CAPTURES:
                self._warmups_left.clear()  # one-off shapes must not pile up
            self._warmups_left[sig] = self.warmups
        if self._warmups_left[sig] > 0:
            self._warmups_left[sig] -= 1
            return self.fn(*args)
        if not self.capture_lock.acquire(blocking=False):
            log.debug("sizebackend: a compile runs on another thread; size-%d capture deferred",
                      self.size)
            return self.fn(*args)
        try:
            return self._capture(sig, args)
        except Exception as e:  # counted, logged; the signature runs uncaptured from now on
            self._fallback("cudagraph_capture_failed", f"a capture fails ({type(e).__name__}: {e})")
            self._refused[sig] = "cudagraph_capture_failed"
            return self.fn(*args)
        finally:
            self.capture_lock.release()
            self._warmups_left.pop(sig, None)

    def _capture(self, sig: tuple, args: Sequence[Any]) -> Any:
        # Own a buffer for every tensor input that does not already sit at a fixed
        # address (parameters, or outputs of an earlier captured piece of this size).
        # Those outputs stay owned by the pool (and the forward): held weakly here.
        buffers = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in self.static_inputs:
                a = _weak(a) if a.data_ptr() in self.stable.ptrs else a.clone()
            buffers.append(a)
        graph, outputs = self.factory.capture(
            lambda: self.fn(*buffers), buffers, prepare=self.prepares
        )
        self.captures[sig] = _Capture(graph, buffers, _weak(outputs))
        self.stable.ptrs.update(t.data_ptr() for t in _tensors(outputs))
        COUNTERS.add_keyed("captures", str(self.size))
        if not _weak_refs_supported():
            COUNTERS.add_keyed("fallbacks", "weak_ref")  # one per capture
        log.debug("captured a piece at size %d (%d signatures)", self.size, len(self.captures))
        # The owning outputs, not the weak ones: the rest of this call's forward keeps
        # them alive exactly as long as it needs them, which is what the pool must see
        # while it captures the later pieces (see the module docstring).
        return outputs


def clone_outputs(outputs: Any) -> Any:
    """Detach the caller's results from the replay buffers the next call overwrites."""
    return _map_tensors(torch.Tensor.clone, outputs)


def capture_pieces(split_gm: torch.fx.GraphModule, split_ops: Collection[str], pieces: dict,
                   size: int, factory: GraphFactory, warmups: int,
                   mutated: dict[str, frozenset[int]] | None = None) -> dict:
    """The pieces of ``size`` wrapped for capture/replay (split ops stay eager).

    ``mutated``: per piece, the argument positions it writes in place (see
    ``compile/pipeline.py``'s recorder). Those, and inputs that are parameters or
    registered buffers, are read in place at an address the signature keys, never
    copied; every other tensor input, a plain tensor attribute included, is copied."""
    mutated = mutated or {}
    stable = StablePointers()
    wrapped = dict(pieces)
    first = True
    for node in split_gm.graph.nodes:
        if node.op != "call_module" or node.target in split_ops:
            continue
        static = frozenset(
            i for i, a in enumerate(node.args)
            if isinstance(a, torch.fx.Node) and a.op == "placeholder"
            and dynamo.is_parameter_or_buffer(a)  # split_module keeps placeholder meta
        )
        written = mutated.get(node.target, frozenset()) - static
        if written:
            log.debug("sizebackend: piece %s writes its inputs %s in place: captured at "
                      "their own address", node.target, sorted(written))
        wrapped[node.target] = CudaGraphPiece(
            pieces[node.target], size, factory, stable, warmups, static | written,
            prepares=first,
        )
        first = False
    return wrapped
