"""``sizebackend bench --tp N``: the benchmark on N tensor-parallel ranks.

Two ways to start it:

- ``torchrun --nproc-per-node N -m dynamo_sizebackend bench --tp N ...``: one process per
  rank, started by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` set);
- ``sizebackend bench --tp N ...``: the command spawns its N ranks itself, with the same
  environment torchrun would give them, and returns the worst exit status.

Every rank runs the whole benchmark in lockstep on its shard of the built-in Llama
(``models/llama_tp``): the logits are all-gathered, so every rank samples the same
tokens and follows the same schedule, and every compiled variant runs its collectives
in the same order on all ranks. Rank 0 prints the table (its own timings) and writes
``--json``/``--plot``; the others print nothing. gloo on CPU, NCCL with CUDA. The
process group's timeout (``SIZEBACKEND_TP_TIMEOUT`` seconds, default 1800) bounds how
long a rank waits in a collective for a peer, which may still be compiling.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..models.llama import SizeLlama, build_model
from ..models.llama_tp import build_tp_model
from ..ranks import compare_ranks


def launched() -> bool:
    """Whether this process is one rank of a launched group (torchrun, or our spawn)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_spawn(tp: int) -> bool:
    return tp > 1 and not launched()


def spawn(main: Callable[[Sequence[str]], int], argv: Sequence[str], tp: int) -> int:
    """Run ``main(argv)`` on ``tp`` spawned ranks; the worst exit status of them."""
    with socket.socket() as s:  # a free port for the rendezvous, as torchrun picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank_main, args=(main, list(argv), rank, tp, port))
             for rank in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max((p.exitcode or 0) if p.exitcode >= 0 else 1 for p in procs)


def _rank_main(main: Callable[[Sequence[str]], int], argv: list[str], rank: int, tp: int,
               port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(main(argv))


@contextlib.contextmanager
def process_group(tp: int) -> Iterator[int]:
    """The default process group of a launched rank, for the benchmark's duration;
    yields this rank (0 without one). Checks that the launch matches ``--tp``."""
    if not launched():
        yield 0
        return
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise SystemExit(f"sizebackend bench: --tp {tp} but launched with {world} processes "
                         f"(WORLD_SIZE); pass --tp {world}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = float(os.environ.get("SIZEBACKEND_TP_TIMEOUT", "1800"))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    quiet = open(os.devnull, "w") if rank else None
    try:
        with contextlib.redirect_stdout(quiet) if quiet else contextlib.nullcontext():
            yield rank
    finally:
        if quiet:
            quiet.close()
        dist.destroy_process_group()


def model(name: str, seed: int) -> SizeLlama:
    """This rank's shard of the preset under a process group, else the whole model."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return build_tp_model(name, seed=seed)
    return build_model(name, seed=seed)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def report_agreement(sb_stats: dict[str, Any] | None) -> None:
    """With several ranks: whether they built and dispatched alike (a collective)."""
    if world_size() == 1 or sb_stats is None:
        return
    init, run = sb_stats["init"], sb_stats["run"]
    fallbacks = {**init["fallbacks"]}
    for key, n in run["fallbacks"].items():
        fallbacks[key] = fallbacks.get(key, 0) + n
    snapshot = {"graphs": init["graphs"], "pieces": init["pieces"], "splits": init["splits"],
                "calls": run["calls"], "fallbacks": fallbacks}
    report = compare_ranks(snapshot=snapshot)
    if report.agree:
        print(f"sizebackend on {world_size()} ranks: same graphs, pieces and calls per size "
              f"on every rank, no fallback on one rank only")
    else:
        print(f"sizebackend ranks differ: {'; '.join(report.differences)}")
