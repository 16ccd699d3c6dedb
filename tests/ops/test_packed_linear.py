"""sizebackend::packed_linear: aten's linear, on a copy of the weight packed for oneDNN
(or, up to ``panel_rows`` rows, in panels for ``panel_linear``) once and packed again
whenever the weight changes in a way its version counter shows."""
import pytest
import torch
import torch.nn.functional as F

import dynamo_sizebackend as sb
from dynamo_sizebackend import _C
from dynamo_sizebackend.ops import packed_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="the op packs for oneDNN")


def _packs() -> int:
    return _C.packed_linear_counts()[1]


def _weights(n=48, k=32):
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(n, k)), torch.nn.Parameter(torch.randn(n))


@pytest.mark.parametrize("shape", [(6, 32), (3, 5, 32), (2, 2, 2, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_aten_linear(shape, bias):
    w, b = _weights()
    b = b if bias else None
    x = torch.randn(shape)
    before = _packs()
    with torch.no_grad():
        out = packed_linear(x, w, b, 2)
    assert out.shape == (*shape[:-1], 48)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert _packs() == before + 1  # packed once, at the first call


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_non_contiguous_weights_and_inputs(layout):
    torch.manual_seed(0)
    w = torch.randn(32, 48).t() if layout == "transposed" else torch.randn(48, 64)[:, ::2]
    x = torch.randn(32, 5).t()
    with torch.no_grad():
        torch.testing.assert_close(packed_linear(x, w, None, 1), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fewer_rows_than_asked_run_aten_unpacked():
    w, b = _weights()
    x = torch.randn(3, 32)
    before = _packs()
    with torch.no_grad():
        assert torch.equal(packed_linear(x, w, b, 4), F.linear(x, w, b))
    assert _packs() == before


def test_a_weight_is_packed_once_while_it_is_unchanged():
    w, b = _weights()
    before = _packs()
    with torch.no_grad():
        for rows in (2, 5, 9, 5):
            packed_linear(torch.randn(rows, 32), w, b, 2)
    assert _packs() == before + 1


def test_in_place_writes_pack_again():
    w, b = _weights()
    x = torch.randn(5, 32)
    before = _packs()
    with torch.no_grad():
        packed_linear(x, w, b, 2)
        w.mul_(2)  # the version counter moves
        torch.testing.assert_close(packed_linear(x, w, b, 2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        w[:4].zero_()  # a write through a view: the view shares the counter
        torch.testing.assert_close(packed_linear(x, w, b, 2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        w.data = torch.randn(48, 32)  # new storage
        torch.testing.assert_close(packed_linear(x, w, b, 2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert _packs() == before + 4


def test_a_write_through_data_needs_weights_updated():
    w, b = _weights()
    x = torch.randn(5, 32)
    with torch.no_grad():
        old = packed_linear(x, w, b, 2)
        w.data.copy_(torch.randn(48, 32))  # .data has a counter of its own: not seen
        assert torch.equal(packed_linear(x, w, b, 2), old)
        sb.weights_updated()
        torch.testing.assert_close(packed_linear(x, w, b, 2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_inference_tensors_and_other_dtypes_run_aten():
    with torch.inference_mode():
        w = torch.randn(48, 32)  # no version counter: a write could never be seen
        x = torch.randn(5, 32)
        before = _packs()
        assert torch.equal(packed_linear(x, w, None, 2), F.linear(x, w))
    w64, x64 = torch.randn(48, 32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(packed_linear(x64, w64, None, 2), F.linear(x64, w64))
    assert _packs() == before


def test_gradients_come_from_aten():
    w, b = _weights()
    x = torch.randn(5, 32, requires_grad=True)
    packed_linear(x, w, b, 2).square().sum().backward()
    grads = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    F.linear(x, w, b).square().sum().backward()
    for ours, aten in zip(grads, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(ours, aten)


def test_dead_weights_leave_the_cache():
    with torch.no_grad():
        first, _ = _weights()
        packed_linear(torch.randn(4, 32), first, None, 2)
        held = _C.packed_linear_counts()[0]
        del first  # its copy stays until the next new weight is packed...
        second, _ = _weights()
        packed_linear(torch.randn(4, 32), second, None, 2)
    assert _C.packed_linear_counts()[0] == held  # ...which drops it: one out, one in


def test_fake_kernel_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = packed_linear(torch.empty(7, 3, 32), torch.empty(48, 32), torch.empty(48), 2)
    assert out.shape == (7, 3, 48)
    with pytest.raises(Exception, match="features"), FakeTensorMode():
        packed_linear(torch.empty(7, 31), torch.empty(48, 32), None, 2)


NEVER = 1 << 62  # min_rows of a linear whose oneDNN copy never pays (compile/linears.py)


def _panels(x, w, b):
    """What sizebackend::panel_linear gives on a copy packed at compile time: the frozen
    pieces' kernel, which the run-time copy must match bit for bit."""
    return torch.ops.sizebackend.panel_linear(x, torch.ops.sizebackend.pack_panels(w), b,
                                              w.shape[0])


@pytest.mark.parametrize("shape", [(1, 32), (3, 32), (2, 4, 32), (8, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_up_to_panel_rows_the_panels_run(shape, bias):
    w, b = _weights(n=40)  # not a multiple of 16: the last panel is partly padding
    b = b if bias else None
    x = torch.randn(shape)
    before = _packs()
    with torch.no_grad():
        out = packed_linear(x, w, b, NEVER, 8)
        assert torch.equal(out, _panels(x, w, b))
        assert torch.equal(packed_linear(x, w, b, NEVER, 8), out)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert _packs() == before + 1  # the panels' copy, once


def test_panels_below_onednn_and_each_copy_packed_once():
    """Rows 1..panel_rows: the panels; from there, oneDNN from min_rows, aten below it.
    A weight used both ways holds both copies, each packed once."""
    w, b = _weights()
    before = _packs()
    with torch.no_grad():
        for rows in (2, 4, 9, 6, 3, 12, 1):
            x = torch.randn(rows, 32)
            out = packed_linear(x, w, b, 8, 4)
            if rows <= 4:
                assert torch.equal(out, _panels(x, w, b)), rows
            elif rows < 8:
                assert torch.equal(out, F.linear(x, w, b)), rows
            else:
                torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert _packs() == before + 2


def test_a_written_weight_repacks_its_panels():
    w, b = _weights()
    x = torch.randn(3, 32)
    with torch.no_grad():
        packed_linear(x, w, b, NEVER, 4)
        before = _packs()
        w.mul_(2)
        assert torch.equal(packed_linear(x, w, b, NEVER, 4), _panels(x, w, b))
    assert _packs() == before + 1


def test_panels_are_left_for_what_they_cannot_take():
    w, b = _weights()
    before = _packs()
    with torch.no_grad():
        x64, w64 = torch.randn(3, 32, dtype=torch.float64), w.double()
        assert torch.equal(packed_linear(x64, w64, None, NEVER, 4), F.linear(x64, w64))
        with torch.inference_mode():  # no version counter: a write could not be seen
            wi = torch.randn(48, 32)
        x = torch.randn(3, 32)
        assert torch.equal(packed_linear(x, wi, None, NEVER, 4), F.linear(x, wi))
    assert _packs() == before  # neither was packed


def test_panel_rows_gradients_come_from_aten():
    w, b = _weights()
    x = torch.randn(3, 32, requires_grad=True)
    packed_linear(x, w, b, NEVER, 4).square().sum().backward()
    grads = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    F.linear(x, w, b).square().sum().backward()
    for ours, aten in zip(grads, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(ours, aten)
