"""GPU per-call latency of the built-in model, as ratios, in one run (issue 5).

Decode steps of T tokens (one per sequence) at listed sizes and two unlisted ones, for
eager, ``torch.compile(dynamic=True)``, ``mode="reduce-overhead"`` and sizebackend with
and without piecewise CUDA graphs. Needs CUDA; prints one table.

    python benchmarks/bench_gpu.py [--model small] [--sizes 1,2,4,8,16] [--unlisted 3,12]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--unlisted", default="3,12")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    listed = [int(s) for s in args.sizes.split(",")]
    sizes = sorted(listed + [int(s) for s in args.unlisted.split(",")])
    torch._dynamo.config.recompile_limit = 64

    model = build_model(args.model, device="cuda")
    model.allocate_kv_cache(max(sizes), 64)
    inputs = {
        n: (torch.randint(0, model.config.vocab_size, (n,), device="cuda"),
            torch.full((n,), 7, device="cuda"), torch.arange(n, device="cuda"))
        for n in sizes
    }
    variants = {
        "eager": model,
        "dynamic=True": torch.compile(model, dynamic=True),
        "reduce-overhead": torch.compile(model, mode="reduce-overhead"),
        "sb": torch.compile(model, backend="sizebackend", dynamic=True,
                            options={"compile_sizes": listed, "cache_dir": None}),
        "sb+cudagraphs": torch.compile(model, backend="sizebackend", dynamic=True,
                                       options={"compile_sizes": listed, "cudagraphs": True,
                                                "cache_dir": None}),
    }
    times: dict[str, dict[int, float]] = {k: {} for k in variants}
    with torch.no_grad():
        for name, fn in variants.items():
            start = time.perf_counter()
            for n in sizes:
                torch.testing.assert_close(fn(*inputs[n]), model(*inputs[n]), rtol=2e-3, atol=2e-3)
            print(f"# {name}: compile/warm-up {time.perf_counter() - start:.1f}s", file=sys.stderr)
        for name, fn in variants.items():
            for n in sizes:
                times[name][n] = cuda_timed(fn, inputs[n], args.iters)

    print(f"GPU per-call latency, model {args.model} (us); ratio = dynamic=True / variant")
    print(f"{'T':>4} {'listed':>6} " + " ".join(f"{k:>16}" for k in variants) + f" {'speedup sb+cg':>14}")
    rows = []
    for n in sizes:
        us = {k: times[k][n] * 1e6 for k in variants}
        speed = us["dynamic=True"] / us["sb+cudagraphs"]
        rows.append({"size": n, "listed": n in listed, **us, "sb_cudagraphs_vs_dynamic": speed})
        print(f"{n:>4} {'yes' if n in listed else 'no':>6} " + " ".join(f"{us[k]:>16.1f}" for k in variants)
              + f" {speed:>13.2f}x")
    small = [r["sb_cudagraphs_vs_dynamic"] for r in rows if r["listed"] and r["size"] <= 8]
    print(f"sb+cudagraphs vs dynamic=True at listed sizes 1..8: min {min(small):.2f}x (target >= 1.5x)")
    print("stats:", json.dumps(sb.stats().to_dict()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
