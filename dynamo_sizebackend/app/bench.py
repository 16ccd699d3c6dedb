"""``sizebackend bench``: generation throughput of eager vs ``torch.compile`` vs sizebackend.

The workload imitates vLLM's ``benchmark_throughput.py``: ``--requests`` prompts of
``--input-len`` random tokens, each generating about ``--output-len`` tokens (lengths vary
per request, from ``--seed``, so sequences finish at different steps), greedily, through
the continuous-batching scheduler of :mod:`dynamo_sizebackend.scheduler` on the built-in
Llama-style model. Every step is one flattened token batch of ``T`` tokens, the size
Dynamo sees as symbolic and sizebackend specializes on.

The variants run one after the other in this process, on the same model and workload:

- ``eager``: the model itself;
- ``dynamic``: ``torch.compile(model, dynamic=True)`` (Inductor);
- ``sizebackend``: ``torch.compile(model, backend="sizebackend", dynamic=True,
  options={"compile_sizes": ...})``; by default the sizes are the ``T`` the schedule
  produces most, known up front because the schedule is deterministic (a dry run);
- ``sizebackend-unsplit`` (not in the default set): the same with ``splitting_ops=[]``,
  nothing split, so that one process compares the two;
- the peers a user would pick instead (:mod:`.peers`): ``specialize`` (torch's own
  ``specialize_on`` per listed size, in the default set), ``specialize-tuned`` and
  ``dynamic-tuned`` (the same tuning as the sized pieces: frozen weights +
  max-autotune), with ``--variants all``. A peer torch cannot compile is reported
  with its error, not left out (``specialize-tuned`` runs through a workaround for a
  torch 2.13 bug, :class:`.peers.KeepSources`).

Per variant, *init* is a warm-up that calls the model once at every distinct ``T`` of
the schedule, so every Dynamo trace and compile happens there (as vLLM's "init engine"
warms up); the variants are initialized one after the other. Then the full generation
runs ``--repeat`` rounds, every variant once per round on a zeroed KV cache, and each
variant's fastest run gives its throughput. No compilation happens in the timed runs.
Then ``--passes`` replays of the first run's steps time the variants in turns of a few
steps (:func:`interleaved_runs`): on a machine whose speed drifts by tens of percent from
one run to the next, whole runs one after another compare the drift as much as the
compilers, while a turn is tens of milliseconds, so every variant meets the same
machine. Within a process these ratios are the steady ones (3-4% apart from pass to
pass here, where fastest full runs disagree by up to 40%); between processes the same
code still moves (see the README: one process is one sample).

``--tp N`` runs all of it on N tensor-parallel ranks (:mod:`.tp`: the shards of
``models/llama_tp``, spawned here or started by torchrun); rank 0 prints.

One intra-op thread by default (``--threads``): on a machine of a couple of cores shared
with other work, OpenMP workers that spin-wait for a core another process holds cut
throughput several-fold (7x measured on a busy 2-core machine, every variant alike), so
the ratios would measure the neighbours instead of the compilers. Pass ``--threads 2``
on a quiet machine.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import logging
import platform
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from . import plot, tp
from .peers import PEERS, PeerForward
from ..compile.progress import stderr_is_terminal
from ..models.llama import PRESETS, SizeLlama
from ..models.llama_tp import check_divisible
from .scheduler import Request, Scheduler, make_requests, plan, size_histogram
from ..cache.package_worker import wait_for_packages
from .._torch import isa_probe
from ..options import check_options
from ..stats import reset_stats, stats

#: sizebackend as the bench runs it (``--sb-options`` adds to both): with its defaults,
#: and with nothing split (``splitting_ops=[]``: one piece per graph, the attention
#: op inside it), which on a CPU without CUDA graphs trades compile reuse across
#: layers for fewer calls per step (see the README's "Performance").
SB_VARIANTS: dict[str, dict[str, Any]] = {"sizebackend": {},
                                          "sizebackend-unsplit": {"splitting_ops": []}}
VARIANTS = ("eager", "dynamic") + tuple(SB_VARIANTS) + PEERS
log = logging.getLogger(__name__)
#: What ``--variants`` runs by default (``all``: every one of :data:`VARIANTS`; the tuned
#: peers add minutes of autotuning each).
DEFAULT_VARIANTS = ("eager", "dynamic", "sizebackend", "specialize")
#: A greedy mismatch whose two tokens' reference logits are closer than this is a
#: floating-point tie (fused kernels sum in another order), not a wrong result.
TIE_TOLERANCE = 1e-3

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Prints an option's default once: not for options without one (``None``) or whose
    help already says what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "without it" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


_EPILOG = """T is the number of tokens in one model call (one step of the schedule): one per
decoding sequence plus the prompt tokens admitted that step. It is the batch
dim Dynamo sees as symbolic and the size sizebackend specializes on; the
benchmark prints how often each T occurs."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sizebackend bench",
        description="Generation throughput of eager vs torch.compile vs sizebackend, "
                    "in one run, on the built-in Llama-style model.",
        epilog=_EPILOG, formatter_class=_Defaults,
    )
    p.add_argument("--model", default="small", choices=list(PRESETS), help="model preset")
    p.add_argument("--requests", type=int, default=64, help="number of requests")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="mean generated tokens per request")
    p.add_argument("--output-spread", type=float, default=0.25,
                   help="output lengths are uniform in output_len * (1 +- spread)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (decodes + admitted prompts)")
    p.add_argument("--compile-sizes", default=None,
                   help="comma-separated values of T to compile for; without it, the "
                        "--num-compile-sizes most frequent T of the schedule")
    p.add_argument("--num-compile-sizes", type=int, default=4,
                   help="without --compile-sizes: compile for this many of the most frequent T")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}, or 'all' (see "
                        "app/peers.py for the peers)")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"),
                   help="what compiles the pieces: 'eager' (no codegen) is for quick checks")
    p.add_argument("--repeat", type=int, default=5,
                   help="timed runs per variant; the fastest counts")
    p.add_argument("--passes", type=int, default=5,
                   help="after the full runs, replays of their steps with the variants taking "
                        "each step in turn (the steadier comparison on a noisy machine); 0: none")
    p.add_argument("--sb-options", metavar="DICT", default=None,
                   help="more options for the sizebackend variants, a Python dict literal "
                        "(e.g. \"{'splitting_ops': []}\"); compile_sizes and compiler come "
                        "from --compile-sizes and --compiler")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads: 1 because OpenMP workers that spin-wait for a "
                        "busy core skew the ratios; more on a quiet machine")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the requests")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: the model sharded over this many processes "
                        "(spawned, or started by torchrun --nproc-per-node N); see app/tp.py")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw output tokens/s and init seconds of every variant: "
                        ".svg (no dependency) or .png (needs matplotlib)")
    return p


