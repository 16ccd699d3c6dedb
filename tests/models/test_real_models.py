"""Models not written here: transformers architectures built from tiny configs with random
weights (nothing downloaded), compared with eager at listed and unlisted batch sizes.

The Llama family is in test_hf_llama.py; these add GPT-2 (Conv1D projections, a GELU
with Python-float constants), BERT (an encoder with a padding mask), Mistral and Qwen2
(grouped-query attention, sliding-window and bias variants), a ViT (vision, attention) and
a ResNet (vision, convolutions and batch norm, no attention).
"""
from __future__ import annotations

import pytest
import torch

import dynamo_sizebackend as sb

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ = 8
LAYERS = 2


def _decoder(config_cls, model_cls, **extra):
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa", **extra,
    )
    return model_cls(config)


def gpt2(layers: int = LAYERS):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
        attn_implementation="sdpa",
    ))


BUILDERS = {
    "gpt2": gpt2,
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa",
    ), add_pooling_layer=False),
    "mistral": lambda: _decoder(transformers.MistralConfig, transformers.MistralForCausalLM,
                                sliding_window=4),
    "qwen2": lambda: _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, attn_implementation="sdpa",
    ), add_pooling_layer=False),
    "resnet": lambda: transformers.ResNetModel(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
    )),
}


class TextOut(torch.nn.Module):
    """Token ids in, one tensor out; BERT also gets a padding mask (rows padded at the
    end by different amounts), so its masked attention runs for real."""

    def __init__(self, model, masked: bool):
        super().__init__()
        self.model, self.masked = model, masked

    def forward(self, input_ids):
        if self.masked:
            lengths = SEQ - torch.arange(input_ids.shape[0]) % 3
            mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
            return self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return self.model(input_ids=input_ids, use_cache=False).logits


class ImageOut(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def build(name: str) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    if name in ("vit", "resnet"):
        def inputs(size, seq=SEQ):
            return torch.randn(size, 3, 16, 16, generator=torch.Generator().manual_seed(size))
        return ImageOut(model), inputs

    def inputs(size, seq=SEQ):
        g = torch.Generator().manual_seed(size * 100 + seq)
        return torch.randint(0, VOCAB, (size, seq), generator=g)
    return TextOut(model, masked=name == "bert"), inputs


# Attention calls per forward: one per layer, none in a ResNet.
ATTENTION = {"gpt2": LAYERS, "bert": LAYERS, "mistral": LAYERS, "qwen2": LAYERS,
             "vit": LAYERS, "resnet": 0}


@pytest.mark.parametrize("name", list(BUILDERS))
@torch.no_grad()
def test_real_model_matches_eager(name):
    model, inputs = build(name)
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [2, 4], "compiler": "eager"})
    # Fullgraph: one graph split at every attention into attention + 1 pieces, each
    # compiled for the general shape and for 2 and 4. (The first batch is not 3: duck
    # sizing would tie it to the 3 image channels, which the vision models check, and
    # make the first graph static.)
    pieces = ATTENTION[name] + 1
    with sb.expect(graphs=1, pieces=pieces, splits=ATTENTION[name], fallbacks={},
                   compiles={"dynamic": pieces, 2: pieces, 4: pieces}, calls={"dynamic": 1}):
        out = compiled(inputs(5))
    torch.testing.assert_close(out, model(inputs(5)))
    for size, key in ((4, "4"), (2, "2"), (3, "dynamic")):
        with sb.expect(graphs=0, calls={key: 1}):
            out = compiled(inputs(size))
        torch.testing.assert_close(out, model(inputs(size)))
    if name in ("gpt2", "bert"):  # another sequence length: same graph, same sized pieces
        with sb.expect(graphs=0, calls={"4": 1}):
            out = compiled(inputs(4, seq=SEQ - 3))
        torch.testing.assert_close(out, model(inputs(4, seq=SEQ - 3)))


@torch.no_grad()
def test_real_model_with_default_dynamic_and_batch_one():
    # dynamic=None: the first call is traced static, the second with a new batch size
    # makes the batch dim dynamic (a second graph, now with sized pieces); batch 1 is
    # static again. 3 graphs of 3 pieces.
    model, inputs = build("qwen2")
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [2, 4], "compiler": "eager"})
    with sb.expect(graphs=1, pieces=3, compiles={3: 3}, calls={"3": 1}):
        torch.testing.assert_close(compiled(inputs(3)), model(inputs(3)))
    with sb.expect(graphs=1, pieces=3, compiles={"dynamic": 3, 2: 3, 4: 3}, calls={"4": 1}):
        torch.testing.assert_close(compiled(inputs(4)), model(inputs(4)))
    with sb.expect(graphs=1, calls={"1": 1}):
        torch.testing.assert_close(compiled(inputs(1)), model(inputs(1)))
    with sb.expect(graphs=0, calls={"dynamic": 1}):
        torch.testing.assert_close(compiled(inputs(7)), model(inputs(7)))


@pytest.mark.inductor
@torch.no_grad()
def test_gpt2_through_inductor():
    # GPT-2 passes its attention scale and its GELU's sqrt(2/pi) between pieces as
    # Python floats Dynamo keeps symbolic; Inductor cannot return one from a piece, so
    # the backend passes pinned floats on as constants and has Dynamo specialize the
    # rest. Nothing may fall back to uncompiled pieces.
    torch.manual_seed(0)
    model = TextOut(gpt2(layers=1).eval(), masked=False)
    _, inputs = build("gpt2")
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "compiler": "inductor"})
    for size, key in ((3, "dynamic"), (4, "4")):
        with sb.expect(calls={key: 1}, fallbacks={}):
            out = compiled(inputs(size))
        torch.testing.assert_close(out, model(inputs(size)))
    assert sb.stats().pieces == 2  # 1 attention + 1
