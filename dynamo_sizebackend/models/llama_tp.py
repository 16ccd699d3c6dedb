"""The built-in Llama, tensor-parallel: one shard of every linear per rank.

:func:`build_tp_model` builds the whole reference model on every rank from the same
seed (``llama.build_model``) and keeps this rank's slices of it, so the shards of all
ranks are exactly the slices of one model and a single process can compute the
reference. The split is the usual Megatron one:

- column-parallel (output features sliced, no communication): ``q_proj``, ``k_proj``,
  ``v_proj`` (whole heads: rank r holds query heads ``r*H/W .. (r+1)*H/W`` and the kv
  heads they attend with, so grouped-query attention and the KV cache stay local),
  ``gate_proj``, ``up_proj``;
- row-parallel (input features sliced, then an all-reduce of the partial sums):
  ``o_proj``, ``down_proj``;
- vocab-parallel head: ``lm_head`` column-parallel over the vocabulary, then an
  all-gather of the logits, so every rank returns the full ``[T, vocab]``.

The embedding and the norms are replicated. The collectives are torch's *functional*
ones (``torch.distributed._functional_collectives``), which Dynamo traces into the
graph (``_c10d_functional.all_reduce`` + ``wait_tensor``) and Inductor compiles, so
they stay inside the backend's compiled pieces; the attention op between them is
still the split point. Communication is by process-group *name*, a string constant of
the graph: every rank traces the same graph text.

Only the module classes of ``llama`` are reused; nothing of its math is copied here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol

from .. import ops
from .llama import AttentionFn, LlamaConfig, SizeLlama, build_model, config


class RowParallelLinear(nn.Module):
    """``x [T, in/W] -> all_reduce_sum(x @ W_shard.T) [T, out]``: this rank's columns of
    a bias-free linear, summed over the group."""

    def __init__(self, weight: Tensor, group_name: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group_name = group_name

    def forward(self, x: Tensor) -> Tensor:
        return _waited(funcol.all_reduce(nn.functional.linear(x, self.weight), "sum",
                                         self.group_name))


class GatheredLinear(nn.Module):
    """``x [T, in] -> all_gather(x @ W_shard.T, dim=1) [T, out]``: a column-parallel
    linear whose output every rank gets whole (the vocab-parallel head)."""

    def __init__(self, weight: Tensor, group_name: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group_name = group_name

    def forward(self, x: Tensor) -> Tensor:
        local = nn.functional.linear(x, self.weight)
        return _waited(funcol.all_gather_single(local, 1, self.group_name))


def _waited(result: Tensor) -> Tensor:
    """Eager only (a traced collective is already followed by its ``wait_tensor``): the
    wait now, rather than at the result's first use, so that logits nobody reads (a
    warm-up call's) leave no collective in flight at exit, which torch warns about."""
    if isinstance(result, funcol.AsyncCollectiveTensor):
        return result.wait()
    return result


def _rows(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """A column-parallel shard of ``linear``: its output features ``rank`` of ``world_size``."""
    out = linear.out_features // world_size
    # On the meta device: no random init drawn from the global RNG, the weight replaced.
    shard = nn.Linear(linear.in_features, out, bias=False, device="meta")
    shard.weight = nn.Parameter(linear.weight[rank * out:(rank + 1) * out].clone(),
                                requires_grad=False)
    return shard


def _columns(weight: Tensor, rank: int, world_size: int) -> Tensor:
    width = weight.shape[1] // world_size
    return weight[:, rank * width:(rank + 1) * width].clone()


def check_divisible(cfg: LlamaConfig, world_size: int) -> None:
    """Raise ``ValueError`` unless every sharded dim of ``cfg`` splits evenly."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, name)
        if value % world_size:
            raise ValueError(f"tensor parallel over {world_size} ranks needs {name} "
                             f"divisible by {world_size}, got {value}")


def shard_model(model: SizeLlama, rank: int, world_size: int, group_name: str) -> SizeLlama:
    """Turn ``model`` (mutated, and returned) into rank ``rank``'s shard of it.

    Call before ``allocate_kv_cache``: each layer keeps ``num_kv_heads / world_size``
    heads, and the cache is sized from the layer."""
    check_divisible(model.config, world_size)
    if model.kv_cache_shape is not None:
        raise RuntimeError("shard_model: shard before allocate_kv_cache")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _rows(getattr(attn, name), rank, world_size))
        attn.num_heads //= world_size
        attn.num_kv_heads //= world_size
        attn.o_proj = RowParallelLinear(_columns(attn.o_proj.weight, rank, world_size), group_name)
        mlp.gate_proj = _rows(mlp.gate_proj, rank, world_size)
        mlp.up_proj = _rows(mlp.up_proj, rank, world_size)
        mlp.down_proj = RowParallelLinear(_columns(mlp.down_proj.weight, rank, world_size),
                                          group_name)
    head = _rows(model.lm_head, rank, world_size)
    model.lm_head = GatheredLinear(head.weight.detach(), group_name)
    return model


def build_tp_model(
    name_or_config: str | LlamaConfig,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_fn: AttentionFn = ops.attention,
) -> SizeLlama:
    """This rank's shard of ``build_model(name_or_config, seed, ...)`` over ``group``
    (default: the default process group, which must be initialized).

    Every rank builds the whole model first (same seed, same weights), then keeps its
    slices: simple and exact, at the cost of one full model in memory while building.
    With a group of one rank the model is returned unsharded and without collectives."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("build_tp_model: torch.distributed is not initialized")
    cfg = config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible(cfg, world_size)
    model = build_model(cfg, seed=seed, dtype=dtype, device=device, attention_fn=attention_fn)
    if world_size == 1:
        return model
    return shard_model(model, rank, world_size, group.group_name)
