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

``--packaged``: what a warm restart serves instead: the sized pieces stored as packages
(``store_frozen="inline"``, one cache folder per variant kept across its processes: the
first builds, the others load), and a third variant, the default with the packages'
equal constants not shared (``SIZEBACKEND_SHARE_CONSTANTS=0``).

    python benchmarks/bench_rotation.py [--preset small] [--sizes 2,4,8] [--repeats 3]
                                        [--iters 400] [--threads 1] [--packaged]
                                        [--json out.json]
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
#: With ``--packaged``: the default with every package's constants its own.
UNSHARED = "default, unshared"


def child(spec: dict) -> dict:
    """One process: compile, warm up, time; per size the median seconds per call."""
    import torch

    from dynamo_sizebackend.models import build_model, config

    if spec["variant"] == UNSHARED:
        os.environ["SIZEBACKEND_SHARE_CONSTANTS"] = "0"
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    cfg = config(spec["preset"])
    model = build_model(cfg)
    model.allocate_kv_cache(8, 64)

    def inputs(n: int):
        g = torch.Generator().manual_seed(n)
        return (torch.randint(cfg.vocab_size, (n,), generator=g), torch.arange(n),
                torch.zeros(n, dtype=torch.long))

    # Packaged: the cache folder from SIZEBACKEND_CACHE_DIR, kept per variant.
    where = {"store_frozen": "inline"} if spec["packaged"] else {"cache_dir": None}
    options = {"compile_sizes": spec["sizes"], **where, **VARIANTS.get(spec["variant"], {})}
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
    parser.add_argument("--packaged", action="store_true",
                        help="sized pieces as stored packages; adds the default unshared")
    parser.add_argument("--json", default=None)
    args = _child.parse_or_serve(parser, child, argv)
    if args is None:
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = list(VARIANTS) + ([UNSHARED] if args.packaged else [])
    root = tempfile.mkdtemp(prefix="bench-rotation-")
    runs: dict[tuple[str, str], list[dict]] = {}
    print(f"llama {args.preset}, sizes {sizes}, {args.threads} thread(s), {args.repeats} "
          f"alternated processes per variant and mode, {args.iters} rounds each")
    for repeat in range(args.repeats):
        for mode in ("rotate", "one size"):
            for variant in variants:
                spec = dict(variant=variant, mode=mode, preset=args.preset, sizes=sizes,
                            iters=args.iters, threads=args.threads, packaged=args.packaged)
                name = variant.replace(" ", "_").replace(",", "")
                folder = os.path.join(root, f"{repeat}-{mode}-{name}")
                cache = os.path.join(root, f"cache-{name}") if args.packaged else \
                    os.path.join(folder, "sizebackend")
                result, _, _ = _child.run(__file__, spec, os.path.join(folder, "inductor"), cache,
                                          drop_env=("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS",
                                                    "SIZEBACKEND_SHARE_CONSTANTS"))
                runs.setdefault((mode, variant), []).append(result)
                print(f"  {repeat + 1}: {mode:<8} {variant:<11} " + "  ".join(
                    f"n={n}: {s * 1e6:7.1f} us" for n, s in result.items()), flush=True)
    summary = {}
    unshared = f" {'unshared us':>11} {'ratio':>6}" if args.packaged else ""
    print(f"\n  {'calls':<10} {'n':>3} {'untuned us':>11} {'default us':>11} {'ratio':>6}{unshared}")
    for mode in ("rotate", "one size"):
        for n in runs[(mode, "untuned {}")][0]:
            best = {v: min(r[n] for r in runs[(mode, v)]) for v in variants}
            plain, tuned = best["untuned {}"], best["CPU default"]
            row = {"untuned": plain, "default": tuned, "ratio": tuned / plain}
            line = f"  {mode:<10} {n:>3} {plain * 1e6:11.1f} {tuned * 1e6:11.1f} {tuned / plain:6.3f}"
            if args.packaged:
                row.update(unshared=best[UNSHARED], unshared_ratio=best[UNSHARED] / plain)
                line += f" {best[UNSHARED] * 1e6:11.1f} {best[UNSHARED] / plain:6.3f}"
            summary[f"{mode} n={n}"] = row
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "preset": args.preset, "summary": summary,
                       "runs": {f"{m}/{v}": r for (m, v), r in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
