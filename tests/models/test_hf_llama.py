"""A HuggingFace transformers Llama built from a tiny config (random weights, no hub)."""
import pytest
import torch

import dynamo_sizebackend as sb

transformers = pytest.importorskip("transformers")

UNLISTED = [3, 5]
SEQ = 8


def tiny_llama(layers: int):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def ids(size: int) -> torch.Tensor:
    return torch.randint(0, 128, (size, SEQ), generator=torch.Generator().manual_seed(size))


class Logits(torch.nn.Module):
    """Tensor in, tensor out: the logits of a forward without KV cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.mark.parametrize(
    "compiler, layers, listed",
    [
        ("eager", 2, [2, 4]),
        # Inductor compiles cost ~15 s a piece on 2 cores: one layer, one listed size.
        pytest.param("inductor", 1, [4], marks=pytest.mark.inductor),
    ],
)
@torch.no_grad()
def test_tiny_llama_counts_and_numerics(compiler, layers, listed):
    model = Logits(tiny_llama(layers))
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": listed, "compiler": compiler})
    with sb.expect(graphs=1):
        out = compiled(ids(listed[0]))
    torch.testing.assert_close(out, model(ids(listed[0])))
    s = sb.stats()
    # One SDPA call per decoder layer -> layers + 1 pieces and `layers` split ops.
    pieces = layers + 1
    assert (s.graphs, s.pieces, s.splits) == (1, pieces, layers)
    # Every piece once for the general shape and once per listed size (a piece identical
    # to one already compiled may be served by it: counted as reused, not compiled).
    assert sum(s.compiles.values()) + s.reused == pieces * (len(listed) + 1)
    if compiler == "eager":
        assert s.compiles == {"dynamic": pieces, **{str(n): pieces for n in listed}}
    for size in listed + UNLISTED:
        key = str(size) if size in listed else "dynamic"
        with sb.expect(calls={key: 1}, graphs=0):
            out = compiled(ids(size))
        torch.testing.assert_close(out, model(ids(size)), rtol=1e-4, atol=1e-4)
    print("tiny llama stats:", sb.stats().to_dict())
