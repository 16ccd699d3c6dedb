"""``compile_mode="background"``: listed sizes compiled in a thread while the general
pieces serve, and stopped cleanly at exit and on ``torch._dynamo.reset()``."""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

import torch

from .._torch.process import register_exit_hook
from ..runtime.runner import Program, Runner
from .failures import SizeCompileError

log = logging.getLogger(__name__)

LIVE_JOBS: "weakref.WeakSet[BackgroundJob]" = weakref.WeakSet()


class BackgroundJob(threading.Thread):
    """Compiles listed sizes one by one and publishes each as it is ready."""

    def __init__(self, runner: Runner, sizes: list[int], compile_size: Callable[[int], Program | None]):
        super().__init__(name="sizebackend-background-compile", daemon=True)
        self.runner = runner
        self.sizes = sizes
        self.compile_size = compile_size
        self.cancelled = threading.Event()
        self.grad_enabled = torch.is_grad_enabled()  # grad mode is thread-local

    def run(self) -> None:
        with torch.set_grad_enabled(self.grad_enabled):
            for size in self.sizes:
                if self.cancelled.is_set():
                    return
                try:
                    program = self.compile_size(size)
                except SizeCompileError as e:  # strict: no caller here, so the next call raises
                    self.runner.fail(e)
                    return
                if program is not None and not self.cancelled.is_set():
                    self.runner.publish(size, program)


def on_background_thread() -> bool:
    """Whether the caller runs on a background compile thread."""
    return isinstance(threading.current_thread(), BackgroundJob)


def start(runner: Runner, sizes: list[int], compile_size: Callable[[int], Program | None]) -> None:
    job = BackgroundJob(runner, sizes, compile_size)
    LIVE_JOBS.add(job)
    runner.background = job
    job.start()


def cancel_all() -> None:
    """Ask every job to stop after the size it is compiling (``torch._dynamo.reset()``)."""
    for job in list(LIVE_JOBS):
        job.cancelled.set()


def _stop_at_exit() -> None:
    """At exit Python stops daemon threads wherever they are; one inside an Inductor
    compile aborts the process ("terminate called without an active exception", exit
    status 134). Cancel the jobs and wait for the size each is compiling, before
    ``concurrent.futures`` shuts down the thread pools Inductor's compile still uses."""
    jobs = [job for job in list(LIVE_JOBS) if job.is_alive()]
    for job in jobs:
        job.cancelled.set()
    if jobs:
        log.info("sizebackend: waiting for %d background compile(s) to stop", len(jobs))
    for job in jobs:
        job.join()


register_exit_hook(_stop_at_exit)
