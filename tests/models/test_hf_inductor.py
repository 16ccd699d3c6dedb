"""``model.generate()`` of a tiny HF Llama the way the README's recipe 1 has a user run
it: ``model.forward`` compiled with the backend, a static KV cache, Inductor pieces and
the real default options (on CPU the sized pieces are frozen and autotuned). Issue 21,
case 8: the second ``generate()`` at a batch size crashed ("index out of bounds") in a
frozen sized piece that had frozen the cache's ``cumulative_length``, per-call data.

Tokens are compared with eager ``generate`` of the same model in the same process.
"""
from __future__ import annotations

import functools

import pytest
import torch

import dynamo_sizebackend as sb

transformers = pytest.importorskip("transformers")

NEW = 3  # tokens per generate(): one prefill and NEW - 1 decoding steps
PROMPT = 4


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1,
        eos_token_id=None,  # every generate() runs all NEW steps
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(batch: int) -> dict:
    ids = torch.randint(3, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, inputs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                          cache_implementation="static")


@pytest.mark.inductor
@torch.no_grad()
def test_static_cache_generate_twice_per_batch_with_the_defaults(monkeypatch):
    monkeypatch.delenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS")  # the CPU default: freeze + autotune
    model = tiny_llama()
    batches = [1, 2, 4]
    expected = {b: generate(model, prompt(b)) for b in batches}
    compiled = torch.compile(model.forward, backend="sizebackend",
                             options={"compile_sizes": [1, 2, 4]})
    # wraps: generate() reads forward's signature to choose the kwargs it passes.
    model.forward = functools.wraps(compiled)(lambda *a, **k: compiled(*a, **k))
    for b in batches:
        for _ in range(2):  # the second generate() at a size is the one that crashed
            assert torch.equal(generate(model, prompt(b)), expected[b])
    s = sb.stats()
    assert "frozen_weights" not in s.fallbacks  # nothing frozen changed behind the guard
    assert s.cache_skips.get("frozen", 0) > 0  # the sized pieces were frozen at all
