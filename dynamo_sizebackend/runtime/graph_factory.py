"""How a piece is captured and replayed: real CUDA graphs, or a CPU simulator with the
same buffer, allocator and stream semantics (what the CPU tests of
``runtime/cudagraphs.py`` run on).

A factory captures ``fn()`` and returns the graph and the outputs it rewrites on replay,
already holding ``fn()``'s results (the capturing call's forward uses them). One factory
per compiled Dynamo graph: its captures, pools and streams are shared by every size of
that graph. The policy (which pool, which stream, what orders what) lives in
:class:`GraphFactory` and runs unchanged on the simulator; the subclasses only say how
a stream, a pool and a recording are made on their device.
"""
from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .. import ops


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphFactory:
    """Capture policy shared by the real factory and the simulator: which pool a
    capture allocates in, which stream it records on, what orders a replay.

    - **Pools.** A capture call of a size (one call of its pieces in which one or more
      of them are captured) allocates in one pool, and no two capture calls of one size
      share a pool; calls of different sizes do (:meth:`begin_call`). Why: a capture
      may be handed any block of its pool that no tensor *owns*, and the pieces hold
      what earlier captures allocated only weakly. Within one call the forward owns
      what it still needs, so the pool sees the true liveness; in a later call of the
      same size the pieces that replay return weak views, and a capture sharing their
      pool could allocate over them (and over its own inputs). A call of another size
      never reads this size's blocks, so sharing with it is safe, and memory is one pool
      per capture call of the size captured most often, not one per capture.
    - **Streams.** Every capture records on a private stream of the factory, fenced
      both ways with the caller's current stream: recording on the caller's stream would
      take in whatever other threads enqueue there meanwhile (``thread_local`` capture
      mode guards API calls, not stream work). Replays run on the caller's stream, and
      a call on another stream than the factory's previous call first waits for that
      stream: the runner's lock orders the host, not the device, and the two calls share
      the pool and the input buffers.

    ``device_type``: tensors on other devices are never captured
    (``fallbacks["cudagraph_device"]``)."""

    device_type: str

    def __init__(self) -> None:
        self.pools: list[tuple[Any, set[int | None]]] = []  # each with the sizes it served
        self.prepares = 0
        self._capture_stream: Any = None
        self._last_stream: Any = None
        self._call_size: int | None = None
        self._call_pool: Any = None

    # -- device hooks -----------------------------------------------------------------
    def current_stream(self) -> Any:
        raise NotImplementedError

    def default_stream(self) -> Any:
        raise NotImplementedError

    def _new_stream(self) -> Any:
        raise NotImplementedError

    def _new_pool(self) -> Any:
        raise NotImplementedError

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _free_cached(self) -> None:
        """What ``torch.cuda.graph`` does before a capture: collect, empty the cache."""
        gc.collect()

    def _record(self, fn: Callable[[], Any], inputs: Sequence[Any], pool: Any,
                stream: Any) -> tuple[Any, Any]:
        """Record ``fn()`` (which reads ``inputs``) on ``stream`` into ``pool``: the
        graph and its outputs, which hold nothing until the graph is replayed."""
        raise NotImplementedError

    # -- policy -----------------------------------------------------------------------
    def begin_call(self, size: int | None) -> None:
        """A call of ``size``'s pieces starts (its first captured piece says so, under
        the runner's lock): order it after the previous call's stream, and let its
        captures, if any, pick their pool."""
        current = self.current_stream()
        last = self._last_stream
        if last is not None and last != current:
            current.wait_stream(last)
        self._last_stream = current
        self._call_size, self._call_pool = size, None

    def _pool(self) -> Any:
        """This call's pool: the first one no capture call of its size used, or a new one."""
        if self._call_pool is None:
            for pool, sizes in self.pools:
                if self._call_size not in sizes:
                    break
            else:
                pool, sizes = self._new_pool(), set()
                self.pools.append((pool, sizes))
            sizes.add(self._call_size)
            self._call_pool = pool
        return self._call_pool

    def capture(self, fn: Callable[[], Any], inputs: Sequence[Any] = (),
                prepare: bool = True) -> tuple[CapturedGraph, Any]:
        """Capture ``fn()``, which reads ``inputs``; ``prepare``: first capture of a
        batch (free cached memory first)."""
        current = self.current_stream()
        # What torch.cuda.graph does before every capture, cheap on an idle device, and
        # what lets this capture reuse blocks the forward freed after using them on the
        # caller's stream (the allocator saw them freed on the capture stream only).
        self._synchronize()
        if prepare:
            self.prepares += 1
            self._free_cached()
        stream = self._stream_for_capture(current)
        if stream is not current:
            stream.wait_stream(current)  # the input buffers were written on ``current``
        graph, outputs = self._record(fn, inputs, self._pool(), stream)
        if stream is not current:
            current.wait_stream(stream)
        graph.replay()  # capture records the kernels without running them
        return graph, outputs

    def _stream_for_capture(self, current: Any) -> Any:
        """The factory's private capture stream, whatever ``current`` is."""
        if self._capture_stream is None:
            self._capture_stream = self._new_stream()
        return self._capture_stream


