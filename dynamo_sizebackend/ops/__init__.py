"""The ``sizebackend`` custom-op library: attention with an in-place KV-cache write,
``sdpa`` (SDPA with a direct kernel for small CPU calls; see :func:`sdpa`),
``weak_ref`` (a non-owning view, for CUDA-graph outputs; see :func:`weak_ref`) and
``packed_linear`` (a linear on a weight packed for oneDNN at run time; see
:func:`packed_linear`).

``torch.ops.sizebackend.attention(q, k, v, k_cache, v_cache, slots, positions, scale)``
is attention for a *flattened token batch*, the layout serving engines use: dim 0 of
every per-token tensor is the number of tokens ``T`` in the batch, whatever sequences
they come from. Under ``torch.compile(dynamic=True)`` that is the one symbolic size the
backend specializes on.

Shapes (``H`` query heads, ``KVH`` kv heads, ``D`` head_dim)::

    q                 [T, H, D]
    k, v              [T, KVH, D]
    k_cache, v_cache  [num_slots, max_len, KVH, D]   contiguous, mutated in place
    slots, positions  int64 [T]   token t is at positions[t] of sequence slots[t]

Cache semantics, in this order:

1. every token's key and value row is stored: ``k_cache[slots[t], positions[t]] = k[t]``
   (and likewise ``v``) for all ``t``;
2. ``out[t, h] = softmax(scale * q[t, h] @ K.T) @ V`` where ``K, V`` are rows
   ``0..positions[t]`` (inclusive) of slot ``slots[t]`` of the caches, kv head
   ``h // (H // KVH)`` (grouped-query attention).

Because every write happens before any read, one batch may mix prefill (several
consecutive tokens of one sequence: each sees its predecessors in the same batch) and
decode (one token of a sequence whose history earlier calls stored). Rows past
``positions[t]`` are never read, so stale rows of a reused slot are harmless. A batch
that names the same ``(slot, position)`` twice stores one of the two rows (the C++
kernel: the later token's).

The op is for inference: it has no autograd formula (``build_model`` turns gradients
off for that reason). Kernels: C++ for CPU (``csrc/attention.cpp``); on CUDA a Triton
kernel (``triton_attention.py``) when Triton is installed, else ``attention_reference``.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import Tensor

try:
    from .. import _C  # noqa: F401  (loading the .so runs its TORCH_LIBRARY registrations)
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "dynamo_sizebackend._C is not built; run `pip install --no-build-isolation -e .` "
        "in the repository root"
    ) from error

logger = logging.getLogger(__name__)

__all__ = ["attention", "attention_reference", "has_weak_ref", "packed_linear", "sdpa", "sdpa_counts",
           "weak_ref"]

_OP = "sizebackend::attention"
_PREFIX = f"{_OP}: "
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    scale: float,
) -> Tensor:
    """Store ``k``/``v`` into the caches at ``(slots, positions)``, then attend (see the
    module docstring). Mutates ``k_cache`` and ``v_cache``; returns ``[T, H, D]``."""
    return torch.ops.sizebackend.attention.default(
        q, k, v, k_cache, v_cache, slots, positions, scale
    )


def _check_layout(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
) -> None:
    """The C++ kernel's checks that need no tensor data, with the same messages.

    Shared by the fake kernel and the reference. Size comparisons go through
    ``torch._check`` (one comparison per call: ``and`` on two SymBools would guard) so
    that with a symbolic ``T`` they become runtime asserts instead of guards that
    specialize the graph on one batch size."""
    named = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    named.update(slots=slots, positions=positions)
    ranks = {"q": 3, "k": 3, "v": 3, "k_cache": 4, "v_cache": 4, "slots": 1, "positions": 1}
    for name, rank in ranks.items():
        if named[name].dim() != rank:
            _fail(f"{name} must have {rank} dims, got shape {tuple(named[name].shape)}")
    for name, tensor in named.items():
        if tensor.device != q.device:
            _fail(f"{name} is on {tensor.device} but q is on {q.device}")
    if q.dtype not in _FLOAT_DTYPES:
        _fail(f"q must be float32, bfloat16, float16 or float64, got {q.dtype}")
    for name in ("k", "v", "k_cache", "v_cache"):
        if named[name].dtype != q.dtype:
            _fail(f"{name} has dtype {named[name].dtype} but q has dtype {q.dtype}")
    for name in ("slots", "positions"):
        if named[name].dtype != torch.int64:
            _fail(f"{name} must be int64, got {named[name].dtype}")

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for name in ("k", "v", "slots", "positions"):
        _check_size(named[name].shape[0], num_tokens, f"{name} has {{}} tokens but q has {{}}")
    for name in ("k", "v", "k_cache", "v_cache"):
        _check_size(
            named[name].shape[-1], head_dim, f"head_dim mismatch: {name} has {{}} but q has {{}}"
        )
    for name, size in (
        ("v", v.shape[1]),
        ("k_cache", k_cache.shape[2]),
        ("v_cache", v_cache.shape[2]),
    ):
        _check_size(size, num_kv_heads, f"num_kv_heads mismatch: {name} has {{}} but k has {{}}")
    multiple = (
        f"{_PREFIX}num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    )
    torch._check(num_kv_heads > 0, lambda: multiple)
    torch._check(num_heads % num_kv_heads == 0, lambda: multiple)
    for dim in (0, 1):
        message = f"v_cache has {{}} but k_cache has {{}} in dim {dim}"
        _check_size(v_cache.shape[dim], k_cache.shape[dim], message)


def _check_contiguous_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    """Real kernels only: on symbolic shapes ``is_contiguous()`` would add guards, and what
    must be dense is the memory written at run time."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail("k_cache and v_cache must be contiguous (they are written in place)")


