"""The built-in Llama-style model: determinism, cache semantics end to end, torch.compile."""

from __future__ import annotations

import pytest
import torch

from dynamo_sizebackend import ops
from dynamo_sizebackend.models import LlamaConfig, build_model, config

NUM_SLOTS, MAX_LEN = 4, 32


def serving_steps(vocab_size: int, seed: int = 0):
    """(input_ids, positions, slots) of four calls of a small serving loop:
    two prefills together (T=8), decodes mixed with a third prefill (T=4), three decodes
    (T=3), one decode (T=1)."""
    generator = torch.Generator().manual_seed(seed)
    layout = [
        ([0] * 5 + [2] * 3, [0, 1, 2, 3, 4, 0, 1, 2]),
        ([0, 2, 1, 1], [5, 3, 0, 1]),
        ([0, 2, 1], [6, 4, 2]),
        ([2], [5]),
    ]
    return [
        (
            torch.randint(vocab_size, (len(slots),), generator=generator),
            torch.tensor(positions),
            torch.tensor(slots),
        )
        for slots, positions in layout
    ]


def run(model, steps):
    return [model(*step) for step in steps]


def fresh(name="tiny", **kwargs):
    model = build_model(name, **kwargs)
    model.allocate_kv_cache(NUM_SLOTS, MAX_LEN)
    return model


def assert_caches_equal(model, other, **tolerance):
    for layer, other_layer in zip(model.layers, other.layers, strict=True):
        torch.testing.assert_close(
            layer.self_attn.k_cache, other_layer.self_attn.k_cache, **tolerance
        )
        torch.testing.assert_close(
            layer.self_attn.v_cache, other_layer.self_attn.v_cache, **tolerance
        )


def test_presets_and_config_validation():
    tiny = config("tiny")
    assert tiny.head_dim * tiny.num_heads == tiny.hidden_size
    assert tiny.num_heads % tiny.num_kv_heads == 0
    with pytest.raises(ValueError, match="did you mean 'small'"):
        config("smal")
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        LlamaConfig(
            vocab_size=8,
            hidden_size=16,
            intermediate_size=8,
            num_layers=1,
            num_heads=4,
            num_kv_heads=3,
        )


def test_same_seed_same_model():
    steps = serving_steps(config("tiny").vocab_size)[:1]
    first, second, other = fresh(seed=0), fresh(seed=0), fresh(seed=1)
    logits = run(first, steps)[0]
    assert logits.shape == (8, config("tiny").vocab_size)
    torch.testing.assert_close(run(second, steps)[0], logits, atol=0, rtol=0)
    assert not torch.allclose(run(other, steps)[0], logits)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_rotary_tables_are_accurate_in_every_process(preset):
    # Frozen into the sized pieces and hashed by the cache key: computed by parallel
    # ATen ops, some processes got half the table at low precision (errors up to 1.5e-4,
    # MKL VML's first-call dispatch race) and then missed the cache. Computed in blocks
    # on the calling thread they match float64 to float32 rounding.
    model = build_model(config(preset))
    cfg, rotary = model.config, model.rotary
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** half
    angles = torch.arange(cfg.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1).double()
    assert rotary.cos.shape == angles.shape and rotary.cos.numel() > 2048  # several blocks
    torch.testing.assert_close(rotary.cos.double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.sin.double(), angles.sin(), rtol=0, atol=1e-6)


def test_forward_needs_a_cache():
    model = build_model("tiny")
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model(*serving_steps(config("tiny").vocab_size)[0])


def test_op_matches_reference_attention():
    # The same weights with plain-PyTorch attention: every step's logits and the final
    # caches must agree.
    steps = serving_steps(config("tiny").vocab_size)
    model, reference = fresh(), fresh(attention_fn=ops.attention_reference)
    for logits, expected in zip(run(model, steps), run(reference, steps), strict=True):
        torch.testing.assert_close(logits, expected)
    assert_caches_equal(model, reference)


def test_incremental_decode_equals_one_shot_prefill():
    # Cache semantics end to end: a token's logits must not depend on whether its
    # predecessors came in earlier calls (through the cache) or in the same call.
    steps = serving_steps(config("tiny").vocab_size)
    incremental = torch.cat(run(fresh(), steps))
    ids, positions, slots = (torch.cat(parts) for parts in zip(*steps, strict=True))
    one_shot = fresh()(ids, positions, slots)
    torch.testing.assert_close(incremental, one_shot)


def test_bfloat16_model_runs_close_to_float32():
    steps = serving_steps(config("tiny").vocab_size)[:2]
    logits32 = torch.cat(run(fresh(), steps))
    logits16 = torch.cat(run(fresh(dtype=torch.bfloat16), steps))
    assert logits16.dtype == torch.bfloat16
    # A coarse bound: bf16 weights and activations through two layers.
    torch.testing.assert_close(logits16.float(), logits32, atol=0.15, rtol=0.1)