@dataclasses.dataclass
class Workload:
    requests: list[Request]
    max_num_seqs: int
    max_num_batched_tokens: int
    histogram: dict[int, int]
    """Steps per token count ``T``, from the dry run."""

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return self.output_tokens + sum(len(r.prompt) for r in self.requests)

    @property
    def max_len(self) -> int:
        """KV-cache rows one sequence needs (its last token is never written)."""
        return max(len(r.prompt) + r.output_len - 1 for r in self.requests)


@dataclasses.dataclass
class Result:
    name: str
    init_seconds: float
    outputs: dict[int, list[int]]
    runs: list[float] = dataclasses.field(default_factory=list)
    """Wall seconds of every timed run."""
    cpu_runs: list[float] = dataclasses.field(default_factory=list)
    """Process CPU seconds of every timed run."""
    interleaved: list[float] = dataclasses.field(default_factory=list)
    """Seconds of the variant's steps in each interleaved pass (forward and sampling)."""
    stats: dict[str, Any] | None = None

    @property
    def run_seconds(self) -> float:
        """The fastest run: the one least disturbed by whatever else the machine did."""
        return min(self.runs)

    def rates(self, w: Workload) -> dict[str, float]:
        return {
            "requests_per_s": len(w.requests) / self.run_seconds,
            "total_tokens_per_s": w.total_tokens / self.run_seconds,
            "output_tokens_per_s": w.output_tokens / self.run_seconds,
        }


def most_frequent_sizes(histogram: dict[int, int], n: int) -> list[int]:
    """The ``n`` most frequent ``T`` (ties: the smaller first), skipping 1: Dynamo always
    specializes a size of 1 into a graph of its own, so listing it compiles nothing."""
    ranked = sorted((t for t in histogram if t > 1), key=lambda t: (-histogram[t], t))
    return sorted(ranked[:n])


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr,
                disable=not stderr_is_terminal())


