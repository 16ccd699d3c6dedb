"""sizebackend::attention: opcheck, numerics against attention_reference, input checks;
sizebackend::weak_ref: same memory, no ownership."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from dynamo_sizebackend import ops

NUM_SLOTS, MAX_LEN, HEAD_DIM = 4, 16, 16

# (slots, positions) of flattened token batches.
BATCHES = {
    # One sequence, six tokens in one call: token t must see the rows tokens 0..t-1
    # of the same batch wrote.
    "prefill": ([1] * 6, [0, 1, 2, 3, 4, 5]),
    # One token per sequence over a history already in the cache; 15 is max_len - 1.
    "decode": ([0, 1, 2, 3], [7, 3, 0, 15]),
    # Prefill of slot 2, decode of slots 0 and 3, a two-token continuation of slot 1.
    "mixed": ([2, 2, 2, 0, 3, 1, 1], [0, 1, 2, 9, 4, 5, 6]),
    # The same sequence out of order: still every write happens before any read.
    "unordered": ([0, 0, 0], [2, 0, 1]),
}
HEADS = [(4, 2), (4, 4), (8, 1)]  # (num_heads, num_kv_heads)
TOLERANCE = {
    torch.float32: {},
    torch.float64: {},
    # Both sides accumulate in float32 and round once at the end.
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}


Q, K, V, K_CACHE, V_CACHE, SLOTS, POSITIONS = range(7)  # argument positions of the op


def make_inputs(slots, positions, heads=4, kv_heads=2, dtype=torch.float32, seed=0,
                head_dim=HEAD_DIM, max_len=MAX_LEN):
    """Arguments of the op. The caches start random, standing in for histories that
    earlier calls stored."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    num_tokens = len(slots)
    return [
        randn(num_tokens, heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(NUM_SLOTS, max_len, kv_heads, head_dim),
        randn(NUM_SLOTS, max_len, kv_heads, head_dim),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
    ]


def clone_all(args):
    return [a.clone() for a in args]


SCALE = HEAD_DIM**-0.5


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(make_inputs(*BATCHES["mixed"]), id="mixed-gqa"),
        pytest.param(make_inputs(*BATCHES["prefill"], heads=4, kv_heads=4), id="prefill-mha"),
        pytest.param(make_inputs(*BATCHES["decode"], dtype=torch.bfloat16), id="decode-bf16"),
    ],
)
def test_opcheck(args):
    # All of opcheck's tests: test_schema, test_autograd_registration, test_faketensor
    # and test_aot_dispatch_dynamic.
    torch.library.opcheck(torch.ops.sizebackend.attention.default, (*args, SCALE))


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_reference(batch, heads, kv_heads, dtype):
    args = make_inputs(*BATCHES[batch], heads=heads, kv_heads=kv_heads, dtype=dtype)
    expected_args = clone_all(args)
    out = ops.attention(*args, SCALE)
    expected = ops.attention_reference(*expected_args, SCALE)
    assert out.dtype == dtype and out.shape == args[Q].shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # The caches must hold exactly the same rows: both sides copy k and v verbatim.
    torch.testing.assert_close(args[K_CACHE], expected_args[K_CACHE], atol=0, rtol=0)
    torch.testing.assert_close(args[V_CACHE], expected_args[V_CACHE], atol=0, rtol=0)


# The CPU kernel takes a different loop for a head_dim that its vectors divide (16 lanes
# with AVX-512, 8 with AVX2, 4 otherwise), one that only 4 divides, and any other; and
# sums the history four rows at a time, then the rest one by one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [4, 7, 20, 24, 64, 128])
def test_matches_reference_at_every_head_dim_and_long_histories(head_dim, dtype):
    # Histories of 1, 2, 3, 4, 5 and up to 200 rows (every remainder of 4), decode
    # and prefill mixed, grouped-query heads.
    slots = [0, 1, 2, 3, 0, 1, 2, 3, 3, 3]
    positions = [0, 1, 2, 3, 4, 198, 199, 137, 138, 139]
    args = make_inputs(slots, positions, heads=8, kv_heads=2, dtype=dtype, head_dim=head_dim,
                       max_len=200)
    expected_args = clone_all(args)
    out = ops.attention(*args, head_dim**-0.5)
    expected = ops.attention_reference(*expected_args, head_dim**-0.5)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("scale", [4.0, 64.0])
