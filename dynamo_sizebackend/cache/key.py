"""What makes two pieces the same compile: the key of the artifact cache.

Two pieces share a key exactly when Inductor would generate the same code for them, so
the middle layers of a transformer (same ops, same shapes, different weights, which are
graph *inputs*) share one. The key hashes:

- the versions of torch and of this package, the options that change code
  (``SizeBackendOptions.code_key``), and everything else Inductor's and AOTAutograd's own
  caches key a compile on (``_torch.inductor.compile_environment_key``: torch's source
  hash, Triton/CUDA/GPU, every Inductor config, the C++ thread count, default dtype,
  matmul precision, deterministic algorithms, autocast, custom passes): Inductor's list,
  so that a factor torch adds is keyed without a change here;
- the piece's graph, written canonically: nodes by position instead of by name, so
  ``l_self_modules_layers_modules_3_..._weight_`` and ``..._4_...`` read the same;
- each example input's kind, dtype, shape, stride, offset, device and requires_grad,
  with symbols renamed by first appearance (``z0``, ``z1``...), their value ranges and
  hint overrides,
  and what the ShapeEnv assumes about them (its guards, written by input position):
  Inductor may rely on any of those facts, so an artifact fits only where they hold;
- the runtime size (or ``"dynamic"``), grad mode, and the host (CPU ISA, GPU model):
  a CPU artifact holds machine code built for the ISA it was compiled on;
- for a piece holding collectives (tensor parallel), the process group behind every
  group name it uses: size and global ranks (:func:`collective_groups`). Not the rank
  of this process: the generated code calls the collective by group name and is the
  same on every rank, so ranks on one ``cache_dir`` share a piece whose weights are
  inputs; a frozen piece holds its rank's shard, whose values the key hashes.

A graph holding something this module cannot write canonically (a submodule call, a
non-tensor attribute, an argument of an unknown type) gets no key; it is then compiled
every time rather than risk two different pieces sharing one artifact.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import sympy
import torch
import torch.fx

from .. import _torch
from .._torch import aot_checks, distributed, fx, inductor, packed_linear, shape_env

log = logging.getLogger(__name__)

#: Bumped when the key's layout changes, so old entries stop matching.
KEY_FORMAT = "sizebackend-piece-v2"


class Unkeyable(Exception):
    """The piece holds something that cannot be written canonically."""


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if node.op in ("call_method", "placeholder", "output"):
        return str(target)
    if fx.is_op(target):
        return f"op:{target}"
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if not module or not name or "<" in name:  # a lambda or local function: no stable name
        raise Unkeyable(f"call target {target!r}")
    return f"{module}.{name}"


class _GraphWriter:
    """Writes a graph as text in which nodes are numbered, never named."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.index: dict[torch.fx.Node, int] = {}

    def arg(self, value: Any) -> str:
        if isinstance(value, torch.fx.Node):
            return f"%{self.index[value]}"
        if isinstance(value, (list, tuple)):
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
            return open_ + ",".join(self.arg(v) for v in value) + close
        if isinstance(value, dict):
            return "{" + ",".join(f"{k!r}:{self.arg(v)}" for k, v in sorted(value.items())) + "}"
        if isinstance(value, slice):
            return f"slice({self.arg(value.start)},{self.arg(value.stop)},{self.arg(value.step)})"
        if value is Ellipsis:
            return "..."
        if isinstance(value, _PLAIN):
            return f"{type(value).__name__}:{value!r}"
        raise Unkeyable(f"argument of type {type(value).__name__}")

    def attribute(self, target: str) -> str:
        value = self.root
        for part in target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.fx.GraphModule):
            return "graph{" + graph_text(value) + "}"
        if isinstance(value, torch.Tensor) and not shape_env.is_fake(value):
            data = value.detach().cpu().contiguous()
            digest = hashlib.sha256(data.flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            return f"tensor:{data.dtype}:{tuple(data.shape)}:{tuple(value.stride())}:{digest}"
        raise Unkeyable(f"attribute {target!r} of type {type(value).__name__}")

    def write(self, graph: torch.fx.Graph) -> str:
        lines = []
        for i, node in enumerate(graph.nodes):
            self.index[node] = i
            if node.op == "call_module":
                raise Unkeyable(f"submodule call {node.target!r}")
            if node.op == "get_attr":
                lines.append(f"%{i}=get_attr {self.attribute(node.target)}")
                continue
            lines.append(
                f"%{i}={node.op} {_target(node) if node.op != 'placeholder' else ''}"
                f"({self.arg(node.args)};{self.arg(node.kwargs)})"
            )
        return "\n".join(lines)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """``gm``'s graph with its nodes numbered by position; raises :class:`Unkeyable`."""
    return _GraphWriter(gm).write(gm.graph)


class _InputWriter:
    """Writes example inputs with their symbols renamed by first appearance."""

    def __init__(self) -> None:
        self.names: dict[sympy.Symbol, sympy.Symbol] = {}
        self.ranges: list[str] = []

    def expr(self, value: Any) -> str:
        if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return repr(value)
        expr = shape_env.sym_expr(value)
        for sym in sorted(expr.free_symbols, key=str):
            if sym not in self.names:
                self.names[sym] = sympy.Symbol(f"z{len(self.names)}", integer=True)
                self.ranges.append(f"{self.names[sym]}:{shape_env.symbol_range(value, sym)}"
                                   f":hint={shape_env.symbol_hint_override(value, sym)}")
        return str(expr.xreplace(self.names))

    def one(self, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            shape = ",".join(self.expr(s) for s in value.shape)
            stride = ",".join(self.expr(s) for s in value.stride())
            return (
                f"T({value.dtype};{shape};{stride};{self.expr(value.storage_offset())};"
                f"{value.device};{value.layout};rg={value.requires_grad};"
                f"param={isinstance(value, torch.nn.Parameter)})"
            )
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"{type(value).__name__}({self.expr(value)})"
        if isinstance(value, (int, float, bool, type(None))):
            return f"{type(value).__name__}({value!r})"
        raise Unkeyable(f"example input of type {type(value).__name__}")

    def write(self, values: Sequence[Any]) -> str:
        items = [self.one(v) for v in values]
        return ";".join(items) + "|ranges:" + ",".join(self.ranges)


def host_fingerprint(values: Sequence[Any]) -> str:
    """What the machine code in an artifact was built for: the CPU's vector ISA (Inductor
    compiles C++ for the host it runs on) and the model of every GPU involved."""
    parts = [f"cpu:{torch.backends.cpu.get_cpu_capability()}"]
    devices = sorted({v.device for v in values if isinstance(v, torch.Tensor)}, key=str)
    for device in devices:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            name = torch.cuda.get_device_name(index)
            parts.append(f"cuda:{name}:{torch.cuda.get_device_capability(index)}:{torch.version.cuda}")
        elif device.type != "cpu":
            parts.append(device.type)
    return ";".join(parts)


def _environment(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    try:
        return inductor.compile_environment_key(gm, list(example_inputs))
    except Exception as e:  # where Inductor bypasses its own cache: no key, counted
        raise Unkeyable(f"Inductor's cache key ({type(e).__name__}: {e})") from None


def _codegen() -> str:
    """Our hooks that change the code Inductor generates, with no effect on results: in
    the key so that code stored before a hook existed, or with it off, is not served as
    if built with it (a package built with ``AOTI_TORCH_CHECK`` runs its 4-row GEMM
    template ~1.4x slower, see :mod:`.._torch.aot_checks`; a piece stored before
    ``panel_linear`` existed, or with it off, runs the libraries' slower GEMMs, see
    :mod:`.._torch.packed_linear`)."""
    return f"aot_torch_check={aot_checks.enabled()}, panel_linear={packed_linear.panels_enabled()}"


def _guards(example_inputs: Sequence[Any]) -> str:
    try:
        return shape_env.shape_guards_text(example_inputs)
    except Exception as e:  # a guard torch cannot print for these inputs: no key, counted
        raise Unkeyable(f"shape guards ({type(e).__name__}: {e})") from None


def collective_groups(gm: torch.fx.GraphModule) -> str:
    """The process groups ``gm``'s collectives name (every op argument called
    ``group_name``), each with its size and ranks; ``""`` without collectives. Raises
    :class:`Unkeyable` for a name this process does not know."""
    names = distributed.group_names(gm)
    identities = []
    for name in sorted(names):
        identity = distributed.group_identity(name)
        if identity is None:
            raise Unkeyable(f"collective over process group {name!r}, unknown to this process")
        identities.append(identity)
    return ";".join(identities)


def piece_key(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    runtime_size: int | None,
    code_key: str,
) -> str | None:
    """The cache key (hex sha256) of compiling ``gm`` for ``runtime_size``; ``None`` when
    the piece cannot be keyed safely (it is then never shared nor cached)."""
    from .. import __version__

    try:
        parts = [
            KEY_FORMAT,
            _torch.TORCH_VERSION,
            __version__,
            code_key,
            _codegen(),
            _environment(gm, example_inputs),
            "dynamic" if runtime_size is None else str(runtime_size),
            f"grad={torch.is_grad_enabled()}",
            host_fingerprint(example_inputs),
            graph_text(gm),
            _InputWriter().write(example_inputs),
            _guards(example_inputs),
        ]
        groups = collective_groups(gm)
        if groups:  # appended only when present: keys of other pieces stay as they were
            parts.append("groups:" + groups)
    except Unkeyable as e:
        log.debug("sizebackend: piece not cacheable: %s", e)
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
