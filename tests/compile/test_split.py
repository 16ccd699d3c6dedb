"""Splitting at an op that returns a tuple (``torch.split``): the size's program is
compiled and served, not dropped, and its pieces take tensors of the size's shape."""
from __future__ import annotations

import pytest
import torch

import dynamo_sizebackend as sb
import dynamo_sizebackend.compile.pipeline as pipeline
from dynamo_sizebackend.compile import split as split_stage

from ..nets import compile_sb


class SplitMLP(torch.nn.Module):
    """``up`` -> ``torch.split`` into two halves -> ``relu(a) * b``: with ``torch.split``
    as a splitting op, 2 compiled pieces (before and after it) and 1 split op."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)

    def forward(self, x):
        a, b = torch.split(self.up(x), 8, dim=-1)
        return a.relu() * b


def rows(size: int) -> torch.Tensor:
    return torch.randn(size, 8, generator=torch.Generator().manual_seed(size))


def _spy_inputs(monkeypatch) -> dict:
    """The example inputs compile_piece gets, per runtime size."""
    seen: dict = {}
    real = pipeline.compile_piece

    def spy(adaptor, gm, inputs, size, **kw):
        seen.setdefault(size, []).append(list(inputs))
        return real(adaptor, gm, inputs, size, **kw)

    monkeypatch.setattr(pipeline, "compile_piece", spy)
    return seen


def _run_and_check(model, compiled):
    # The first call (size 3) compiles the general pieces and size 4: 2 pieces each.
    with sb.expect(graphs=1, pieces=2, splits=1, compiles={"dynamic": 2, 4: 2},
                   calls={"dynamic": 1}, fallbacks={}):
        torch.testing.assert_close(compiled(rows(3)), model(rows(3)))
    with sb.expect(compiles={}, calls={"4": 2}, fallbacks={}):  # served, not dropped
        for _ in range(2):
            torch.testing.assert_close(compiled(rows(4)), model(rows(4)))
    with sb.expect(compiles={}, calls={"dynamic": 1}, fallbacks={}):
        torch.testing.assert_close(compiled(rows(5)), model(rows(5)))


@pytest.mark.parametrize(
    "compiler_name", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
@torch.no_grad()
def test_tuple_returning_split_op_size_is_compiled_and_served(monkeypatch, compiler_name):
    seen = _spy_inputs(monkeypatch)
    model = SplitMLP().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler=compiler_name,
                          splitting_ops=["torch.split"], cache_dir=None)
    _run_and_check(model, compiled)
    # The getitems went with the split op: the piece after it takes the two halves as
    # tensors (the tuple never crosses), and for size 4 they are 4 rows, not symbolic.
    before, after = seen[4]
    assert not [v for v in before + after if isinstance(v, (tuple, list))]
    assert [tuple(v.shape) for v in after if isinstance(v, torch.Tensor)] == [(4, 8), (4, 8)]


@torch.no_grad()
def test_a_tuple_between_pieces_is_converted_item_by_item(monkeypatch):
    """Should a tuple cross anyway, the size's example inputs hold concrete tensors."""
    monkeypatch.setattr(split_stage, "_getitem_source", lambda node: None)  # tuples cross
    seen = _spy_inputs(monkeypatch)
    model = SplitMLP().eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager",
                          splitting_ops=["torch.split"])
    _run_and_check(model, compiled)
    [halves] = [v for inputs in seen[4] for v in inputs if isinstance(v, (tuple, list))]
    assert [tuple(t.shape) for t in halves] == [(4, 8), (4, 8)]
