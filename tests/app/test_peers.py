"""The bench's peers (app/peers.py) compile as a user would configure them, with real
Inductor: ``specialize-tuned`` fails inside AOTAutograd on torch 2.13 as shipped, and
runs frozen and autotuned through :class:`KeepSources`."""
import pytest
import torch

from dynamo_sizebackend.app.peers import PeerForward


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _model():
    torch.manual_seed(0)
    return _MLP().eval()


def test_specialize_tuned_runs_frozen_with_sources_kept():
    model = _model()
    peer = PeerForward("specialize-tuned", model, [2])
    with torch.no_grad():
        # 3: the general graph; 2: its specialization, compiled at this call.
        for n in (3, 2, 5, 2):
            x = torch.randn(n, 32)
            torch.testing.assert_close(peer(x), model(x))
    found = peer.evidence()
    assert found["frozen"], found
    # The general compile carried the sources; the size-2 one needed them put back.
    assert found["sources_restored"] == 1, found


def test_specialize_tuned_without_the_workaround_fails_as_torch_ships():
    # If this starts passing, torch fixed the lazy specialization compile and
    # KeepSources can go (the bench would then say so by running it unchanged).
    model = _model()
    peer = PeerForward("specialize-tuned", model, [2], keep_sources=False)
    with torch.no_grad():
        peer(torch.randn(3, 32))
        with pytest.raises(Exception, match="NoneType' is not iterable"):
            peer(torch.randn(2, 32))


@pytest.mark.parametrize("batch_only", [True, False])
def test_batch_only_marks_dim_0_alone(batch_only):
    # 3-D inputs: with dynamic=True the sequence dim is symbolic too; batch_only keeps it
    # static, as bench_latency's peers (and its "sb batch-dyn") run.
    model = _model()
    peer = PeerForward("specialize", model, [2], compiler="eager", batch_only=batch_only)
    with torch.no_grad():
        for n in (3, 2, 5):
            x = torch.randn(n, 4, 32)
            torch.testing.assert_close(peer(x), model(x))
    # One graph for every size (its size-2 specialization is compiled from it).
    assert peer.symbolic[0] == ([True, False, False] if batch_only else [True, True, True])


def test_the_bench_compiles_the_specialize_peers_of_the_llama():
    # The bench's own setup (app/bench.make_variant) with real Inductor, on the built-in
    # Llama: its RMSNorms keep a float eps, which torch.compile(dynamic=True) traces as
    # a symbolic input that every specialize_on compile then fails on (torch 2.13); the
    # bench marks the token dim alone, and the peer compiles every size. (Untuned: the
    # tuned peer marks alike, and its max-autotune builds cost a minute here.)
    from dynamo_sizebackend.app.bench import make_variant
    from dynamo_sizebackend.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny")
    model.allocate_kv_cache(2, 64)

    def step(fn, n):
        ids = torch.randint(model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        return fn(ids, torch.arange(n), torch.zeros(n, dtype=torch.long))

    peer = make_variant("specialize", model, "inductor", [4])
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for n in (3, 4):  # the general graph, then the size-4 specialization
            torch.testing.assert_close(step(peer, n), step(model, n), rtol=1e-4, atol=1e-4)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
