"""sizebackend::sdpa: ``F.scaled_dot_product_attention``'s results and output layout,
from the direct CPU kernel where it takes the call (counted) and from ATen elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dynamo_sizebackend import ops

TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # Ours accumulates in float and rounds once; ATen's flash kernel rounds the weights
    # to the input dtype before its second GEMM.
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}

# (batch, heads, kv_heads, queries, keys, head_dim): GQA groups, more keys than queries
# (decode over a history), more queries than keys, head dims off every vector width.
# Query and key counts off the vector widths and the kernel's 4-row unroll on purpose.
SHAPES = [
    (1, 4, 4, 4, 4, 64),
    (2, 4, 2, 3, 7, 20),
    (1, 8, 2, 1, 33, 128),
    (3, 2, 2, 5, 5, 7),
    (2, 6, 3, 9, 4, 4),
    (1, 4, 1, 1, 64, 16),
    (2, 4, 2, 6, 9, 32),
    (1, 2, 2, 13, 13, 16),
    (1, 2, 2, 7, 3, 48),
    (1, 2, 1, 2, 12, 128),
]


def qkv(shape, dtype=torch.float32, seed=0):
    """Views of one fused projection's output, [B, L, H*E] transposed to [B, H, L, E],
    as a model's attention makes them (rows dense, heads and tokens strided)."""
    b, h, kvh, lq, s, e = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h * e, generator=g).to(dtype).view(b, lq, h, e).transpose(1, 2)
    kv = torch.randn(b, s, 2 * kvh * e, generator=g).to(dtype)
    k, v = (t.view(b, s, kvh, e).transpose(1, 2) for t in kv.chunk(2, dim=-1))
    return q, k, v


def masks(shape, seed=0):
    b, h, _, lq, s, _ = shape
    g = torch.Generator().manual_seed(seed)
    dead_row = torch.rand(lq, s, generator=g) > 0.5
    dead_row[0] = False  # query 0 sees no key: zeros, as ATen's flash kernel gives
    return {
        "bool [B,1,L,S]": torch.rand(b, 1, lq, s, generator=g) > 0.3,
        "bool [L,S]": torch.rand(lq, s, generator=g) > 0.5,
        "float [B,H,L,S]": torch.randn(b, h, lq, s, generator=g),
        "a query sees no key": dead_row,
    }


def direct_calls() -> int:
    return ops.sdpa_counts()[0]


def check(q, k, v, dtype=torch.float32, direct=True, **kwargs):
    """ops.sdpa against F.scaled_dot_product_attention: values, layout, and which kernel
    ran."""
    kwargs.setdefault("enable_gqa", q.shape[1] != k.shape[1])
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    before = ops.sdpa_counts()
    got = ops.sdpa(q, k, v, **kwargs)
    after = ops.sdpa_counts()
    assert (after[0] - before[0], after[1] - before[1]) == ((1, 0) if direct else (0, 1))
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_direct_kernel_matches_sdpa(shape, dtype):
    q, k, v = qkv(shape, dtype)
    check(q, k, v, dtype)
    check(q, k, v, dtype, is_causal=True)  # top-left: query i sees keys 0..i
    check(q, k, v, dtype, scale=0.3)
    for name, mask in masks(shape).items():
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
        got = check(q, k, v, dtype, attn_mask=mask)
        if name == "a query sees no key":
            assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))


@pytest.mark.parametrize("layout", ["contiguous", "heads split off tokens", "tokens outermost",
                                    "heads outermost", "a slice of a fused projection"])
def test_output_layout_follows_atens(layout):
    """ATen's flash kernel returns q's layout (``empty_like(q)``): contiguous for a
    contiguous q, [B, L, H, E] in memory for heads split off a projection's output. A
    compiled piece after the op was traced with that layout and checks it."""
    b, h, lq, e = 3, 2, 5, 8
    if layout == "contiguous":
        q = torch.randn(b, h, lq, e)
    elif layout == "heads split off tokens":
        q = torch.randn(b, lq, h, e).transpose(1, 2)
    elif layout == "tokens outermost":
        q = torch.randn(lq, b, h, e).permute(1, 2, 0, 3)
    elif layout == "heads outermost":
        q = torch.randn(h, b, lq, e).transpose(0, 1)
    else:
        q = torch.randn(b, lq, 3 * h * e)[..., : h * e].view(b, lq, h, e).transpose(1, 2)
    k = torch.randn(b, h, 7, e)
    check(q, k, k)
    check(q, q, q, is_causal=True)


