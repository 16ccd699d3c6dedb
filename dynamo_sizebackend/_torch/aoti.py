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

Constants shared between packages: the listed sizes of one model freeze the same weights,
and where Inductor packs a weight the same way for two sizes (the same GEMM kernel
choice), their packages embed the same bytes. A constant whose dtype, shape, stride,
offset, opaque layout and bytes equal those of a constant already loaded in this process
runs on that one tensor (:class:`SharedConstants`): memory and the cache hold one copy.
The Llama ``small`` at sizes 2, 5, 8, 39: 45.0 MiB of constants in 20 packages, 21.3
MiB of them distinct (sizes 2 and 5 share every template-packed weight, 8 and 39 most of
oneDNN's). Off switch: ``SIZEBACKEND_SHARE_CONSTANTS=0``.

What this does not take on returns :class:`NotAligned` and the package loads with
torch's loader as before: another device or several libraries, folded constants, an
opaque constant sharing its FQN (not counted), and any failed check (counted in
``fallbacks["aot_unaligned"]`` by the caller, logged: slower, still correct).

Off switch: ``SIZEBACKEND_ALIGN_PACKAGES=0`` in the environment.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
import threading
import warnings
import weakref
import zipfile
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree


log = logging.getLogger(__name__)

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
    opaque_metadata: str = ""
    """An opaque constant's layout as the table writes it (oneDNN's descriptor)."""

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
                opaque_metadata=entry.get("opaque_metadata", ""),
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


def share_enabled() -> bool:
    return os.environ.get("SIZEBACKEND_SHARE_CONSTANTS", "1") != "0"


class SharedConstants:
    """The constants of the process's aligned packages, by what makes two the same: the
    table's dtype, shape, stride, offset and opaque layout, and a digest of the bytes the
    library embeds (a plain constant's bytes are also compared in full). Each entry
    counts the packages that run on it; the last one to go frees it (:func:`_release_all`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a package's finalizer may run under it (GC)
        self._entries: dict[tuple, list[Any]] = {}  # key -> [tensor, packages holding it]
        self.reused = 0
        """Constants handed out again since the process started."""

    @staticmethod
    def key(c: Constant, data: memoryview) -> tuple:
        digest = hashlib.blake2b(data, digest_size=16).digest()
        return (c.dtype, c.shape, c.stride, c.offset, c.nbytes, c.strided, c.opaque_metadata,
                digest)

    def acquire(self, key: tuple, data: memoryview) -> torch.Tensor | None:
        """The constant held under ``key``, one more package counted on it; ``data``: the
        bytes the asking package embeds."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            tensor = entry[0]
            if tensor.layout == torch.strided and not torch.equal(_bytes_of(tensor), _frombuffer(data)):
                return None  # a digest collision: never seen, but never trusted either
            entry[1] += 1
            self.reused += 1
            return tensor

    def add(self, key: tuple, tensor: torch.Tensor) -> bool:
        """Hold ``tensor`` under ``key`` for one package, unless another holds the key
        (loaded meanwhile on another thread): then ``False``, and it stays the caller's."""
        with self._lock:
            if key in self._entries:
                return False
            self._entries[key] = [tensor, 1]
            return True

    def release(self, key: tuple, tensor: torch.Tensor) -> bool:
        """One package less on ``tensor``; ``True`` if it was the last (the entry goes)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not tensor:
                return True  # never held here: the caller's alone
            entry[1] -= 1
            if entry[1] > 0:
                return False
            del self._entries[key]
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


#: The process's one registry (packages of every compiled model share it).
SHARED = SharedConstants()


def _frombuffer(data: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory, only read from: not a concern
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A plain constant's whole storage as bytes (what its copy was made from)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _copies(runner: Any, table: Sequence[Constant], embedded: memoryview,
            keys: dict[str, tuple], reused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Aligned copies of every constant, keyed by internal name: one already loaded with
    the same layout and bytes (:data:`SHARED`), else a plain one made from the bytes the
    library embeds, an opaque (oneDNN) one cloned from the runner's (its FQN is unique,
    checked by the caller). Fills ``keys`` with each constant's
    :meth:`SharedConstants.key` (none with sharing off) and ``reused`` with those taken
    from :data:`SHARED` (counted there: the caller releases them, also when this raises).
    Raises ``ValueError`` where the table disagrees with those bytes or with the
    constants the runner loaded."""
    if {c.name: c.fqn for c in table} != dict(runner.get_constant_names_to_original_fqns()):
        raise ValueError("constant names differ from the runner's")
    if sum(c.nbytes for c in table) != len(embedded):
        raise ValueError(f"the table's {sum(c.nbytes for c in table)} bytes are not the "
                         f"library's {len(embedded)}")
    loaded = runner.extract_constants_map(False)
    data = _frombuffer(embedded)
    share = share_enabled()
    copies, read = {}, 0
    for c in table:
        copy = None
        if share:
            with embedded[read:read + c.nbytes] as own:
                keys[c.name] = SharedConstants.key(c, own)
                copy = SHARED.acquire(keys[c.name], own)
        if copy is not None:
            reused[c.name] = copy  # the same bytes and layout as a constant already loaded
        elif not c.strided:
            copy = loaded[c.fqn].clone()  # oneDNN's clone: its own buffer, the same format
            if not copy.is_mkldnn or torch.ops.mkldnn._nbytes(copy) != c.nbytes:
                raise ValueError(f"{c.name}: not an opaque tensor of {c.nbytes} bytes")
        else:
            raw = torch.empty(c.nbytes, dtype=torch.uint8)
            if c.nbytes:
                raw.copy_(data[read:read + c.nbytes])
            copy = raw.view(c.dtype).as_strided(c.shape, c.stride, c.offset)
        copies[c.name] = copy
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


def _free(tensor: torch.Tensor) -> None:
    """Give a constant's memory back. The container runner never lets go of a constant
    it was handed as user-managed (torch 2.13's ``MaybeOwningAtenTensorHandle`` takes a
    new handle to it that nothing deletes), so without this every package loaded, then
    dropped (a weight change, a cold start's swap) kept its weights for the process's
    life. An opaque (oneDNN) constant has no storage to shrink: it stays."""
    if tensor.layout == torch.strided:
        tensor.untyped_storage().resize_(0)


def _drop_embedded_pages(library: str, start: int, end: int) -> int:
    """Let the kernel drop this process's pages of ``library``'s embedded constants (file
    offsets ``start`` to ``end``), which the runner read once to make its own copy and
    never reads again: without this every constant stays resident twice (the loaded
    library's pages, and the aligned copy). Returns the bytes advised; 0 where the mapping
    is not found or ``madvise`` refuses (nothing else changes: those pages are only
    memory)."""
    import ctypes

    page = mmap.PAGESIZE
    advised = 0
    try:
        real = os.path.realpath(library)  # the kernel lists mappings by their resolved path
        with open("/proc/self/maps") as maps:
            lines = [line.rstrip("\n").split(maxsplit=5) for line in maps]
        libc = ctypes.CDLL(None, use_errno=True)
        for fields in lines:
            if len(fields) < 6 or fields[5] != real:
                continue
            low, high = (int(v, 16) for v in fields[0].split("-"))
            offset = int(fields[2], 16)
            # The part of [start, end) this mapping holds, in whole pages inside it.
            first = max(start, offset)
            last = min(end, offset + high - low)
            a = low + first - offset
            b = low + last - offset
            a = (a + page - 1) // page * page
            b = b // page * page
            if b > a and libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 4) == 0:
                advised += b - a  # 4: MADV_DONTNEED
    except (OSError, ValueError, AttributeError):
        return advised
    return advised


