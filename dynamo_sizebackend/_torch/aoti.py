"""A CPU AOTInductor package run with its constants on 64-byte boundaries (torch 2.13).

Why: torch's package loader copies a CPU package's constants (a sized piece's frozen,
prepacked weights) out of its ``.so`` into one ``std::malloc`` blob (``RAII_cpuMalloc``
in ``aoti_runtime/model_base.h``) and places each at a 64-byte offset *within* the blob;
glibc hands out a blob of a megabyte or more at 16 bytes past a page (its chunk
header), so every constant starts 16 bytes off a cache line and every 64-byte vector
load of the C++ GEMM template's packed weights spans two lines. Tensors torch allocates
are 64-byte aligned (``c10::alloc_cpu``).

How: the package's one ``.so`` is run by torch's container runner
(``AOTIModelContainerRunnerCpu``) rather than the package loader, because only the
runner can swap in new constants and free the old blob (``update_constant_buffer``
into the inactive buffer, ``swap_constant_buffer``, ``free_inactive_constant_buffer``):
memory stays one copy. The runner takes constants keyed by their *internal* names,
and the one method that hands them out (``extract_constants_map``) keys them by
original FQN, which Inductor does not keep unique: a weight the GEMM template packs
for several GEMMs becomes ``constant3``, ``constant3_0``, ``constant3_1``, all with FQN
``constant3`` and of different shapes (an earlier attempt that matched by FQN gave the
three GEMMs one weight; the Hugging Face restart test caught it). So each internal
constant is made from the bytes the library embeds (``_binary_constants_bin_start`` to
``_end`` in its symbol table: the constants in table order, unpadded, what the loader
copies from), cut by the table in the package's generated ``wrapper.cpp`` (name,
shape, stride, offset, bytes of each). Checked before anything is swapped: the table's
names are the runner's, its byte counts sum to the embedded bytes exactly, and every
constant ``extract_constants_map`` returns has the table's shape, stride and offset and
the same values as its copy; after the swap, the runner's constants are the copies.

An opaque constant (a weight oneDNN packed: freezing picked mkldnn's linear, as it
does without max-autotune and for some GEMM shapes with it) sits in the same blob,
equally misaligned; its copy is oneDNN's own clone of the runner's tensor (same
format, a buffer of its own), which needs its FQN to be unique in the table.

What this does not take on returns :class:`NotAligned` and the package loads with
torch's loader as before: another device or several libraries, folded constants, an
opaque constant sharing its FQN (not counted), and any failed check (counted in
``fallbacks["aot_unaligned"]`` by the caller, logged: slower, still correct).

Off switch: ``SIZEBACKEND_ALIGN_PACKAGES=0`` in the environment.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree


#: A cache line, and what torch's CPU allocator aligns tensors to (``c10::gAlignment``).
ALIGNMENT = 64

_FIELD = re.compile(r"^\s*constants_info_\[(\d+)\]\.(\w+) = (.*);\s*$", re.M)


@dataclass(frozen=True)
class Constant:
    """One entry of the package's constant table (``constants_info_`` in its wrapper)."""

    index: int
    name: str
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    folded: bool
    strided: bool

    def fits(self) -> bool:
        """Whether shape, stride and offset stay inside ``nbytes``."""
        if any(n == 0 for n in self.shape):
            return True
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (last + 1) * self.dtype.itemsize <= self.nbytes


def _ints(text: str) -> tuple[int, ...]:
    inner = text.strip().strip("{}").strip()
    return tuple(int(v) for v in inner.split(",")) if inner else ()


def parse_constants(source: str) -> list[Constant]:
    """The constant table of a package's generated ``wrapper.cpp``; raises ``ValueError``
    on an entry it does not understand."""
    fields: dict[int, dict[str, str]] = {}
    for index, field, value in _FIELD.findall(source):
        fields.setdefault(int(index), {})[field] = value.strip()
    table = []
    for index in range(len(fields)):
        entry = fields.get(index)
        if entry is None:
            raise ValueError(f"constant {index} missing from the table")
        try:
            dtype = getattr(torch, entry["dtype"].removeprefix("cached_torch_dtype_"))
            if not isinstance(dtype, torch.dtype):
                raise ValueError(entry["dtype"])
            table.append(Constant(
                index=index,
                name=entry["name"].strip('"'),
                fqn=entry["original_fqn"].strip('"'),
                dtype=dtype,
                shape=_ints(entry["shape"]),
                stride=_ints(entry["stride"]),
                offset=int(entry["offset"]),
                nbytes=int(entry["data_size"]),
                folded=entry["from_folded"] == "true",
                strided=entry["layout"].endswith("(cached_torch_layout_strided)"),
            ))
        except (KeyError, AttributeError) as e:
            raise ValueError(f"constant {index}: {type(e).__name__} {e}") from None
    return table


