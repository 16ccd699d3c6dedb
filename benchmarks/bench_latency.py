"""Per-call latency at listed and unlisted batch sizes, in one run, as ratios.

Compares eager, ``torch.compile(dynamic=True)``, ``torch.compile(dynamic=False)`` (one
recompile per size) and sizebackend on a small transformer (LayerNorm + SDPA + MLP),
then measures the runner's own per-piece overhead with the eager adaptor.

    python benchmarks/bench_latency.py [--sizes 1,2,4,8] [--unlisted 3,6] [--json out.json]
                                       [--plot latency.svg] [--base ...] [--processes N]

``--processes N`` runs the whole comparison in N fresh processes, one after another, and
prints each one's sizebackend / peer ratios and their median: a ratio within a few
percent of 1.0 can hold in every round of one process and reverse in the next process
(the same compiled code, another placement in memory), so one process is one sample.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-latency-"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dynamo_sizebackend as sb  # noqa: E402
from dynamo_sizebackend.app import plot  # noqa: E402
from dynamo_sizebackend.app.bench import CHUNK_STEPS, WARM_CALLS, more_options  # noqa: E402
from dynamo_sizebackend.app.peers import PeerForward  # noqa: E402
from dynamo_sizebackend.models.sdpa import TinyTransformer  # noqa: E402


BASE_VARIANTS = ("eager", "dynamic=True", "dynamic=False", "sizebackend", "sb batch-dyn",
                 "sb unbacked")
OURS = ("sizebackend", "sb batch-dyn", "sb unbacked")


def interleaved(calls: dict, iters: int) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable over ``iters`` timed calls
    each, the callables taking turns of :data:`CHUNK_STEPS` timed calls, each turn after
    :data:`WARM_CALLS` untimed ones, in rotating order.

    This machine's speed drifts by 1.5x between consecutive batches of 100 calls (measured
    on plain eager), so timing one variant after another compares drift, not code; turns
    of a few calls let every variant see the same drift. The untimed calls: a call right
    after another model's runs 1.3-1.7x slower and takes several calls to recover (see
    ``sizebackend.app.bench.interleaved_runs``), while a process serving one model is
    always warm."""
    names = list(calls)
    for name in names:
        for _ in range(3):
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(-(-iters // CHUNK_STEPS)):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            for _ in range(WARM_CALLS):
                call()
            for _ in range(min(CHUNK_STEPS, iters - i * CHUNK_STEPS)):
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def batch_dynamic(x: torch.Tensor, unbacked: bool = False) -> torch.Tensor:
    """A copy of ``x`` whose batch dim (only) Dynamo treats as dynamic from the first
    call: backed (``mark_dynamic``; batch 1 gets a graph of its own) or unbacked
    (``mark_unbacked``; one graph for every size, the README's recommendation)."""
    x = x.clone()
    if unbacked:
        torch._dynamo.decorators.mark_unbacked(x, 0)
    else:
        torch._dynamo.mark_dynamic(x, 0)
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--unlisted", default="3,6")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads; 1 keeps figures stable on a shared 2-core machine")
    p.add_argument("--json")
    p.add_argument("--peers", default="specialize",
                   help="comma-separated peers of app/peers.py to add (specialize, "
                        "specialize-tuned, dynamic-tuned); '' for none")
    p.add_argument("--plot", metavar="FILE",
                   help="draw per-size latency of every variant: .svg, or .png (matplotlib)")
    p.add_argument("--base", default=",".join(BASE_VARIANTS),
                   help=f"comma-separated subset of {', '.join(BASE_VARIANTS)} (default all)")
    p.add_argument("--sb-options", metavar="DICT",
                   help="more options for the sizebackend variants, a Python dict literal "
                        "(e.g. \"{'splitting_ops': []}\": no split)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the comparison in this many fresh processes and print the "
                        "median of their sizebackend / peer ratios")
    args = p.parse_args(argv)
    try:
        extra = (more_options(args.sb_options, {"compile_sizes": "--sizes"})
                 if args.sb_options else {})
    except ValueError as e:
        p.error(f"--sb-options: {e}")
    base = [b for b in args.base.split(",") if b]
    unknown = sorted(set(base) - set(BASE_VARIANTS))
    if unknown or not base:
        p.error(f"--base: unknown variant(s) {unknown}; pick from {list(BASE_VARIANTS)}")
    if args.processes < 1:
        p.error("--processes must be at least 1")
    if args.processes > 1:
        return in_processes(argv if argv is not None else sys.argv[1:], args.processes, args.json)
    if args.plot:
        plot.check_path(args.plot)
    listed = [int(s) for s in args.sizes.split(",")]
    unlisted = [int(s) for s in args.unlisted.split(",")]
    sizes = sorted(listed + unlisted)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # dynamic=False recompiles once per size

    model = TinyTransformer(args.layers, args.dim, 4, mlp_ratio=4).eval()
    inputs = {n: torch.randn(n, args.seq, args.dim) for n in sizes}
    marked = {n: batch_dynamic(x) for n, x in inputs.items()}
    unbacked = {n: batch_dynamic(x, unbacked=True) for n, x in inputs.items()}
    options = {"cache_dir": None, **extra, "compile_sizes": listed}
    # name -> (callable, its inputs by size). Two sizebackend setups: dynamic=True, as the
    # dynamic=True baseline traces (every dim symbolic), and the batch dim alone marked
    # dynamic, the way a serving engine marks it: fewer symbols, fewer guards per call.
    variants = {  # torch.compile compiles at the first call: unpicked ones cost nothing
        "eager": (model, inputs),
        "dynamic=True": (torch.compile(model, dynamic=True), inputs),
        "dynamic=False": (torch.compile(model, dynamic=False), inputs),
        "sizebackend": (torch.compile(model, backend="sizebackend", dynamic=True,
                                      options=dict(options)), inputs),
        "sb batch-dyn": (torch.compile(model, backend="sizebackend", options=dict(options)), marked),
        "sb unbacked": (torch.compile(model, backend="sizebackend", options=dict(options)), unbacked),
    }
    variants = {name: v for name, v in variants.items() if name in base}
    for name in args.peers.split(",") if args.peers else ():  # app/peers.py
        # Copies: the first call's tensor gets the specialize_on marks, which must not
        # reach the other variants through a shared input.
        # batch_only: the batch dim alone dynamic, the setup "sb batch-dyn" has (with
        # dynamic=True the sequence dim is symbolic too, and frozen weights lose).
        variants[name] = (PeerForward(name, model, listed, batch_only=True),
                          {n: x.clone() for n, x in inputs.items()})
    results: dict[str, dict[int, float]] = {name: {} for name in variants}
    with torch.no_grad():
        for name, (fn, feed) in variants.items():
            start = time.perf_counter()
            for n in sorted(sizes, reverse=True):  # compile (or warm) every size, largest first:
                # a first call at 1 would trace static (0/1 specialization)
                torch.testing.assert_close(fn(feed[n]), model(inputs[n]), rtol=1e-3, atol=1e-3)
            if isinstance(fn, PeerForward):
                fn.warming = False
                print(f"# {name}: {fn.evidence()}", file=sys.stderr)
            print(f"# {name}: warm-up and compile {time.perf_counter() - start:.1f}s", file=sys.stderr)
        for n in sizes:
            calls = {name: functools.partial(fn, feed[n]) for name, (fn, feed) in variants.items()}
            for name, t in interleaved(calls, args.iters).items():
                results[name][n] = t

    ours = [o for o in OURS if o in variants]
    baselines = [(b, short) for b, short in (("eager", "eager"), ("dynamic=True", "dynamic"),
                                             ("dynamic=False", "static")) if b in variants]
    print(f"\nper-call latency, {args.layers} layers, dim {args.dim}, seq {args.seq} "
          f"(us; ratios: {', '.join(ours)}, over the baseline)")
    print(f"{'size':>4} {'listed':>6} " + " ".join(f"{k:>13}" for k in variants)
          + "".join(f" {'sb/' + short:>20}" for b, short in baselines if short != "eager"))
    rows = []
    for n in sizes:
        us = {k: results[k][n] * 1e6 for k in variants}
        row = {"size": n, "listed": n in listed, **{k: round(v, 1) for k, v in us.items()}}
        for o in ours:
            for b, short in baselines:
                row[f"{o}/{short}"] = us[o] / us[b]
        rows.append(row)
        cols = [" ".join(f"{row[f'{o}/{short}']:.3f}" for o in ours)
                for b, short in baselines if short != "eager"]
        print(f"{n:>4} {'yes' if n in listed else 'no':>6} " + " ".join(f"{us[k]:>13.1f}" for k in variants)
              + "".join(f" {c:>20}" for c in cols))
    peer_ratios = {}
    for peer in [k for k in variants if isinstance(variants[k][0], PeerForward)]:
        for o in ours:
            lst = [results[o][n] / results[peer][n] for n in sizes if n in listed]
            unl = [results[o][n] / results[peer][n] for n in sizes if n not in listed]
            peer_ratios[f"{o} / {peer}"] = {
                "listed_max": max(lst), "listed_mean": statistics.mean(lst),
                "unlisted_max": max(unl) if unl else None,
                "unlisted_mean": statistics.mean(unl) if unl else None}
            print(f"{o} / {peer}: listed max {max(lst):.3f} mean {statistics.mean(lst):.3f}"
                  + (f"; unlisted max {max(unl):.3f} mean {statistics.mean(unl):.3f}" if unl else ""))
    for o in ours:
        if "dynamic=False" in variants:
            lst = [r[f"{o}/static"] for r in rows if r["listed"]]
            print(f"\n{o}: listed sizes / dynamic=False  max {max(lst):.3f}  mean {statistics.mean(lst):.3f} (target <= 0.95)")
        unl = [r[f"{o}/dynamic"] for r in rows if not r["listed"]] if "dynamic=True" in variants else []
        if unl:
            print(f"{o}: unlisted sizes / dynamic=True max {max(unl):.3f}  mean {statistics.mean(unl):.3f} (target <= 1.03)")

    overhead = runner_overhead()
    print(f"runner overhead: {overhead:.2f} us per piece (target < 10)")
    print(f"stats: {json.dumps(sb.stats().to_dict())}")
    if args.plot:
        groups = [f"{n}{'*' if n in listed else ''}" for n in sizes]
        plot.write(args.plot, f"per-call latency, {args.layers} layers, dim {args.dim}, seq "
                              f"{args.seq} (* listed size)", [
            plot.Panel("median us per call (lower is better)", "us", groups,
                       {k: [results[k][n] * 1e6 for n in sizes] for k in variants}),
        ] + ([plot.Panel("ratio to dynamic=False", "x", groups,
                         {k: [results[k][n] / results["dynamic=False"][n] for n in sizes]
                          for k in variants})] if "dynamic=False" in variants else []))
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "peer_ratios": peer_ratios,
                       "runner_overhead_us_per_piece": overhead}, f, indent=2)
    return 0