def test_matches_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    model = fresh()
    cfg = model.config
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_eps,
            rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    ).eval()
    # Same names except Hugging Face's "model." prefix on everything but lm_head.
    state = {
        (k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, strict=True)

    ids = torch.randint(cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    positions = torch.arange(9).repeat(2)
    slots = torch.arange(2).repeat_interleave(9)
    logits = model(ids.flatten(), positions, slots).view(2, 9, -1)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


class GraphRecorder:
    """A Dynamo backend that keeps every graph it is given and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def test_compile_eager_backend_matches_eager():
    steps = serving_steps(config("tiny").vocab_size)
    recorder = GraphRecorder()
    model, expected_model = fresh(), fresh()
    compiled = torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)
    for logits, expected in zip(run(compiled, steps), run(expected_model, steps), strict=True):
        torch.testing.assert_close(logits, expected)
    assert_caches_equal(model, expected_model)

    # One graph for every T >= 2 (symbolic) plus one for the T=1 step: Dynamo
    # specializes sizes 0 and 1 even with dynamic=True.
    assert len(recorder.graphs) == 2
    attention = torch.ops.sizebackend.attention.default
    for gm in recorder.graphs:
        calls = [node for node in gm.graph.nodes if node.target is attention]
        assert len(calls) == model.config.num_layers


@pytest.mark.inductor
def test_compile_inductor_matches_eager():
    # One Inductor compile: the T=1 step would add a second (0/1 specialization).
    steps = serving_steps(config("tiny").vocab_size)[:3]
    model, expected_model = fresh(), fresh()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for logits, expected in zip(run(compiled, steps), run(expected_model, steps), strict=True):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # The op wrote the module's buffers in place, not functional copies of them.
    assert_caches_equal(model, expected_model, atol=1e-5, rtol=1e-5)


@pytest.mark.inductor
@torch.no_grad()
def test_unsplit_graph_serves_the_kv_cache_model_with_the_real_defaults(real_defaults, tmp_path):
    """``splitting_ops=[]`` (what the README suggests on a CPU without CUDA graphs): the
    attention op and its in-place KV-cache write inside each compiled graph, the sized
    one frozen and tuned (the user's defaults) and stored as a package that calls the
    op back; the same logits and caches as eager, cold and after a restart."""
    import zipfile

    import dynamo_sizebackend as sb
    from dynamo_sizebackend._torch import aoti
    from dynamo_sizebackend.cache import store
    from dynamo_sizebackend.cache.store import DiskCache

    from ..nets import compile_sb

    steps = serving_steps(config("tiny").vocab_size)[:3]  # T = 8, 4, 3: size 4 listed
    options = {"compile_sizes": [4], "splitting_ops": [], "cache_dir": str(tmp_path / "cache"),
               "store_frozen": "inline"}
    counts = [{"compiles": {"dynamic": 1, 4: 1}, "cache_hits": 0},
              {"compiles": {}, "cache_hits": 2}]  # cold, then a restart
    for expect in counts:
        torch._dynamo.reset()
        store.forget_shared()
        model, expected_model = fresh(), fresh()
        with sb.expect(graphs=1, pieces=1, splits=0, fallbacks={}, calls={"dynamic": 2, 4: 1},
                       **expect):
            compiled = compile_sb(model, **options)
            got = run(compiled, steps)
        for logits, expected in zip(got, run(expected_model, steps), strict=True):
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert_caches_equal(model, expected_model, atol=1e-5, rtol=1e-5)

    # The stored package calls the op back: it says so in the file beside its library,
    # which its aligned load needs (without it the first call failed: "Unable to find a
    # proxy executor"), and it loads aligned.
    (entry,) = [e for e in DiskCache(options["cache_dir"]).entries()[0] if e.kind == "aot"]
    key = entry.path.rsplit("/", 1)[1].removesuffix(store.SUFFIX)
    package = tmp_path / "size4.pt2"
    package.write_bytes(DiskCache(options["cache_dir"]).read(key))
    with zipfile.ZipFile(package) as archive:
        (library,) = [n for n in archive.namelist() if n.endswith(".so")]
        assert b"sizebackend::attention" in archive.read(library.removesuffix(".so") + ".json")
    assert isinstance(aoti.load_aligned(str(package)), aoti.AlignedCpuPackage)


@pytest.mark.inductor
@torch.no_grad()
def test_split_pieces_with_the_real_defaults_feed_attention_without_copies(real_defaults):
    """The user's path: split at the attention op, the listed size frozen and tuned (its
    q/k/v and gate/up linears concatenated into one GEMM each, so q, k and v leave the
    piece as slices of one output). Logits and caches as eager's; the op reads those
    slices through their strides: no copy of them at the listed size."""
    import dynamo_sizebackend as sb

    from ..nets import compile_sb

    steps = serving_steps(config("tiny").vocab_size)[:3]  # T = 8, 4, 3: size 4 listed
    model, expected_model = fresh(), fresh()
    compiled = compile_sb(model, compile_sizes=[4], cache_dir=None)
    got = [compiled(*steps[0])]
    with torch.profiler.profile() as prof:
        got.append(compiled(*steps[1]))
    got.append(compiled(*steps[2]))
    for logits, expected in zip(got, run(expected_model, steps), strict=True):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert_caches_equal(model, expected_model, atol=1e-5, rtol=1e-5)
    events = {e.key: e.count for e in prof.key_averages()}
    assert events.get("sizebackend::attention") == config("tiny").num_layers, events
    assert "aten::clone" not in events and "aten::contiguous" not in events, events
    stats = sb.stats()
    assert (stats.splits, stats.fallbacks, stats.calls) == (2, {}, {"dynamic": 2, "4": 1})