def _release_all(held: Sequence[tuple[tuple | None, torch.Tensor]]) -> None:
    """A package is gone (or never made): each constant it ran on is freed unless another
    package runs on it too. ``held``: (its key in :data:`SHARED`, or ``None`` for one of
    its own, the tensor)."""
    for key, tensor in held:
        if key is None or SHARED.release(key, tensor):
            _free(tensor)


class AlignedCpuPackage:
    """A CPU package run by torch's container runner on constants torch allocated.

    ``run(tensors)`` is the flat entry point (a list of tensors in, a list out), as the
    package loader's; calling the object takes the exported module's arguments and
    rebuilds its outputs from the package's call spec, as ``AOTICompiledModel`` does."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor],
                 held: Sequence[tuple[tuple | None, torch.Tensor]] = (), embedded_dropped: int = 0):
        self.runner = runner
        self.constants = constants  # the runner's user-managed constants point here
        _, out_spec = runner.get_call_spec()
        self._out_spec = pytree.treespec_loads(out_spec)
        # The constants live as long as this object: whatever runs the runner holds the
        # package (``run`` is its method; a chain keeps the package), never the runner alone.
        self._finalizer = weakref.finalize(self, _release_all, list(held))
        self._finalizer.atexit = False  # at exit a daemon thread may still be in a call
        self.embedded_dropped = embedded_dropped
        """Bytes of the library's embedded constants given back to the kernel at load."""

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runner.run(tensors)

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
        keys: dict[str, tuple] = {}
        reused: dict[str, torch.Tensor] = {}
        copies: dict[str, torch.Tensor] = {}
        try:
            with open(extracted, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
                start, end = embedded_constants(lib)
                with memoryview(lib)[start:end] as embedded:
                    copies = _copies(runner, table, embedded, keys, reused)
            runner.update_constant_buffer(copies, True, True, True)  # inactive, full, user-managed
            runner.swap_constant_buffer()
            runner.free_inactive_constant_buffer()
            first = _first_by_fqn(table)
            for fqn, tensor in runner.extract_constants_map(False).items():
                if address(tensor) != address(copies[first[fqn].name]):
                    raise ValueError(f"{fqn}: not the aligned copy after the swap")
        except BaseException:  # the runner goes unused: what it was given, and what was taken
            _release_all([(keys[n], t) for n, t in reused.items()]
                         + [(None, t) for n, t in copies.items() if n not in reused])
            raise
        dropped = _drop_embedded_pages(extracted, start, end)
        held = []
        for name, tensor in copies.items():  # checked: offered to the packages loaded next
            key = keys.get(name)
            mine = name in reused or (key is not None and SHARED.add(key, tensor))
            held.append((key if mine else None, tensor))
        package = AlignedCpuPackage(runner, copies, held, dropped)
        log.debug("package %s: %d of %d constants (%d of %d bytes) shared with packages "
                  "loaded before", path, len(reused), len(table),
                  sum(c.nbytes for c in table if c.name in reused), sum(c.nbytes for c in table))
        return package
    except Exception as e:  # another runner or table: torch's loader, as before
        return NotAligned(f"{type(e).__name__}: {e}", counted=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
