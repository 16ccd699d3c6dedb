"""sizebackend::pack_panels and sizebackend::panel_linear: a float32 linear on a weight
packed once in panels of 16 output columns, for the row counts a frozen sized piece
has. Checked against aten's linear on every tile shape the kernel has (one to three
rows take 4 panels a tile on AVX-512 and 2 on AVX2, up to 15 one panel, 16 and more 2
panels of 8-row tiles on AVX-512), column counts that do not fill the last panel, and
the instruction set ATen's CPU capability picks (CI's second pass runs the baseline
copy, its third the AVX2 copy; test_matches_aten_linear_in_each_copy runs both here)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dynamo_sizebackend import _C  # noqa: F401  (loads the ops)

ops = torch.ops.sizebackend


def _case(rows, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g),
            torch.randn(n, generator=g))


def test_packing_puts_16_columns_of_each_k_together():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # N = 20: 2 panels, 12 zeros
    packed = ops.pack_panels(w)
    assert packed.shape == (2, 3, 16) and packed.is_contiguous()
    torch.testing.assert_close(packed[0], w[:16].t(), rtol=0, atol=0)
    torch.testing.assert_close(packed[1, :, :4], w[16:].t(), rtol=0, atol=0)
    assert not packed[1, :, 4:].any()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 15, 16, 17, 24, 33, 64])
@pytest.mark.parametrize("k, n", [(64, 128), (37, 50), (256, 768), (5, 3)])
def test_matches_aten_linear(rows, k, n):
    x, w, b = _case(rows, k, n)
    packed = ops.pack_panels(w)
    expected = F.linear(x, w, b)
    torch.testing.assert_close(ops.panel_linear(x, packed, b, n), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.panel_linear(x, packed, None, n), F.linear(x, w),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_split_the_panels_without_changing_a_bit(threads):
    x, w, b = _case(16, 512, 1024)  # 64 panels, enough work for more than one chunk
    packed = ops.pack_panels(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.panel_linear(x, packed, b, 1024)
        torch.set_num_threads(threads)
        assert torch.equal(ops.panel_linear(x, packed, b, 1024), one)  # same sums, same order
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


_ISA_CHILD = """
import torch, torch.nn.functional as F
from dynamo_sizebackend import _C
for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 17, 33):
    for k, n in ((37, 50), (256, 72), (64, 200), (5, 3)):
        g = torch.Generator().manual_seed(rows * 1000 + n)
        x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = torch.ops.sizebackend.pack_panels(w)
        for bias in (b, None):
            got = torch.ops.sizebackend.panel_linear(x, packed, bias, n)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
print(_C.attention_isa())
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_matches_aten_linear_in_each_copy(capability):
    # Each instruction set's copy computes in its own vector width (a 64-byte vector type
    # under AVX2 compiled to scalar code, 14x slower): every tile and remainder shape, a
    # partly filled last panel, with and without bias, under ATEN_CPU_CAPABILITY (on a
    # CPU without AVX2 both runs pick the baseline copy).
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    out = subprocess.run([sys.executable, "-c", _ISA_CHILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] in (capability, "default")


def test_leading_dims_and_strided_rows():
    x, w, b = _case(24, 64, 40)
    packed = ops.pack_panels(w)
    x3 = x.view(2, 3, 4, 64)
    out = ops.panel_linear(x3, packed, b, 40)
    assert out.shape == (2, 3, 4, 40)
    torch.testing.assert_close(out, F.linear(x3, w, b), rtol=1e-4, atol=1e-4)
    wide = torch.randn(24, 128)
    strided = wide[:, ::2]  # not contiguous in its last dim: copied first
    torch.testing.assert_close(ops.panel_linear(strided, packed, b, 40), F.linear(strided, w, b),
                               rtol=1e-4, atol=1e-4)
    rows_apart = wide[:, :64]  # rows 128 floats apart, features contiguous: read in place
    torch.testing.assert_close(ops.panel_linear(rows_apart, packed, b, 40),
                               F.linear(rows_apart, w, b), rtol=1e-4, atol=1e-4)


def test_empty_inputs():
    _, w, b = _case(1, 8, 20)
    packed = ops.pack_panels(w)
    assert ops.panel_linear(torch.randn(0, 8), packed, b, 20).shape == (0, 20)
    no_k = ops.pack_panels(torch.randn(20, 0))
    torch.testing.assert_close(ops.panel_linear(torch.randn(3, 0), no_k, b, 20), b.expand(3, 20))


def test_bad_arguments_are_named():
    x, w, b = _case(4, 32, 48)
    packed = ops.pack_panels(w)
    with pytest.raises(RuntimeError, match="x has 31 features, the weight takes 32"):
        ops.panel_linear(torch.randn(4, 31), packed, b, 48)
    with pytest.raises(RuntimeError, match="n = 20 does not fit 3 panels"):
        ops.panel_linear(x, packed, b, 20)
    with pytest.raises(RuntimeError, match="bias must be float32 of 48 values"):
        ops.panel_linear(x, packed, b[:40], 48)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.panel_linear(x.double(), packed, b, 48)
    with pytest.raises(RuntimeError, match=r"packed must be a contiguous float32 \[panels, K, 16\]"):
        ops.panel_linear(x, w, b, 48)
    with pytest.raises(RuntimeError, match="w must be 2-D"):
        ops.pack_panels(torch.randn(3, 4, 5))
    with pytest.raises(RuntimeError, match="w must be float32"):
        ops.pack_panels(w.double())


def test_fake_tensors_give_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(50, 64)
        packed = ops.pack_panels(w)
        assert packed.shape == (4, 64, 16)
        assert ops.panel_linear(torch.empty(2, 3, 64), packed, None, 50).shape == (2, 3, 50)
