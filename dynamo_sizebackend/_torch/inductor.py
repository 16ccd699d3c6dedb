"""Inductor's private surface: compiling a piece, its config, and saving/loading the
result (torch 2.13).

Why private: ``torch._inductor.standalone_compile`` is the documented precompile entry
point and ``CompiledArtifact.save/load`` the documented way to persist its result, but
both live under ``torch._inductor``; what Inductor's and AOTAutograd's caches key a
compile on (for the artifact cache key) has no public accessor.
"""
from __future__ import annotations

import contextlib
import os
import logging
from typing import Any, Callable, Iterator

import torch
import torch.fx

from . import aot_checks, aoti, autotune, isa_probe, packed_linear, pch, templates
from .dynamo import COMPILE_LOCK

log = logging.getLogger(__name__)


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

    One compile at a time per process (:data:`COMPILE_LOCK`): ``standalone_compile``
    records the artifact it returns in class-level state (``CacheArtifactManager``,
    swapped in and out by ``with_fresh_cache``) and applies ``config_patches`` to
    Inductor's global config, so two compiles in two threads (a background compile
    while Dynamo compiles another graph) could save one piece's code as the other's,
    and the artifact cache would then serve it to every later process.
    """
    inductor_options, prune = autotune.split(inductor_options)
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    with COMPILE_LOCK, _quiet_when_frozen(inductor_options), _our_hooks(prune):
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


@contextlib.contextmanager
def _our_hooks(prune: bool) -> Iterator[None]:
    """Inductor as this backend's compiles run it: GEMM candidates pruned (when
    ``prune``), frozen static GEMMs packed for the kernel that is faster on this CPU,
    Jinja templates parsed once, benchmark candidates built with the precompiled
    header, the vector-ISA probe remembered."""
    with autotune.pruning(prune), packed_linear.measured(), templates.memoized(), \
            pch.precompiled(), isa_probe.remembered():
        yield


class _DropUnsaveable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "artifact generation failed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_when_frozen(inductor_options: dict[str, Any]):
    """A frozen graph is never saveable (the FX cache skips graphs with frozen constants),
    so ``standalone_compile`` warns "artifact generation failed" for every one of them.
    The backend knows, does not try to cache them, and counts them in
    ``cache_skips["frozen"]``; that one warning is dropped while they compile."""
    if not inductor_options.get("freezing"):
        yield
        return
    logger, quiet = logging.getLogger("torch._inductor.standalone_compile"), _DropUnsaveable()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


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


#: What :class:`FxGraphHashDetails` holds that the piece key writes itself, canonically
#: (nodes by position, symbols by first appearance): Inductor's own pickles of the graph
#: and the fake inputs carry node and symbol names, which differ between identical layers.
_KEYED_BY_CALLER = frozenset({"gm", "example_inputs", "fx_kwargs"})


def compile_environment_key(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """A hash of everything but the graph and its inputs that Inductor's and AOTAutograd's
    own caches key a compile on. Raises where Inductor could not hash it either and
    bypasses its own cache (a custom pass that is no ``CustomGraphPass``: ``AssertionError``;
    a config that does not pickle: ``BypassFxGraphCache``).

    The factors are Inductor's, not a list of ours: the object its FX graph cache hashes
    (``FxGraphHashDetails``, built as ``AOTAutogradCacheDetails`` builds it, plus that
    class's runtime state) minus the graph, inputs and compile kwargs, pickled by its
    ``FxGraphCachePickler``. So: ``torch_key()`` (torch's source), ``CacheBase.get_system()``
    (Triton, CUDA/HIP and the GPU), every Inductor config including private ones
    (``save_config_portable(ignore_private_configs=False)``), the C++ thread count the
    kernels are specialized for (``parallel_num_threads()``), the default dtype, CUDA
    matmul precision flags, deterministic-algorithm settings, custom passes by uuid, hint
    overrides; and from AOTAutograd: grad mode, autocast dtypes, its config. Added here:
    ``torch.get_float32_matmul_precision()`` and the oneDNN matmul precision (CPU GEMMs),
    which ``"medium"`` and ``"high"`` set apart and Inductor's key does not.
    """
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    from torch._inductor.codecache import FxGraphCachePickler, FxGraphHashDetails

    details = AOTAutogradCacheDetails.__new__(AOTAutogradCacheDetails)
    details._record_runtime_state(gm)
    with isa_probe.remembered():  # the details hold the vector ISA: Inductor probes it
        FxGraphHashDetails.__init__(details, gm, example_inputs, {}, [])
    state = {k: v for k, v in vars(details).items() if k not in _KEYED_BY_CALLER}
    state["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    state["mkldnn_matmul_fp32_precision"] = torch.backends.mkldnn.matmul.fp32_precision
    return FxGraphCachePickler(gm).get_hash(state)


def save_artifact(artifact: Any, path: str) -> None:
    """Write a ``standalone_compile`` result to ``path`` (torch's own binary format)."""
    with COMPILE_LOCK:
        artifact.save(path=path, format="binary")


def load_artifact(path: str) -> Callable[..., Any]:
    """Read back what :func:`save_artifact` wrote. Torch checks its own build key and
    raises (``AssertionError``, ``RuntimeError``...) on any mismatch or damage."""
    # loading fills the same class-level caches a compile records into
    with COMPILE_LOCK, isa_probe.remembered():
        return torch._inductor.CompiledArtifact.load(path=path, format="binary")


def inductor_cache_dir() -> str:
    """The folder Inductor's own caches use (``TORCHINDUCTOR_CACHE_DIR``, else its
    per-user default under the temp folder), without creating it as Inductor does."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())


def aot_compile_package(
    module: torch.nn.Module, args: list[torch.Tensor], inductor_options: dict[str, Any], path: str
) -> None:
    """Export ``module`` at ``args`` (real tensors, static shapes) and compile it with
    AOTInductor into a package at ``path``: its ``.so``, and the module's parameters and
    buffers as constants (frozen with ``freezing``). Raises whatever export or
    AOTInductor raise (an op export cannot trace, a lowering AOT mode lacks).

    Under :data:`COMPILE_LOCK`, for the reason :func:`standalone_compile` is: Inductor's
    config is global and ``inductor_configs`` patches it for the compile."""
    import warnings

    # Outside any tracing context: a size compiled as Dynamo's graph arrives runs inside
    # Dynamo's, and AOTInductor's freezing would read that one's (empty) parameters.
    inductor_options, prune = autotune.split(inductor_options)
    with COMPILE_LOCK, torch._guards.tracing(None), warnings.catch_warnings(), \
            _our_hooks(prune), aot_checks.torch_checks():
        # Export's functionalization reads ``out.storage()`` (TypedStorage is deprecated).
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        exported = torch.export.export(module, tuple(args), strict=False)
        # A dict of our own: AOTInductor writes its device facts into the one it finds
        # (codecache.py, ``metadata["AOTI_DEVICE_KEY"] = ...``), which would otherwise be
        # the config's default, changing the key of every later compile in the process.
        configs = {**inductor_options, "aot_inductor.metadata": {}}
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=configs)


def aot_load_package(path: str) -> Any:
    """Load a package :func:`aot_compile_package` wrote; the file may be deleted after
    (its ``.so`` is extracted to a folder of its own). Raises on a damaged package or
    one built by another torch. A CPU package comes back with its constants on 64-byte
    boundaries where :func:`.aoti.load_aligned` can do that, else as torch's loader
    gives it (:func:`aot_unaligned` says why, where that is to be counted)."""
    with COMPILE_LOCK, isa_probe.remembered():
        aligned = aoti.load_aligned(path)
        if isinstance(aligned, aoti.AlignedCpuPackage):
            return aligned
        package = torch._inductor.aoti_load_package(path)
    if aligned.counted:
        package._sizebackend_unaligned = aligned.reason
    else:
        log.debug("package %s left to torch's loader: %s", path, aligned.reason)
    return package


def aot_unaligned(package: Any) -> str | None:
    """Why ``package`` runs on torch's loader's misaligned constants where a check of
    ``_torch/aoti.py`` failed (``fallbacks["aot_unaligned"]``); ``None`` otherwise."""
    return getattr(package, "_sizebackend_unaligned", None)


def aot_runner(package: Any) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
    """The loaded package's flat entry point, ``run(list of input tensors) -> list of
    outputs``, skipping the pytree flattening of its ``__call__`` (about 30 us per call
    on this machine's CPU); ``None`` where torch's loader has no such method."""
    if isinstance(package, aoti.AlignedCpuPackage):
        return package.run
    loader = getattr(package, "loader", None)
    run = getattr(loader, "run", None)
    return run if callable(run) else None