def make_variant(name: str, model: SizeLlama, compiler: str, sizes: list[int],
                 extra: dict[str, Any] | None = None) -> Forward:
    """The model as variant ``name`` runs it. The compiled variants share the model's
    code object; Dynamo keeps each one's graphs apart (its cache entries record their
    backend), so all three stay live and the timed runs can interleave."""
    if name == "eager":
        return model
    backend = "inductor" if compiler == "inductor" else "eager"
    if name == "dynamic":
        return torch.compile(model, backend=backend, dynamic=True)
    if name in PEERS:
        # specialize_on as its documentation marks it: the token dim alone, on a
        # default torch.compile. Under dynamic=True torch 2.13 also traces the RMSNorms'
        # float eps as a symbolic input, and every specialization then fails to compile
        # (AOTAutograd runs the eps' `.item()` on a fake tensor: DataDependentOutputException,
        # reported as "AttributeError: 'NoneType' object has no attribute 'f_code'").
        return PeerForward(name, model, sizes, compiler,
                           batch_only=name.startswith("specialize"))
    options = {**(extra or {}), **SB_VARIANTS[name], "compile_sizes": sizes,
               "compiler": compiler}
    return torch.compile(model, backend="sizebackend", dynamic=True, options=options)


def warm_up(forward: Forward, model: SizeLlama, w: Workload, name: str) -> float:
    """Call ``forward`` once at every distinct ``T`` of the schedule (largest first);
    returns the seconds it took, compilation included."""
    num_slots, max_len = model.kv_cache_shape[:2]
    start = time.perf_counter()
    with _bar(len(w.histogram), f"{name}: warm-up (compiles)") as bar:
        for t in sorted(w.histogram, reverse=True):
            index = torch.arange(t)
            slots = (index // max_len) % num_slots
            forward(torch.zeros(t, dtype=torch.long), index % max_len, slots)
            bar.update(1)
    return time.perf_counter() - start


Step = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""One step's model inputs (token ids, positions, slots) and the rows it samples."""


def generate(
    forward: Forward, w: Workload, desc: str, record: list[Step] | None = None
) -> tuple[dict[int, list[int]], float, float]:
    """Run the whole workload once; returns every request's tokens and the wall and
    process CPU seconds it took. ``record``: append every step's inputs to it."""
    scheduler = Scheduler(w.requests, w.max_num_seqs, w.max_num_batched_tokens)
    with _bar(sum(w.histogram.values()), desc) as bar:
        start, cpu_start = time.perf_counter(), time.process_time()
        while (step := scheduler.schedule()) is not None:
            inputs = (torch.tensor(step.input_ids), torch.tensor(step.positions),
                      torch.tensor(step.slots))
            rows = torch.tensor(step.sample_indices)
            logits = forward(*inputs)
            sampled = logits[rows].argmax(dim=-1).tolist()
            scheduler.update(step, sampled)
            if record is not None:
                record.append((inputs, rows))
            bar.update(1)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return scheduler.outputs, elapsed, cpu


def zero_kv_cache(model: SizeLlama) -> None:
    """In place: the compiled variants hold these very tensors as graph inputs."""
    for layer in model.layers:
        layer.self_attn.k_cache.zero_()
        layer.self_attn.v_cache.zero_()


def init_variant(name: str, model: SizeLlama, w: Workload, args, sizes: list[int]):
    """Build variant ``name`` and warm it up (its "init"); returns it and its Result."""
    forward = make_variant(name, model, args.compiler, sizes, args.sb_options)
    reset_stats()
    zero_kv_cache(model)
    result = Result(name, warm_up(forward, model, w, name), {})
    if isinstance(forward, PeerForward):
        forward.warming = False
        result.stats = {"peer": forward.evidence()}
    if name in SB_VARIANTS:
        result.stats = {"init": stats().to_dict()}
        # The package worker stores the frozen sized pieces for the next start; wait
        # for it here, so that its builds never share the cores with a timed run.
        start = time.perf_counter()
        done = wait_for_packages()
        result.stats["packages"] = {"stored": done.stored, "present": done.present,
                                    "failed": done.failed, "wait_s": time.perf_counter() - start}
    return forward, result


def timed_runs(
    model: SizeLlama, variants: list[tuple[Forward, Result]], w: Workload, repeat: int
) -> list[Step]:
    """``repeat`` rounds, each running every variant once on a zeroed KV cache: round
    robin, so load that comes and goes on a shared machine hits every variant alike.
    Keeps each variant's fastest run; every run must produce the same tokens. Returns
    the steps of the first run (every run's, since their tokens are the same)."""
    steps: list[Step] = []
    for i in range(repeat):
        for j, (forward, result) in enumerate(variants):
            zero_kv_cache(model)
            reset_stats()  # so the sizebackend calls below count exactly one run
            outputs, seconds, cpu = generate(forward, w, f"{result.name}: run {i + 1}/{repeat}",
                                             record=steps if i == j == 0 else None)
            if result.outputs and outputs != result.outputs:
                raise RuntimeError(f"{result.name}: run {i + 1} generated other tokens than run 1")
            result.outputs = outputs
            result.runs.append(seconds)
            result.cpu_runs.append(cpu)
            if result.name in SB_VARIANTS:
                run = stats().to_dict()
                result.stats["run"] = {"calls": run["calls"], "fallbacks": run["fallbacks"]}
    return steps


#: Steps a variant runs per turn in an interleaved pass, after :data:`WARM_CALLS`
#: untimed calls of the turn's first step (:func:`interleaved_runs` says why). Turns of
#: one step and no warm-up (stop 35) measured every variant cold, sizebackend the most.
CHUNK_STEPS = 16
WARM_CALLS = 4


def interleaved_runs(
    model: SizeLlama, variants: list[tuple[Forward, Result]], steps: list[Step], passes: int
) -> None:
    """``passes`` replays of the recorded ``steps`` in which every variant runs each
    chunk of :data:`CHUNK_STEPS` steps in turn (the first variant to go rotating from
    chunk to chunk), timing its forwards and sampling: a slow stretch of the machine
    lasts many chunks and so hits every variant alike, which whole runs one after
    another cannot promise. The variants share the KV cache, so a variant may read rows
    that one before it wrote for a later step of the chunk (a slot the next request
    took over): the work of a step does not depend on the values it reads, and the
    tokens were checked in the full runs. Fills ``Result.interleaved``.

    A turn starts with :data:`WARM_CALLS` untimed calls of its first step (idempotent:
    the step writes the same keys and values into the same cache rows again), as a
    process serving one variant is always warm. Measured on this machine (built-in
    ``small``, T=8, one process, sizebackend's packages): a call right after another
    model's call takes 1.3-1.7x its time in a run of calls of its own, and it takes ~8
    calls to get back (1763, 1443, 1307, 1222, 1144, 1104, 1070, 1052 us after one
    eager call of another model). Sizebackend lost the most there (its frozen pieces
    hold copies of the weights of their own; the other variants read the model's one
    set): 300 calls in a row took 0.65-0.72x of ``dynamic=True``'s time, the same calls
    alternating eager / ``dynamic=True`` / sizebackend 0.85-0.89x, with one untimed
    call before each timed one still 0.89-0.90x. In the default command, turns of one
    step without warm-up gave sizebackend 1.09x ``dynamic=True`` (passes 1.07-1.13x)
    where its fastest full run gave 1.29x; these turns give 1.30x (1.29-1.34x) beside
    full runs at 1.27x."""
    order = list(range(len(variants)))
    chunks = [steps[k:k + CHUNK_STEPS] for k in range(0, len(steps), CHUNK_STEPS)]
    for i in range(passes):
        zero_kv_cache(model)
        seconds = [0.0] * len(variants)
        with _bar(len(steps), f"interleaved pass {i + 1}/{passes}") as bar:
            for k, chunk in enumerate(chunks):
                shift = k % len(order)
                for v in order[shift:] + order[:shift]:
                    forward = variants[v][0]
                    for _ in range(WARM_CALLS):  # untimed: see the docstring
                        forward(*chunk[0][0])
                    start = time.perf_counter()
                    for inputs, rows in chunk:
                        forward(*inputs)[rows].argmax(dim=-1).tolist()
                    seconds[v] += time.perf_counter() - start
                bar.update(len(chunk))
        for (_, result), t in zip(variants, seconds):
            result.interleaved.append(t)


def logit_gap(model: SizeLlama, request: Request, prefix: list[int], a: int, b: int) -> float:
    """|logit a - logit b| of the eager model after ``prompt + prefix`` (one prefill)."""
    tokens = list(request.prompt) + prefix
    zero_kv_cache(model)
    n = len(tokens)
    logits = model(torch.tensor(tokens), torch.arange(n), torch.zeros(n, dtype=torch.long))
    return float((logits[-1, a] - logits[-1, b]).abs())


def compare_tokens(model: SizeLlama, w: Workload, reference: Result, other: Result) -> list[dict]:
    """Where ``other`` first differs from ``reference``, per request, with the logit gap."""
    mismatches = []
    for request in w.requests:
        want, got = reference.outputs[request.id], other.outputs[request.id]
        if want == got:
            continue
        # Same length: the scheduler stops a request at its output_len whatever it samples.
        i = next(i for i, (x, y) in enumerate(zip(want, got)) if x != y)
        gap = logit_gap(model, request, want[:i], want[i], got[i])
        mismatches.append({"variant": other.name, "request": request.id, "index": i,
                           "tokens": [want[i], got[i]], "logit_gap": gap,
                           "tie": gap < TIE_TOLERANCE})
    return mismatches


def figures(w: Workload, results: list[Result]) -> dict[str, dict[str, Any]]:
    """Per variant: the throughputs, times and ratios that are printed and written."""
    by_name = {r.name: r for r in results}
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        cpu = min(r.cpu_runs)
        row = {**r.rates(w), "init_seconds": r.init_seconds, "run_seconds": r.run_seconds,
               "all_run_seconds": r.runs, "cpu_seconds": cpu, "all_cpu_seconds": r.cpu_runs,
               "output_tokens_per_cpu_s": w.output_tokens / cpu}
        if r.interleaved:
            row["all_interleaved_seconds"] = r.interleaved
        for base in ("eager", "dynamic"):
            if base in by_name:
                row[f"vs_{base}"] = by_name[base].run_seconds / r.run_seconds
                row[f"cpu_vs_{base}"] = min(by_name[base].cpu_runs) / cpu
                # Round by round (each round runs every variant back to back): load
                # that lasts a round hits both sides of its ratio.
                paired = [b / a for a, b in zip(r.runs, by_name[base].runs)]
                row[f"rounds_vs_{base}"] = paired
                row[f"median_round_vs_{base}"] = statistics.median(paired)
                if r.interleaved:
                    passes = [b / a for a, b in zip(r.interleaved, by_name[base].interleaved)]
                    row[f"passes_vs_{base}"] = passes
                    row[f"interleaved_vs_{base}"] = statistics.median(passes)
        rows[r.name] = row
    return rows


def _ratios(row: dict[str, Any], prefix: str = "") -> str:
    keys = (prefix + "vs_eager", prefix + "vs_dynamic")
    cells = [f"{row[k]:.2f}x" if k in row else "-" for k in keys]
    return f"{cells[0]:>9} {cells[1]:>10}"


def _table(columns: str, lines: dict[str, str]) -> None:
    """A variant column, ``columns``, the two ratio columns, a rule, one line per variant."""
    width = max([12, *map(len, lines)])
    head = f"{'variant':<{width}} {columns} {'vs eager':>9} {'vs dynamic':>10}"
    print(f"{head}\n{'-' * len(head)}")
    for name, line in lines.items():
        print(f"{name:<{width}} {line}")


def report(w: Workload, results: list[Result], rows: dict[str, dict[str, Any]]) -> None:
    """The seed-style lines, then the tables by wall time and by CPU time."""
    for name, row in rows.items():
        print(f"[{name}] Throughput: {row['requests_per_s']:.2f} requests/s, "
              f"{row['total_tokens_per_s']:.2f} total tokens/s, "
              f"{row['output_tokens_per_s']:.2f} output tokens/s")
        what = "" if name == "eager" else ", compilation included"
        print(f"[{name}] init engine (warm-up at {len(w.histogram)} batch sizes{what}) "
              f"took {row['init_seconds']:.2f} seconds")

    repeat = len(results[0].runs)
    print(f"\nthroughput: fastest of {repeat} full runs (round robin, after warm-up); "
          f"ratios of output tokens/s")
    _table(
        f"{'requests/s':>10} {'total tok/s':>12} {'output tok/s':>12} {'init s':>8}",
        {name: f"{row['requests_per_s']:>10.2f} {row['total_tokens_per_s']:>12.1f} "
               f"{row['output_tokens_per_s']:>12.1f} {row['init_seconds']:>8.2f} {_ratios(row)}"
         for name, row in rows.items()},
    )
    print("slowest/fastest run (machine noise): "
          + ", ".join(f"{r.name} {max(r.runs) / min(r.runs):.2f}" for r in results))
    base = "dynamic" if "dynamic" in rows else "eager"
    if base in rows and len(rows) > 1:
        print(f"ratios vs {base} round by round (each round runs every variant back to "
              "back), median (least-most): " + ", ".join(
                  f"{name} {row[f'median_round_vs_{base}']:.2f}x "
                  f"({min(row[f'rounds_vs_{base}']):.2f}-{max(row[f'rounds_vs_{base}']):.2f})"
                  for name, row in rows.items() if name != base))

    # CPU time leaves out the time the process waited for a core, the main noise on a
    # shared machine (with --threads above 1 it includes OpenMP workers spinning).
    print(f"\nthe same runs by process CPU time (least of {repeat}; "
          f"leaves out waiting for a core):")
    _table(
        f"{'cpu s':>8} {'output tok/cpu-s':>17}",
        {name: f"{row['cpu_seconds']:>8.2f} {row['output_tokens_per_cpu_s']:>17.1f} "
               f"{_ratios(row, 'cpu_')}"
         for name, row in rows.items()},
    )


def _pass_ratio(a: Result, b: Result) -> float:
    """How much faster ``a`` ran than ``b`` in the interleaved passes: the median of the
    per-pass ratios of their step seconds."""
    return statistics.median(tb / ta for ta, tb in zip(a.interleaved, b.interleaved))


def report_interleaved(w: Workload, results: list[Result], rows: dict[str, dict[str, Any]]) -> None:
    passes = len(results[0].interleaved)
    if not passes:
        return
    turn = f"{CHUNK_STEPS} step{'s' if CHUNK_STEPS > 1 else ''} per turn"
    if WARM_CALLS:
        turn += f", each turn after {WARM_CALLS} untimed call{'s' if WARM_CALLS > 1 else ''}"
    print(f"\ninterleaved: the same {sum(w.histogram.values())} steps again, the variants "
          f"taking turns ({turn}), {passes} passes (forward + sampling, the scheduler left "
          f"out); ratios: median of the passes")
    _table(
        f"{'step s':>8} {'output tok/step-s':>18}",
        {r.name: f"{statistics.median(r.interleaved):>8.3f} "
                 f"{w.output_tokens / statistics.median(r.interleaved):>18.1f} "
                 f"{_ratios(rows[r.name], 'interleaved_')}"
         for r in results},
    )
    base = "dynamic" if "dynamic" in rows else "eager"
    if base in rows and len(rows) > 1:
        print(f"ratios vs {base} pass by pass (least-most): " + ", ".join(
            f"{name} {min(row[f'passes_vs_{base}']):.3f}-{max(row[f'passes_vs_{base}']):.3f}"
            for name, row in rows.items() if name != base))


def report_tokens(mismatches: list[dict], num_variants: int, w: Workload) -> None:
    if not mismatches:
        print(f"\ntokens identical: yes ({num_variants} variants, {w.output_tokens} tokens each)")
        return
    real = sum(not m["tie"] for m in mismatches)
    kind = f"{real} not explained by ties" if real else "all at floating-point ties"
    print(f"\ntokens identical: no ({len(mismatches)} requests diverge, {kind})")
    for m in mismatches[:5]:
        print(f"  {m['variant']}: request {m['request']} token {m['index']}: {m['tokens'][0]} "
              f"vs {m['tokens'][1]}, reference logit gap {m['logit_gap']:.2e}")


def report_peers(results: list[Result], rows: dict[str, dict[str, Any]],
                 failed: dict[str, str]) -> None:
    """How the tuned peers were set up (proof they froze and autotuned), and
    sizebackend against the best compiled peer."""
    for r in results:
        peer = (r.stats or {}).get("peer")
        if peer:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(peer["autotuned_ops"].items()))
            print(f"[{r.name}] autotuned at init: {ops or 'nothing'}; weights frozen "
                  f"(prepacked linears): {'yes' if peer['frozen'] else 'NO'}")
    for name, why in failed.items():
        print(f"[{name}] not run: {why}")
    peers = {n: row for n, row in rows.items() if n == "dynamic" or n in PEERS}
    by_name = {r.name: r for r in results}
    for ours in (n for n in SB_VARIANTS if n in rows and peers):
        best = max(peers, key=lambda n: peers[n]["output_tokens_per_s"])
        ratio = rows[ours]["output_tokens_per_s"] / peers[best]["output_tokens_per_s"]
        print(f"{ours} / best compiled peer ({best}), output tokens/s: {ratio:.2f}x "
              f"by fastest full run (target >= 1.15)")
        if by_name[ours].interleaved:
            ratios = {n: _pass_ratio(by_name[ours], by_name[n]) for n in peers}
            best = min(ratios, key=ratios.get)
            rows[ours]["interleaved_vs_best_peer"] = {"peer": best, "ratio": ratios[best]}
            print(f"{ours} / best compiled peer ({best}), interleaved: {ratios[best]:.3f}x "
                  f"(target >= 1.15)")


