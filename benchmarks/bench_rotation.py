"""Per-call latency of the CPU default's tuned sizes when calls rotate among the listed
sizes, against one size called alone: what constant weights cost in memory traffic.

Each listed size of the CPU default holds its own frozen (prepacked) copy of every
weight, so a server whose calls move between sizes reads a different copy on each
call; a model whose weights fit the CPU's caches once may not fit them N times. This
script measures it on the built-in Llama: for each variant (``sized_inductor_options``
``{}`` against the default), a fresh process compiles the sizes (``mark_dynamic`` on
the token dim, ``cache_dir=None``), then times ``--iters`` rounds of calls either
rotating among ``--sizes`` or at the first listed size only. Variants run in separate
processes (two variants in one would share and evict each other's caches), alternated
``--repeats`` times, so that this machine's drift hits both; each process reports its
per-call medians and the best process of each variant counts (this machine's speed
drifts by 2x between processes minutes apart), with the ratio tuned / untuned.

    python benchmarks/bench_rotation.py [--preset small] [--sizes 2,4,8] [--repeats 3]
                                        [--iters 400] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import _child

VARIANTS = {"untuned {}": {"sized_inductor_options": {}}, "CPU default": {}}


def child(spec: dict) -> dict:
    """One process: compile, warm up, time; per size the median seconds per call."""
    import torch

    from dynamo_sizebackend.models import build_model, config

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    cfg = config(spec["preset"])
    model = build_model(cfg)
    model.allocate_kv_cache(8, 64)

    def inputs(n: int):
        g = torch.Generator().manual_seed(n)
        return (torch.randint(cfg.vocab_size, (n,), generator=g), torch.arange(n),
                torch.zeros(n, dtype=torch.long))

    options = {"compile_sizes": spec["sizes"], "cache_dir": None, **VARIANTS[spec["variant"]]}
    compiled = torch.compile(model, backend="sizebackend", options=options)
    called = spec["sizes"] if spec["mode"] == "rotate" else spec["sizes"][:1]
    with torch.no_grad():
        trigger = inputs(max(spec["sizes"]) + 1)
        for t in trigger:
            torch._dynamo.mark_dynamic(t, 0)
        compiled(*trigger)
        xs = {n: inputs(n) for n in called}
        for _ in range(20):
            for x in xs.values():
                compiled(*x)
        times: dict[int, list[float]] = {n: [] for n in xs}
        for _ in range(spec["iters"]):
            for n, x in xs.items():
                start = time.perf_counter()
                compiled(*x)
                times[n].append(time.perf_counter() - start)
    return {str(n): statistics.median(v) for n, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = _child.parse_or_serve(parser, child, argv)
    if args is None:
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    root = tempfile.mkdtemp(prefix="bench-rotation-")
    runs: dict[tuple[str, str], list[dict]] = {}
    print(f"llama {args.preset}, sizes {sizes}, {args.threads} thread(s), {args.repeats} "
          f"alternated processes per variant and mode, {args.iters} rounds each")
    for repeat in range(args.repeats):
        for mode in ("rotate", "one size"):
            for variant in VARIANTS:
                spec = dict(variant=variant, mode=mode, preset=args.preset, sizes=sizes,
                            iters=args.iters, threads=args.threads)
                folder = os.path.join(root, f"{repeat}-{mode}-{variant}".replace(" ", "_"))
                result, _, _ = _child.run(__file__, spec, os.path.join(folder, "inductor"),
                                          os.path.join(folder, "sizebackend"),
                                          drop_env=("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS",))
                runs.setdefault((mode, variant), []).append(result)
                print(f"  {repeat + 1}: {mode:<8} {variant:<11} " + "  ".join(
                    f"n={n}: {s * 1e6:7.1f} us" for n, s in result.items()), flush=True)
    summary = {}
    print(f"\n  {'calls':<10} {'n':>3} {'untuned us':>11} {'default us':>11} {'ratio':>6}")
    for mode in ("rotate", "one size"):
        for n in runs[(mode, "untuned {}")][0]:
            plain, tuned = (min(r[n] for r in runs[(mode, v)]) for v in VARIANTS)
            summary[f"{mode} n={n}"] = {"untuned": plain, "default": tuned, "ratio": tuned / plain}
            print(f"  {mode:<10} {n:>3} {plain * 1e6:11.1f} {tuned * 1e6:11.1f} {tuned / plain:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "preset": args.preset, "summary": summary,
                       "runs": {f"{m}/{v}": r for (m, v), r in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
