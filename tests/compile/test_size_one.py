"""Batch 1's graph of its own (Dynamo's 0/1 specialization of a backed batch): with 1 a
listed size, its pieces for size 1 compile with the sized options (frozen, tuned) as a
listed size does inside the dynamic graph, and the frozen-weights check guards them."""
import pytest
import torch
import torch.nn as nn

import dynamo_sizebackend as sb

from ..nets import TinyTransformer, batch

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _first_call_marked(x):
    torch._dynamo.mark_dynamic(x, 0)
    return x


@pytest.mark.inductor
@torch.no_grad()
def test_real_defaults_tune_batch_ones_own_graph_and_guard_its_weights(real_defaults):
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [1, 4], "cache_dir": None})
    # 1 attention -> 2 pieces. Batch 1's graph: 2 pieces as Dynamo traced it (they serve
    # while size 1's compile runs, and if it fails), then 2 frozen size-1 pieces.
    with sb.expect(graphs=2, compiles={"dynamic": 2, 4: 2, 1: 4},
                   calls={"dynamic": 1, 4: 1, 1: 2}, cache_skips={"frozen": 4}):
        for x in (_first_call_marked(batch(3)), batch(4), batch(1), batch(1)):
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert "sized_untuned_symbolic_rows" not in sb.stats().fallbacks

    # A weight written in place after compiling: size 1 notices and compiles again.
    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    linear.weight.mul_(2)
    with sb.expect(compiles={1: 2}, fallbacks={"frozen_weights": 1}):
        torch.testing.assert_close(compiled(batch(1)), model(batch(1)), **TOL)
        torch.testing.assert_close(compiled(batch(1)), model(batch(1)), **TOL)


@pytest.mark.inductor
@torch.no_grad()
def test_general_options_leave_batch_ones_graph_compiled_once():
    # The suite's {} (sized pieces compile like the general ones): nothing to gain from a
    # second compile of batch 1's graph, so there is none.
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [1, 4], "cache_dir": None})
    with sb.expect(graphs=2, compiles={"dynamic": 2, 4: 2, 1: 2}, calls={"dynamic": 1, 4: 1, 1: 2}):
        for x in (_first_call_marked(batch(3)), batch(4), batch(1), batch(1)):
            torch.testing.assert_close(compiled(x), model(x), **TOL)
