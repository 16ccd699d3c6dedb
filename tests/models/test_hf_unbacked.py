"""``dynamo_sizebackend.hf.compile_forward``: README recipe 1 with the batch dim marked
unbacked on every forward call, so that one graph family serves every batch of
``generate()`` (static cache), batch 1 included. Pieces compile with ``compiler="eager"``
except in the last test (real Inductor, the default options).

Tokens are compared with eager ``generate()`` of the same model in the same process.
"""
from __future__ import annotations

import subprocess
import sys
import types
from collections import Counter

import pytest
import torch

import dynamo_sizebackend as sb
import dynamo_sizebackend.hf
from dynamo_sizebackend import ops
from dynamo_sizebackend._torch.dynamo import batch_unbacked

from .test_hf_generate import NEW, OPTIONS, counting_forward, generate, prompt, tiny_llama

pytest.importorskip("transformers")

# Batches 2, 1, 4, 3 with same-length prompts, then batch 3 left-padded (row i by i tokens).
SCENARIO = [(2, 0), (1, 0), (4, 0), (3, 0), (3, 1)]


def graph_breaks() -> tuple[Counter, Counter]:
    """Dynamo's record of graph breaks. torch 2.13 leaves ``counters["graph_break"]``
    empty; a break shows as a resumed frame and as the unsupported construct."""
    counters = torch._dynamo.utils.counters
    return Counter(counters["resumes"]), Counter(counters["unimplemented"])


def run(model, forward, scenario, expected) -> sb.StatsSnapshot:
    """``generate()`` every case with ``forward`` as ``model.forward``, tokens checked;
    the backend's stats of this run alone."""
    torch._dynamo.reset()
    sb.reset_stats()
    eager = model.forward
    model.forward = forward
    try:
        for inputs, want in zip(scenario, expected):
            assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    finally:
        model.forward = eager
    return sb.stats()


@torch.no_grad()
def test_one_graph_family_for_every_batch():
    model = tiny_llama()
    scenario = [prompt(*case) for case in SCENARIO]
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]

    backed = run(model, counting_forward(model), scenario, expected)
    breaks = graph_breaks()
    forward = sb.hf.compile_forward(model, OPTIONS)
    unbacked = run(model, forward, scenario, expected)

    assert graph_breaks() == breaks  # none in the unbacked run
    assert forward.calls == len(SCENARIO) * NEW
    # Every call served by one graph (a break would run two or more per call).
    assert sum(unbacked.calls.values()) == forward.calls
    assert sum(backed.calls.values()) == forward.calls
    # Measured (torch 2.13, transformers 5.25). Backed: batch 2's prefill and decode
    # (static: the first size Dynamo sees), batch 1's (static: 0/1 specialization),
    # batch 4's (dynamic), the padded prefill (a mask keyword the others lack): 7.
    # Unbacked: the prefill, the decode and the padded prefill: 3, for every batch.
    assert (backed.graphs, unbacked.graphs) == (7, 3)
    # 1 layer: 2 pieces per graph. Every unbacked graph compiles its pieces for the
    # general shape and for each listed size, 1 included: 3 graphs x 2 pieces per key.
    # A static batch-1 graph would add compiles under "1" alone.
    assert unbacked.compiles == {"dynamic": 6, "1": 6, "2": 6, "4": 6}
    # Backed: 4 static graphs x 2 pieces once, 3 dynamic ones x 2 pieces x 3 (general,
    # "2", "4"; "1" goes to the static graphs): 26.
    assert sum(backed.compiles.values()) == 4 * 2 + 3 * 2 * 3
    # Batch 1's 5 calls ran the size-1 pieces of the unbacked graphs.
    assert unbacked.calls["1"] == NEW
    # Marked per generate(): input_ids and position_ids every call (2 x 5), the mask on
    # the 4 decoding steps (and on the padded prefill), the new cache's keys and values
    # once (from the second call on: the prefill allocates them). 16 x 4 + 17.
    assert forward.marked == 16 * 4 + 17
    print("backed:", backed.to_dict(), "\nunbacked:", unbacked.to_dict())


@torch.no_grad()
def test_batch_one_first_still_one_family():
    """``position_ids`` is marked at batch 1 too: left unmarked, the graphs traced at
    batch 1 were static in it and batch 2 traced 2 more (5 graphs)."""
    model = tiny_llama()
    scenario = [prompt(*case) for case in [(1, 0), (2, 0), (3, 1)]]
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    forward = sb.hf.compile_forward(model, OPTIONS)
    s = run(model, forward, scenario, expected)
    assert s.graphs == 3 and sum(s.calls.values()) == forward.calls == 3 * NEW
    assert s.compiles == {"dynamic": 6, "1": 6, "2": 6, "4": 6}


def test_marks_only_what_carries_the_batch():
    ids, pos = torch.zeros(2, 6, dtype=torch.long), torch.arange(6)[None]  # pos: a broadcast
    cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=None, values=None)])
    kwargs = {"input_ids": ids, "position_ids": pos, "cache": cache, "use_cache": True}
    assert sb.hf.mark_batch((), kwargs) == 1  # input_ids; the cache is not allocated yet
    assert batch_unbacked(ids) and not batch_unbacked(pos)
    # The cache allocated (by the prefill): its tensors are marked once, on first sight.
    cache.layers[0].keys, cache.layers[0].values = torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4)
    assert sb.hf.mark_batch((), {**kwargs, "input_ids": torch.zeros(2, 1, dtype=torch.long)}) == 3
    assert sb.hf.mark_batch((), {**kwargs, "input_ids": torch.zeros(2, 1, dtype=torch.long)}) == 1
    # Positional input_ids, or inputs_embeds, name the batch; a call with neither is not marked.
    assert sb.hf.mark_batch((torch.zeros(3, 1, dtype=torch.long),), {}) == 1
    assert sb.hf.mark_batch((), {"inputs_embeds": torch.zeros(3, 1, 8)}) == 1
    assert sb.hf.mark_batch((), {"attention_mask": torch.zeros(3, 1)}) == 0


def test_importing_hf_does_not_import_transformers():
    code = ("import sys, dynamo_sizebackend.hf; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_with_the_default_options(real_defaults):
    """The sized pieces of the unbacked graphs frozen and autotuned (the CPU default).
    No disk cache: the packages of frozen pieces are test_hf_inductor.py's subject, and
    their build would add a minute after the test."""
    model = tiny_llama()
    scenario = [prompt(2, 0), prompt(1, 0)]
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    forward = sb.hf.compile_forward(model, {"compile_sizes": [1, 2], "cache_dir": None})
    direct = ops.sdpa_counts()[0]
    s = run(model, forward, scenario, expected)
    assert sum(s.calls.values()) == forward.calls == 2 * NEW
    # The one layer's attention, between the pieces, ran the direct SDPA kernel in
    # every call, prefill (a mask over the static cache) and decode alike.
    assert ops.sdpa_counts()[0] - direct == forward.calls
    assert s.calls["1"] == s.calls["2"] == NEW  # both batches on their tuned pieces
    # The prefill and the decode graph, 2 pieces each, for the general shape, 1 and 2.
    assert s.graphs == 2 and s.compiles == {"dynamic": 4, "1": 4, "2": 4}
    print("inductor:", s.to_dict())
