"""Frozen sized pieces stored as AOTInductor packages, so that a restart loads them.

Why a second kind of entry: torch refuses to save a frozen JIT compile (AOTAutograd's
cache bypasses any compile with ``freezing`` set, the FX graph cache bypasses CPU
freezing because prepacked weights are mkldnn tensors), so before this every start
compiled every frozen sized piece again: a warm restart cost nearly a cold one.
AOTInductor does store them: the piece is exported (``torch.export``) and compiled
ahead of time into a package holding its ``.so`` and its constants, the frozen weights
among them; a later process loads it in milliseconds.

The key is the piece key (:func:`.key.piece_key`) of the *frozen* copy of the piece,
whose ``get_attr`` constants it hashes by value, plus the marker ``aot``: a package
holds the weights it was compiled with, so a checkpoint with other values has another
key and never loads a stale package. Identical layers therefore do not share a
package (their weights differ); each size and layer is one entry, and the cache holds
one copy of the frozen weights per listed size (``sizebackend cache info`` shows it).

Used only where the disk cache is on (``cache_dir``) and ``store_frozen`` is true, for
a piece whose inputs at that size are fully static (tensors and ints, no symbol left:
AOTInductor would need export's dynamic-shape spec for the others) and that writes
none of its inputs in place. Everything else, and a piece that export or AOTInductor
cannot take, compiles on the JIT path as before, counted in
``cache_skips["frozen"]`` (and ``cache_skips["aot_failed"]`` for a failure, logged once
per reason).

Where a package is built (``store_frozen``): by default (``True``, ``"worker"``) in the
package worker process (``cache/package_worker.py``) while a JIT compile of the piece
serves; with ``"inline"`` here, before the size serves. Never inline on the background
thread (``compile_mode="background"``): torch's AOT compile sets process-wide flags
for its whole duration (``torch.compiler._is_compiling_flag`` and
``_is_exporting_flag``, see ``torch._export.utils._compiling_state_context``), so
every other thread's compiled code sees ``is_compiling()`` and ``is_exporting()`` true
meanwhile; measured: a call of the compiled Llama on the main thread while the
background thread built a package raised ``KeyError: 'custom'`` in
``fx.traceback.annotate``, which Dynamo's wrapper enters only when exporting. So with
``"inline"`` the background thread only loads packages (a missing one compiles on the
JIT path, ``cache_skips["frozen"]``), and an inline build in the caller's thread has
the same effect on other serving threads: the worker has neither problem.

A piece holding collectives (a tensor-parallel model) is never made a package; it
compiles on the JIT path (``cache_skips["frozen"]``). Tried on 2 gloo ranks: the
package worker cannot build one (AOTInductor resolves the collective's process group
by name, and the worker has none: ``aot_failed``); built in the rank itself, two ranks
building the same code at once raced in Inductor's cache folder (a JSON file read back
empty), and with a lock against that, the Llama ``small`` at sizes 2, 5, 6, 8 (frozen,
max-autotune) hung in its first size-2 call: both ranks waiting in ``wait_tensor``
inside the same package, cause not found. The same sizes and options on the JIT path
ran through (``sizebackend bench --tp 2`` without a ``cache_dir``).

An AOT package is called through its loader's flat ``run(tensors)``: the piece's int
arguments are constants of the package (static at this size), so only its tensor
arguments are passed.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from .._torch import distributed, inductor
from ..stats import COUNTERS
from . import package_worker
from .store import PieceCache, load_package

log = logging.getLogger(__name__)

KIND = "aot"


class Sent:
    """What :func:`compile_or_load` returns for a piece handed to the package worker:
    the JIT path serves it meanwhile; :meth:`load` takes the package once the worker
    has answered (``compile/swap.py``)."""

    def __init__(self, job: str, cache: PieceCache, key: str, gm: torch.fx.GraphModule,
                 name: str, positions: Sequence[int], outputs: Outputs | None):
        self.job, self.cache, self.key, self.name = job, cache, key, name
        self._gm, self._positions, self._outputs = gm, list(positions), outputs

    def answered(self) -> str | None:
        """The worker's answer to the job (``"stored"``, ``"present"``, ``"failed"``),
        ``None`` while it builds."""
        return package_worker.answer(self.job)

    def load(self) -> "AotPiece | None":
        """The stored package as a piece (counted as a cache hit), ``None`` where there is
        none to load (the build failed, or the entry is gone or damaged)."""
        package = self.cache.lookup(self.key, self._gm, self.name, kind=KIND)
        return AotPiece(package, self._positions, self._outputs) if package is not None else None


def static_reason(inputs: Sequence[Any]) -> str | None:
    """Why a frozen piece with these example inputs cannot be an AOT package, or
    ``None`` if it can (every input a tensor of static shape and strides, or an int)."""
    for value in inputs:
        if isinstance(value, torch.Tensor):
            dims = list(value.shape) + list(value.stride()) + [value.storage_offset()]
            if any(isinstance(d, torch.SymInt) for d in dims):
                return "an input of symbolic shape"
        elif isinstance(value, bool) or not isinstance(value, int):
            return f"an input of type {type(value).__name__}"
    return None


class _Bound(torch.nn.Module):
    """The frozen piece with its int arguments bound: export sees tensors only."""

    def __init__(self, gm: torch.fx.GraphModule, example: Sequence[Any]):
        super().__init__()
        self.piece = gm
        self.count = len(example)
        self.ints = {i: v for i, v in enumerate(example) if not isinstance(v, torch.Tensor)}

    def forward(self, *tensors: torch.Tensor) -> Any:
        given = iter(tensors)
        return self.piece(*[self.ints[i] if i in self.ints else next(given) for i in range(self.count)])


@dataclass(frozen=True)
class Outputs:
    """What a piece returns, where its package's flat ``run`` can give it: ``"one"``
    tensor or a ``"flat"`` tuple of ``count`` tensors."""

    kind: str
    count: int


def _outputs(gm: torch.fx.GraphModule) -> Outputs | None:
    """The piece's :class:`Outputs`; ``None`` for anything else (an output not known to
    be a tensor, which the flat ``run`` would leave out; a nested structure): the
    package's own ``__call__`` rebuilds it."""
    out = next(iter(reversed(gm.graph.nodes))).args[0]
    nodes = [out] if isinstance(out, torch.fx.Node) else out
    if not isinstance(nodes, (tuple, list)) or not all(
            isinstance(v, torch.fx.Node)
            and isinstance(v.meta.get("val", v.meta.get("example_value")), torch.Tensor)
            for v in nodes):
        return None
    return Outputs("one" if isinstance(out, torch.fx.Node) else "flat", len(nodes))