def test_far_apart_scores(scale):
    # Scores up to thousands apart: the kernel's exp of (score - max) bottoms out near
    # e^-87 rather than reaching 0; next to the largest term (1) that must not show.
    # Small integers and a power-of-two scale make every score exact on both sides, so
    # only the softmax can differ (with random floats, a score of 500 differs by an ulp
    # of 3e-5 between two summation orders, and its weight by as much).
    args = make_inputs(*BATCHES["mixed"])
    generator = torch.Generator().manual_seed(1)
    for i in (Q, K, V, K_CACHE, V_CACHE):
        args[i] = torch.randint(-3, 4, args[i].shape, generator=generator).float()
    expected_args = clone_all(args)
    out = ops.attention(*args, scale)
    torch.testing.assert_close(out, ops.attention_reference(*expected_args, scale))


def test_nan_in_a_query_stays_in_its_rows():
    args = make_inputs(*BATCHES["decode"])
    args[Q][1, 0, 3] = float("nan")
    out = ops.attention(*args, SCALE)
    assert out[1, 0].isnan().all()
    assert not out[[0, 2, 3]].isnan().any() and not out[1, 1:].isnan().any()


_ISA_CHILD = """
import torch
from dynamo_sizebackend import _C, ops
print(_C.attention_isa(), torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("capability", [None, "default", "avx2"])
def test_kernel_follows_atens_cpu_capability(capability):
    # The op runs the copy of its kernel that ATen's own kernels run: ATEN_CPU_CAPABILITY
    # lowers both (the CI's second pass runs the whole suite that way).
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", _ISA_CHILD], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    ours, aten = out
    if aten in ("AVX512", "AVX2", "DEFAULT"):  # x86; elsewhere the kernel has one copy
        assert ours == aten.lower(), out
    else:
        assert ours == "default", out


def test_writes_cache_rows_and_nothing_else():
    args = make_inputs(*BATCHES["mixed"])
    before = clone_all(args)
    ops.attention(*args, SCALE)
    rows = args[SLOTS], args[POSITIONS]
    untouched = torch.ones(NUM_SLOTS, MAX_LEN, dtype=torch.bool)
    untouched[rows] = False
    for cache, new in ((K_CACHE, K), (V_CACHE, V)):
        torch.testing.assert_close(args[cache][rows], args[new], atol=0, rtol=0)
        torch.testing.assert_close(args[cache][untouched], before[cache][untouched], atol=0, rtol=0)


def test_first_token_attends_to_itself_only():
    # Position 0 has a one-row history, its own value: softmax of one score is 1.
    args = make_inputs([3], [0])
    out = ops.attention(*args, SCALE)
    group = args[Q].shape[1] // args[K].shape[1]
    torch.testing.assert_close(out, args[V].repeat_interleave(group, dim=1))


def _fused_projection(q, k, v):
    fused = torch.cat([q, k, v], dim=1)  # [T, 4 + 2 + 2, D], as a fused qkv projection gives
    return fused[:, :4], fused[:, 4:6], fused[:, 6:]


def _heads_outermost(q, k, v):
    # [H, T, D] storage seen as [T, H, D]: every head a block of its own (head stride T*D).
    return tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))


def _dim_last_strided(q, k, v):
    # [T, D, H] storage seen as [T, H, D]: a head's D elements are not adjacent.
    return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))


@pytest.mark.parametrize("layout, copies", [
    (_fused_projection, 0), (_heads_outermost, 0), (_dim_last_strided, 3)],
    ids=["fused-projection", "heads-outermost", "dim-strided"])
def test_noncontiguous_qkv(layout, copies):
    # q/k/v are often views of one fused projection; the kernel honours their token and
    # head strides without a copy, and copies only where a head's D elements are apart.
    args = make_inputs(*BATCHES["mixed"])
    args[:3] = layout(*args[:3])
    assert not any(a.is_contiguous() for a in args[:3])
    expected_args = clone_all(args)  # clones of strided slices come out contiguous
    with torch.profiler.profile() as prof:
        out = ops.attention(*args, SCALE)
    torch.testing.assert_close(out, ops.attention_reference(*expected_args, SCALE))
    torch.testing.assert_close(args[K_CACHE], expected_args[K_CACHE], atol=0, rtol=0)
    torch.testing.assert_close(args[V_CACHE], expected_args[V_CACHE], atol=0, rtol=0)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::clone") == copies


@pytest.mark.parametrize("impl", [ops.attention, ops.attention_reference], ids=["op", "reference"])
def test_empty_batch(impl):
    args = make_inputs([], [])
    before = clone_all(args)
    out = impl(*args, SCALE)
    assert out.shape == (0, 4, HEAD_DIM)
    torch.testing.assert_close(args[K_CACHE], before[K_CACHE], atol=0, rtol=0)
    torch.testing.assert_close(args[V_CACHE], before[V_CACHE], atol=0, rtol=0)


def _set(values, index, value):
    """A copy of the int64 ``values`` with ``values[index] = value``."""
    values = values.clone()
    values[index] = value
    return values


# (argument, how to spoil it, the message); the valid batch is BATCHES["mixed"]: 7 tokens.
BAD_INPUTS = {
    # wrong rank of each tensor
    "q-rank": (Q, lambda t: t[0], r"q must have 3 dims"),
    "k-rank": (K, lambda t: t[..., None], r"k must have 3 dims"),
    "v-rank": (V, lambda t: t[0], r"v must have 3 dims"),
    "k_cache-rank": (K_CACHE, lambda t: t[0], r"k_cache must have 4 dims"),
    "v_cache-rank": (V_CACHE, lambda t: t[0], r"v_cache must have 4 dims"),
    "slots-rank": (SLOTS, lambda t: t[:, None], r"slots must have 1 dims"),
    "positions-rank": (POSITIONS, lambda t: t[:, None], r"positions must have 1 dims"),
    # dtypes
    "q-int": (Q, lambda t: t.int(), r"q must be float32, bfloat16"),
    "k-dtype": (K, lambda t: t.double(), r"k has dtype .* but q has dtype"),
    "v-dtype": (V, lambda t: t.bfloat16(), r"v has dtype .* but q has dtype"),
    "k_cache-dtype": (K_CACHE, lambda t: t.half(), r"k_cache has dtype .* but q has dtype"),
    "v_cache-dtype": (V_CACHE, lambda t: t.double(), r"v_cache has dtype .* but q has dtype"),
    "slots-int32": (SLOTS, lambda t: t.int(), r"slots must be int64"),
    "positions-float": (POSITIONS, lambda t: t.float(), r"positions must be int64"),
    # device (meta is the one other device every build has)
    "k_cache-device": (K_CACHE, lambda t: t.to("meta"), r"k_cache is on meta but q is on cpu"),
    "slots-device": (SLOTS, lambda t: t.to("meta"), r"slots is on meta but q is on cpu"),
    # number of tokens
    "k-tokens": (K, lambda t: t[:-1], r"k has 6 tokens but q has 7"),
    "v-tokens": (V, lambda t: t[:-1], r"v has 6 tokens but q has 7"),
    "slots-tokens": (SLOTS, lambda t: t[:-1], r"slots has 6 tokens but q has 7"),
    "positions-tokens": (POSITIONS, lambda t: t[:-2], r"positions has 5 tokens but q has 7"),
    # head_dim, kv heads, heads
    "k-head_dim": (K, lambda t: t[..., :8], r"head_dim mismatch: k has 8 but q has 16"),
    "v_cache-head_dim": (
        V_CACHE,
        lambda t: t[..., :8].contiguous(),
        r"head_dim mismatch: v_cache has 8 but q has 16",
    ),
    "v-kv_heads": (V, lambda t: t[:, :1], r"num_kv_heads mismatch: v has 1 but k has 2"),
    "k_cache-kv_heads": (
        K_CACHE,
        lambda t: t[:, :, :1].contiguous(),
        r"num_kv_heads mismatch: k_cache has 1 but k has 2",
    ),
    "heads-not-multiple": (
        Q,
        lambda t: t[:, :3],
        r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)",
    ),
    "cache-max_len": (
        V_CACHE,
        lambda t: t[:, :8].contiguous(),
        r"v_cache has 8 but k_cache has 16",
    ),
    # index ranges
    "slot-too-large": (SLOTS, lambda t: _set(t, 4, 4), r"slots\[4\] = 4 is out of range \[0, 4\)"),
    "slot-negative": (SLOTS, lambda t: _set(t, 0, -1), r"slots\[0\] = -1 is out of range \[0, 4\)"),
    "position-too-large": (
        POSITIONS,
        lambda t: _set(t, 6, MAX_LEN),
        r"positions\[6\] = 16 is out of range \[0, 16\)",
    ),
    "position-negative": (
        POSITIONS,
        lambda t: _set(t, 2, -3),
        r"positions\[2\] = -3 is out of range \[0, 16\)",
    ),
    # the caches are written in place
    "k_cache-noncontiguous": (
        K_CACHE,
        lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
        r"k_cache and v_cache must be contiguous",
    ),
}
# Checks that need tensor data or memory layout, which the fake (meta) kernel lacks.
DATA_CHECKS = {
    "slot-too-large",
    "slot-negative",
    "position-too-large",
    "position-negative",
    "k_cache-noncontiguous",
}


def bad_inputs(case, args):
    index, spoil, message = BAD_INPUTS[case]
    args = list(args)
    args[index] = spoil(args[index])
    return args, message


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_rejected_before_any_write(case):
    valid = make_inputs(*BATCHES["mixed"])
    before = clone_all(valid)
    args, message = bad_inputs(case, valid)
    with pytest.raises(RuntimeError, match=message):
        ops.attention(*args, SCALE)
    # Caches the case did not replace are the ones the call would have written to.
    torch.testing.assert_close(valid[K_CACHE], before[K_CACHE], atol=0, rtol=0)
    torch.testing.assert_close(valid[V_CACHE], before[V_CACHE], atol=0, rtol=0)


def test_caches_sharing_memory_are_rejected():
    args = make_inputs(*BATCHES["mixed"])
    args[V_CACHE] = args[K_CACHE]
    with pytest.raises(RuntimeError, match=r"k_cache and v_cache must not share memory"):
        ops.attention(*args, SCALE)


@pytest.mark.parametrize(
    "case", [c for c in BAD_INPUTS if c not in DATA_CHECKS and "device" not in c]
)
def test_fake_kernel_rejects_the_same(case):
    # On meta tensors the op runs its register_fake kernel, the one Dynamo traces with.
    args, message = bad_inputs(case, [a.to("meta") for a in make_inputs(*BATCHES["mixed"])])
    with pytest.raises(RuntimeError, match=message):
        ops.attention(*args, SCALE)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_reference_rejects_the_same(case):
    args, message = bad_inputs(case, make_inputs(*BATCHES["mixed"]))
    with pytest.raises(RuntimeError, match=message):
        ops.attention_reference(*args, SCALE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_cuda_kernel_matches_reference(batch, dtype):
    args = [a.cuda() for a in make_inputs(*BATCHES[batch], dtype=dtype)]
    expected_args = clone_all(args)
    out = ops.attention(*args, SCALE)
    torch.testing.assert_close(
        out, ops.attention_reference(*expected_args, SCALE), **TOLERANCE[dtype]
    )
    torch.testing.assert_close(args[K_CACHE], expected_args[K_CACHE], atol=0, rtol=0)
    torch.testing.assert_close(args[V_CACHE], expected_args[V_CACHE], atol=0, rtol=0)


# sizebackend::weak_ref


def test_weak_ref_views_the_same_memory():
    base = torch.arange(48.0).reshape(6, 8)
    t = base[1:, ::2]  # offset and strides of its own
    w = ops.weak_ref(t)
    assert w.data_ptr() == t.data_ptr()
    assert (w.shape, w.stride(), w.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
    assert (w.dtype, w.device) == (t.dtype, t.device)
    assert w.untyped_storage().nbytes() == base.untyped_storage().nbytes()
    w[0, 0] = -1.0  # writes go both ways
    assert base[1, 0] == -1.0
    base[5, 6] = -2.0
    assert w[4, 3] == -2.0
    torch.testing.assert_close(w, t)


def test_weak_ref_does_not_keep_the_memory_alive():
    np = pytest.importorskip("numpy")
    owner = np.zeros(16, dtype=np.float32)  # the storage's only owner, and weakly referable
    alive = weakref.ref(owner)
    t = torch.from_numpy(owner)
    w = ops.weak_ref(t)
    del owner, t
    gc.collect()
    assert alive() is None  # freed with `w` still alive (which must not be read now)
    del w


def test_weak_ref_keeps_no_reference_to_the_tensor():
    t = torch.randn(4, 4)
    uses = t._use_count()
    w = ops.weak_ref(t)
    assert t._use_count() == uses and w._use_count() == 1


def test_weak_ref_schema():
    # No mutation, and an output with a storage of its own: as `-> Tensor` says.
    torch.library.opcheck(
        torch.ops.sizebackend.weak_ref.default, (torch.randn(3, 4),), test_utils="test_schema"
    )


def test_weak_ref_of_empty_and_sparse():
    assert ops.weak_ref(torch.empty(0, 3)).shape == (0, 3)
    with pytest.raises(RuntimeError, match="only strided tensors"):
        ops.weak_ref(torch.eye(3).to_sparse())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weak_ref_on_cuda():
    t = torch.randn(4, 6, device="cuda")[:, 1:]
    w = ops.weak_ref(t)
    assert (w.device, w.data_ptr(), w.stride()) == (t.device, t.data_ptr(), t.stride())
    w.fill_(3.0)
    torch.testing.assert_close(t, torch.full_like(t, 3.0))
