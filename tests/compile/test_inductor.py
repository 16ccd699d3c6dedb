"""Real Inductor compiles: the sized pieces are different code from the general ones."""
import re

import pytest
import torch

import dynamo_sizebackend as sb

from ..nets import TinyTransformer, batch, compile_sb

pytestmark = pytest.mark.inductor


def _signature_sizes(path) -> list[str]:
    """The sizes Inductor asserts for the piece's first input, e.g. ['4', '4', 's3', '8']."""
    text = path.read_text()
    match = re.search(r"assert_size_stride\(arg0_1, \(([^)]*)\)", text)
    assert match, f"no input assertion in {path.name}"
    return [s.strip() for s in match.group(1).split(",") if s.strip()]


@torch.no_grad()
def test_inductor_sized_pieces_are_specialized(tmp_path):
    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="inductor", debug_dir=str(tmp_path))
    # 1 attention -> 2 pieces, each compiled for the general shape and for size 4.
    with sb.expect(graphs=1, pieces=2, splits=1, calls={"4": 1}):
        out = compiled(batch(4))
    torch.testing.assert_close(out, model(batch(4)))
    compiles = sb.stats().compiles
    assert compiles.get("dynamic", 0) + compiles.get("4", 0) + sb.stats().reused >= 2
    for size in (3, 6, 4):
        torch.testing.assert_close(compiled(batch(size)), model(batch(size)))
    assert sb.stats().calls == {"4": 2, "dynamic": 2}

    # The piece after attention reads the attention output [B, heads, T, head_dim]:
    # its general code asserts a symbolic batch, the size-4 code a literal 4, while the
    # sequence length stays symbolic in both.
    general = sorted(tmp_path.glob("graph*_submod_2_dynamic.code*.py"))
    sized = sorted(tmp_path.glob("graph*_submod_2_4.code*.py"))
    assert general and sized, sorted(p.name for p in tmp_path.iterdir())
    g, s = _signature_sizes(general[0]), _signature_sizes(sized[0])
    assert g[0].startswith("s") and s[0] == "4", (g, s)
    assert s[2].startswith("s"), s  # T stays symbolic in the sized piece
    assert general[0].read_text() != sized[0].read_text()
    assert sb.stats().compile_seconds > 0
