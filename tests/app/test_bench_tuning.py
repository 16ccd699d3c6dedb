"""benchmarks/bench_tuning.py end to end on a tiny model, with real Inductor: every
candidate and peer is checked against eager before it is timed, and each candidate's
ratio to each peer is printed."""
import re

import pytest

from . import load_benchmark



def test_an_unknown_peer_is_refused():
    with pytest.raises(SystemExit):
        load_benchmark("bench_tuning").main(["--peers", "specialise"])


@pytest.mark.inductor
def test_candidates_are_timed_beside_a_peer(capsys):
    bt = load_benchmark("bench_tuning")
    assert bt.main(["--model", "sdpa", "--dim", "16", "--layers", "1", "--seq", "2",
                    "--sizes", "2", "--candidates", "none", "--iters", "2",
                    "--peers", "specialize"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+specialize\s+[\d.]+ \(", out, re.M), out
    ratios = re.search(r"^sb none / specialize: n=2 ([\d.]+)$", out, re.M)
    assert ratios and all(float(r) > 0 for r in ratios.groups()), out
