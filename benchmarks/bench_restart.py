"""Startup of a server process, whole-process wall time, sizebackend against
``torch.compile(dynamic=True)`` (issue 18), interleaved in one run.

For each model (the built-in Llama, preset ``tiny``; a plain SDPA transformer,
``models.sdpa.TinyTransformer``), each measure is a fresh Python process timed by this
one from spawn to the event, so interpreter start, imports and model building count:

Both backends see the same graphs: the Llama with ``dynamic=True`` (its one symbol is
the token count), the SDPA model with ``mark_dynamic`` on the batch dim only.

- **cold**: empty Inductor and sizebackend caches; **warm**: a later process on the
  same two folders (a restart), ``--warm-repeats`` of each alternated, the best
  counted. Each process makes the trigger call (the general shape, T=3 / batch 3),
  then one call per listed size and one unlisted size; "last served" is when the last
  of those returned.
- **serve at once**: ``compile_mode="background"`` on empty caches: when the first
  request is answered (the general pieces), and when the sized pieces are all in
  (time to full speed).
- **warm, ISA probed**: a warm restart with ``SIZEBACKEND_REMEMBER_ISA_PROBE=0``, so
  that it pays Inductor's vector-ISA probe as ``torch.compile``'s restart does (what
  remembering it saves; ``_torch/isa_probe.py``).
- **packages stored**: every cold process then waits for the package worker
  (``sb.wait_for_packages()``) to have stored its frozen sized pieces, so that the
  restarts measured next find them; when that happened is reported beside.

sizebackend runs with its real defaults (on CPU: frozen weights, max-autotune, the
C++ GEMM template; ``store_frozen``): ``SIZEBACKEND_SIZED_INDUCTOR_OPTIONS`` is removed
from the children's environment. The warm process's stats show what it loaded (cache
hits) and compiled.

    python benchmarks/bench_restart.py [--models llama,sdpa] [--sizes 1,2,4,8]
        [--layers 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _child


def child(spec: dict) -> dict:
    """One process's work; times are ``time.time()`` stamps, the parent subtracts."""
    if not spec.get("remember_isa_probe", True):
        os.environ["SIZEBACKEND_REMEMBER_ISA_PROBE"] = "0"
    import torch

    import dynamo_sizebackend as sb
    from dynamo_sizebackend.compile import background

    torch.manual_seed(0)
    sizes = spec["sizes"]
    if spec["model"] == "llama":
        import dataclasses

        from dynamo_sizebackend.models import build_model, config

        cfg = dataclasses.replace(config("tiny"), num_layers=spec["layers"])
        model = build_model(cfg)
        model.allocate_kv_cache(8, 64)

        def inputs(n):
            g = torch.Generator().manual_seed(n)
            return (torch.randint(cfg.vocab_size, (n,), generator=g), torch.arange(n),
                    torch.zeros(n, dtype=torch.long))
    else:
        from dynamo_sizebackend.models.sdpa import TinyTransformer

        model = TinyTransformer(layers=spec["layers"], dim=256, heads=4).eval()

        def inputs(n):
            return (torch.randn(n, 16, 256, generator=torch.Generator().manual_seed(n)),)

    # Llama: one symbolic size, the token count (dynamic=True); SDPA: only the batch
    # dim is dynamic (mark_dynamic on the first call), sequence and width static.
    dynamic = True if spec["model"] == "llama" else None
    if spec["kind"] == "dynamic":
        compiled = torch.compile(model, dynamic=dynamic)
    else:
        options = {"compile_sizes": sizes, "compile_mode": spec.get("mode", "eager")}
        compiled = torch.compile(model, backend="sizebackend", dynamic=dynamic, options=options)
    stamps = {}
    with torch.no_grad():
        for i, n in enumerate([3] + sizes + [max(sizes) + 3]):
            args = inputs(n)
            if spec["model"] == "sdpa" and i == 0:  # only the batch dim is dynamic
                torch._dynamo.decorators.mark_dynamic(args[0], 0)
            compiled(*args)
            if i == 0:
                stamps["first"] = time.time()
        stamps["last"] = time.time()
        for job in list(background.LIVE_JOBS):
            job.join()
        stamps["full_speed"] = time.time()
        # one more round: every listed size now served by its own pieces
        for n in sizes:
            compiled(*inputs(n))
    # The package worker stores the frozen sized pieces for the next start (the
    # default store_frozen): a restart measured next must find them.
    done = sb.wait_for_packages()
    stamps["stored"] = time.time()
    return {"stamps": stamps, "stats": sb.stats().to_dict(),
            "packages": {"stored": done.stored, "present": done.present, "failed": done.failed,
                         "seconds": done.seconds}}


