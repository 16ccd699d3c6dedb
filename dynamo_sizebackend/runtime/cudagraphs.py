"""Piecewise CUDA graphs: capture each compiled piece once per size, replay it after.

Attention (the split ops) is never captured: it runs eagerly between the graphs, which
is what lets one capture per size serve every sequence length mix of a serving batch.

Memory and addresses, the hazards this module exists for:
- every capture of one graph shares one memory pool, so the pieces of a size reuse the
  same blocks instead of each reserving its own;
- a replay reads its inputs from the addresses seen at capture. An input that arrives at
  another address (a user tensor, an attention output: fresh allocations each call) is
  copied into the piece's own static buffer first. An input that is the output of an
  earlier captured piece of the same size lives at a fixed pool address and is not
  copied;
- a replay writes its outputs into the same buffers every time, so the runner clones the
  graph's final outputs before handing them to the caller.

Why a piece keeps its captured outputs (and the earlier pieces' outputs it reads) only
as weak references (``ops.weak_ref``: same memory, not owned), so that memory does not
grow with pieces x sizes:
- the capture call hands the *owning* outputs on down the forward, so while the later
  pieces of that size are captured the pool sees exactly the tensors the forward still
  needs as live, and reuses only blocks the forward is done with. When the call ends
  the blocks go back to the pool (not to the general allocator: a private pool keeps
  them while its graphs live), and later captures, of other sizes, may reuse them;
- a replay call runs the pieces of one size in capture order, every piece rewriting its
  blocks before a later piece reads them, so what a weak reference shows is always the
  current call's value; the blocks the pieces of a size share follow the same liveness
  as in the capture call. Nothing in the pool outlives a call: the runner clones the
  final outputs, static input buffers are cloned outside the pool, and attention runs
  eagerly between the pieces, allocating outside the pool;
- hence replays of different sizes of one graph may overwrite each other's outputs:
  fine one call after another (A, B, A), wrong if two calls run at once.
Without ``weak_ref`` in the loaded extension (a stale build) pieces keep owning
references: correct, memory grows as before; counted in ``fallbacks["weak_ref"]``.

Capture and replay go through a small ``GraphFactory`` so that the planning logic is
tested on CPU with a simulator that has the same buffer semantics as a CUDA graph. The
simulator cannot show address reuse across captures: its graphs own their outputs.
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.fx

from .. import ops
from .._torch import dynamo
from ..options import SizeBackendOptions
from ..stats import COUNTERS

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """Whether captures can run here (one place, so CPU tests can stand in a simulator)."""
    return torch.cuda.is_available()


def effective_compile_sizes(options: SizeBackendOptions) -> tuple[int, ...]:
    """The seed's rule: with cudagraphs on, a compile size that is not a capture size is
    dropped, with one warning. (In vLLM a batch is always padded up to a capture size,
    so it never runs at its own; here it runs on the general pieces, uncaptured, unless
    ``pad_to_size`` pads it.)"""
    sizes = options.compile_sizes
    if not options.cudagraphs:
        return sizes
    capture = set(options.cudagraph_sizes)
    kept = tuple(n for n in sizes if n in capture)
    dropped = [n for n in sizes if n not in capture]
    if dropped:
        message = (
            f"sizebackend: compile_sizes {dropped} are not in cudagraph_sizes and are dropped "
            f"(with cudagraphs on they would never run at their own size); compiling {list(kept)}"
        )
        # Both channels: Dynamo may run the backend with Python warnings filtered.
        log.warning("%s", message)
        warnings.warn(message, stacklevel=2)
    return kept


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    def capture(self, fn: Callable[[], Any]) -> tuple[CapturedGraph, Any]:
        """Capture ``fn()`` and return the graph and the outputs it writes on replay,
        already holding ``fn()``'s results (the caller of the capturing call uses them)."""
        ...


