"""Hugging Face ``generate()`` the way a user runs it: README recipe 1 (``model.forward``
compiled, static cache), real Inductor compiles and the backend's *default* options
(on CPU the sized pieces freeze the weights and autotune their GEMMs), which the rest
of the suite turns off with ``SIZEBACKEND_SIZED_INDUCTOR_OPTIONS={}``.

Before issue 21 the second ``generate()`` at a batch size crashed in a cache-update
kernel of a frozen sized piece: the static cache's ``cumulative_length`` (a tensor of
the cache object the call passes) had been frozen as a constant.
"""
from __future__ import annotations

import pytest
import torch

import dynamo_sizebackend as sb

from .test_hf_generate import counting_forward, generate, prompt, tiny_llama

pytest.importorskip("transformers")

BATCHES = (1, 2, 4)


@pytest.fixture
def real_defaults(monkeypatch):
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")


@pytest.mark.inductor
@torch.no_grad()
def test_generate_with_inductor_and_the_default_options(real_defaults):
    model = tiny_llama()
    scenario = [prompt(n, 0) for n in BATCHES for _ in range(2)]  # two generate() per batch
    expected = [generate(model, inputs, cache_implementation="static") for inputs in scenario]
    model.forward = counting_forward(model, {"compile_sizes": [1, 2, 4]})
    for inputs, want in zip(scenario, expected):
        assert torch.equal(generate(model, inputs, cache_implementation="static"), want)
    s = sb.stats()
    assert s.cache_skips.get("frozen", 0) > 0  # the sized pieces did freeze the weights
    assert "frozen_weights" not in s.fallbacks  # and nothing they froze ever changed
    assert sum(s.calls.values()) == model.forward.calls

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