class AotPiece:
    """A loaded package called with the split graph's arguments of the piece."""

    def __init__(self, package: Any, positions: Sequence[int], outputs: Outputs | None):
        self.package = package
        self.positions = tuple(positions)
        run = inductor.aot_runner(package) if outputs is not None else None
        self.outputs = outputs if run is not None else None  # how runtime/chain.py reads it
        if run is None:
            self._call = lambda tensors: package(*tensors)
        elif outputs.kind == "one":
            self._call = lambda tensors: run(tensors)[0]
        else:
            self._call = run

    def __call__(self, *args: Any) -> Any:
        return self._call([args[i] for i in self.positions])


def _via_worker(cache: PieceCache, artifact_key: str, gm: torch.fx.GraphModule,
                example: Sequence[Any], config: Mapping[str, Any], key: str, name: str) -> Any:
    """``store_frozen="worker"``: the stored package, or the id of the worker's job
    building it (a ``str``; ``None`` where it could not be sent): the caller then serves
    it on the JIT path. The entry's lock is taken before the second look and held until
    the worker answers, so a peer process that wants the same piece meanwhile waits
    for the package instead of compiling it too (one compile among them)."""
    job = package_worker.building(artifact_key)
    if job is not None:  # this process sent it already
        return job
    stamp = cache.stamp(artifact_key)
    package = cache.lookup(artifact_key, gm, name, kind=KIND)
    if package is not None:
        return package
    held = cache.hold(artifact_key, name)
    package = cache.lookup_again(artifact_key, stamp, gm, name, kind=KIND)
    if package is not None:
        held.release()
        return package
    COUNTERS.add("cache_misses")
    tensors = [v for v in example if isinstance(v, torch.Tensor)]
    sent = package_worker.submit(
        module=_Bound(gm, example), tensors=tensors, config=config,
        cache_dir=cache.disk.root, key=artifact_key, size=key, name=name, held=held)
    return sent


