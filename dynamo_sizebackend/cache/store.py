"""Compiled pieces kept for reuse: shared in memory within a process, and on disk across.

Every Inductor compile of a piece goes through :class:`PieceCache`. Its key
(:func:`.key.piece_key`) is the same for pieces Inductor would generate the same code
for, so:

1. in memory, identical pieces (a transformer's middle layers, for each size) compile
   once and share the artifact (``stats().reused``). The table holds artifacts weakly:
   an entry lives as long as some compiled graph still runs it.
2. on disk (``options.cache_dir``), a later process loads the artifact instead of
   compiling (``cache_hits``; ``cache_misses`` counts real compiles that were looked up).

An entry is one file ``<cache_dir>/pieces-v1/<key>.sbart``: a magic line, a JSON header
line, then the payload in torch's ``CompiledArtifact`` binary format. The header holds
the payload's length and sha256, so a truncated or damaged entry is detected before
torch reads it: it is counted (``cache_skips["corrupt"]``), logged once, recompiled and
replaced, never trusted. Entries are written to a temp file in the same folder and
``os.replace``-d into place, so processes that compile into one folder at once only ever
see whole files. Before compiling a piece that missed, a process takes an exclusive lock
on ``.<key>.lock`` in the same folder (:meth:`PieceCache.claim`) and looks again: N
processes started at once (a server's workers, replicas on a shared filesystem)
compile each piece once between them, the others wait and load it. A lock dies with its
holder; a holder slower than ``SIZEBACKEND_CACHE_LOCK_WAIT`` seconds (900) is given up
on and the piece compiled anyway (``cache_skips["lock_timeout"]``).

Two kinds of entry (the header's ``kind``): ``jit``, a ``standalone_compile`` artifact
(generated code, no weights), and ``aot``, an AOTInductor package of a frozen sized
piece with its weights inside (``cache/aot.py``).

What is never cached nor shared: a piece without a key (see :func:`.key.piece_key`) and a
compile that added shape guards (``cache_skips["guards"]``): those guards are how
Dynamo or the size program learn where the artifact is valid, and a reused artifact
would not add them again.

On CPU an artifact holds Inductor's generated Python and C++ *source*; loading it
builds the C++ into Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``) unless that
already holds the build. A warm start is fastest with both caches kept.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch.fx

from .. import _torch
from .._torch import inductor
from ..filelock import lock_within
from ..stats import COUNTERS
from .key import piece_key

log = logging.getLogger(__name__)

MAGIC = b"sizebackend-artifact\n"
SUFFIX = ".sbart"
SUBDIR = "pieces-v1"
_HEADER_LIMIT = 4096  # the JSON header line is far shorter; a longer one is corrupt
LOCK_SUFFIX = ".lock"
#: How long a process waits for another that compiles the same piece before it
#: compiles the piece itself (``cache_skips["lock_timeout"]``): a peer stopped in a
#: debugger must not stall a server for ever; a dead peer's lock is released at once.
LOCK_WAIT_SECONDS = float(os.environ.get("SIZEBACKEND_CACHE_LOCK_WAIT", "900"))


class CorruptEntry(Exception):
    """An entry whose bytes do not match its header."""


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``sizebackend cache info`` lists it (header only, not verified)."""

    path: str
    bytes: int
    torch: str
    size: str
    piece: str
    kind: str = "jit"
    """``"jit"`` (a ``standalone_compile`` artifact: generated code, no weights) or
    ``"aot"`` (an AOTInductor package of a frozen piece: its ``.so`` and weights)."""


def _tmp_name(key: str, what: str) -> str:
    return f".{key}.{os.getpid()}.{threading.get_ident()}.{what}.tmp"


