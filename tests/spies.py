"""Spies on the real compiler adaptor, and a thread runner, shared by the reliability tests."""
from __future__ import annotations

import logging
import threading

import torch

from dynamo_sizebackend.compile import adaptor as compiler

BACKEND_LOG = "dynamo_sizebackend."  # every logger of the package


class AdaptorSpy:
    """Wraps the real ``EagerAdaptor.compile``: records every compile, raises for the
    runtime sizes in ``fail`` (``None``: the general or static compile), and makes every
    piece it returns check, on each call, that each tensor argument has the concrete dims
    the piece was compiled for (a symbolic dim accepts anything)."""

    def __init__(self, monkeypatch, fail: set[int | None] = frozenset()):
        self.fail = set(fail)
        self.compiled: list[int | None] = []
        self.runs = 0
        self._lock = threading.Lock()
        real = compiler.EagerAdaptor.compile
        spy = self

        def compile(adaptor, gm, example_inputs, runtime_size, fake_mode=None):
            if runtime_size in spy.fail:
                raise RuntimeError(f"injected failure at size {runtime_size}\nsecond line")
            forward = real(adaptor, gm, example_inputs, runtime_size, fake_mode)
            spy.compiled.append(runtime_size)
            return spy._checked(forward, example_inputs, runtime_size)

        monkeypatch.setattr(compiler.EagerAdaptor, "compile", compile)

    def _checked(self, forward, example_inputs, runtime_size):
        wanted = [
            tuple(d if isinstance(d, int) else None for d in v.shape)
            if isinstance(v, torch.Tensor) else None
            for v in example_inputs
        ]

        def run(*args):
            for want, arg in zip(wanted, args):
                if want is None:
                    continue
                got = tuple(arg.shape)
                assert len(got) == len(want) and all(
                    w is None or w == g for w, g in zip(want, got)
                ), f"piece compiled for {want} (size {runtime_size}) called with {got}"
            with self._lock:
                self.runs += 1
            return forward(*args)

        return run


def count_float_restarts(monkeypatch) -> list[int]:
    """A list that grows by one each time Dynamo restarts a frame's analysis to trace a
    float as a constant (``TensorifyScalarRestartAnalysis``)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    restarts: list[int] = []
    real_init = TensorifyScalarRestartAnalysis.__init__

    def counted(self, *args, **kwargs):
        restarts.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(TensorifyScalarRestartAnalysis, "__init__", counted)
    return restarts


def warnings_from(caplog, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name.startswith(BACKEND_LOG) and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def run_threads(n: int, work) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def target(i):
        try:
            barrier.wait()
            with torch.no_grad():  # grad mode is per thread (and guarded by Dynamo)
                work(i)
        except BaseException as e:  # re-raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
