"""Hugging Face ``generate()`` the way a user runs it: README recipe 1 (``model.forward``
compiled, static cache), real Inductor compiles and the backend's *default* options
(on CPU the sized pieces freeze the weights and autotune their GEMMs), which the rest
of the suite turns off with ``SIZEBACKEND_SIZED_INDUCTOR_OPTIONS={}``.

Before issue 21 the second ``generate()`` at a batch size crashed in a cache-update
kernel of a frozen sized piece: the static cache's ``cumulative_length`` (a tensor of
the cache object the call passes) had been frozen as a constant. Since issue 18 the
frozen sized pieces are stored as AOTInductor packages, and a restart loads them, on
64-byte aligned copies of their constants (``_torch/aoti.py``).
"""
from __future__ import annotations

import logging

import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import aoti
from dynamo_sizebackend.cache import store
from dynamo_sizebackend.cache.store import DiskCache

from ..spies import count_float_restarts
from .test_hf_generate import counting_forward, generate, prompt, tiny_llama

pytest.importorskip("transformers")

BATCHES = (1, 2, 4)


@pytest.mark.inductor
@torch.no_grad()
def test_generate_with_inductor_and_the_default_options(real_defaults, tmp_path, monkeypatch,
                                                        caplog):
    restarts = count_float_restarts(monkeypatch)
    caplog.set_level(logging.INFO, logger="dynamo_sizebackend")
    model = tiny_llama()
    # Else the defaults; batch 4 runs the general pieces (one tuned size keeps CI short).
    options = {"compile_sizes": [1, 2], "cache_dir": str(tmp_path)}
    scenario = [prompt(n, 0) for n in BATCHES for _ in range(2)]  # two generate() per batch
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    eager_forward = model.forward
    model.forward = counting_forward(model, options)
    for inputs, want in zip(scenario, expected):
        assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    s = sb.stats()
    # The sized pieces froze the weights; the package worker stored them (issue 18).
    assert sb.wait_for_packages(timeout=600).pending == 0
    packages = [e for e in DiskCache(str(tmp_path)).entries()[0] if e.kind == "aot"]
    assert packages and s.cache_misses >= len(packages)
    assert "frozen_weights" not in s.fallbacks  # and nothing they froze ever changed
    assert sum(s.calls.values()) == model.forward.calls
    # No frame was traced twice to turn a float into a constant.
    assert restarts == [] and "trace again" not in caplog.text

    # A restart (what a new process starts without): every stored sized piece loads;
    # only the pieces that were never stored compile again (batch 1's graph of its own
    # has tuned size-1 pieces too): frozen ones that write the
    # static cache (torch 2.13's AOTInductor with freezing drops writes to inputs, so they
    # are never packaged) and the untuned size-2 pieces of the prefill graph, whose rows
    # (batch x prompt length) stay symbolic (compile/rows.py) and whose compile added shape
    # guards (cache_skips["guards"]). Tokens identical.
    torch._dynamo.reset()
    store.forget_shared()
    model.forward = eager_forward
    model.forward = counting_forward(model, options)
    loads = []  # every package the restart loads runs on aligned constants (_torch/aoti.py)
    load_aligned = aoti.load_aligned

    def recorded(path):
        loads.append(load_aligned(path))
        return loads[-1]

    monkeypatch.setattr(aoti, "load_aligned", recorded)
    before = sb.stats()
    for inputs, want in zip(scenario[::2], expected[::2]):
        assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    after = sb.stats()
    recompiled = sum(after.compiles.get(k, 0) - before.compiles.get(k, 0) for k in ("1", "2"))
    unstored = sum(after.cache_skips.get(k, 0) - before.cache_skips.get(k, 0) for k in ("frozen", "guards"))
    assert recompiled == unstored, (after.compiles, after.cache_skips)
    assert after.cache_hits - before.cache_hits >= len(packages)
    assert loads and all(isinstance(p, aoti.AlignedCpuPackage) for p in loads), loads
    assert "aot_unaligned" not in after.fallbacks

    # Weights reloaded in place after compiling (a new checkpoint): every frozen size
    # sees it once and recompiles; tokens follow the new weights.
    torch.manual_seed(1)
    fresh = {k: torch.randn_like(v) * 0.02 for k, v in model.state_dict().items()}
    reference = tiny_llama()
    reference.load_state_dict(fresh)
    model.load_state_dict(fresh)
    inputs = prompt(2, 0)
    want = generate(reference, inputs, cache_implementation="static")
    assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    assert sb.stats().fallbacks.get("frozen_weights", 0) >= 1
