"""An unbacked batch (``mark_unbacked``): one Dynamo graph serves every batch size,
size 1 included, and a listed size 1 is compiled inside it like any other size."""
import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.models import build_model

from ..nets import TinyTransformer, batch

# Sizes 1..16, listed and unlisted, first in an order that used to make a second graph.
ORDER = [16, 2, 1, 2, 5, 1, 8, 3] + list(range(1, 17))
LISTED = [1, 2, 4]
mark_unbacked = torch._dynamo.decorators.mark_unbacked


def _calls_by_key(order):
    calls = {}
    for n in order:
        key = str(n) if n in LISTED else "dynamic"
        calls[key] = calls.get(key, 0) + 1
    return calls


@torch.no_grad()
def test_tiny_transformer_one_graph_over_sizes_1_to_16():
    model = TinyTransformer(layers=2).eval()
    compiled = torch.compile(
        model, backend="sizebackend", options={"compile_sizes": LISTED, "compiler": "eager"}
    )
    first = batch(ORDER[0])
    mark_unbacked(first, 0)
    # 2 attention ops -> 3 pieces, compiled for the general shape and sizes 1, 2 and 4.
    with sb.expect(graphs=1, pieces=3, compiles={"dynamic": 3, 1: 3, 2: 3, 4: 3},
                   calls=_calls_by_key(ORDER), fallbacks={}):
        torch.testing.assert_close(compiled(first), model(batch(ORDER[0])))
        for n in ORDER[1:]:
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)))


@torch.no_grad()
def test_backed_batch_still_gives_size_1_a_graph_of_its_own():
    """The contrast: ``mark_dynamic`` is 0/1-specialized, so batch 1 is a second graph."""
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(
        model, backend="sizebackend", options={"compile_sizes": LISTED, "compiler": "eager"}
    )
    first = batch(2)
    torch._dynamo.mark_dynamic(first, 0)
    with sb.expect(graphs=2):
        compiled(first)
        torch.testing.assert_close(compiled(batch(1)), model(batch(1)))
    assert sb.stats().compiles == {"dynamic": 2, "2": 2, "4": 2, "1": 2}


@torch.no_grad()
def test_llama_with_kv_cache_one_graph_over_sizes_1_to_16():
    """The built-in model takes three batch-sized inputs (tokens, positions, slots);
    each is marked, Dynamo merges their symbols into one."""
    model, reference = build_model("tiny"), build_model("tiny")
    for m in (model, reference):
        m.allocate_kv_cache(16, 64)
    compiled = torch.compile(
        model, backend="sizebackend", options={"compile_sizes": LISTED, "compiler": "eager"}
    )

    def inputs(n):  # n tokens of a flattened batch; token t goes to slot t % 16
        ids = torch.randint(model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        return ids, torch.arange(n) // 16, torch.arange(n) % 16

    with sb.expect(graphs=1, calls=_calls_by_key(ORDER), fallbacks={}):
        for i, n in enumerate(ORDER):
            args = inputs(n)
            if i == 0:
                for t in args:
                    mark_unbacked(t, 0)
            torch.testing.assert_close(compiled(*args), reference(*inputs(n)))
    pieces = sb.stats().pieces
    assert sb.stats().compiles == {"dynamic": pieces, "1": pieces, "2": pieces, "4": pieces}


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_compiles_size_1_inside_the_one_graph():
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend",
                             options={"compile_sizes": [1, 4], "cache_dir": None,
                                      "sized_inductor_options": {}})
    first = batch(3)
    mark_unbacked(first, 0)
    # 1 attention -> 2 pieces, general + sizes 1 and 4.
    with sb.expect(graphs=1, compiles={"dynamic": 2, 1: 2, 4: 2}, calls={"dynamic": 2, 1: 2, 4: 1}):
        torch.testing.assert_close(compiled(first), model(batch(3)), rtol=1e-4, atol=1e-4)
        for n in (1, 4, 1, 7):
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)), rtol=1e-4, atol=1e-4)