def in_processes(argv: list[str], processes: int, json_path: str | None) -> int:
    """Run this script ``processes`` times in fresh processes (one after another, sharing
    the Inductor cache folder) and print every sizebackend / peer ratio per process and
    the median over processes; ``json_path``: write every process's ratios there."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-latency-runs-") as folder:
        for i in range(processes):
            out = os.path.join(folder, f"run{i}.json")
            # argparse keeps an option's last value: these override the caller's
            rc = subprocess.call([sys.executable, os.path.abspath(__file__), *argv,
                                  "--processes", "1", "--json", out])
            if rc != 0:
                print(f"process {i} failed with exit status {rc}", file=sys.stderr)
                return rc
            with open(out) as f:
                runs.append(json.load(f)["peer_ratios"])
    if not runs[0]:
        print("no peer to compare with: --processes reports sizebackend / peer ratios "
              "(--peers)", file=sys.stderr)
        return 2
    print(f"\nsizebackend / peer over {processes} processes (each process's mean over sizes; "
          "median, then every process's):")
    for pair in runs[0]:
        for kind in ("listed", "unlisted"):
            means = [r[pair][f"{kind}_mean"] for r in runs]
            if None in means:
                continue
            print(f"{pair}: {kind} mean {statistics.median(means):.3f} "
                  f"[{' '.join(f'{m:.3f}' for m in means)}]")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"processes": runs}, f, indent=2)
    return 0


def runner_overhead(pieces_per_graph: int = 17, iters: int = 3000) -> float:
    """Microseconds the runner adds per piece: sizebackend with the eager adaptor against
    torch.compile(backend="eager") on a model of many tiny attention-separated pieces."""

    class Tiny(nn.Module):
        def forward(self, x):
            for _ in range(pieces_per_graph - 1):
                x = F.scaled_dot_product_attention(x, x, x) + 1
            return x

    model, x = Tiny(), torch.randn(2, 1, 2, 4)
    plain = torch.compile(model, backend="eager", dynamic=True)
    ours = torch.compile(model, backend="sizebackend", dynamic=True,
                         options={"compile_sizes": [2], "compiler": "eager", "cache_dir": None})
    with torch.no_grad():
        t = interleaved({"plain": functools.partial(plain, x), "ours": functools.partial(ours, x)}, iters)
    return (t["ours"] - t["plain"]) * 1e6 / pieces_per_graph


if __name__ == "__main__":
    sys.exit(main())