class CudaGraphFactory(GraphFactory):
    """Real CUDA graphs (``torch.cuda.CUDAGraph``), in pools of
    ``torch.cuda.graph_pool_handle()``.

    - ``capture_error_mode="thread_local"``: CUDA calls other threads make during a
      capture (a compile's allocations) do not invalidate it; only this thread's do.
    - The ``gc.collect`` and ``empty_cache`` that ``torch.cuda.graph`` may do on every
      capture run once per batch of captures (``prepare``): a size's pieces are captured
      in one call, and collecting before each of them costs tens of ms apiece. (The
      device synchronize stays per capture: it costs nothing on an idle device.)
    """

    device_type = "cuda"

    def current_stream(self):
        return torch.cuda.current_stream()

    def default_stream(self):
        return torch.cuda.default_stream()

    def _new_stream(self):
        return torch.cuda.Stream()

    def _new_pool(self):
        return torch.cuda.graph_pool_handle()

    def _synchronize(self) -> None:
        torch.cuda.synchronize()

    def _free_cached(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def _record(self, fn, inputs, pool, stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            finally:
                graph.capture_end()
        return graph, outputs


# -- the simulator ---------------------------------------------------------------------


class SimulatedStream:
    """A stream as far as ordering goes: how much work was enqueued on it, how much of
    each other stream's work it waited for, and the capture recording on it, if any."""

    def __init__(self, name: str = "side") -> None:
        self.name = name
        self.work = 0
        self.waited: dict[SimulatedStream, int] = {}
        self.capturing: tuple[list, int] | None = None  # (work recorded, thread id)

    def wait_stream(self, other: "SimulatedStream") -> None:
        if other is not self:
            self.waited[other] = other.work

    def ordered_after(self, other: "SimulatedStream", work: int) -> bool:
        """Whether this stream's next work runs after ``other``'s ``work``-th op."""
        return other is self or self.waited.get(other, 0) >= work

    def __repr__(self) -> str:
        return f"SimulatedStream({self.name})"


DEFAULT_STREAM = SimulatedStream("default")
_current = threading.local()


class simulated_stream:
    """``with simulated_stream(s):`` makes ``s`` this thread's current simulated stream
    (what ``torch.cuda.stream`` does for a real one)."""

    def __init__(self, stream: SimulatedStream) -> None:
        self.stream = stream

    def __enter__(self) -> SimulatedStream:
        self._before = getattr(_current, "stream", DEFAULT_STREAM)
        _current.stream = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        _current.stream = self._before


class SimulatedPool:
    """A private memory pool as the caching allocator keeps one: blocks of raw memory
    that stay reserved for the pool. A block is allocated while a tensor owning its
    storage lives (a view or a ``detach()`` of it counts, a ``weak_ref`` does not), and
    free otherwise: a later capture into the pool may then be handed it, best fit by
    size, then by age (as the allocator's size-then-address order)."""

    class Block:
        __slots__ = ("memory", "owner")

        def __init__(self, nbytes: int) -> None:
            self.memory = torch.empty(nbytes, dtype=torch.uint8)
            self.owner: weakref.ref | None = None  # the storage of the tensor handed out

        def free(self) -> bool:
            return self.owner is None or self.owner() is None

        def scribble(self) -> None:
            """What a graph's kernels may leave in a block it uses as scratch: all bits
            set (NaN in every float dtype, -1 in every int)."""
            self.memory.fill_(0xFF)

    def __init__(self) -> None:
        self.blocks: list[SimulatedPool.Block] = []

    def free_blocks(self) -> list["SimulatedPool.Block"]:
        return [b for b in self.blocks if b.free()]

    def allocate(self, like: torch.Tensor, free: list["SimulatedPool.Block"]) -> tuple[
            torch.Tensor, "SimulatedPool.Block"]:
        """An owning tensor with ``like``'s shape, strides and dtype over a block of the
        pool: the best fit among ``free`` (taken out of it), else a new block."""
        span = 1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride()))
        nbytes = (span if like.numel() else 1) * like.element_size()
        fits = [b for b in free if b.memory.numel() >= nbytes]
        if fits:
            block = min(fits, key=lambda b: b.memory.numel())
            free.remove(block)
        else:
            block = SimulatedPool.Block(nbytes)
            self.blocks.append(block)
        # A tensor with a storage of its own over the block's memory: its owner.
        flat = block.memory[:nbytes].view(like.dtype)
        owner = ops.weak_ref(flat.as_strided(like.shape, like.stride()))
        block.owner = weakref.ref(owner.untyped_storage())
        return owner, block


