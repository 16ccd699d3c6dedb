"""How a piece is captured and replayed: real CUDA graphs, or a CPU simulator with the
same buffer semantics (what the CPU tests of ``runtime/cudagraphs.py`` run on).

A factory captures ``fn()`` and returns the graph and the outputs it rewrites on replay,
already holding ``fn()``'s results (the capturing call's forward uses them). One factory
per compiled Dynamo graph: all its captures share one memory pool.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    device_type: str
    """Tensors on other devices are never captured (``fallbacks["cudagraph_device"]``)."""

    def capture(
        self, fn: Callable[[], Any], inputs: Sequence[Any] = (), prepare: bool = True
    ) -> tuple[CapturedGraph, Any]:
        """Capture ``fn()``, which reads ``inputs``; ``prepare``: first capture of a
        batch (free cached memory first)."""
        ...


class CudaGraphFactory:
    """Real CUDA graphs, all captures of one compiled graph in one memory pool.

    - Captured on the caller's current stream, so a replay (which runs on the current
      stream) is ordered with the work around it the way the capture saw it. The legacy
      default stream cannot be captured: there, a side stream of this factory's own,
      fenced both ways with the current stream.
    - ``capture_error_mode="thread_local"``: CUDA calls other threads make during a
      capture (a compile's allocations) do not invalidate it; only this thread's do.
    - The ``gc.collect`` and ``empty_cache`` that ``torch.cuda.graph`` may do on every
      capture run once per batch of captures (``prepare``): a size's pieces are captured
      in one call, and collecting before each of them costs tens of ms apiece. (The
      device synchronize stays per capture: it costs nothing on an idle device.)
    """

    device_type = "cuda"

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self._side: torch.cuda.Stream | None = None
        self.prepares = 0

    def _stream(self, current: torch.cuda.Stream) -> torch.cuda.Stream:
        if current != torch.cuda.default_stream(current.device):
            return current
        if self._side is None:
            self._side = torch.cuda.Stream(current.device)
        return self._side

    def capture(self, fn, inputs=(), prepare: bool = True):
        current = torch.cuda.current_stream()
        torch.cuda.synchronize()  # cheap; what torch.cuda.graph does before every capture
        if prepare:
            self.prepares += 1
            gc.collect()
            torch.cuda.empty_cache()
        stream = self._stream(current)
        if stream is not current:
            stream.wait_stream(current)  # the input buffers were written on ``current``
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            finally:
                graph.capture_end()
        if stream is not current:
            current.wait_stream(stream)
        # Capture records the kernels without running them: the outputs hold nothing yet.
        graph.replay()
        return graph, outputs


class SimulatedGraphFactory:
    """CPU stand-in with a CUDA graph's buffer semantics: replay recomputes from the
    captured input tensors and writes into the captured output tensors in place.

    A simulated graph owns its outputs, standing in for the pool that keeps a real
    graph's output blocks reserved: the pieces hold only weak references to them. It
    cannot show address reuse across captures; a replay whose input tensor moved (a
    weight given new storage) raises, where a real graph would read stale memory.
    ``device_type``: the device whose tensors it accepts (``"cuda"`` makes the pieces
    refuse CPU inputs as with a real one)."""

    class _Graph:
        def __init__(self, fn, outputs, inputs):
            self.fn, self.outputs = fn, outputs  # owned here, as a pool's blocks are
            self.addresses = [(t, t.data_ptr()) for t in inputs if isinstance(t, torch.Tensor)]

        def replay(self) -> None:
            # A real graph would read whatever now lies at the captured address.
            for t, ptr in self.addresses:
                if t.data_ptr() != ptr:
                    raise RuntimeError("simulated CUDA graph: a captured input moved")
            fresh = self.fn()
            for old, new in zip(tensors_of(self.outputs), tensors_of(fresh)):
                old.copy_(new)

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.prepares = 0

    def capture(self, fn, inputs=(), prepare: bool = True):
        self.prepares += prepare
        outputs = fn()
        return self._Graph(fn, outputs, inputs), outputs


def tensors_of(values: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, list or tuple (a piece's outputs)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []
