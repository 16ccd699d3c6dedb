"""Hugging Face ``generate()`` (README recipe 1: ``model.forward`` compiled, static KV
cache) at several batch sizes: eager, stock ``torch.compile(model.forward)``, the best
native peer (``dynamic=True`` with the tuning the backend gives its sized pieces:
frozen weights + max-autotune with the C++ GEMM template), sizebackend with its
defaults, and the same through ``dynamo_sizebackend.hf.compile_forward`` (the batch dim
marked unbacked: one graph family for every batch, batch 1 on its tuned pieces), in one
interleaved run, tokens compared (issue 19).

The model is a random-weight ``LlamaForCausalLM`` built from a config (nothing is
downloaded). Every variant gets its own copy of it (a frozen variant must not see
another's weights) and its own compile options (two ``torch.compile`` wrappers with
equal options share Dynamo's cache entries on one model class). Each variant first
runs one ``generate()`` per batch (its *init*: every compile happens there); the run
waits for sizebackend's package worker to finish and runs one untimed ``generate()``
per batch in which the backend's runners load the packages it built (its steady
state), then ``--repeat`` rounds, in each of which the variants take turns, one
``generate()`` per batch each (this machine's speed drifts; taking turns makes every
variant see it).

Caches are cold for every variant (fresh ``TORCHINDUCTOR_CACHE_DIR`` and
``SIZEBACKEND_CACHE_DIR`` unless set). Output tok/s = new tokens of all timed rounds /
their seconds; "in forward" = the share of those seconds inside ``model.forward``. A variant that cannot
run says why under "failed" (as ``sizebackend bench`` does), rather than being left out.

    python benchmarks/bench_hf.py [--layers 4] [--hidden 512] [--batches 1,2,4]
        [--new-tokens 24] [--variants eager,stock,dynamic-tuned,sizebackend,sizebackend-unbacked]
        [--repeat 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import types

# Cold for every variant unless the caller points these at kept folders.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-hf-"))
os.environ.setdefault("SIZEBACKEND_CACHE_DIR", tempfile.mkdtemp(prefix="bench-hf-sb-"))

import torch  # noqa: E402

import dynamo_sizebackend as sb  # noqa: E402
import dynamo_sizebackend.hf  # noqa: E402
from dynamo_sizebackend.app import peers  # noqa: E402
from dynamo_sizebackend.app.bench import more_options  # noqa: E402

VARIANTS = ("eager", "stock", "dynamic-tuned", "sizebackend", "sizebackend-unbacked")
#: The backend's variants: each one's share of ``sb.stats()`` is counted apart.
BACKEND = ("sizebackend", "sizebackend-unbacked")
#: The native peer's options: ``sizebackend bench``'s tuned peers' (the tuning of the
#: backend's sized pieces on CPU), with an entry of its own (see the module docstring).
#: Freezing is set around its init: Inductor reads it while Dynamo's compile runs.
_TUNED = {**peers._TUNING, **peers._OWN["dynamic-tuned"]}


def build(layers: int, hidden: int, seed: int = 0):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1,
        eos_token_id=None,  # every generate() makes all its new tokens
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(batch: int, length: int) -> dict:
    ids = torch.randint(3, 8192, (batch, length), generator=torch.Generator().manual_seed(batch))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class Variant:
    """One way of running ``model.generate()``; :meth:`generate` returns the tokens."""

    def __init__(self, name: str, model, sizes: list[int], compiler: str, new_tokens: int,
                 extra: dict | None = None):
        self.name, self.model, self.new_tokens = name, model, new_tokens
        self.tuned = name == "dynamic-tuned" and compiler == "inductor"
        self.autotuned: dict[str, int] = {}
        self.forward_seconds = 0.0  # inside model.forward, while timing
        self.stats: dict[str, object] = {}  # this variant's share of sb.stats()
        self.timing = False
        self.code = None  # the code object Dynamo compiled (its own, see own_code)
        if name == "eager":
            self._time_forward(model.forward)
            return
        # Every compiled variant starts from what a user's one compiled model sees.
        model.forward = own_code(model.forward, name)
        self.code = model.forward.__func__.__code__
        if name in BACKEND:
            options = {**(extra or {}), "compile_sizes": sizes}
            if compiler == "eager":
                options["compiler"] = "eager"
            if name == "sizebackend":
                compiled = torch.compile(model.forward, backend="sizebackend", options=options)
            else:
                # A distinct (default-valued) entry: equal options would share Dynamo's
                # cache entries with the other sizebackend variant.
                compiled = sb.hf.compile_forward(model, {**options, "cudagraphs": False})
        elif compiler == "eager":  # logic checks: Dynamo without codegen
            compiled = torch.compile(model.forward, backend="eager",
                                     dynamic=True if name == "dynamic-tuned" else None)
        elif name == "stock":
            compiled = torch.compile(model.forward)
        else:
            compiled = torch.compile(model.forward, dynamic=True, options=_TUNED)
        self._time_forward(compiled)

    def dynamo_entries(self) -> int | None:
        """How many graphs Dynamo holds for this variant's forward (its cache entries)."""
        if self.code is None:
            return None
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(self.code))

    def _time_forward(self, forward) -> None:
        """``model.forward`` = ``forward``, timed while :attr:`timing`: how much of a
        ``generate()`` the model's forward is (the rest is HF's own Python per step)."""

        @functools.wraps(forward)  # generate() reads forward's signature
        def timed(*args, **kwargs):
            if not self.timing:
                return forward(*args, **kwargs)
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward_seconds += time.perf_counter() - start

        self.model.forward = timed

    def generate(self, inputs: dict, warming: bool = False) -> torch.Tensor:
        if self.name not in BACKEND:
            return self._generate(inputs, warming)
        # Two snapshots inside the timed generate(): microseconds against milliseconds.
        before = sb.stats().to_dict()
        try:
            return self._generate(inputs, warming)
        finally:
            after = sb.stats().to_dict()
            for key in ("graphs", "pieces", "splits", "compiles", "calls", "fallbacks"):
                self.stats[key] = _add(self.stats.get(key), before[key], after[key])

    def _generate(self, inputs: dict, warming: bool) -> torch.Tensor:
        def run():
            return self.model.generate(**inputs, max_new_tokens=self.new_tokens,
                                       do_sample=False, cache_implementation="static")

        if not (self.tuned and warming):
            return run()
        from torch._inductor import config, select_algorithm

        def saw(timings, name, *_):
            self.autotuned[name] = self.autotuned.get(name, 0) + 1

        select_algorithm.add_feedback_saver(saw)
        try:
            with config.patch(freezing=True):
                return run()
        finally:
            select_algorithm.clear_feedback_savers()


def own_code(forward, tag: str):
    """``forward`` (a bound method) as a function with a code object of its own, named
    after ``tag``. Dynamo keys both its compiled entries (stored on the code object) and
    its automatic-dynamic record of which dims changed (``torch._dynamo.pgo``: file,
    line, name) on the code being compiled; every variant compiling the one
    ``LlamaForCausalLM.forward`` would share them: each call's guard lookup walks the
    other variants' entries first, and a variant compiled after another starts from the
    dims that one saw change (its first batch-1 call then traces a dynamic-batch graph,
    where a user's first call traces a static one). Measured on the AMD EPYC family 25
    (2026-12-07): sizebackend compiled after stock's variant made 11 size-1 compiles
    against 16 alone, and Dynamo's lookup took 504 us a call against 356."""
    f = forward.__func__
    name = f"{f.__code__.co_name}_{tag.replace('-', '_')}"
    code = f.__code__.replace(co_name=name, co_qualname=name)
    g = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
    functools.update_wrapper(g, f)  # generate() reads the signature (through __wrapped__)
    g.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(g, forward.__self__)


def _add(total, before, after):
    """``total`` plus the change from ``before`` to ``after`` (ints, or dicts of them)."""
    if isinstance(after, dict):
        total = dict(total or {})
        for key in after:
            total[key] = total.get(key, 0) + after[key] - before.get(key, 0)
        return {key: n for key, n in total.items() if n}
    return (total or 0) + after - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batches", default="1,2,4",
                        help="batch sizes; also sizebackend's compile_sizes")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"a subset of {','.join(VARIANTS)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                        help="eager: Dynamo without codegen (a logic check, not a benchmark)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sb-options", metavar="DICT",
                        help="more options for the sizebackend variants, a Python dict literal "
                             "(e.g. \"{'splitting_ops': []}\": no split)")
    args = parser.parse_args(argv)
    try:
        extra = (more_options(args.sb_options, {"compile_sizes": "--batches",
                                                "cudagraphs": "this script (off)"})
                 if args.sb_options else {})
    except ValueError as e:
        parser.error(f"--sb-options: {e}")
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    if "eager" not in names:
        names.insert(0, "eager")  # the reference tokens
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    inputs = {b: prompt(b, args.prompt) for b in batches}
    base = build(args.layers, args.hidden)
    print(f"HF LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, batches {batches}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"compiler {args.compiler}", flush=True)

    # Each compiled variant has a code object of its own (own_code): Dynamo's recompile
    # limit (8 entries per code object) counts that variant's graphs alone, as it would
    # for a user's one compiled model.
    variants: dict[str, Variant] = {}
    init: dict[str, float] = {}
    failed: dict[str, str] = {}
    reference: dict[int, torch.Tensor] = {}
    tokens_equal: dict[str, bool] = {}
    with torch.no_grad():
        for name in names:
            try:
                v = Variant(name, copy.deepcopy(base), batches, args.compiler, args.new_tokens,
                            extra)
                start = time.perf_counter()
                outs = {b: v.generate(inputs[b], warming=True) for b in batches}
                init[name] = time.perf_counter() - start
            except Exception as e:  # a peer that cannot run says why
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"[{name}] not run: {failed[name]}", flush=True)
                traceback.print_exc(limit=3)
                continue
            if name == "eager":
                reference = outs
            tokens_equal[name] = all(torch.equal(outs[b], reference[b]) for b in batches)
            variants[name] = v
            print(f"[{name}] init {init[name]:.1f} s, tokens equal eager: {tokens_equal[name]}",
                  flush=True)
        # The package worker builds the tuned pieces' packages after sizebackend's init
        # (store_frozen): a server's steady state starts when it is done; timing beside
        # its gcc runs would time the OpenMP regions' waits for a busy core.
        start = time.perf_counter()
        stored = sb.wait_for_packages()
        waited = time.perf_counter() - start
        if any(name in variants for name in BACKEND):
            print(f"[sizebackend] packages stored {waited:.1f} s after the inits "
                  f"({stored.stored} built, {stored.failed} failed)", flush=True)
        # A backend variant's first call at a size after the worker answered (stored, or
        # found present: written by another process) loads that size's packages in place
        # of its JIT pieces (compile/swap.py): one generate() per batch, untimed, so that
        # the rounds time what the server runs from then on.
        # Unsettled, that load fell in the first timed round: on the AMD EPYC family 25
        # (2026-12-07) batch 1's mean fell from about 230 tok/s to 112-146.
        swapped: dict[str, float] = {}
        for name in BACKEND:
            if name in variants and stored.stored + stored.present:
                start = time.perf_counter()
                for b in batches:
                    tokens_equal[name] &= torch.equal(variants[name].generate(inputs[b]),
                                                      reference[b])
                swapped[name] = time.perf_counter() - start
                print(f"[{name}] one generate() per batch with the packages swapped in: "
                      f"{swapped[name]:.2f} s (untimed)", flush=True)
        seconds = {name: 0.0 for name in variants}
        by_batch = {name: {b: 0.0 for b in batches} for name in variants}
        order = list(variants)
        for r in range(args.repeat):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                for b in batches:
                    variants[name].timing = True
                    start = time.perf_counter()
                    out = variants[name].generate(inputs[b])
                    took = time.perf_counter() - start
                    seconds[name] += took
                    by_batch[name][b] += took
                    variants[name].timing = False
                    tokens_equal[name] &= torch.equal(out, reference[b])

    produced = args.repeat * args.new_tokens * sum(batches)
    tok_s = {name: produced / s for name, s in seconds.items()}
    forward_share = {name: v.forward_seconds / seconds[name] for name, v in variants.items()}
    print(f"\n{'variant':<20} {'tok/s':>8} {'init s':>8} {'vs eager':>9} {'vs stock':>9} "
          f"{'tokens':>7} {'in forward':>11}")
    for name in variants:
        vs_stock = f"{tok_s[name] / tok_s['stock']:9.2f}" if "stock" in tok_s else f"{'-':>9}"
        print(f"{name:<20} {tok_s[name]:8.1f} {init[name]:8.1f} {tok_s[name] / tok_s['eager']:9.2f} "
              f"{vs_stock} {'equal' if tokens_equal[name] else 'DIFFER':>7} "
              f"{forward_share[name]:10.0%}")
    print("(in forward: the share of the timed generate() seconds spent inside model.forward;"
          " the rest is generate()'s own work per step)")
    per_batch = {name: {b: args.repeat * args.new_tokens * b / t for b, t in times.items()}
                 for name, times in by_batch.items()}
    print("\nper batch, tok/s" + ("" if "stock" not in per_batch else " (vs stock)"))
    for name in variants:
        cells = []
        for b in batches:
            cell = f"{per_batch[name][b]:7.1f}"
            if "stock" in per_batch:
                cell += f" ({per_batch[name][b] / per_batch['stock'][b]:4.2f})"
            cells.append(f"b={b}: {cell}")
        print(f"{name:<20} " + "   ".join(cells))
    for name, why in failed.items():
        print(f"{name:<20} not run: {why}")
    evidence = {}
    if "dynamic-tuned" in variants and variants["dynamic-tuned"].tuned:
        ops = variants["dynamic-tuned"].autotuned
        frozen = peers.froze(ops)
        evidence["dynamic-tuned"] = {"autotuned_ops": ops, "frozen": frozen}
        print(f"dynamic-tuned autotuned at init: {ops or 'nothing'}; weights frozen (prepacked "
              f"linears): {'yes' if frozen else 'no'}")
    for name in BACKEND:
        if name in variants:
            s = evidence[name] = variants[name].stats
            print(f"{name}: {s['graphs']} graphs, compiles {s['compiles']}, "
                  f"calls {s['calls']}, fallbacks {s['fallbacks']}")
    entries = {name: v.dynamo_entries() for name, v in variants.items() if v.code is not None}
    print("Dynamo graphs per variant (each on a forward code object of its own): "
          + ", ".join(f"{name} {n}" for name, n in entries.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tok_s": tok_s, "init_s": init, "forward_share": forward_share,
                       "tok_s_by_batch": per_batch,
                       "packages_wait_s": waited, "swap_generate_s": swapped,
                       "tokens_equal": tokens_equal,
                       "failed": failed, "evidence": evidence, "dynamo_entries": entries,
                       "config": {k: v for k, v in vars(args).items() if k != "json"}}, f, indent=1)
    return 0 if all(tokens_equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
