"""The cache key of a piece holding collectives names the process groups behind them."""
from __future__ import annotations

import torch
import torch.fx

from dynamo_sizebackend._torch import distributed
from dynamo_sizebackend.cache import key as cache_key


def _all_reduce_piece(group_name: str) -> torch.fx.GraphModule:
    """What Dynamo traces for ``funcol.all_reduce(x * 2, "sum", group_name)``."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce, (doubled, "sum", group_name))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor, (reduced,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_group_names_come_from_the_op_schema():
    gm = _all_reduce_piece("7")
    # "sum" is the reduce op, not a group: only the argument called group_name counts.
    assert distributed.group_names(gm) == {"7"}
    assert distributed.group_names(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))) == set()


def test_the_key_changes_with_the_group_and_a_group_unknown_here_gives_none(monkeypatch):
    gm, inputs = _all_reduce_piece("0"), [torch.randn(4, 8)]
    groups = {"0": "0:size=2:ranks=[0, 1]"}
    monkeypatch.setattr(distributed, "group_identity", groups.get)
    two = cache_key.piece_key(gm, inputs, 4, "opts")
    assert two is not None and cache_key.piece_key(gm, inputs, 4, "opts") == two
    # The same graph text, group "0" of another world size: another key.
    groups["0"] = "0:size=4:ranks=[0, 1, 2, 3]"
    assert cache_key.piece_key(gm, inputs, 4, "opts") not in (None, two)
    # torch.distributed not initialized (this process), or a name it does not know:
    # no key, so the piece is compiled rather than matched against another group's.
    groups.clear()
    assert cache_key.piece_key(gm, inputs, 4, "opts") is None
    monkeypatch.undo()
    assert not torch.distributed.is_initialized()
    assert distributed.group_identity("0") is None
    assert cache_key.piece_key(gm, inputs, 4, "opts") is None