def report_stats(result: Result, sizes: list[int]) -> None:
    init, run = result.stats["init"], result.stats["run"]
    calls = sorted(run["calls"].items(), key=lambda kv: -kv[1])
    print(f"{result.name} calls in one run, by the pieces they ran: "
          + ", ".join(f"{key}: {n}" for key, n in calls))
    static = [key for key, _ in calls if key != "dynamic" and int(key) not in sizes]
    if static:  # Dynamo gives T=1 a graph of its own, whatever dynamic=True says
        print(f"  ({', '.join(static)}: graphs Dynamo traced for that T alone; "
              f"'dynamic': the general pieces)")
    print(f"{result.name} init: {init['graphs']} graphs, {init['pieces']} pieces, compiles "
          f"{init['compiles']}, cache hits {init['cache_hits']}, reused {init['reused']}, "
          f"fallbacks {init['fallbacks'] or 0}, {init['compile_seconds']:.1f} s compiling")
    packages = result.stats.get("packages")
    if packages and packages["stored"] + packages["present"] + packages["failed"]:
        print(f"{result.name} packages for the next start (worker process): {packages['stored']} "
              f"stored, {packages['failed']} failed; {packages['wait_s']:.1f} s waited after init")


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        _parser().error(f"--compile-sizes: expected comma-separated ints, got {text!r}")
    if not sizes or sizes[0] < 1:
        _parser().error(f"--compile-sizes: expected positive sizes, got {text!r}")
    return sizes


