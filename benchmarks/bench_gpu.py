"""GPU per-call latency of the built-in model, in one run, into one JSON (issues 5, 12).

Decode steps of T tokens (one per sequence) at the listed sizes (1-8 by default) and one
unlisted size, for eager, ``torch.compile(dynamic=True)`` and sizebackend without and
with piecewise CUDA graphs (``--reduce-overhead`` adds torch's own CUDA graphs). Prints
one table and the ratio the target is set on: sizebackend+cudagraphs against
``dynamic=True`` at listed sizes 1-8 (target >= 1.5x). Needs CUDA.

    python benchmarks/bench_gpu.py [--model small] [--sizes 1,...,8] [--unlisted 12]
                                   [--iters 200] [--tuned] [--json out.json]

Sized pieces compile untuned by default (``sized_inductor_options={}``) so that the
whole GPU check fits its time budget; ``--tuned`` uses the measured CUDA defaults
(max-autotune and coordinate descent: minutes of autotuning per size).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.models import build_model


def cuda_timed(fn, args, iters: int) -> float:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", default="1,2,3,4,5,6,7,8", help="listed (compiled, captured) sizes")
    p.add_argument("--unlisted", default="12", help="sizes run on the general pieces")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--tuned", action="store_true", help="sized pieces with the CUDA defaults")
    p.add_argument("--reduce-overhead", action="store_true", help="also torch.compile(mode=...)")
    p.add_argument("--json", help="write every figure and the stats here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    listed = _ints(args.sizes)
    sizes = sorted(set(listed + _ints(args.unlisted)))
    torch._dynamo.config.recompile_limit = 64

    model = build_model(args.model, device="cuda")
    model.allocate_kv_cache(max(sizes), 64)
    inputs = {
        n: (torch.randint(0, model.config.vocab_size, (n,), device="cuda"),
            torch.full((n,), 7, device="cuda"), torch.arange(n, device="cuda"))
        for n in sizes
    }
    sb_options = {"compile_sizes": listed, "cudagraph_sizes": listed, "cache_dir": None}
    if not args.tuned:
        sb_options["sized_inductor_options"] = {}
    variants = {
        "eager": model,
        "dynamic=True": torch.compile(model, dynamic=True),
        "sb": torch.compile(model, backend="sizebackend", dynamic=True, options=sb_options),
        "sb+cudagraphs": torch.compile(model, backend="sizebackend", dynamic=True,
                                       options={**sb_options, "cudagraphs": True}),
    }
    if args.reduce_overhead:
        variants["reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
    warmup_s: dict[str, float] = {}
    times: dict[str, dict[int, float]] = {k: {} for k in variants}
    with torch.no_grad():
        for name, fn in variants.items():
            start = time.perf_counter()
            for n in sizes:
                for _ in range(3):  # compile, warm-up, capture: every later call replays
                    torch.testing.assert_close(fn(*inputs[n]), model(*inputs[n]),
                                               rtol=2e-3, atol=2e-3)
            warmup_s[name] = time.perf_counter() - start
            print(f"# {name}: compile/warm-up {warmup_s[name]:.1f}s", file=sys.stderr, flush=True)
        for name, fn in variants.items():
            for n in sizes:
                times[name][n] = cuda_timed(fn, inputs[n], args.iters)

    print(f"GPU per-call latency, model {args.model} (us); ratio = dynamic=True / sb+cudagraphs")
    print(f"{'T':>4} {'listed':>6} " + " ".join(f"{k:>16}" for k in variants) + f" {'ratio':>8}")
    rows = []
    for n in sizes:
        us = {k: times[k][n] * 1e6 for k in variants}
        ratio = us["dynamic=True"] / us["sb+cudagraphs"]
        rows.append({"size": n, "listed": n in listed, "us": us, "cudagraphs_vs_dynamic": ratio})
        print(f"{n:>4} {'yes' if n in listed else 'no':>6} "
              + " ".join(f"{us[k]:>16.1f}" for k in variants) + f" {ratio:>7.2f}x")
    small = [r["cudagraphs_vs_dynamic"] for r in rows if r["listed"] and r["size"] <= 8]
    worst = min(small) if small else float("nan")
    print(f"sb+cudagraphs vs dynamic=True at listed sizes 1..8: min {worst:.2f}x "
          f"({'meets' if worst >= 1.5 else 'misses'} the target >= 1.5x)")
    stats = sb.stats().to_dict()
    print("stats:", json.dumps(stats))
    if args.json:
        report = {
            "model": args.model, "listed": listed, "sizes": sizes, "iters": args.iters,
            "tuned": args.tuned, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "warmup_s": warmup_s, "rows": rows,
            "min_cudagraphs_vs_dynamic_1_8": worst, "target": 1.5, "stats": stats,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
