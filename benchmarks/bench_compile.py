"""Compile cost of sizebackend, in one run, as ratios (issue 4).

On the built-in Llama-style model (``dynamo_sizebackend.models``, preset ``tiny`` with
2 and 8 layers), every measure in a fresh process with its own cache folders:

- cold compile (empty Inductor and sizebackend caches), 8 layers / 2 layers: identical
  layers compile once, so depth should cost little (target <= 1.2);
- warm start (a new process, both caches kept) / cold (target <= 0.10), twice: Dynamo
  restarts its analysis when Inductor specializes a float input (the model's RMSNorm
  eps) but not when Inductor's own cache already holds the compiled graph, so the first
  warm process can trace a few pieces differently from the cold one and compile them
  (once: the second warm start finds them); and, for information, a warm start that
  kept only sizebackend's cache (on CPU, loading then rebuilds Inductor's C++ kernels);
- sizebackend cold vs ``torch.compile(dynamic=False)``, which compiles the whole graph
  once per size (target: sizebackend faster);
- time to first output: ``compile_mode="background"`` vs the general shape compiled
  alone (target: no slower), and vs ``compile_mode="eager"``;
- warm restart: sizebackend's warm start against ``torch.compile(dynamic=True)``'s own
  warm start (its cold run, then a new process with its caches kept), same model and
  calls (target <= 1.0). ``--restart-only`` measures just these four;
- the cold/warm pair again under ``torch._dynamo.config.patch(specialize_float=True)``:
  no restarts, so every process traces the same graphs and a warm start finds them all.

"Compile" is the wall time of the calls that compile: one at T=3 tokens (the dynamic
graph: general pieces and every listed size it covers) and one per listed size (size 1
is a graph of its own: Dynamo specializes a dim of 1).

    python benchmarks/bench_compile.py [--sizes 1,2,4,8] [--layers 2,8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _child


def _inputs(torch, vocab: int, tokens: int):
    g = torch.Generator().manual_seed(tokens)
    return (torch.randint(vocab, (tokens,), generator=g), torch.arange(tokens),
            torch.zeros(tokens, dtype=torch.long))


def child(spec: dict) -> dict:
    """One measurement, in this (fresh) process."""
    start = time.perf_counter()
    import contextlib
    import dataclasses

    import torch

    import dynamo_sizebackend as sb
    from dynamo_sizebackend.compile import background
    from dynamo_sizebackend.models import build_model, config

    imported = time.perf_counter() - start
    cfg = dataclasses.replace(config(spec["preset"]), num_layers=spec["layers"])
    model = build_model(cfg)
    model.allocate_kv_cache(8, 64)
    sizes = spec["sizes"]
    if spec["kind"] == "static":
        compiled = torch.compile(model, dynamic=False)
        order = sizes
    elif spec["kind"] == "dynamic":
        compiled = torch.compile(model, dynamic=True)
        order = [3] + sizes
    else:
        options = {"compile_sizes": sizes if spec["kind"] != "general" else [],
                   "compile_mode": spec.get("mode", "eager")}
        compiled = torch.compile(model, backend="sizebackend", dynamic=True, options=options)
        order = [3] + sizes
    times = []
    floats = (torch._dynamo.config.patch(specialize_float=True) if spec.get("specialize_float")
              else contextlib.nullcontext())
    with torch.no_grad(), floats:
        for tokens in order:
            t = time.perf_counter()
            compiled(*_inputs(torch, cfg.vocab_size, tokens))
            times.append(time.perf_counter() - t)
            if spec.get("first_only"):
                break
        t = time.perf_counter()
        for job in list(background.LIVE_JOBS):  # background compiles still running
            job.join()
        background = time.perf_counter() - t
    return {"first": times[0], "compile": sum(times), "background_after": background,
            "import": imported, "stats": sb.stats().to_dict()}


def measure(spec: dict, inductor_dir: str, cache_dir: str) -> dict:
    result, _, _ = _child.run(__file__, spec, inductor_dir, cache_dir)
    s = result["stats"]
    print(f"  {spec['label']:<48} {result['compile']:6.1f}s  first call {result['first']:5.1f}s  "
          f"compiles {sum(s['compiles'].values()):2d} reused {s['reused']:2d} "
          f"hits {s['cache_hits']:2d} misses {s['cache_misses']:2d}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--layers", default="2,8", help="shallow,deep")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--json", default=None)
    parser.add_argument("--restart-only", action="store_true",
                        help="only the warm-restart comparison with dynamic=True")
    args = _child.parse_or_serve(parser, child, argv)
    if args is None:
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    shallow, deep = (int(n) for n in args.layers.split(","))
    root = tempfile.mkdtemp(prefix="bench-compile-")
    fresh = iter(range(100))

    def dirs() -> tuple[str, str]:
        n = next(fresh)
        return os.path.join(root, f"inductor{n}"), os.path.join(root, f"sizebackend{n}")

    def spec(label, layers, kind="sizebackend", **extra):
        return dict(label=label, layers=layers, kind=kind, sizes=sizes, preset=args.preset, **extra)

    print(f"compile cost, preset {args.preset!r}, sizes {sizes}, {os.cpu_count()} CPUs, "
          f"sized_inductor_options from env: "
          f"{os.environ.get('SIZEBACKEND_SIZED_INDUCTOR_OPTIONS', 'auto')}")
    r = {}
    if args.restart_only:
        ours, theirs = dirs(), dirs()
        r["cold_deep"] = measure(spec(f"cold, {deep} layers", deep), *ours)
        r["warm_deep"] = measure(spec(f"warm start, {deep} layers", deep), *ours)
        r["cold_dynamic"] = measure(spec(f"dynamic=True cold, {deep} layers", deep, kind="dynamic"), *theirs)
        r["warm_dynamic"] = measure(spec(f"dynamic=True warm start, {deep} layers", deep, kind="dynamic"), *theirs)
        rows = [("warm start: sizebackend / dynamic=True",
                 r["warm_deep"]["compile"] / r["warm_dynamic"]["compile"], "<= 1.0"),
                ("cold: sizebackend / dynamic=True",
                 r["cold_deep"]["compile"] / r["cold_dynamic"]["compile"], "(info)")]
        _report(rows, r, args.json)
        return 0
    r["cold_shallow"] = measure(spec(f"cold, {shallow} layers", shallow), *dirs())
    deep_dirs = dirs()
    r["cold_deep"] = measure(spec(f"cold, {deep} layers", deep), *deep_dirs)
    r["warm_deep"] = measure(spec(f"warm start, {deep} layers", deep), *deep_dirs)
    r["warm_deep_2"] = measure(spec(f"second warm start, {deep} layers", deep), *deep_dirs)
    dynamic_dirs = dirs()
    r["cold_dynamic"] = measure(spec(f"dynamic=True cold, {deep} layers", deep, kind="dynamic"), *dynamic_dirs)
    r["warm_dynamic"] = measure(spec(f"dynamic=True warm start, {deep} layers", deep, kind="dynamic"),
                                *dynamic_dirs)
    r["warm_ours_only"] = measure(spec(f"warm, Inductor cache emptied, {deep} layers", deep),
                                  dirs()[0], deep_dirs[1])
    r["static_deep"] = measure(spec(f"torch.compile(dynamic=False), {deep} layers", deep,
                                    kind="static"), *dirs())
    r["general_deep"] = measure(spec(f"general shape only, {deep} layers", deep, kind="general",
                                     first_only=True), *dirs())
    r["background_deep"] = measure(spec(f"background mode, {deep} layers", deep,
                                        mode="background"), *dirs())
    # The same cold/warm pair with Dynamo told to specialize floats: no restarts, so
    # every process traces the same graphs (what the model's own fix would give).
    sf_dirs = dirs()
    r["cold_deep_sf"] = measure(spec(f"cold, {deep} layers, specialize_float", deep,
                                     specialize_float=True), *sf_dirs)
    r["warm_deep_sf"] = measure(spec(f"warm start, {deep} layers, specialize_float", deep,
                                     specialize_float=True), *sf_dirs)

    cold, warm = r["cold_deep"]["compile"], r["warm_deep"]["compile"]
    rows = [
        (f"cold {deep} layers / cold {shallow} layers", cold / r["cold_shallow"]["compile"], "<= 1.2"),
        ("warm start / cold", warm / cold, "<= 0.10"),
        ("second warm start / cold", r["warm_deep_2"]["compile"] / cold, "<= 0.10"),
        ("warm start: sizebackend / dynamic=True", warm / r["warm_dynamic"]["compile"], "<= 1.0"),
        ("warm, only our cache kept / cold", r["warm_ours_only"]["compile"] / cold, "(info)"),
        ("sizebackend cold / dynamic=False per size", cold / r["static_deep"]["compile"], "< 1"),
        ("specialize_float: warm start / cold",
         r["warm_deep_sf"]["compile"] / r["cold_deep_sf"]["compile"], "<= 0.10"),
        ("specialize_float: cold / dynamic=False per size",
         r["cold_deep_sf"]["compile"] / r["static_deep"]["compile"], "< 1"),
        ("first output: background / general alone",
         r["background_deep"]["first"] / r["general_deep"]["first"], "<= 1.0"),
        ("first output: background / eager mode",
         r["background_deep"]["first"] / r["cold_deep"]["first"], "(info)"),
    ]
    _report(rows, r, args.json)
    return 0


def _report(rows, results: dict, json_path: str | None) -> None:
    print()
    print(f"  {'ratio':<48} {'value':>6}  target")
    for name, value, target in rows:
        print(f"  {name:<48} {value:6.2f}  {target}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"results": results, "ratios": {n: v for n, v, _ in rows}}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
