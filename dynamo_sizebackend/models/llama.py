"""A Llama-style decoder whose attention is the ``sizebackend::attention`` custom op.

It exists so that tests and the benchmark have a realistic model without downloading
anything: random weights from a fixed seed, presets sized for CPU runs.

The forward takes a *flattened token batch* (``input_ids``, ``positions`` and ``slots``
all ``[T]``), as serving engines do: prefill tokens of several sequences and decode
tokens can share one call, and under ``torch.compile(dynamic=True)`` Dynamo sees a
single symbolic size, the number of tokens ``T``. The KV cache lives in per-layer
buffers that the op writes in place (see ``dynamo_sizebackend.ops``).

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (minus its
``model.`` prefix), and so does the math (RMSNorm in float32, rotate-half rotary
embedding, SwiGLU MLP), so a state dict maps across by renaming keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from .. import ops

#: The signature of ``ops.attention``; ``ops.attention_reference`` is the other one.
AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    """Rows of the embedding and columns of the logits."""
    hidden_size: int
    """Width of the residual stream; ``num_heads * head_dim``."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads; ``num_heads`` must be a multiple (grouped-query attention)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rms_eps: float = 1e-6
    max_position: int = 2048
    """Length of the rotary tables: the largest (and default) ``max_len`` of the KV cache."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with ``lm_head``."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and value <= 0:
                raise ValueError(f"LlamaConfig.{field.name} must be positive, got {value}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for the rotary embedding")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: Mapping[str, LlamaConfig] = MappingProxyType(
    {
        # Tests: every layer small enough that an Inductor compile stays in seconds.
        "tiny": LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position=256,
        ),
        # Benchmark on a couple of CPU cores.
        "small": LlamaConfig(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            max_position=1024,
        ),
        # Benchmark on a GPU or a large CPU.
        "medium": LlamaConfig(
            vocab_size=8192,
            hidden_size=1024,
            intermediate_size=2816,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
            max_position=2048,
        ),
    }
)


def config(name: str) -> LlamaConfig:
    """The preset called ``name`` (``"tiny"``, ``"small"`` or ``"medium"``)."""
    if name not in PRESETS:
        near = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)}){hint}")
    return PRESETS[name]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # In float32 whatever the model dtype: the mean of squares loses too much in bf16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin tables ``[max_position, head_dim]``, looked up by each token's position.

    Tables rather than computing the angles in ``forward``: tokens of a flattened batch
    sit at arbitrary positions, so a lookup is the whole job, and ``forward`` then uses
    no Python float. (With ``dynamic=True`` Dynamo lifts float attributes into graph
    inputs; Inductor cannot turn ``theta ** tensor`` back into a tensor op, and so
    restarted Dynamo's analysis on every compile to specialize theta.) The angles are
    computed in float32 as Hugging Face does; casting the model to bf16 then rounds the
    tables exactly as it would round the freshly computed values."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        # In blocks the calling thread computes alone (ATen's VML ops split work in
        # chunks of 2048 elements across threads): computed in parallel, a process now
        # and then got the second thread's half at low precision (seen in 3 of 30 fresh
        # processes on a 2-CPU machine, errors up to 1.5e-4; torch issue 188792, MKL
        # VML's first-call dispatch race). The tables become frozen constants of the
        # sized pieces, whose bytes the cache key hashes: such a process also missed
        # the cache on a warm start and compiled again.
        blocks = angles.split(max(1, 2048 // angles.shape[1]))
        self.register_buffer("cos", torch.cat([b.cos() for b in blocks]), persistent=False)
        self.register_buffer("sin", torch.cat([b.sin() for b in blocks]), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, heads, D]`` by the per-token angles (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention_fn: AttentionFn) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attention_fn = attention_fn
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Set by SizeLlama.allocate_kv_cache. Non-persistent: runtime state, not weights.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, slots: Tensor
    ) -> Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Derived here from the int head_dim, not stored: with dynamic=True Dynamo lifts
        # every float attribute into a graph input, while this stays a constant of the op.
        scale = self.head_dim**-0.5
        out = self.attention_fn(q, k, v, self.k_cache, self.v_cache, slots, positions, scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention_fn: AttentionFn) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, attention_fn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, slots: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class SizeLlama(nn.Module):
    """Llama-style decoder over a flattened token batch; see the module docstring.

    ``attention_fn`` defaults to the custom op; pass ``ops.attention_reference`` to get
    the same model with plain-PyTorch attention (eager only: it loops over sequences)."""

    def __init__(self, cfg: LlamaConfig, attention_fn: AttentionFn = ops.attention) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attention_fn) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_cache_shape: tuple[int, int, int, int] | None = None
        """Shape of each layer's k and v cache; None until ``allocate_kv_cache``."""

    def allocate_kv_cache(self, num_slots: int, max_len: int | None = None) -> None:
        """Give every layer zeroed k/v caches ``[num_slots, max_len, num_kv_heads, head_dim]``
        (model dtype and device); any previous cache is dropped. A slot holds one
        sequence; ``forward`` writes into them in place."""
        max_len = self.config.max_position if max_len is None else max_len
        if num_slots <= 0 or not 0 < max_len <= self.config.max_position:
            raise ValueError(
                f"need num_slots > 0 and 0 < max_len <= max_position ({self.config.max_position}), "
                f"got {num_slots} and {max_len}"
            )
        weight = self.embed_tokens.weight
        # The layers' own head count: a tensor-parallel shard (llama_tp) holds fewer.
        kv_heads = self.layers[0].self_attn.num_kv_heads
        self.kv_cache_shape = (num_slots, max_len, kv_heads, self.config.head_dim)
        for layer in self.layers:
            for name in ("k_cache", "v_cache"):
                cache = torch.zeros(self.kv_cache_shape, dtype=weight.dtype, device=weight.device)
                setattr(layer.self_attn, name, cache)

    def forward(self, input_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Logits ``[T, vocab_size]`` for tokens ``input_ids[t]`` at ``positions[t]`` of
        sequence ``slots[t]`` (all ``[T]``, int64; positions below the cache's
        ``max_len``, slots below its ``num_slots``); stores their keys and values."""
        # A plain attribute, not the buffer: Dynamo would lift a buffer it reads here
        # into a graph input ahead of input_ids.
        if self.kv_cache_shape is None:
            raise RuntimeError(
                "SizeLlama: call allocate_kv_cache(num_slots, max_len) before forward"
            )
        # Not self.embed_tokens(input_ids): that passes the module's float norm_type,
        # which dynamic=True lifts into a graph input that Inductor then specializes,
        # restarting the analysis.
        x = nn.functional.embedding(input_ids, self.embed_tokens.weight)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, slots)
        return self.lm_head(self.norm(x))


def build_model(
    name_or_config: str | LlamaConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_fn: AttentionFn = ops.attention,
) -> SizeLlama:
    """A ``SizeLlama`` with random weights drawn from ``seed``, in eval mode, gradients off.

    Weights are drawn in float32 on the CPU from a private generator, so the same seed
    gives the same model whatever ``dtype``/``device`` (up to rounding), and the global
    RNG, which nn.Module constructors draw from, is restored afterwards. Gradients are
    off because the attention op has no autograd formula. Call ``allocate_kv_cache``
    before running it."""
    cfg = config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    with torch.random.fork_rng(devices=[]):
        model = SizeLlama(cfg, attention_fn)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        else:
            # std 1/sqrt(fan_in) keeps activations O(1) through the layers, so the
            # logits (and attention patterns) of a random model are far from uniform.
            std = 1.0 if name == "embed_tokens.weight" else 1.0 / math.sqrt(param.shape[1])
            nn.init.normal_(param, std=std, generator=generator)
    return model.to(device=device, dtype=dtype).requires_grad_(False).eval()
