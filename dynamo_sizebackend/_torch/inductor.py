"""Inductor's private surface: compiling a piece, its config, and saving/loading the
result (torch 2.13).

Why private: ``torch._inductor.standalone_compile`` is the documented precompile entry
point and ``CompiledArtifact.save/load`` the documented way to persist its result, but
both live under ``torch._inductor``; Inductor's and AOTAutograd's config dumps (for the
cache key) have no public accessor.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from .dynamo import COMPILE_LOCK


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
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    with COMPILE_LOCK:
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


def _stable_repr(value: Any) -> str:
    """``repr`` that is the same in every process (sets sorted), or ``TypeError``."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ",".join(_stable_repr(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(_stable_repr(v) for v in value)) + ")"
    if isinstance(value, dict):
        items = sorted((_stable_repr(k), _stable_repr(v)) for k, v in value.items())
        return "dict(" + ",".join(f"{k}:{v}" for k, v in items) + ")"
    uuid = getattr(value, "uuid", None)  # Inductor's CustomGraphPass protocol
    if callable(uuid):
        return f"uuid:{uuid()!r}"
    raise TypeError(f"no stable text for {type(value).__name__}")


def compile_config_fingerprint() -> str | None:
    """Inductor's and AOTAutograd's global configs as stable text, or ``None`` when a
    setting (a custom pass without ``uuid()``) cannot be written stably.

    ``save_config_portable`` leaves out what does not change code (trace and cache
    settings), as the FX graph cache does; the custom passes it also leaves out do change
    code, so they are added back by their ``uuid()``."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    parts = []
    try:
        for config in (inductor_config, functorch_config):
            portable = config.save_config_portable()
            for name, value in sorted(config.get_config_copy().items()):
                if name in portable:
                    parts.append(f"{name}={_stable_repr(value)}")
                elif "custom" in name and "pass" in name and value is not None:
                    parts.append(f"{name}={_stable_repr(value)}")
    except TypeError:
        return None
    return "\n".join(parts)


def save_artifact(artifact: Any, path: str) -> None:
    """Write a ``standalone_compile`` result to ``path`` (torch's own binary format)."""
    with COMPILE_LOCK:
        artifact.save(path=path, format="binary")


def load_artifact(path: str) -> Callable[..., Any]:
    """Read back what :func:`save_artifact` wrote. Torch checks its own build key and
    raises (``AssertionError``, ``RuntimeError``...) on any mismatch or damage."""
    with COMPILE_LOCK:  # loading fills the same class-level caches a compile records into
        return torch._inductor.CompiledArtifact.load(path=path, format="binary")