class DiskCache:
    """The entries in one folder. Methods raise ``OSError`` and :class:`CorruptEntry`;
    :class:`PieceCache` decides what each means."""

    def __init__(self, root: str):
        self.root = root
        self.folder = os.path.join(root, SUBDIR)

    def path(self, key: str) -> str:
        return os.path.join(self.folder, key + SUFFIX)

    def stamp(self, key: str) -> tuple[int, int, int] | None:
        """What the entry's file is now (inode, size, mtime), ``None`` when absent: a
        changed stamp means another process wrote the entry meanwhile."""
        try:
            st = os.stat(self.path(key))
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def read(self, key: str) -> bytes | None:
        """The payload stored for ``key``, ``None`` if there is none."""
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        header, payload = _split(data)
        if header.get("key") != key:
            raise CorruptEntry(f"entry holds key {header.get('key')!r}")
        if len(payload) != header.get("length"):
            raise CorruptEntry(f"payload is {len(payload)} bytes, header says {header.get('length')}")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise CorruptEntry("payload checksum mismatch")
        return payload

    def write(self, key: str, payload: bytes, **meta: Any) -> None:
        os.makedirs(self.folder, exist_ok=True)
        header = dict(meta, key=key, length=len(payload),
                      sha256=hashlib.sha256(payload).hexdigest(), created=time.time())
        tmp = os.path.join(self.folder, _tmp_name(key, "write"))
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
            os.replace(tmp, self.path(key))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def entries(self) -> tuple[list[EntryInfo], int]:
        """Entries with a readable header, and the number of unreadable ones."""
        found, bad = [], 0
        for name in sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []:
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.folder, name)
            try:
                with open(path, "rb") as f:
                    header, _ = _split(f.read(len(MAGIC) + _HEADER_LIMIT), payload=False)
                size = os.path.getsize(path)
            except (OSError, CorruptEntry):
                bad += 1
                continue
            found.append(EntryInfo(path, size, str(header.get("torch")), str(header.get("size")),
                                   str(header.get("piece")), str(header.get("kind", "jit"))))
        return found, bad

    def clear(self) -> tuple[int, int]:
        """Delete every entry and leftover temp file: (files removed, bytes freed)."""
        removed = freed = 0
        if not os.path.isdir(self.folder):
            return 0, 0
        for name in os.listdir(self.folder):
            if not (name.endswith(SUFFIX) or name.endswith(".tmp") or name.endswith(LOCK_SUFFIX)):
                continue
            path = os.path.join(self.folder, name)
            try:
                size = os.path.getsize(path)
                os.unlink(path)
            except FileNotFoundError:  # another process cleared or replaced it first
                continue
            removed += 1
            freed += size
        try:
            os.rmdir(self.folder)
        except OSError:  # not empty: someone wrote meanwhile, or files not ours
            pass
        return removed, freed