def _check_size(actual, expected, message: str) -> None:
    torch._check(actual == expected, lambda: _PREFIX + message.format(actual, expected))


def _fail(message: str) -> None:
    raise RuntimeError(_PREFIX + message)


@torch.library.register_fake(_OP)
def _attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    scale: float,
) -> Tensor:
    """Shape-only kernel that lets Dynamo/AOTAutograd trace the op with a symbolic T.
    The cache writes need no fake counterpart: the schema's ``(a!)``/``(b!)`` already
    tell functionalization which inputs change."""
    _check_layout(q, k, v, k_cache, v_cache, slots, positions)
    return q.new_empty(q.shape)


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    scale: float,
) -> Tensor:
    """Plain-PyTorch ``sizebackend::attention`` (same semantics, also mutates the caches).

    The ground truth for tests and the CUDA kernel when Triton is missing. It loops over
    the sequences present in the batch rather than gathering a ``[T, max_len, H, D]``
    history, so its memory stays proportional to one sequence's attention matrix."""
    _check_layout(q, k, v, k_cache, v_cache, slots, positions)
    _check_contiguous_caches(k_cache, v_cache)
    num_slots, max_len = k_cache.shape[:2]
    bounds = (
        (slots, num_slots, "slots", "num_slots"),
        (positions, max_len, "positions", "max_len"),
    )
    for index, bound, name, dim in bounds:
        bad = ((index < 0) | (index >= bound)).nonzero()
        if bad.numel():
            t = int(bad[0])
            _fail(
                f"{name}[{t}] = {int(index[t])} is out of range [0, {bound}) ({dim} of the cache)"
            )

    k_cache[slots, positions] = k
    v_cache[slots, positions] = v

    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)  # what the C++ kernel accumulates in
    out = q.new_empty(q.shape)
    for slot in slots.unique().tolist():
        tokens = (slots == slot).nonzero().squeeze(1)
        pos = positions[tokens]
        length = int(pos.max()) + 1
        keys = k_cache[slot, :length].to(compute)  # [L, KVH, D]
        values = v_cache[slot, :length].to(compute)
        query = q[tokens].to(compute).view(-1, num_kv_heads, group, head_dim)  # [n, KVH, G, D]
        scores = torch.einsum("nkgd,lkd->nkgl", query, keys) * scale
        future = torch.arange(length, device=q.device)[None, :] > pos[:, None]  # [n, L]
        scores = scores.masked_fill(future[:, None, None, :], float("-inf"))
        mixed = torch.einsum("nkgl,lkd->nkgd", scores.softmax(dim=-1), values)
        out[tokens] = mixed.reshape(-1, num_heads, head_dim).to(q.dtype)
    return out


def _register_cuda_kernel() -> None:
    """Give the op a CUDA kernel: Triton when it can run, else the reference (a decision
    logged once here, at import). Registering for the CUDA key needs no GPU, so a CPU
    build of torch takes this path too and simply never dispatches to it."""
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        from .triton_attention import attention_triton

        torch.library.register_kernel(_OP, "cuda", attention_triton)
        return
    if torch.cuda.is_available():
        logger.warning("triton is not installed: %s on CUDA runs attention_reference (slow)", _OP)
    torch.library.register_kernel(_OP, "cuda", attention_reference)