def more_options(text: str, set_elsewhere: Mapping[str, str]) -> dict[str, Any]:
    """``--sb-options`` of this bench and of the scripts in ``benchmarks/``: a Python dict
    literal of backend options to add to those the script sets, checked as the backend
    checks them, before anything compiles. A key in ``set_elsewhere`` (key: where it
    comes from) is refused. Raises ValueError saying why."""
    try:
        extra = ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python dict literal: {text!r} ({e})") from None
    if not isinstance(extra, dict):
        raise ValueError(f"must be a dict literal, got {type(extra).__name__}: {text!r}")
    check_options({**extra, "compile_sizes": [1]})  # OptionError is a ValueError
    taken = [key for key in set_elsewhere if key in extra]
    if taken:
        raise ValueError("; ".join(f"{key} come from {set_elsewhere[key]}" for key in taken))
    return extra


def _check_args(args: argparse.Namespace) -> list[str]:
    names = list(VARIANTS) if args.variants.strip() == "all" else [
        v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        _parser().error(f"--variants: unknown {unknown or 'empty list'}; "
                        f"choose from {','.join(VARIANTS)}")
    if args.passes < 0:
        _parser().error("--passes must be 0 or more")
    if args.sb_options is not None:
        try:
            args.sb_options = more_options(args.sb_options, {
                "compile_sizes": "--compile-sizes", "compiler": "--compiler"})
        except ValueError as e:
            _parser().error(f"--sb-options: {e}")
    for flag in ("repeat", "threads", "max_num_seqs", "max_num_batched_tokens", "tp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be at least 1")
    try:  # before spawning ranks that would each fail
        check_divisible(PRESETS[args.model], args.tp)
    except ValueError as e:
        _parser().error(f"--tp: {e}")
    if args.plot:
        try:
            plot.check_path(args.plot)  # before minutes of compiles, not after
        except ValueError as e:
            _parser().error(str(e))
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = _check_args(args)
    if tp.needs_spawn(args.tp):  # each rank runs this function again, launched
        return tp.spawn(main, list(sys.argv[1:] if argv is None else argv), args.tp)
    with tp.process_group(args.tp) as rank:
        if rank:  # rank 0 writes the files
            args.json = args.plot = None
        return _main(args, names)


def _main(args: argparse.Namespace, names: list[str]) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    # Every compiled variant compiles the same model, so their graphs are entries of
    # one code object: Dynamo's default limit (8) is 2 graphs (T=1 and the rest) for
    # 4 variants; past it a variant would silently run eager.
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 4 * len(names))
    try:
        return _run(args, names)
    finally:  # process-wide settings; callers in the same process keep theirs
        torch.set_num_threads(threads)
        torch._dynamo.config.recompile_limit = limit