class CudaGraphFactory:
    """Real CUDA graphs, all captures of one compiled graph in one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        # Capture records the kernels without running them: the outputs hold nothing yet.
        graph.replay()
        return graph, outputs


class SimulatedGraphFactory:
    """CPU stand-in with a CUDA graph's buffer semantics: replay recomputes from the
    captured input tensors and writes into the captured output tensors in place.

    A simulated graph owns its outputs, standing in for the pool that keeps a real
    graph's output blocks reserved: the pieces hold only weak references to them."""

    class _Graph:
        def __init__(self, fn, outputs):
            self.fn, self.outputs = fn, outputs  # owned here, as a pool's blocks are

        def replay(self) -> None:
            fresh = self.fn()
            for old, new in zip(_tensors(self.outputs), _tensors(fresh)):
                old.copy_(new)

    def capture(self, fn):
        outputs = fn()
        return self._Graph(fn, outputs), outputs


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], values: Any) -> Any:
    """``fn`` applied to a tensor, or to the tensors of a list or tuple (others kept)."""
    if isinstance(values, torch.Tensor):
        return fn(values)
    if isinstance(values, (list, tuple)):
        out = [fn(v) if isinstance(v, torch.Tensor) else v for v in values]
        return type(values)(out) if isinstance(values, tuple) else out
    return values


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


def _tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []


class StablePointers:
    """Addresses of the outputs captured pieces of one size write to: inputs found here
    need no copy on replay."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()


def plan_copies(
    captured: Sequence[Any], args: Sequence[Any]
) -> list[int]:
    """Indices of tensor ``args`` whose address differs from the captured buffer."""
    return [
        i
        for i, (buf, arg) in enumerate(zip(captured, args))
        if isinstance(buf, torch.Tensor) and buf.data_ptr() != arg.data_ptr()
    ]


class CudaGraphPiece:
    """One compiled piece at one size: ``warmups`` plain runs, one capture, then replays."""

    def __init__(
        self,
        fn: Callable[..., Any],
        size: int,
        factory: GraphFactory,
        stable: StablePointers,
        warmups: int,
        static_inputs: frozenset[int] = frozenset(),
    ):
        self.fn = fn
        self.size = size
        self.factory = factory
        self.stable = stable
        self.warmups_left = warmups
        self.static_inputs = static_inputs  # parameters: never copied, never change
        self.graph: CapturedGraph | None = None
        self.buffers: list[Any] = []
        self.outputs: Any = None
        self.copies = 0

    def _capture(self, args: Sequence[Any]) -> Any:
        # Own a buffer for every tensor input that does not already sit at a fixed
        # address (parameters, or outputs of an earlier captured piece of this size).
        # Those outputs stay owned by the pool (and the forward): held weakly here.
        buffers = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in self.static_inputs:
                a = _weak(a) if a.data_ptr() in self.stable.ptrs else a.clone()
            buffers.append(a)
        self.buffers = buffers
        self.graph, outputs = self.factory.capture(lambda: self.fn(*self.buffers))
        self.outputs = _weak(outputs)
        self.stable.ptrs.update(t.data_ptr() for t in _tensors(outputs))
        COUNTERS.add_keyed("captures", str(self.size))
        if not _weak_refs_supported():
            COUNTERS.add_keyed("fallbacks", "weak_ref")  # one per capture
        log.debug("captured a piece at size %d", self.size)
        # The owning outputs, not the weak ones: the rest of this call's forward keeps
        # them alive exactly as long as it needs them, which is what the pool must see
        # while it captures the later pieces (see the module docstring).
        return outputs

    def __call__(self, *args: Any) -> Any:
        if self.graph is None:
            if self.warmups_left > 0:
                self.warmups_left -= 1
                return self.fn(*args)
            return self._capture(args)
        for i in plan_copies(self.buffers, args):
            self.buffers[i].copy_(args[i])
            self.copies += 1
        self.graph.replay()
        return self.outputs


def clone_outputs(outputs: Any) -> Any:
    """Detach the caller's results from the replay buffers the next call overwrites."""
    return _map_tensors(torch.Tensor.clone, outputs)


def capture_pieces(split_gm: torch.fx.GraphModule, split_ops: set[str], pieces: dict,
                   size: int, factory: "GraphFactory", warmups: int) -> dict:
    """The pieces of ``size`` wrapped for capture/replay (split ops stay eager). Inputs
    that are parameters or buffers (not user inputs) are never copied."""
    stable = StablePointers()
    wrapped = dict(pieces)
    for node in split_gm.graph.nodes:
        if node.op != "call_module" or node.target in split_ops:
            continue
        static = frozenset(
            i for i, a in enumerate(node.args)
            if isinstance(a, torch.fx.Node) and a.op == "placeholder"
            and not dynamo.is_user_input(a)  # split_module keeps placeholder meta
        )
        wrapped[node.target] = CudaGraphPiece(pieces[node.target], size, factory, stable, warmups, static)
    return wrapped