def compile_or_load(
    cache: PieceCache,
    gm: torch.fx.GraphModule,
    example: Sequence[Any],
    keep: Sequence[int],
    runtime_size: int,
    config: Mapping[str, Any],
    *,
    key: str,
    name: str,
    build: bool = True,
    mode: str = "inline",
) -> Callable[..., Any] | object | None:
    """The frozen piece ``gm`` (taking the split graph's arguments at ``keep``, with
    concrete fake ``example`` inputs) as an AOT package: loaded from the cache, or
    compiled, stored and loaded; ``None`` when it cannot be one (the caller compiles it
    on the JIT path, counted as ``cache_skips["frozen"]``). ``key``: the stats key of the
    size. ``mode="inline"`` builds a missing package here (``build=False``: load only;
    see the module docstring: a background thread never builds one inline);
    ``mode="worker"`` sends it to the package worker (``cache/package_worker.py``) and
    returns a :class:`Sent`: the caller compiles the piece on the JIT path to serve now."""
    if cache.disk is None or static_reason(example) is not None:
        return None
    if distributed.group_names(gm):  # see the module docstring: not as a package
        log.debug("%s (size %s) holds collectives: compiled on the JIT path, not stored",
                  name, key)
        return None
    artifact_key = cache.key(gm, example, runtime_size, {**config, "sizebackend_kind": KIND})
    if artifact_key is None:
        return None
    positions = [keep[i] for i, v in enumerate(example) if isinstance(v, torch.Tensor)]
    outputs = _outputs(gm)

    def make() -> Any:
        """Compile, store and load the package; ``None`` where it cannot be built."""
        fd, path = tempfile.mkstemp(prefix="sizebackend-aot-", suffix=".pt2")
        os.close(fd)
        try:
            start = time.perf_counter()
            try:
                tensors = [package_worker.zeros(package_worker.spec_of(v))
                           for v in example if isinstance(v, torch.Tensor)]
                inductor.aot_compile_package(_Bound(gm, example), tensors, dict(config), path)
                package = load_package(path)
            except Exception as e:  # export or AOTInductor cannot take it: the JIT path
                cache.skip("aot_failed", "%s (size %s) cannot be compiled ahead of time "
                           "(%s: %s); compiling it on the JIT path, not stored",
                           name, key, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                return None
            elapsed = time.perf_counter() - start
            COUNTERS.add_keyed("compiles", key)
            COUNTERS.add_seconds(elapsed)
            log.debug("compiled %s for size %s ahead of time in %.2fs", name, key, elapsed)
            with open(path, "rb") as f:
                payload = f.read()
            cache.store_payload(artifact_key, package, payload, key, name, kind=KIND)
            return package
        finally:
            os.unlink(path)

    if mode == "worker":
        package = _via_worker(cache, artifact_key, gm, example, config, key, name)
        if isinstance(package, str):
            return Sent(package, cache, artifact_key, gm, name, positions, outputs)
        if package is None:
            return None
    else:
        package = cache.find_or_make(artifact_key, gm, name, make if build else None, kind=KIND)
    return AotPiece(package, positions, outputs) if package is not None else None
