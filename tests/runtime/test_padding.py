"""pad_to_size: an unlisted batch runs on the next larger listed size's pieces."""
import torch

import dynamo_sizebackend as sb

from ..nets import TinyTransformer, batch, compile_sb


@torch.no_grad()
def test_padded_batches_equal_eager_on_row_independent_model():
    # TinyTransformer's rows (batch entries) never interact: attention is within a row.
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[4, 8], compiler="eager", pad_to_size=True)
    for size, key in ((3, "4"), (5, "8"), (4, "4"), (8, "8"), (9, "dynamic")):
        with sb.expect(calls={key: 1}):
            out = compiled(batch(size))
        assert out.shape[0] == size
        torch.testing.assert_close(out, model(batch(size)))


@torch.no_grad()
def test_padding_is_refused_for_graphs_that_write_their_inputs():
    class InPlace(torch.nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    model = InPlace()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager", pad_to_size=True)
    x, ref = torch.zeros(3, 2), torch.zeros(3, 2)
    compiled(torch.zeros(4, 2))  # first graph
    with sb.expect(calls={"dynamic": 1}):
        out = compiled(x)
    torch.testing.assert_close(out, model(ref))
    torch.testing.assert_close(x, ref)  # the caller sees the write
    assert sb.stats().fallbacks.get("pad_to_size") == 1


def test_pad_plan_targets():
    from dynamo_sizebackend.runtime.padding import PadPlan

    plan = PadPlan((), (), (), (), (2, 4, 8))
    assert [plan.target_for(n) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, None]
