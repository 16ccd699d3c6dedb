"""CUDA kernel of ``sizebackend::attention`` in Triton (semantics: ``ops`` docstring).

Imported by ``ops`` only when CUDA and Triton are both present. The cache write is a
plain ``index_put_`` (already a CUDA kernel); Triton does the read side, one program
per (token, query head), walking the token's history in blocks of ``BLOCK_N`` positions
with an online softmax so that no ``[T, max_len]`` score matrix is materialized.

Bad indices are caught by a device-side assert rather than a host check: reading them
back would synchronize the stream once per layer per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _check_contiguous_caches, _check_layout


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    slots_ptr,
    positions_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_cache_slot,
    stride_cache_position,
    stride_cache_head,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    position = tl.load(positions_ptr + token)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_q_token + head * stride_q_head + dims, mask=dim_mask, other=0.0
    )
    q = q.to(tl.float32) * scale
    base = slot * stride_cache_slot + (head // GROUP) * stride_cache_head

    # Running max, running denominator and unnormalized output of the online softmax.
    row_max = tl.full((1,), float("-inf"), tl.float32)
    denominator = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, position + 1, BLOCK_N):
        offsets = start + tl.arange(0, BLOCK_N)
        valid = offsets <= position
        rows = base + offsets[:, None] * stride_cache_position + dims[None, :]
        mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=0))
        # exp(-inf - finite) = 0 on the first block, so the empty history drops out.
        correction = tl.exp(row_max - new_max)
        weights = tl.exp(scores - new_max)
        v = tl.load(v_cache_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        denominator = denominator * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
        row_max = new_max

    out = acc / denominator
    out_offsets = token * stride_out_token + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    scale: float,
) -> Tensor:
    """``sizebackend::attention`` for CUDA tensors (registered by ``ops``)."""
    _check_layout(q, k, v, k_cache, v_cache, slots, positions)
    _check_contiguous_caches(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    num_slots, max_len = k_cache.shape[:2]
    in_range = (slots >= 0) & (slots < num_slots) & (positions >= 0) & (positions < max_len)
    torch._assert_async(in_range.all(), "sizebackend::attention: slot or position out of range")

    k_cache[slots, positions] = k
    v_cache[slots, positions] = v

    q = q.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    _attention_kernel[(num_tokens, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        slots.contiguous(),
        positions.contiguous(),
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 64 else 32,
    )
    return out