def _run(args: argparse.Namespace, names: list[str]) -> int:
    model = tp.model(args.model, args.seed)
    cfg = model.config
    requests = make_requests(args.requests, args.input_len, args.output_len, cfg.vocab_size,
                             seed=args.seed, output_spread=args.output_spread)
    # The dry run: the schedule, hence every step's T, is known before anything runs.
    steps = plan(requests, args.max_num_seqs, args.max_num_batched_tokens)
    w = Workload(requests, args.max_num_seqs, args.max_num_batched_tokens,
                 dict(size_histogram(steps)))
    if w.max_len > cfg.max_position:
        _parser().error(f"input_len + output_len needs {w.max_len} positions; model "
                        f"{args.model!r} has {cfg.max_position}")
    if args.compile_sizes:
        sizes = _parse_sizes(args.compile_sizes)
    else:
        sizes = most_frequent_sizes(w.histogram, args.num_compile_sizes)
    model.allocate_kv_cache(args.max_num_seqs, w.max_len)
    _print_setup(args, cfg, w, sizes)

    torch.compiler.reset()  # the compiled variants start from nothing traced
    with torch.no_grad():
        variants, failed = [], {}
        for name in names:
            try:
                variants.append(init_variant(name, model, w, args, sizes))
            except Exception as e:  # a peer torch cannot run here: said, not left out
                if name not in PEERS:
                    raise
                cause = getattr(e, "inner_exception", None) or e.__cause__ or e  # Dynamo wraps it
                first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
                failed[name] = f"{type(e).__name__} ({type(cause).__name__}: {first[:300]})"
                print(f"[{name}] could not run: {failed[name]}")
                # The whole story on stderr, so that a failure seen once can be looked into.
                log.warning("%s could not run", name, exc_info=True)
        steps = timed_runs(model, variants, w, args.repeat)
        if args.passes and len(variants) > 1:
            interleaved_runs(model, variants, steps, args.passes)
        results = [result for _, result in variants]
        rows = figures(w, results)
        report(w, results, rows)
        report_interleaved(w, results, rows)
        # Against the first variant (eager by default), token by token.
        mismatches = [m for r in results[1:] for m in compare_tokens(model, w, results[0], r)]
    report_tokens(mismatches, len(results), w)
    sb_results = {r.name: r for r in results if r.name in SB_VARIANTS}
    for result in sb_results.values():
        report_stats(result, sizes)
    sb_result = sb_results.get("sizebackend")
    for result in sb_results.values():
        tp.report_agreement(result.stats)
    report_peers(results, rows, failed)

    if args.plot:
        plot.write(args.plot, f"sizebackend bench: model {args.model}, sizes {sizes}", [
            plot.Panel("output tokens/s (higher is better)", "tokens/s", ["fastest run"],
                       {name: [row["output_tokens_per_s"]] for name, row in rows.items()}),
            plot.Panel("init: warm-up with compiles (lower is better)", "seconds", ["init"],
                       {name: [row["init_seconds"]] for name, row in rows.items()}),
        ])
        print(f"wrote {args.plot}")
    if args.json:
        payload = {
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": machine(),
            "compile_sizes": sizes,
            "interleaved_turn": {"steps": CHUNK_STEPS, "warm_calls": WARM_CALLS},
            "schedule": {"steps": sum(w.histogram.values()),
                         "steps_per_size": {str(t): n for t, n in _by_frequency(w.histogram)},
                         "total_tokens": w.total_tokens, "output_tokens": w.output_tokens},
            "variants": rows,
            "failed_variants": failed,
            "tokens_identical": not mismatches,
            "token_mismatches": mismatches,
            "sizebackend_stats": sb_result.stats if sb_result is not None else None,
            **({"sizebackend_unsplit_stats": sb_results["sizebackend-unsplit"].stats}
               if "sizebackend-unsplit" in sb_results else {}),
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 1 if any(not m["tie"] for m in mismatches) else 0


def _by_frequency(histogram: dict[int, int]) -> list[tuple[int, int]]:
    return sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))