def measure(spec: dict, inductor_dir: str, cache_dir: str) -> dict:
    result, start, end = _child.run(__file__, spec, inductor_dir, cache_dir,
                                    drop_env=("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS",))  # real defaults
    result["process"] = end - start
    for name, stamp in result.pop("stamps").items():
        result[name] = stamp - start
    s = result["stats"]
    print(f"  {spec['label']:<40} first {result['first']:6.1f}s  last served {result['last']:6.1f}s"
          f"  full speed {result['full_speed']:6.1f}s  packages stored {result['stored']:6.1f}s"
          f" ({result['packages']['stored']} built, {result['packages']['failed']} failed)"
          f"  compiles {sum(s['compiles'].values()):3d}"
          f"  hits {s['cache_hits']:3d}  reused {s['reused']:3d}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,sdpa")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warm-repeats", type=int, default=3,
                        help="warm restarts of each, alternated; the best of each counts")
    parser.add_argument("--json", default=None)
    args = _child.parse_or_serve(parser, child, argv)
    if args is None:
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    root = tempfile.mkdtemp(prefix="bench-restart-")
    counter = iter(range(1000))

    def dirs() -> tuple[str, str]:
        n = next(counter)
        return os.path.join(root, f"inductor{n}"), os.path.join(root, f"sizebackend{n}")

    print(f"startup, sizes {sizes}, {args.layers} layers, {os.cpu_count()} CPUs, whole processes")
    results, rows = {}, []
    for model in args.models.split(","):
        def spec(label, kind, **extra):
            return dict(label=f"{model}: {label}", model=model, kind=kind, sizes=sizes,
                        layers=args.layers, **extra)

        ours, theirs = dirs(), dirs()
        r = {
            "cold": measure(spec("sizebackend cold", "sb"), *ours),
            "dynamic_cold": measure(spec("torch.compile cold", "dynamic"), *theirs),
        }
        warm, dynamic_warm, probing = [], [], []
        for i in range(args.warm_repeats):  # alternated; the best of each is reported
            warm.append(measure(spec(f"sizebackend warm restart {i + 1}", "sb"), *ours))
            dynamic_warm.append(measure(spec(f"torch.compile warm restart {i + 1}", "dynamic"),
                                        *theirs))
            probing.append(measure(spec(f"sizebackend warm, ISA probed {i + 1}", "sb",
                                        remember_isa_probe=False), *ours))
        r["warm"] = min(warm, key=lambda x: x["last"])
        r["dynamic_warm"] = min(dynamic_warm, key=lambda x: x["last"])
        r["warm_isa_probed"] = min(probing, key=lambda x: x["last"])
        r["background"] = measure(spec("sizebackend cold, background", "sb", mode="background"),
                                  *dirs())
        results[model] = r
        rows += [
            (f"{model}: warm restart, sizebackend / dynamic=True",
             r["warm"]["last"] / r["dynamic_warm"]["last"], "<= 1.0"),
            (f"{model}: warm, Inductor's ISA probe run (not remembered)",
             r["warm_isa_probed"]["last"] / r["dynamic_warm"]["last"], "(info)"),
            (f"{model}: cold total, sizebackend / dynamic=True",
             r["cold"]["last"] / r["dynamic_cold"]["last"], "<= 3.0"),
            (f"{model}: background first answer / dynamic=True init",
             r["background"]["first"] / r["dynamic_cold"]["first"], "<= 1.1"),
            (f"{model}: background full speed / dynamic=True init",
             r["background"]["full_speed"] / r["dynamic_cold"]["first"], "(info)"),
            (f"{model}: cold, packages stored / dynamic=True init",
             r["cold"]["stored"] / r["dynamic_cold"]["last"], "(info)"),
        ]
    print()
    print(f"  {'ratio':<56} {'value':>6}  target")
    for name, value, target in rows:
        print(f"  {name:<56} {value:6.2f}  {target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "ratios": {n: v for n, v, _ in rows}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