def _symbols(elf: Any, names: Sequence[str]) -> dict[str, int]:
    """File offsets of the named symbols of a little-endian ELF64 shared library (its
    bytes, or an ``mmap`` of it), read from its static symbol table (``nm`` lists them; they are not exported)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 library")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    wanted, found = set(names), {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2 or not entsize:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name_at, _, _, index, value, _ = struct.unpack_from("<IBBHQQ", elf, at)
            end = elf.find(b"\0", strings + name_at)
            name = elf[strings + name_at:end].decode(errors="replace")
            if name in wanted and 0 < index < shnum:
                _, _, _, address, file_offset, *_ = sections[index]
                found[name] = value - address + file_offset
    if set(found) != wanted:
        raise ValueError(f"symbols missing: {sorted(wanted - set(found))}")
    return found


def embedded_constants(library: Any) -> tuple[int, int]:
    """Where a package's library (its bytes, or an ``mmap`` of it) carries its constants:
    ``_binary_constants_bin_start`` to ``_end``, each constant's bytes in table order,
    unpadded, which the loader copies into its blob."""
    at = _symbols(library, ("_binary_constants_bin_start", "_binary_constants_bin_end"))
    return at["_binary_constants_bin_start"], at["_binary_constants_bin_end"]


def address(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s data starts (a oneDNN tensor's own buffer for an opaque one)."""
    return torch.ops.mkldnn.data_ptr(tensor) if tensor.is_mkldnn else tensor.data_ptr()


def _first_by_fqn(table: Sequence[Constant]) -> dict[str, Constant]:
    """The first constant of each FQN in table order: the one ``extract_constants_map``
    returns for that FQN (it keeps the lowest index)."""
    first: dict[str, Constant] = {}
    for c in table:
        first.setdefault(c.fqn, c)
    return first


def _copies(runner: Any, table: Sequence[Constant], embedded: memoryview) -> dict[str, torch.Tensor]:
    """Aligned copies of every constant, keyed by internal name: a plain one made from
    the bytes the library embeds, an opaque (oneDNN) one cloned from the runner's (its
    FQN is unique, checked by the caller). Raises ``ValueError`` where the table
    disagrees with those bytes or with the constants the runner loaded."""
    if {c.name: c.fqn for c in table} != dict(runner.get_constant_names_to_original_fqns()):
        raise ValueError("constant names differ from the runner's")
    if sum(c.nbytes for c in table) != len(embedded):
        raise ValueError(f"the table's {sum(c.nbytes for c in table)} bytes are not the "
                         f"library's {len(embedded)}")
    loaded = runner.extract_constants_map(False)
    with warnings.catch_warnings():  # read-only memory, only read from: not a concern
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(embedded, dtype=torch.uint8) if len(embedded) else None
    copies, read = {}, 0
    for c in table:
        if not c.strided:
            copy = loaded[c.fqn].clone()  # oneDNN's clone: its own buffer, the same format
            if not copy.is_mkldnn or torch.ops.mkldnn._nbytes(copy) != c.nbytes:
                raise ValueError(f"{c.name}: not an opaque tensor of {c.nbytes} bytes")
            copies[c.name] = copy
        else:
            raw = torch.empty(c.nbytes, dtype=torch.uint8)
            if c.nbytes:
                raw.copy_(data[read:read + c.nbytes])
            copies[c.name] = raw.view(c.dtype).as_strided(c.shape, c.stride, c.offset)
        read += c.nbytes
    first = _first_by_fqn(table)
    for fqn, tensor in loaded.items():
        c = first[fqn]
        if not c.strided:
            continue  # its copy is its clone
        if (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset()) != (c.dtype, c.shape, c.stride, c.offset):
            raise ValueError(f"{c.name}: the runner's tensor differs from the table")
        if not torch.equal(tensor, copies[c.name]):
            raise ValueError(f"{c.name}: the runner's values differ from the library's")
    return copies