def machine() -> dict[str, str]:
    """What CPU ran the bench: results differ by CPU far more than by run (e.g. which
    GEMM library wins, ``_torch/packed_linear.py``), so every result names it."""
    cpu = isa_probe.cpu_fields()
    return {"model_name": cpu.get("model name", platform.processor() or "unknown"),
            "vendor": cpu.get("vendor_id", ""), "family": cpu.get("cpu family", ""),
            "model": cpu.get("model", ""),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_line() -> str:
    m = machine()
    where = " ".join(x for x in (m["vendor"], m["family"] and f"family {m['family']}",
                                 m["model"] and f"model {m['model']}") if x)
    return f"{m['model_name']}{f' ({where})' if where else ''}, torch CPU capability " \
           f"{m['torch_cpu_capability']}"


def _print_setup(args: argparse.Namespace, cfg, w: Workload, sizes: list[int]) -> None:
    num_steps = sum(w.histogram.values())
    print(f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}; tensor parallel over {tp.world_size()} rank(s), "
          f"{torch.get_num_threads()} threads each; "
          f"compiled variants use {args.compiler}")
    print(f"CPU: {machine_line()}")
    print(f"workload: {len(w.requests)} requests, input {args.input_len}, output "
          f"{args.output_len} +-{args.output_spread:.0%}, max_num_seqs {args.max_num_seqs}: "
          f"{num_steps} steps at {len(w.histogram)} distinct T (tokens per step)")
    print("steps per T (most frequent): "
          + ", ".join(f"{t}: {n}" for t, n in _by_frequency(w.histogram)[:8]))
    listed = sum(n for t, n in w.histogram.items() if t in sizes)
    more = f"; more options: {args.sb_options}" if args.sb_options else ""
    print(f"sizebackend compile_sizes: {sizes} "
          f"({'given' if args.compile_sizes else 'the most frequent T > 1'}); "
          f"{listed} of {num_steps} steps at a listed size{more}\n")