def test_far_apart_scores_and_nan():
    """Scores hundreds apart (the softmax must subtract the row's max: e^400 is inf in
    float) and a NaN in one key, which stays in the rows that see it."""
    q, k, v = qkv((1, 2, 2, 3, 6, 8))
    k = k.clone()
    k[:, :, 2] *= 200
    check(q, k, v)
    k[0, 0, 4, 0] = float("nan")
    got = ops.sdpa(q, k, v, is_causal=True)
    assert not got[0, 0, :4].isnan().any()  # queries 0-3 do not see key 4 (causal)
    assert got[0, 0, 4:].isnan().all() and not got[0, 1].isnan().any()


@pytest.mark.parametrize("case", [
    "float64", "3 dims", "dropout", "large", "value head dim differs", "last dim strided",
    "flash disabled", "mask and causal",
])
def test_everything_else_is_atens(case):
    """Calls the direct kernel does not take run ATen's SDPA: the same values bit for
    bit (the same kernel), and the same layout."""
    q, k, v = qkv((2, 4, 4, 3, 5, 8))
    kwargs = {}
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "3 dims":
        q, k, v = q[0], k[0], v[0]
    elif case == "dropout":
        kwargs["dropout_p"] = 0.5
    elif case == "large":  # 96 causal queries of 8: 4656 pairs x 8 > 4096
        q, k, v = qkv((1, 2, 2, 96, 96, 8))
        kwargs["is_causal"] = True
    elif case == "value head dim differs":
        v = torch.randn(2, 4, 5, 16)
    elif case == "mask and causal":  # ATen's CPU kernel applies both
        kwargs.update(attn_mask=torch.rand(3, 5) > 0.4, is_causal=True)
    elif case == "last dim strided":
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    before = ops.sdpa_counts()
    if case == "dropout":  # random: compare with ATen under the same seed
        torch.manual_seed(0)
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.manual_seed(0)
        got = ops.sdpa(q, k, v, **kwargs)
    elif case == "flash disabled":  # ATen runs its math kernel: another layout
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            want = F.scaled_dot_product_attention(q, k, v, **kwargs)
            got = ops.sdpa(q, k, v, **kwargs)
    else:
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        got = ops.sdpa(q, k, v, **kwargs)
    after = ops.sdpa_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)
    assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.parametrize("heads", [3, 4])
def test_errors_are_atens(heads):
    """Inputs ATen refuses (3 kv heads for 2 query heads; head dims 8 and 4) get ATen's
    error."""
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 3, 3, 8) if heads == 3 else torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError) as want:
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError) as got:
        ops.sdpa(q, k, k)
    assert str(got.value) == str(want.value)


def test_gradients_are_atens():
    """With an input that requires grad the op is ATen's SDPA, autograd formula
    included; under no_grad the same inputs run the direct kernel."""
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv((1, 4, 2, 3, 5, 8)))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(want.sum(), (q, k, v))
    before = ops.sdpa_counts()
    got = ops.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert ops.sdpa_counts()[1] == before[1] + 1 and got.requires_grad
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), grads):
        torch.testing.assert_close(g, w)
    with torch.no_grad():
        check(q, k, v, is_causal=True)


def test_fake_and_meta_layouts_are_atens():
    """Under FakeTensorMode (how the backend propagates shapes through the split graph)
    the op reports the layout the real CPU call returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 5, 4, 8).transpose(1, 2) for _ in range(3))
        got = ops.sdpa(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.shape == want.shape and got.stride() == want.stride() == (160, 8, 32, 1)


def test_opcheck():
    q, k, v = qkv((1, 4, 2, 3, 5, 8))
    mask = torch.rand(3, 5) > 0.4
    for args, kwargs in [((q, k, v), {"is_causal": True, "enable_gqa": True}),
                         ((q, k, v, mask), {"enable_gqa": True})]:
        torch.library.opcheck(torch.ops.sizebackend.sdpa.default, args, kwargs)


_ISA_CHECK = """
import torch, torch.nn.functional as F
from dynamo_sizebackend import _C, ops
q, k, v = (torch.randn(2, 6, 4, 40).transpose(1, 2) for _ in range(3))
mask = torch.rand(6, 6) > 0.3
for kw in ({"is_causal": True}, {"attn_mask": mask}):
    torch.testing.assert_close(ops.sdpa(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw))
assert ops.sdpa_counts() == (2, 0), ops.sdpa_counts()
print(_C.attention_isa())
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_instruction_set_copy(capability):
    """The direct kernel runs the inner loop of ATen's CPU capability (the copy
    ``sizebackend::attention`` shares): each copy gives ATen's values."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    isa = out.stdout.strip()
    assert isa == "default" if capability == "default" else isa in ("avx2", "default")