class AlignedCpuPackage:
    """A CPU package run by torch's container runner on constants torch allocated.

    ``run(tensors)`` is the flat entry point (a list of tensors in, a list out), as the
    package loader's; calling the object takes the exported module's arguments and
    rebuilds its outputs from the package's call spec, as ``AOTICompiledModel`` does."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor]):
        self.runner = runner
        self.constants = constants  # the runner's user-managed constants point here
        self.run = runner.run
        _, out_spec = runner.get_call_spec()
        self._out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.run(flat), self._out_spec)


def enabled() -> bool:
    return os.environ.get("SIZEBACKEND_ALIGN_PACKAGES", "1") != "0"


#: What a package holds under ``data/`` that :func:`load_aligned` knows what to do with:
#: the library, its sources, the description of its calls into PyTorch, metadata.
#: Anything else (weights stored beside the library, TorchBind objects) is torch's
#: loader's to set up.
_KNOWN_DATA = (".so", ".cpp", ".wrapper.json", "_metadata.json")


def _members(path: str) -> tuple[str, str, str | None] | str:
    """The package's one library, its wrapper source and the description of the ops
    its code calls back into PyTorch for (``<library stem>.json``, where it has one);
    or why torch's loader is to load it: not a CPU package of one library (its
    wrapper's metadata names the device), or one holding files only that loader sets up."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        libraries = [n for n in names if n.endswith(".so")]
        wrappers = [n for n in names if n.endswith("wrapper.cpp")]
        metadata = [n for n in names if n.endswith("wrapper_metadata.json")]
        if len(libraries) != 1 or len(wrappers) != 1 or len(metadata) != 1:
            return "not one CPU library"
        try:
            device = json.loads(archive.read(metadata[0])).get("AOTI_DEVICE_KEY")
        except (ValueError, AttributeError):
            return "not one CPU library"
    if device != "cpu" or any(n.endswith((".cubin", ".fatbin", ".spv", ".hsaco")) for n in names):
        return "not one CPU library"
    unknown = next((n for n in names if "/data/" in f"/{n}" and not n.endswith("/")
                    and not n.endswith(_KNOWN_DATA)), None)
    if unknown is not None:
        return f"holds {unknown.rsplit('/', 1)[-1]}, which torch's loader sets up"
    calls = libraries[0].removesuffix(".so") + ".json"
    return libraries[0], wrappers[0], calls if calls in names else None


@dataclass(frozen=True)
class NotAligned:
    """Why :func:`load_aligned` left a package to torch's loader. ``counted``: a CPU
    package of plain (strided) constants that failed a check, which the caller counts
    (``fallbacks["aot_unaligned"]``); not counted: realignment off, a package that is
    not one CPU library, or one holding folded constants or an opaque constant that
    shares its FQN, which this does not take on (those run as torch loads them)."""

    reason: str
    counted: bool = False


def load_aligned(path: str) -> AlignedCpuPackage | NotAligned:
    """The CPU package at ``path`` with its constants realigned, or why not (see the
    module docstring): the caller then uses torch's loader."""
    runner_class = getattr(torch._C._aoti, "AOTIModelContainerRunnerCpu", None)
    if not enabled():
        return NotAligned("off (SIZEBACKEND_ALIGN_PACKAGES=0)")
    if runner_class is None:
        return NotAligned("this torch has no CPU container runner", counted=True)
    try:
        members = _members(path)
    except (OSError, zipfile.BadZipFile) as e:  # torch's loader says what is wrong with it
        return NotAligned(f"unreadable: {e}")
    if isinstance(members, str):
        return NotAligned(members)
    library, wrapper, calls = members
    folder = tempfile.mkdtemp(prefix="sizebackend-aoti-")
    try:
        with zipfile.ZipFile(path) as archive:
            table = parse_constants(archive.read(wrapper).decode())
            extracted = archive.extract(library, folder)
            if calls is not None:
                # The runner reads the ops its library calls back into PyTorch for
                # (custom ops, fallbacks) from the file beside the library, as it is
                # made; without it such a call fails ("Unable to find a proxy executor").
                archive.extract(calls, folder)
        fqns = [c.fqn for c in table]
        if not table or any(c.folded for c in table):
            return NotAligned("no constants, or folded ones")
        if any(not c.strided and fqns.count(c.fqn) > 1 for c in table):
            return NotAligned("an opaque constant shares its FQN")
        if not all(c.fits() for c in table):
            return NotAligned("a constant's shape exceeds its bytes", counted=True)
        runner = runner_class(extracted, 1)  # dlopen keeps the library once the file goes
        with open(extracted, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
            start, end = embedded_constants(lib)
            with memoryview(lib)[start:end] as embedded:
                copies = _copies(runner, table, embedded)
        runner.update_constant_buffer(copies, True, True, True)  # inactive, full, user-managed
        runner.swap_constant_buffer()
        runner.free_inactive_constant_buffer()
        first = _first_by_fqn(table)
        for fqn, tensor in runner.extract_constants_map(False).items():
            if address(tensor) != address(copies[first[fqn].name]):
                raise ValueError(f"{fqn}: not the aligned copy after the swap")
        return AlignedCpuPackage(runner, copies)
    except Exception as e:  # another runner or table: torch's loader, as before
        return NotAligned(f"{type(e).__name__}: {e}", counted=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