_register_cuda_kernel()


def weak_ref(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory (same data pointer, sizes, strides, storage offset,
    dtype and device) that does not keep that memory alive.

    The result dangles as soon as the memory's owner frees it, and nothing detects a
    read or write through a dangling one. It is meant for one owner only: a CUDA graph
    memory pool, which keeps the blocks its captures allocated reserved after their
    tensors die, and whose replays rewrite the same addresses (``cudagraphs.py`` says
    when the contents are valid). A runtime helper, never traced: it has no fake kernel
    and no autograd formula (``csrc/weak_ref.cpp``)."""
    return torch.ops.sizebackend.weak_ref.default(t)


def has_weak_ref() -> bool:
    """Whether the loaded ``_C`` has ``weak_ref`` (an extension built before the op was
    added does not; rebuild with ``pip install --no-build-isolation -e .``)."""
    return hasattr(torch.ops.sizebackend, "weak_ref")


def packed_linear(x: Tensor, w: Tensor, b: Tensor | None = None, min_rows: int = 2,
                  panel_rows: int = 0) -> Tensor:
    """``torch.nn.functional.linear(x, w, b)``, computed on a copy of ``w`` packed for
    oneDNN's GEMM when ``x`` has at least ``min_rows`` rows (all dims but the last), or
    by ``sizebackend::panel_linear`` on a copy packed in panels when it has 1 to ``panel_rows``
    rows (that kernel wins over ``min_rows``), and everything is float32 on the CPU;
    aten's ``linear`` otherwise, and wherever gradients are needed. A copy is made at the
    first call that needs it and kept, process-wide, while ``w`` is the same tensor with
    the same storage and version counter: an in-place write packs it again at the next
    call. A write through ``w.data`` is not seen; after one,
    :func:`dynamo_sizebackend.weights_updated` drops every copy
    (``csrc/packed_linear.cpp``; ``compile/linears.py`` says where the backend uses it)."""
    return torch.ops.sizebackend.packed_linear.default(x, w, b, min_rows, panel_rows)


@torch.library.register_fake("sizebackend::packed_linear")
def _packed_linear_fake(x: Tensor, w: Tensor, b: Tensor | None, min_rows: int,
                        panel_rows: int = 0) -> Tensor:
    torch._check(x.shape[-1] == w.shape[1], lambda: (
        f"sizebackend::packed_linear: x has {x.shape[-1]} features, w takes {w.shape[1]}"))
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
         enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, same arguments and results
    (the same output layout too), with a direct CPU kernel for small calls: 4-D float32,
    bfloat16 or float16 inputs, no dropout, where ATen would run its flash kernel, and
    per head at most 8192 query-key pairs times the head dim for one query (a decode
    step over 128 keys of 64), 4096 for several (8 causal queries of 64). Everything
    else, and every call that needs gradients, is ATen's SDPA. The backend runs it in
    place of the SDPA between a CPU graph's pieces (``compile/cpu_sdpa.py``;
    ``csrc/sdpa.cpp`` says why)."""
    return torch.ops.sizebackend.sdpa.default(query, key, value, attn_mask, dropout_p, is_causal,
                                              scale=scale, enable_gqa=enable_gqa)


def sdpa_counts() -> tuple[int, int]:
    """``(direct, aten)``: this process's CPU calls of :func:`sdpa` the direct kernel ran,
    and those it handed to ATen's SDPA."""
    return tuple(_C.sdpa_counts())


@torch.library.register_fake("sizebackend::sdpa")
def _sdpa_fake(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    # ATen's own SDPA on the fake tensors: it picks the backend a real CPU or GPU call
    # would (the C++ meta kernel would see the meta device and pick the math layout).
    return torch.ops.aten.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@torch.library.register_fake("sizebackend::pack_panels")
def _pack_panels_fake(w: Tensor) -> Tensor:
    return w.new_empty((-(-w.shape[0] // 16), w.shape[1], 16))


@torch.library.register_fake("sizebackend::panel_linear")
def _panel_linear_fake(x: Tensor, packed: Tensor, b: Tensor | None, n: int) -> Tensor:
    torch._check(x.shape[-1] == packed.shape[1], lambda: (
        f"sizebackend::panel_linear: x has {x.shape[-1]} features, the weight takes "
        f"{packed.shape[1]}"))
    return x.new_empty((*x.shape[:-1], n))
