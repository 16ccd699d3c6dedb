"""Which Inductor settings make a sized piece earn its compile: one interleaved run.

Per-call latency at listed sizes of sizebackend with each candidate for
``sized_inductor_options`` (the general pieces keep Inductor's defaults), next to eager,
``torch.compile(dynamic=True)`` and ``torch.compile(dynamic=False)``, every variant
timed call by call in rotating order (see ``bench_latency.interleaved``). Ratios are
against ``dynamic=False``; every output is checked against eager first.

    python benchmarks/bench_tuning.py [--model llama-small | sdpa] [--sizes 2,4,8]
                                      [--candidates default,freeze,...] [--json out.json]
                                      [--peers specialize-tuned,...]
                                      [--winners winners.json] [--packaged]

Candidates (``--candidates``, comma-separated; ``all`` for every one):
  none           {}: sized pieces compiled like the general ones
  cpp_wrapper    Inductor's C++ wrapper instead of its Python one
  autotune       max-autotune with the C++ GEMM template, weights still inputs
  freeze         constant (frozen, prepacked) weights
  freeze+autotune   both (the CPU default until 2026-12-06)
  freeze+concat  constant weights with q/k/v and gate/up linears concatenated
  freeze+autotune+concat   all three: the CPU default (options.SIZED_DEFAULTS["cpu"])
  freeze+autotune+cpp_wrapper   the CPU default with Inductor's C++ wrapper
  freeze+autotune+grouped   the CPU default with Inductor's grouped GEMM template
  freeze+autotune-full   the CPU default with Inductor's full GEMM search
                 (``prune_autotune=False``): what pruning costs in speed, and saves in
                 compile time
  python-forward the CPU default with ``direct_calls=False``: with ``--packaged``, the
                 pieces called from Python rather than as one C++ chain
                 (``runtime/chain.py``)
  unsplit        the CPU default with ``splitting_ops=[]``: each size one piece, attention
                 inside it; what the split costs

``--packaged``: every candidate's frozen pieces are built as AOT packages (``cache_dir``
a fresh folder, ``store_frozen="inline"``): what a server restarted on a warm cache
runs. Without it (the default) they are JIT compiles, what a cold start runs.

``--winners FILE``: every GEMM candidate's autotune time (the full search), per shape,
printed and written to FILE: the measurement behind ``_torch/autotune.py``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-tuning-"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dynamo_sizebackend as sb  # noqa: E402
from bench_latency import interleaved  # noqa: E402
from dynamo_sizebackend._torch import autotune  # noqa: E402
from dynamo_sizebackend.app.peers import PEERS, PeerForward  # noqa: E402
from dynamo_sizebackend.models import build_model  # noqa: E402
from dynamo_sizebackend.models.sdpa import TinyTransformer  # noqa: E402
from dynamo_sizebackend.options import SIZED_DEFAULTS  # noqa: E402

GEMM = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
CANDIDATES = {
    "none": {},
    "cpp_wrapper": {"cpp_wrapper": True},
    "autotune": dict(GEMM),
    "freeze": {"freezing": True},
    # The CPU default before 2026-12-06 evening: without concatenated linears.
    "freeze+autotune": {k: v for k, v in SIZED_DEFAULTS["cpu"].items()
                        if k != "cpp.enable_concat_linear"},
    "freeze+concat": {"freezing": True, "cpp.enable_concat_linear": True},
    "freeze+autotune-full": dict(SIZED_DEFAULTS["cpu"]),
    "freeze+autotune+cpp_wrapper": {**SIZED_DEFAULTS["cpu"], "cpp_wrapper": True},
    "freeze+autotune+concat": dict(SIZED_DEFAULTS["cpu"]),
    "freeze+autotune+grouped": {**SIZED_DEFAULTS["cpu"], "cpp.enable_grouped_gemm_template": True},
    "python-forward": dict(SIZED_DEFAULTS["cpu"]),
    "unsplit": dict(SIZED_DEFAULTS["cpu"]),
}
#: Backend options a candidate sets besides its Inductor patches.
BACKEND_OPTIONS = {"freeze+autotune-full": {"prune_autotune": False},
                   "python-forward": {"direct_calls": False},
                   "unsplit": {"splitting_ops": []}}


def build(name: str, dim: int, layers: int, seq: int):
    """The model and ``inputs(n)`` giving the arguments of a call at batch ``n``."""
    if name == "sdpa":
        model = TinyTransformer(layers, dim, 4, mlp_ratio=4).eval()
        return model, lambda n: (torch.randn(n, seq, dim, generator=torch.Generator().manual_seed(n)),)
    model = build_model(name.split("-", 1)[1])
    model.allocate_kv_cache(4, 256)

    def inputs(n):  # n tokens, one per decoding sequence: a decode step
        ids = torch.randint(model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        return ids, torch.arange(n) % 256, torch.zeros(n, dtype=torch.long)

    return model, inputs


def marked(args: tuple) -> tuple:
    """Copies whose batch dim alone is dynamic (the README's marking)."""
    out = []
    for t in args:
        t = t.clone()
        torch._dynamo.mark_dynamic(t, 0)
        out.append(t)
    return tuple(out)


def record_autotune() -> list[dict]:
    """Every autotuned GEMM's candidates and times, appended as Inductor reports them."""
    from torch._inductor import select_algorithm

    rows: list[dict] = []

    def saver(timings, name, input_nodes, *rest):
        out = next(iter(timings)).layout.size
        rows.append({"op": name, "rows": int(torch.tensor([int(d) for d in out[:-1]]).prod()),
                     "k": int(input_nodes[0].get_size()[-1]), "n": int(out[-1]),
                     "us": {("aten" if autotune._is_aten(c) else "template"): float(t) * 1e3
                            for c, t in timings.items()}})

    select_algorithm.add_feedback_saver(saver)
    return rows


def report_winners(rows: list[dict], path: str) -> None:
    shapes = {(r["rows"], r["k"], r["n"]): r["us"] for r in rows}  # repeats: one per shape
    print("\nautotune: per GEMM shape, ATen / template time (> 1: the template wins)")
    print(f"{'rows':>6} {'k':>6} {'n':>6} {'aten us':>9} {'template us':>12} {'ratio':>7}")
    for (m, k, n), us in sorted(shapes.items()):
        if "aten" in us and "template" in us:
            print(f"{m:6d} {k:6d} {n:6d} {us['aten']:9.1f} {us['template']:12.1f} "
                  f"{us['aten'] / us['template']:7.2f}")
    with open(path, "w") as f:
        json.dump([{"rows": m, "k": k, "n": n, "us": us} for (m, k, n), us in sorted(shapes.items())],
                  f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-small", help="sdpa, or llama-<preset>")
    p.add_argument("--dim", type=int, default=128, help="sdpa only")
    p.add_argument("--layers", type=int, default=2, help="sdpa only")
    p.add_argument("--seq", type=int, default=16, help="sdpa only")
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--candidates", default="none,freeze,freeze+autotune")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peers", default="",
                   help=f"comma-separated peers to time beside ({', '.join(PEERS)}), "
                        "each with the batch dim alone marked")
    p.add_argument("--packaged", action="store_true",
                   help="frozen pieces as AOT packages (a warm restart), not JIT compiles")
    p.add_argument("--json")
    p.add_argument("--winners", metavar="FILE",
                   help="record every GEMM candidate's autotune time (the full search: "
                        "prune_autotune=False) and print which kind won at each row count")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch._dynamo.config.recompile_limit = 64  # dynamic=False compiles once per size
    sizes = [int(s) for s in a.sizes.split(",")]
    names = list(CANDIDATES) if a.candidates == "all" else a.candidates.split(",")
    model, inputs = build(a.model, a.dim, a.layers, a.seq)

    peers = [name for name in a.peers.split(",") if name]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {unknown}; pick from {list(PEERS)}")
    variants = {  # name: (callable, its inputs: "plain", "marked", or a peer's name: its copies)
        "eager": (model, "plain"),
        "dynamic=True": (torch.compile(model, dynamic=True), "plain"),
        "dynamic=False": (torch.compile(model, dynamic=False), "plain"),
    }
    # One folder for the run: candidates with the same Inductor settings share packages.
    packages = tempfile.mkdtemp(prefix="bench-tuning-sb-") if a.packaged else None
    for name in names:
        options = {"compile_sizes": sizes, "cache_dir": packages,
                   "store_frozen": "inline",
                   "sized_inductor_options": CANDIDATES[name], **BACKEND_OPTIONS.get(name, {})}
        if a.winners:
            options["prune_autotune"] = False
        variants[f"sb {name}"] = (torch.compile(model, backend="sizebackend", options=options), "marked")
    for name in peers:  # each its own copies: a peer marks the tensors of its first call
        variants[name] = (PeerForward(name, model, sizes, batch_only=True), name)

    timings = record_autotune() if a.winners else None
    plain = {n: inputs(n) for n in sizes}
    feeds = {"plain": plain, "marked": {n: marked(plain[n]) for n in sizes},
             **{name: {n: tuple(t.clone() for t in plain[n]) for n in sizes} for name in peers}}
    compile_s: dict[str, float] = {}
    results: dict[str, dict[int, float]] = {name: {} for name in variants}
    with torch.inference_mode():
        reference = {n: model(*plain[n]) for n in sizes}
        for name, (fn, feed) in variants.items():
            start = time.perf_counter()
            # Largest first: a first call at batch 1 traces batch 1 static (Dynamo's 0/1
            # specialization), and a specialize_on peer then fails inside Dynamo
            # (InternalTorchDynamoError: the size source "is not in list", torch 2.13).
            for n in sorted(sizes, reverse=True):
                out = fn(*feeds[feed][n])
                torch.testing.assert_close(out, reference[n], rtol=1e-4, atol=1e-4)
            compile_s[name] = time.perf_counter() - start
            if isinstance(fn, PeerForward):
                fn.warming = False
                print(f"# {name}: {fn.evidence()}", file=sys.stderr)
            print(f"# {name}: first calls (compiles) {compile_s[name]:.1f}s", file=sys.stderr, flush=True)
        for n in sizes:
            calls = {name: functools.partial(fn, *feeds[feed][n])
                     for name, (fn, feed) in variants.items()}
            for name, seconds in interleaved(calls, a.iters).items():
                results[name][n] = seconds * 1e6

    print(f"\n{a.model}: median us per call (ratio to dynamic=False), {a.threads} thread(s), "
          f"{a.iters} interleaved calls")
    print(f"{'variant':>20} " + " ".join(f"{'n=' + str(n):>17}" for n in sizes) + f" {'first calls s':>14}")
    for name in variants:
        cells = " ".join(
            f"{results[name][n]:9.1f} ({results[name][n] / results['dynamic=False'][n]:.3f})" for n in sizes
        )
        print(f"{name:>20} {cells} {compile_s[name]:14.1f}")
    for peer in peers:
        for name in [v for v in variants if v.startswith("sb ")]:
            print(f"{name} / {peer}: " + ", ".join(
                f"n={n} {results[name][n] / results[peer][n]:.3f}" for n in sizes))
    if timings is not None:
        report_winners(timings, a.winners)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"us": results, "first_calls_s": compile_s, "stats": sb.stats().to_dict()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
