"""The compiler adaptor: turn one piece into a callable, for the general shape or one size.

One small interface, ``compile(gm, example_inputs, runtime_size)``, where ``runtime_size``
``None`` means the general (symbolic) shape. Two implementations: Inductor, and Eager
(the piece's own forward, for debugging and for tests of the splitting/dispatch logic).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Protocol

import torch.fx

from .._torch import autotune, direct_call, inductor, shape_env
from ..cache.store import PieceCache
from ..options import SizeBackendOptions
from ..stats import COUNTERS

log = logging.getLogger(__name__)
dump_log = logging.getLogger(__name__ + ".dump")

CompiledPiece = Callable[..., Any]


class CompilerAdaptor(Protocol):
    name: str

    def compile(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        runtime_size: int | None,
        fake_mode: Any = None,
    ) -> CompiledPiece:
        """Compile ``gm`` (not mutated). ``runtime_size=None``: the general shape, called
        inside Dynamo's tracing context with its fake inputs. Otherwise ``example_inputs``
        are concrete fake tensors made in ``fake_mode``; nothing runs to compile them."""
        ...


class EagerAdaptor:
    name = "eager"

    def config_for(self, runtime_size: int | None) -> dict[str, Any]:
        return {}

    def compile(self, gm, example_inputs, runtime_size, fake_mode=None) -> CompiledPiece:
        return gm.forward


class InductorAdaptor:
    """Inductor, with ``inductor_options`` for every piece and ``sized_options`` on top
    for the pieces of a listed size (see ``options.sized_inductor_options``)."""

    name = "inductor"

    def __init__(self, inductor_options: Mapping[str, Any], sized_options: Mapping[str, Any] = {},
                 prune_autotune: bool = False):
        self.inductor_options = dict(inductor_options)
        self.sized_options = {**self.inductor_options, **sized_options}
        if prune_autotune and self.sized_options.get("max_autotune"):  # see _torch/autotune.py
            self.sized_options[autotune.OPTION] = True

    def config_for(self, runtime_size: int | None) -> dict[str, Any]:
        """The Inductor config patches of a compile for ``runtime_size``."""
        return self.inductor_options if runtime_size is None else self.sized_options

    def compile(self, gm, example_inputs, runtime_size, fake_mode=None) -> CompiledPiece:
        return inductor.standalone_compile(
            gm,
            example_inputs,
            from_graph=runtime_size is None,
            inductor_options=self.config_for(runtime_size),
            fake_mode=fake_mode,
        )


def make_adaptor(options: SizeBackendOptions, device_type: str = "cpu", tuned: bool = True) -> CompilerAdaptor:
    """The adaptor of ``options`` for a graph whose inputs live on ``device_type``;
    ``tuned=False``: its sized pieces compile like the general ones (``{}``)."""
    if options.compiler == "eager":
        return EagerAdaptor()
    return InductorAdaptor(options.inductor_options, options.sized_options_for(device_type) if tuned else {},
                           prune_autotune=options.prune_autotune and device_type == "cpu")


def size_key(runtime_size: int | None) -> str:
    """The stats key of a runtime size: ``"dynamic"`` for the general shape."""
    return "dynamic" if runtime_size is None else str(runtime_size)


def compile_piece(
    adaptor: CompilerAdaptor,
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    runtime_size: int | None,
    *,
    key: str | None = None,
    fake_mode: Any = None,
    debug_dir: str | None = None,
    debug_name: str = "piece",
    cache: PieceCache | None = None,
) -> CompiledPiece:
    """Compile one piece through ``adaptor``, counting and timing it.

    With ``cache``, an identical piece compiled earlier in this process, or stored on
    disk by an earlier one, is returned instead (counted as ``reused`` or a cache hit,
    not as a compile). Nothing is counted for a compile that raises: Dynamo's restarts
    come through here and that attempt's graph is thrown away.
    """
    key = key or size_key(runtime_size)
    config = adaptor.config_for(runtime_size)
    artifact_key = cache.key(gm, example_inputs, runtime_size, config) if cache is not None else None
    if artifact_key is None:
        return _compile_and_count(adaptor, gm, example_inputs, runtime_size, fake_mode, key,
                                  debug_dir, debug_name)
    def make() -> CompiledPiece:
        shape_facts = shape_env.shape_env_state(example_inputs)
        compiled = _compile_and_count(adaptor, gm, example_inputs, runtime_size, fake_mode, key,
                                      debug_dir, debug_name)
        guarded = shape_env.shape_env_state(example_inputs) != shape_facts
        cache.store(artifact_key, compiled, key, debug_name, guarded=guarded)
        return compiled

    return cache.find_or_make(artifact_key, gm, debug_name, make)


def _compile_and_count(adaptor, gm, example_inputs, runtime_size, fake_mode, key, debug_dir,
                       debug_name) -> CompiledPiece:
    start = time.perf_counter()
    compiled = adaptor.compile(gm, example_inputs, runtime_size, fake_mode)
    elapsed = time.perf_counter() - start
    COUNTERS.add_keyed("compiles", key)
    COUNTERS.add_seconds(elapsed)
    log.debug("compiled %s for size %s with %s in %.2fs", debug_name, key, adaptor.name, elapsed)
    if debug_dir:
        _dump(debug_dir, f"{debug_name}_{key}", gm, compiled)
    return compiled


def _dump(debug_dir: str, stem: str, gm: torch.fx.GraphModule, compiled: Any) -> None:
    """Write the piece's graph and the code Inductor generated for it."""
    os.makedirs(debug_dir, exist_ok=True)
    with open(os.path.join(debug_dir, f"{stem}.graph.py"), "w") as f:
        f.write(gm.print_readable(print_output=False))
    code = direct_call.generated_code(compiled)
    if code is not None:
        with open(os.path.join(debug_dir, f"{stem}.code.py"), "w") as f:
            f.write(code)
    dump_log.debug("wrote %s (%s) to %s", stem, "graph and code" if code else "graph", debug_dir)
