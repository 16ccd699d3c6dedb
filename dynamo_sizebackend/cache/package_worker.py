"""AOT packages built in a worker process while the compiling process serves.

Why a process: an AOTInductor build of a frozen piece costs two to three times its JIT
compile on CPU (export, lowering, and a C++ build of the wrapper besides the kernels;
measured on the tiny Llama: 21 s per package against 9 s per JIT piece), and torch's
AOT compile sets process-wide flags (``is_compiling``, ``is_exporting``) that break
other threads' compiled code meanwhile (see ``cache/aot.py``). So with
``store_frozen=True`` (``"worker"``) a frozen sized piece that misses the cache is
compiled on the JIT path to serve at once, and a copy of it (the frozen ``fx`` graph,
its constants, the shapes of its inputs and the Inductor config) is handed to one
long-lived worker process, which builds the package and writes it into the cache for
the next start. ``store_frozen="inline"`` builds it in the compiling process instead
(the first answer waits for it).

The worker:

- is started on the first job (a Python that runs this module's :func:`main`)
  with the caller's environment (``TORCHINDUCTOR_CACHE_DIR`` included) at a lower
  priority (``os.nice``), so its C++ builds yield the cores to serving;
- gets one message per job on a socket (the path of the job file, and the entry's lock
  file descriptor beside it) and answers one message per job; a thread of the parent
  reads the answers (a failed build is counted in
  ``cache_skips["aot_failed"]`` and logged, once per process at warning level);
- builds under the entry's lock (:meth:`.store.PieceCache.hold`), which the parent
  takes before its second look and holds until the worker answers: N processes
  started at once on one ``cache_dir`` compile each frozen piece once between them
  (the first serves it on the JIT path, the others wait for the lock and load the
  package), as they do every other piece;
- outlives its parent only to finish the jobs already sent (the socket reaches its
  end when the parent exits), then exits; a job's lock stays held until its entry is
  written, so a process started meanwhile waits for the package, never builds a
  second one. :func:`wait_for_packages` blocks until every job
  sent so far is answered: a script that must leave a warm cache behind, a benchmark
  or a test, calls it before it exits.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .._torch import aot_checks

log = logging.getLogger(__name__)

_MESSAGE = 65536  # a job or answer message is far shorter
#: The worker's program. Not ``-m`` this module: the package's ``__init__`` imports this
#: module first, and runpy would then run a second copy of it as ``__main__`` (and say so
#: on stderr with a ``RuntimeWarning``, every worker start).
_WORKER_MAIN = ("import sys; from dynamo_sizebackend.cache.package_worker import main; "
                "sys.exit(main(sys.argv[1:]))")
Spec = tuple[list[int], list[int], str, str]  # shape, stride, dtype, device


def spec_of(value: torch.Tensor) -> Spec:
    return ([int(s) for s in value.shape], [int(s) for s in value.stride()],
            str(value.dtype).removeprefix("torch."), str(value.device))


def zeros(spec: Spec) -> torch.Tensor:
    """A zero tensor of ``spec``: what export traces the piece with."""
    shape, stride, dtype, device = spec
    return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device).zero_()


@dataclass
class Summary:
    """What :func:`wait_for_packages` reports: jobs by outcome since the process started."""

    stored: int = 0  # built and written
    present: int = 0  # another process had written it meanwhile
    failed: int = 0
    pending: int = 0
    seconds: float = 0.0  # spent building, summed
    errors: list[str] = field(default_factory=list)


@dataclass
class _Job:
    name: str
    key: str


class _Worker:
    """The parent's side: one worker process, its pending jobs and the reader thread."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._pending: dict[str, _Job] = {}  # by job id
        self._answers: dict[str, str] = {}  # by job id: "stored", "present", "failed"
        self.answered = 0  # answers so far: a change tells a poller to look again
        self._summary = Summary()
        self._next = 0

    def submit(self, job: Mapping[str, Any], name: str, held: Any) -> str | None:
        """Hand ``job`` to the worker: its id, or ``None`` (logged) where it cannot be sent.
        ``held``: the entry's lock (:meth:`.store.PieceCache.hold`): its file
        descriptor travels with the job, so the worker holds the lock from here until
        it has written the entry, even if this process exits first; this process's
        own copy is released either way."""
        try:
            fd, path = tempfile.mkstemp(prefix="sizebackend-job-", suffix=".pt")
            os.close(fd)
            try:
                torch.save(dict(job), path)
            except Exception as e:  # an unpicklable constant or config value
                os.unlink(path)
                _failed(name, f"cannot be handed to the package worker ({type(e).__name__}: {e})")
                return None
            with self._lock:
                self._next += 1
                job_id = f"{os.getpid()}-{self._next}"
                message = json.dumps({"id": job_id, "path": path}).encode()
                try:
                    sock = self._start()
                    socket.send_fds(sock, [message], [held.fd] if held.fd is not None else [])
                except OSError as e:
                    os.unlink(path)
                    _failed(name, f"the package worker did not take it ({e})")
                    return None
                self._pending[job_id] = _Job(name, job["key"])
                self._summary.pending = len(self._pending)
        finally:
            held.release()
        log.debug("sent %s to the package worker (job %s)", name, job_id)
        return job_id

    def building(self, key: str) -> str | None:
        """The id of this process's pending job for entry ``key``, if there is one."""
        with self._lock:
            return next((job_id for job_id, job in self._pending.items() if job.key == key), None)

    def _start(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # One message per job and per answer (SEQPACKET keeps their boundaries), and
        # the job's lock file descriptor beside it (SCM_RIGHTS).
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
            )
        finally:
            theirs.close()
        self._sock = mine
        threading.Thread(target=self._read, args=(self._proc, mine), daemon=True,
                         name="sizebackend-package-worker-reader").start()
        return mine

    def _read(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(_MESSAGE)
            except OSError:
                break
            if not data:
                break
            try:
                answer = json.loads(data)
            except ValueError:
                continue
            with self._lock:
                job = self._pending.pop(answer.get("id"), None)
                if job is not None:
                    self._record(answer, job.name)
                    self._summary.pending = len(self._pending)
                    self._answer(answer["id"], str(answer.get("status")))
                self._lock.notify_all()
        proc.wait()
        with self._lock:  # the worker died with jobs unanswered (killed, or crashed)
            if self._proc is proc:
                lost, self._pending = dict(self._pending), {}
                for job_id, job in lost.items():
                    self._answer(job_id, "failed")
                    self._summary.failed += 1
                    _failed(job.name, f"the package worker exited (status {proc.returncode}) "
                                      "before building it")
                self._summary.pending = 0
                self._proc, self._sock = None, None
                sock.close()
            self._lock.notify_all()

    def _answer(self, job_id: str, status: str) -> None:
        """Note how job ``job_id`` ended (the caller holds the lock)."""
        self._answers[job_id] = status if status in ("stored", "present") else "failed"
        self.answered += 1

    def answer(self, job_id: str) -> str | None:
        """How job ``job_id`` ended: ``"stored"``, ``"present"`` (another process wrote
        the entry first), ``"failed"``; ``None`` while pending or never sent."""
        with self._lock:
            return self._answers.get(job_id)

    def _record(self, answer: Mapping[str, Any], name: str) -> None:
        status = answer.get("status")
        self._summary.seconds += float(answer.get("seconds", 0.0))
        if status == "stored":
            self._summary.stored += 1
            log.info("sizebackend: stored %s ahead of time in %.1fs (package worker)",
                     name, answer.get("seconds", 0.0))
        elif status == "present":
            self._summary.present += 1
        else:
            self._summary.failed += 1
            self._summary.errors.append(f"{name}: {answer.get('error')}")
            _failed(name, f"cannot be compiled ahead of time ({answer.get('error')}); "
                          "served on the JIT path, not stored")

    def wait(self, timeout: float | None) -> Summary:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._lock.wait(left)
            s = self._summary
            return Summary(s.stored, s.present, s.failed, len(self._pending), s.seconds, list(s.errors))


def _failed(name: str, why: str) -> None:
    from .store import skip

    skip("aot_failed", "%s %s", name, why, logger=log)


_WORKER = _Worker()


def submit(*, module: torch.nn.Module, tensors: Sequence[torch.Tensor], config: Mapping[str, Any],
           cache_dir: str, key: str, size: str, name: str, held: Any) -> str | None:
    """Ask the worker to build ``module`` (taking ``tensors``' shapes) as the package of
    entry ``key`` in ``cache_dir``, whose lock the caller ``held`` (the worker builds
    under it, so it does not take it again). Returns at once: the job's id, ``None``
    where it was not sent."""
    job = {"module": module, "specs": [spec_of(t) for t in tensors], "config": dict(config),
           "cache_dir": cache_dir, "key": key, "size": size, "name": name,
           "state": _runtime_state()}
    return _WORKER.submit(job, name, held)


def _runtime_state() -> dict[str, Any]:
    """What the piece key hashes besides config (``_torch/inductor.py``,
    ``compile_environment_key``) that lives in process state, not in the job: the
    worker takes it on, so the package is the code the key names (the C++ kernels are
    specialized for the thread count, for one)."""
    return {"threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "mkldnn_fp32_precision": torch.backends.mkldnn.matmul.fp32_precision,
            "aot_torch_check": aot_checks.enabled()}


def _apply(state: Mapping[str, Any]) -> None:
    torch.set_num_threads(int(state["threads"]))
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    torch.set_default_dtype(getattr(torch, state["default_dtype"]))
    torch.backends.mkldnn.matmul.fp32_precision = state["mkldnn_fp32_precision"]
    if aot_checks.enabled() != state["aot_torch_check"]:
        os.environ["SIZEBACKEND_AOT_TORCH_CHECK"] = "1" if state["aot_torch_check"] else "0"


def answer(job_id: str) -> str | None:
    """How this process's job ``job_id`` ended (see :meth:`_Worker.answer`)."""
    return _WORKER.answer(job_id)


def answered() -> int:
    """How many jobs this process's worker has answered: unchanged means nothing new
    (one attribute read; what a serving call polls)."""
    return _WORKER.answered


def building(key: str) -> str | None:
    """The job this process sent for entry ``key`` and awaits the answer of, if any."""
    return _WORKER.building(key)


def wait_for_packages(timeout: float | None = None) -> Summary:
    """Block until the package worker has answered every job this process sent (or
    ``timeout`` seconds passed: ``pending`` says how many are left)."""
    return _WORKER.wait(timeout)


# ---- the worker process -------------------------------------------------------------


def build(job: Mapping[str, Any]) -> dict[str, Any]:
    """Build one job's package into its cache entry; the answer line's fields."""
    from .._torch import inductor
    from .store import CorruptEntry, DiskCache, PieceCache

    cache = PieceCache("", DiskCache(job["cache_dir"]))
    key, name = job["key"], job["name"]
    start = time.perf_counter()
    # No lock taken here: the parent holds the entry's lock until this job is answered.
    try:
        if cache.disk.read(key) is not None:
            return {"status": "present"}
    except (CorruptEntry, OSError):
        pass  # rebuilt and replaced below
    _apply(job["state"])
    fd, path = tempfile.mkstemp(prefix="sizebackend-aot-", suffix=".pt2")
    os.close(fd)
    try:
        with torch.no_grad():
            inductor.aot_compile_package(job["module"], [zeros(s) for s in job["specs"]],
                                         dict(job["config"]), path)
        with open(path, "rb") as f:
            payload = f.read()
    finally:
        os.unlink(path)
    cache._write(key, payload, job["size"], name, "aot")
    return {"status": "stored", "seconds": time.perf_counter() - start}


def _answer(sock: socket.socket | None, answer: Mapping[str, Any]) -> socket.socket | None:
    """Send one answer; ``None`` once the parent stopped reading (it exited): the
    remaining jobs are still built, for the next start."""
    if sock is None:
        return None
    try:
        sock.send(json.dumps(answer).encode())
        return sock
    except OSError:
        return None


def main(argv: Sequence[str]) -> int:
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    import dynamo_sizebackend  # noqa: F401  (registers the sizebackend:: ops the pieces call)

    sock = socket.socket(fileno=int(argv[0]))
    answers: socket.socket | None = sock
    while True:
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 1)
        if not data:  # the parent exited or closed its end: every job sent is done
            return 0
        request = json.loads(data)
        try:
            job = torch.load(request["path"], weights_only=False)
            answer = build(job)
        except Exception as e:  # answered, never fatal: the next job may build
            first = str(e).splitlines()[0] if str(e) else ""
            answer = {"status": "failed", "error": f"{type(e).__name__}: {first}"}
        finally:
            for fd in fds:  # the entry's lock, held since the parent's second look
                os.close(fd)
            try:
                os.unlink(request["path"])
            except OSError:
                pass
        answers = _answer(answers, {"id": request.get("id"), **answer})