def _split(data: bytes, payload: bool = True) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(MAGIC):
        raise CorruptEntry("not a sizebackend artifact")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _HEADER_LIMIT)
    if end < 0:
        raise CorruptEntry("header line is missing or truncated")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as e:
        raise CorruptEntry(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not a JSON object")
    return header, data[end + 1:] if payload else b""


class _Shared:
    """Artifacts by key, held weakly, for every graph compiled in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        self._warned: set[str] = set()

    def get(self, key: str) -> Any:
        with self._lock:
            return self._by_key.get(key)

    def put(self, key: str, artifact: Any) -> None:
        with self._lock:
            self._by_key[key] = artifact

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
            self._warned.clear()

    def first_warning(self, reason: str) -> bool:
        with self._lock:
            first = reason not in self._warned
            self._warned.add(reason)
            return first


_SHARED = _Shared()


def forget_shared() -> None:
    """Drop the in-memory table (the next identical piece loads from disk or compiles)
    and warn again about cache problems already reported once."""
    _SHARED.clear()


def skip(reason: str, message: str, *args: Any, logger: logging.Logger = log) -> None:
    """Count ``reason`` in ``cache_skips``; warn the first time per process (per
    reason), log at DEBUG after that."""
    COUNTERS.add_keyed("cache_skips", reason)
    level = logging.WARNING if _SHARED.first_warning(reason) else logging.DEBUG
    logger.log(level, "sizebackend cache: " + message, *args)


def load_package(path: str) -> Any:
    """The AOT package at ``path`` (``inductor.aot_load_package``). One that runs on
    torch's loader's misaligned constants because a check of ``_torch/aoti.py`` failed
    is counted in ``fallbacks["aot_unaligned"]``, warned about the first time per
    reason, logged at DEBUG after that."""
    package = inductor.aot_load_package(path)
    reason = inductor.aot_unaligned(package)
    if reason is not None:
        COUNTERS.add_keyed("fallbacks", "aot_unaligned")
        first = _SHARED.first_warning(f"aot_unaligned: {reason}")
        log.log(logging.WARNING if first else logging.DEBUG,
                "sizebackend: a CPU package's constants could not be realigned (%s); it "
                "runs on torch's loader's copy, slower (fallbacks[\"aot_unaligned\"])", reason)
    return package


class PieceCache:
    """The cache as ``compile_piece`` (``compile/adaptor.py``) uses it, for one options set.

    ``disk`` is ``None`` when ``cache_dir`` is ``None``: pieces are then still shared
    within the process, only nothing is read from or written to disk."""

    def __init__(self, code_key: str, disk: DiskCache | None):
        self.code_key = code_key
        self.disk = disk

    def skip(self, reason: str, message: str, *args: Any) -> None:
        """See :func:`skip`."""
        skip(reason, message, *args)

    def key(self, gm: torch.fx.GraphModule, inputs: Sequence[Any], runtime_size: int | None,
            config: Mapping[str, Any]) -> str | None:
        """``config``: the Inductor config patches this compile applies."""
        key = piece_key(gm, inputs, runtime_size, f"{self.code_key}|{sorted(config.items())!r}")
        if key is None:
            COUNTERS.add_keyed("cache_skips", "unkeyable")
        return key

    def lookup(self, key: str, gm: torch.fx.GraphModule, name: str, kind: str = "jit",
               shared: bool = True) -> Callable[..., Any] | None:
        """The artifact for ``key`` from memory (unless ``shared`` is false) or disk,
        counted; ``None`` on a miss. ``kind``: what the entry holds (see
        :class:`EntryInfo`); an ``"aot"`` entry loads as the package itself."""
        found = _SHARED.get(key) if shared else None
        if found is not None:
            COUNTERS.add("reused")
            return found
        if self.disk is None:
            return None
        try:
            payload = self.disk.read(key)
        except CorruptEntry as e:
            self.skip("corrupt", "entry %s is damaged (%s); recompiling %s and replacing it",
                       self.disk.path(key), e, name)
            return None
        except OSError as e:
            self.skip("read", "cannot read %s (%s); compiling %s", self.disk.path(key), e, name)
            return None
        if payload is None:
            return None
        # torch loads from a path; the verified payload goes to a private temp file (in
        # the system's temp folder, so that a read-only shared cache still serves).
        try:
            # torch's package loader takes only a name ending in .pt2
            fd, tmp = tempfile.mkstemp(prefix="sizebackend-load-", suffix=SUFFIX if kind == "jit" else ".pt2")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
        except OSError as e:
            self.skip("read", "cannot stage %s for loading (%s); compiling %s",
                       self.disk.path(key), e, name)
            return None
        try:
            artifact = (inductor.load_artifact if kind == "jit" else load_package)(tmp)
        except Exception as e:  # torch's loader asserts on build mismatch; any failure: recompile
            self.skip("corrupt", "entry %s does not load (%s: %s); recompiling %s and replacing it",
                       self.disk.path(key), type(e).__name__, e, name)
            return None
        finally:
            os.unlink(tmp)
        if kind == "jit" and returns_one_value(gm):
            artifact = FirstOutput(artifact)
        COUNTERS.add("cache_hits")
        _SHARED.put(key, artifact)
        return artifact

    def store(self, key: str, artifact: Any, size: str, name: str, guarded: bool) -> None:
        """Record a fresh compile: shared in memory and written to disk, unless
        ``guarded`` (it added shape guards; see the module docstring)."""
        if self.disk is not None:
            COUNTERS.add("cache_misses")
        if guarded:
            self.skip("guards", "%s (size %s) added shape guards when compiled; not caching it",
                       name, size)
            return
        _SHARED.put(key, artifact)
        if self.disk is None:
            return
        tmp = os.path.join(self.disk.folder, _tmp_name(key, "save"))
        try:
            os.makedirs(self.disk.folder, exist_ok=True)
            try:
                inductor.save_artifact(artifact, tmp)
            except (RuntimeError, AssertionError) as e:  # torch: nothing serializable to save
                self.skip("unsaveable", "%s (size %s) cannot be saved (%s); not caching it",
                           name, size, e)
                return
            with open(tmp, "rb") as f:
                payload = f.read()
        except OSError as e:
            self.skip("write", "cannot write to %s (%s); not caching %s", self.disk.folder, e, name)
            return
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._write(key, payload, size, name, "jit")

    def store_payload(self, key: str, artifact: Any, payload: bytes, size: str, name: str,
                      kind: str) -> None:
        """Record a fresh compile whose stored form is ``payload`` (an AOT package)."""
        COUNTERS.add("cache_misses")
        _SHARED.put(key, artifact)
        self._write(key, payload, size, name, kind)

    def _write(self, key: str, payload: bytes, size: str, name: str, kind: str) -> None:
        from .. import __version__

        try:
            self.disk.write(key, payload, torch=_torch.TORCH_VERSION, package=__version__,
                            size=size, piece=name, kind=kind)
        except OSError as e:
            self.skip("write", "cannot write to %s (%s); not caching %s", self.disk.folder, e, name)

    def stamp(self, key: str) -> Any:
        """See :meth:`DiskCache.stamp`; ``None`` without a disk."""
        return self.disk.stamp(key) if self.disk is not None else None

    def lookup_again(self, key: str, stamp: Any, gm: torch.fx.GraphModule, name: str,
                     kind: str = "jit") -> Callable[..., Any] | None:
        """After :meth:`claim`: the entry another process wrote since ``stamp`` (taken
        before the first lookup), else ``None`` without reading the same file twice (a
        damaged entry is counted once)."""
        if self.disk is None or self.disk.stamp(key) in (None, stamp):
            return None
        return self.lookup(key, gm, name, kind=kind, shared=False)

    def find_or_make(self, key: str, gm: torch.fx.GraphModule, name: str,
                     make: Callable[[], Any] | None, kind: str = "jit") -> Any:
        """The entry for ``key`` from memory or disk; on a miss, ``make()`` (which
        compiles and stores it) under :meth:`claim`, unless another process wrote the
        entry while this one waited for the lock. ``make=None``: load only, ``None`` on
        a miss."""
        stamp = self.stamp(key)
        found = self.lookup(key, gm, name, kind=kind)
        if found is None and make is not None:
            with self.claim(key, name):  # one compile among processes sharing the disk
                found = self.lookup_again(key, stamp, gm, name, kind=kind)
                if found is None:
                    return make()
        if found is not None:
            log.debug("reused %s (key %s)", name, key[:12])
        return found

    @contextlib.contextmanager
    def claim(self, key: str, name: str) -> Iterator[None]:
        """Hold the right to compile ``key`` among the processes sharing the folder:
        whoever holds it compiles and writes the entry, the others wait here and then
        find it (look it up again inside). See :meth:`hold`."""
        held = self.hold(key, name)
        try:
            yield
        finally:
            held.release()

    def hold(self, key: str, name: str) -> "Claim":
        """:meth:`claim` as an object whose ``release()`` the caller calls (the package
        worker's jobs hold it until the worker answers). An exclusive ``flock`` on
        ``.<key>.lock``: released by the OS when its holder exits, however it exits.
        Without a disk, or where the folder cannot hold a lock file (read-only), there
        is nothing to share and nothing is held."""
        if self.disk is None:
            return Claim(None)
        try:
            os.makedirs(self.disk.folder, exist_ok=True)
            fd = os.open(os.path.join(self.disk.folder, f".{key}{LOCK_SUFFIX}"),
                         os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return Claim(None)
        try:
            if not lock_within(fd, LOCK_WAIT_SECONDS):
                self.skip("lock_timeout", "another process has compiled %s for over %.0f s; "
                          "compiling it here too", name, LOCK_WAIT_SECONDS)
        except BaseException:
            os.close(fd)
            raise
        return Claim(fd)


class Claim:
    """A held compile lock (:meth:`PieceCache.hold`); ``release()`` is idempotent."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self._lock = threading.Lock()

    @property
    def fd(self) -> int | None:
        """The lock file's descriptor (``None`` when nothing is held)."""
        return self._fd

    def release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing releases the lock


def returns_one_value(gm: torch.fx.GraphModule) -> bool:
    output = next(iter(reversed(gm.graph.nodes)))
    return isinstance(output.args[0], torch.fx.Node)


class FirstOutput:
    """A loaded artifact returns its outputs as a list even when the graph returns one
    value (a piece ending the split graph, as ``split_module`` builds it); the freshly
    compiled one returns that value itself, and the split graph's code expects it."""

    def __init__(self, artifact: Callable[..., Any]):
        self.artifact = artifact

    def __call__(self, *args: Any) -> Any:
        return self.artifact(*args)[0]


def for_options(options: Any) -> PieceCache | None:
    """The cache of a graph compiled with ``options``; ``None`` when pieces are not
    Inductor-compiled (the eager adaptor compiles nothing worth keeping) or when
    ``debug_dir`` asks for every piece's generated code to be written."""
    if options.compiler != "inductor" or options.debug_dir:
        return None
    disk = DiskCache(options.cache_dir) if options.cache_dir else None
    return PieceCache(options.code_key(), disk)