class SimulatedGraphFactory(GraphFactory):
    """CPU stand-in for :class:`CudaGraphFactory` with a CUDA graph's semantics where
    they decide correctness:

    - **Buffers**: replay recomputes ``fn()`` from the captured input tensors and writes
      into the captured output blocks in place; a replay whose input tensor moved (a
      weight given new storage) raises, where a real graph would read stale memory.
    - **Pool**: a capture's outputs are allocated in the pool (:class:`SimulatedPool`),
      owned by the tensors the capture returns; the graph keeps only weak views. Every
      block that was free when the graph was captured may hold its intermediates: each
      replay scribbles over them (and over its output blocks) before it computes, so a
      live tensor the pool had handed out again shows up as NaN, and so does an input
      that a capture allocated over.
    - **Streams** (:class:`SimulatedStream`, :class:`simulated_stream`): a replay is work
      on the current stream. One enqueued by another thread on a stream that is capturing
      is recorded into that capture, not run; and a replay that is not ordered after the
      factory's previous replay on another stream (no stream wait, no synchronize) raises,
      where a real GPU would let the two overwrite each other's buffers.

    ``device_type``: the device whose tensors it accepts (``"cuda"`` makes the pieces
    refuse CPU inputs as with a real one)."""

    class _Graph:
        def __init__(self, factory, fn, inputs, outputs, blocks, scratch, foreign):
            self.factory, self.fn = factory, fn
            # Weak views: the pool's blocks, not owned here (a real graph owns none either).
            self.outputs = map_tensors(ops.weak_ref, outputs)
            self.blocks, self.scratch = blocks, scratch
            self.addresses = [(t, t.data_ptr()) for t in inputs if isinstance(t, torch.Tensor)]
            self.foreign = foreign  # other threads' work recorded during its capture

        def replay(self) -> None:
            stream = self.factory.current_stream()
            if stream.capturing is not None and stream.capturing[1] != threading.get_ident():
                stream.capturing[0].append(self._run)  # recorded, not run
                return
            self.factory._order(stream)
            self._run()

        def _run(self) -> None:
            # A real graph would read whatever now lies at the captured address.
            for t, ptr in self.addresses:
                if t.data_ptr() != ptr:
                    raise RuntimeError("simulated CUDA graph: a captured input moved")
            for block in self.scratch + self.blocks:
                block.scribble()
            fresh = self.fn()
            for old, new in zip(tensors_of(self.outputs), tensors_of(fresh)):
                old.copy_(new)
            for work in self.foreign:
                work()

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._last: tuple[SimulatedStream, int, int] | None = None  # stream, work, sync
        self._syncs = 0
        super().__init__()

    def live_blocks(self) -> int:
        """Blocks of this factory's pools that a tensor owns now (what a real pool
        could not hand out again)."""
        return sum(not b.free() for pool, _ in self.pools for b in pool.blocks)

    def current_stream(self) -> SimulatedStream:
        return getattr(_current, "stream", DEFAULT_STREAM)

    def default_stream(self) -> SimulatedStream:
        return DEFAULT_STREAM

    def _new_stream(self) -> SimulatedStream:
        return SimulatedStream()

    def _new_pool(self) -> SimulatedPool:
        return SimulatedPool()

    def _synchronize(self) -> None:
        self._syncs += 1

    def _order(self, stream: SimulatedStream) -> None:
        """A replay on ``stream``: raise unless it runs after the previous one."""
        last = self._last
        if last is not None and last[2] == self._syncs and not stream.ordered_after(*last[:2]):
            raise RuntimeError(
                f"simulated CUDA graph: replay on {stream} while a replay of the same pool and "
                f"buffers on {last[0]} may still run (no stream wait orders them)")
        stream.work += 1
        self._last = (stream, stream.work, self._syncs)

    def _record(self, fn, inputs, pool, stream):
        free = pool.free_blocks()  # what this capture's intermediates may use
        foreign: list[Callable[[], None]] = []
        # A capture records kernels without running them: what fn() writes is put back.
        with torch.no_grad():
            saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        stream.capturing = (foreign, threading.get_ident())
        try:
            fresh = fn()
        finally:
            stream.capturing = None
            with torch.no_grad():
                for t, before in saved:
                    t.copy_(before)
        blocks = []

        def allocate(t: torch.Tensor) -> torch.Tensor:
            owner, block = pool.allocate(t, free)
            blocks.append(block)
            return owner

        outputs = map_tensors(allocate, fresh)
        return self._Graph(self, fn, inputs, outputs, blocks, free, foreign), outputs


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], values: Any) -> Any:
    """``fn`` applied to a tensor, or to the tensors of a list or tuple (others kept)."""
    if isinstance(values, torch.Tensor):
        return fn(values)
    if isinstance(values, (list, tuple)):
        out = [fn(v) if isinstance(v, torch.Tensor) else v for v in values]
        return type(values)(out) if isinstance(values, tuple) else out
    return values


def tensors_of(values: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, list or tuple (a piece's outputs)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []
