"""The tensor-parallel Llama on 2 gloo ranks: against the one-process reference model.

Each test spawns its ranks (``ranks.run_ranks``) with a deadline, so a rank stuck in a
collective fails the test instead of stalling CI. The rank functions below run in
those processes; they return plain data that the test asserts on. The reference is
``build_model`` with the same seed, run in each rank's own process.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from .ranks import run_ranks

NUM_SLOTS, MAX_LEN = 4, 32
LISTED = [2, 4]
# Prompts of 5 and 3 tokens: the prefill is T=8 (unlisted), every decode step T=2 (listed).
PROMPTS = [[11, 200, 7, 42, 99], [3, 150, 60]]
NEW_TOKENS = 6


def _models(layers=2, **compile_options):
    """(reference model, this rank's shard, the shard compiled) of the tiny preset with
    ``layers`` layers, caches allocated."""
    from dynamo_sizebackend.models import build_model, config
    from dynamo_sizebackend.models.llama_tp import build_tp_model

    cfg = dataclasses.replace(config("tiny"), num_layers=layers)
    reference = build_model(cfg, seed=0)
    shard = build_tp_model(cfg, seed=0)
    for m in (reference, shard):
        m.allocate_kv_cache(NUM_SLOTS, MAX_LEN)
    compiled = torch.compile(shard, backend="sizebackend", options=compile_options)
    return reference, shard, compiled


def _steps():
    """(input_ids, positions, slots) of calls at T = 8, 4, 3, 2 (slots 2 and 3: the
    generation below uses 0 and 1)."""
    generator = torch.Generator().manual_seed(1)
    steps = []
    position = 0
    for t in (8, 4, 3, 2):
        steps.append((torch.randint(256, (t,), generator=generator),
                      torch.arange(position, position + t) % MAX_LEN,
                      torch.full((t,), 2 + t % 2, dtype=torch.long)))
        position += t
    return steps


def _mark(step):
    from torch._dynamo.decorators import mark_unbacked

    for x in step:  # one graph for every T (see README "How sizes reach the backend")
        mark_unbacked(x, 0)


def greedy(forward, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> list[list[int]]:
    """Greedy generation of ``prompts`` in slots 0, 1, ...: one prefill call of all
    prompts, then one decode call per token for all sequences together."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    slots = torch.tensor([s for s, p in enumerate(prompts) for _ in p])
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [[] for _ in prompts]
    logits = forward(ids, positions, slots)
    for step in range(new_tokens):
        tokens = logits[last].argmax(-1)
        for seq, token in zip(out, tokens.tolist()):
            seq.append(token)
        if step == new_tokens - 1:
            break
        positions = torch.tensor([len(p) + step for p in prompts])
        slots = torch.arange(len(prompts))
        logits = forward(tokens, positions, slots)
        last = torch.arange(len(prompts))
    return out


def _spy_pieces(fail_sizes=()):
    """Record the ops of every general piece the eager adaptor compiles, and raise for
    ``fail_sizes`` (an injected compile failure on this rank only)."""
    from dynamo_sizebackend.compile import adaptor

    real = adaptor.EagerAdaptor.compile
    pieces: list[list[str]] = []

    def compile(self, gm, example_inputs, runtime_size, fake_mode=None):
        if runtime_size in fail_sizes:
            raise RuntimeError(f"injected failure at size {runtime_size}")
        if runtime_size is None:
            pieces.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return real(self, gm, example_inputs, runtime_size, fake_mode)

    adaptor.EagerAdaptor.compile = compile
    return pieces


def _collectives(ops: list[str]) -> dict[str, int]:
    names = [op.split(".")[-1] for op in ops if "_c10d_functional" in op]
    return {name: names.count(name) for name in sorted(set(names))}


# --- rank functions (run in the spawned processes) ----------------------------------


def _eager_compiler_runs(rank, world_size):
    """Two compiles of the shard on both ranks: first alike, then with size 4 failing
    to compile on rank 1 only. Each: the steps and a generation against the reference."""
    import dynamo_sizebackend as sb
    from dynamo_sizebackend.compile import adaptor

    real = adaptor.EagerAdaptor.compile
    runs = {}
    for name, fail in (("alike", ()), ("size_4_fails_on_rank_1", {4} if rank == 1 else ())):
        adaptor.EagerAdaptor.compile = real
        torch._dynamo.reset()
        pieces = _spy_pieces(fail)
        reference, _, compiled = _models(compile_sizes=LISTED, compiler="eager")
        sb.reset_stats()
        steps = _steps()
        _mark(steps[0])
        with torch.no_grad():
            for step in steps:
                torch.testing.assert_close(compiled(*step), reference(*step))
            tokens = greedy(compiled)
            expected_tokens = greedy(reference)
        runs[name] = {"tokens": tokens, "expected_tokens": expected_tokens,
                      "stats": sb.stats().to_dict(), "pieces": [_collectives(p) for p in pieces],
                      "differences": sb.compare_ranks().differences}
    return runs


def _strict_failure(rank, world_size):
    _spy_pieces({4} if rank == 1 else ())
    _, _, compiled = _models(compile_sizes=[4], compiler="eager", strict=True)
    step = _steps()[1]  # T=4
    _mark(step)
    with torch.no_grad():
        compiled(*step)
    return "ran"


def _inductor_shared_cache(rank, world_size, cache_dir):
    """Cold, then warm from the same folder (Dynamo and the in-memory artifacts reset),
    on both ranks at once; sized pieces frozen, each rank's package its own."""
    import dynamo_sizebackend as sb
    from dynamo_sizebackend.cache import store

    reference, _, compiled = _models(
        layers=1, compile_sizes=[4], cache_dir=cache_dir, store_frozen="inline",
        sized_inductor_options={"freezing": True})
    steps = [s for s in _steps() if len(s[0]) in (4, 3)]  # listed and unlisted
    runs = []
    for _ in ("cold", "warm"):
        torch._dynamo.reset()
        store._SHARED.clear()
        sb.reset_stats()
        _mark(steps[0])
        with torch.no_grad():
            for step in steps:
                torch.testing.assert_close(compiled(*step), reference(*step),
                                           atol=1e-4, rtol=1e-4)
        runs.append(sb.stats().to_dict())
    return runs


# --- tests --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager_runs():
    """One spawn of 2 ranks for the two tests below (each spawn costs seconds)."""
    return run_ranks(_eager_compiler_runs, timeout=150)


def test_two_ranks_match_the_reference_at_listed_and_unlisted_sizes(eager_runs):
    for rank, runs in eager_runs.items():
        got = runs["alike"]
        # The steps run T = 8, 4, 3, 2; the generation a prefill (T=8) and 5 decodes (T=2).
        assert got["tokens"] == got["expected_tokens"], rank
        s = got["stats"]
        # mark_unbacked: one graph; 2 layers -> 3 pieces and 2 attention splits; general
        # pieces and sizes 2 and 4 compile each piece: 3 x 3.
        assert (s["graphs"], s["pieces"], s["splits"]) == (1, 3, 2)
        assert s["compiles"] == {"dynamic": 3, "2": 3, "4": 3}
        assert s["calls"] == {"dynamic": 3, "4": 1, "2": 6}
        assert s["fallbacks"] == {}
        # The collectives are inside the compiled pieces, never a split: an all-reduce
        # after o_proj and after down_proj of each layer, the all-gather of the logits last.
        assert got["pieces"] == [{}, {"all_reduce": 2, "wait_tensor": 2},
                                 {"all_gather_into_tensor": 1, "all_reduce": 2, "wait_tensor": 3}]
        assert got["differences"] == []


def test_a_size_that_fails_on_one_rank_is_served_by_its_general_pieces(eager_runs):
    # Rank 1 cannot compile size 4: it serves T=4 with the general pieces, which hold the
    # same collectives in the same order as rank 0's sized program, so both stay right.
    got = {rank: runs["size_4_fails_on_rank_1"] for rank, runs in eager_runs.items()}
    for one in got.values():
        assert one["tokens"] == one["expected_tokens"]
    assert got[0]["stats"]["calls"] == {"dynamic": 3, "4": 1, "2": 6}
    assert got[0]["stats"]["fallbacks"] == {}
    assert got[1]["stats"]["calls"] == {"dynamic": 4, "2": 6}
    assert got[1]["stats"]["fallbacks"] == {"4": 1}
    assert got[1]["stats"]["compiles"] == {"dynamic": 3, "2": 3}
    # Both ranks see the same report, naming what differs.
    expected = ["calls['4']: rank 0: 1, rank 1: 0", "calls['dynamic']: rank 0: 3, rank 1: 4",
                "fallbacks['4']: rank 0: 0, rank 1: 1"]
    assert got[0]["differences"] == got[1]["differences"] == expected


def test_strict_failure_on_one_rank_fails_every_rank_rather_than_hanging():
    # strict=True: rank 1 raises SizeCompileError before its first collective and exits;
    # rank 0, blocked in its first all-reduce, gets an error from gloo instead of waiting
    # for ever (the process group's timeout bounds it otherwise).
    results = run_ranks(_strict_failure, timeout=90, pg_timeout=30, raise_errors=False)
    status, text = results[1]
    assert status == "error" and text.startswith("SizeCompileError"), text
    status, text = results[0]
    assert status == "error", text
    assert "SizeCompileError" not in text.splitlines()[0]


@pytest.mark.inductor
def test_inductor_ranks_on_one_cache_dir_load_only_their_own_frozen_pieces(tmp_path):
    cache_dir = str(tmp_path / "cache")
    results = run_ranks(_inductor_shared_cache, cache_dir, timeout=300)
    cold = [results[r][0] for r in (0, 1)]
    warm = [results[r][1] for r in (0, 1)]
    for s in cold:
        # One graph of one layer: 2 pieces around 1 attention split; T=4 listed, T=3 general.
        assert (s["graphs"], s["pieces"], s["splits"]) == (1, 2, 1)
        assert s["calls"] == {"4": 1, "dynamic": 1}
        assert s["fallbacks"] == {}
        # Size 4's pieces are frozen with this rank's shard: always its own compiles. The
        # first (q/k/v: no collective) is an AOT package built in the rank; the second
        # holds the all-reduces and the all-gather: the JIT path, not stored.
        assert s["compiles"]["4"] == 2
        assert s["cache_skips"] == {"frozen": 1}
    # The general pieces take the weights as inputs: the same code on both ranks, shared
    # through the folder (whichever rank got a piece's lock first compiled it).
    assert sum(s["compiles"].get("dynamic", 0) for s in cold) == 2
    assert sum(s["cache_hits"] for s in cold) == 2
    for s in warm:
        # Loaded: its own package and the 2 shared general pieces; the numerics checked
        # in the rank show that no rank loaded the other's shard. The collective piece
        # compiles again.
        assert s["compiles"] == {"4": 1} and s["cache_hits"] == 3
        assert s["cache_skips"] == {"frozen": 1}
        assert s["calls"] == {"4": 1, "dynamic": 1}
    entries = os.listdir(os.path.join(cache_dir, "pieces-v1"))
    assert len([e for e in entries if e.endswith(".sbart")]) == 2 + 2 * 1
