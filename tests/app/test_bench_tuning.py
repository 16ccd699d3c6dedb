"""benchmarks/bench_tuning.py end to end on a tiny model, with real Inductor: every
candidate and peer is checked against eager before it is timed, and each candidate's
ratio to each peer is printed."""
import json
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


@pytest.mark.inductor
def test_packaged_candidates_run_from_stored_packages(tmp_path, capsys):
    """``--packaged``: the frozen sized pieces are AOT packages (stored, none skipped
    as frozen), which ``python-forward`` (the default with ``direct_calls=False``)
    reuses rather than compiles again; ``unsplit`` compiles each size as one piece."""
    bt = load_benchmark("bench_tuning")
    args = ["--model", "sdpa", "--dim", "16", "--layers", "1", "--seq", "2", "--sizes", "2",
            "--candidates", "freeze+autotune+concat,python-forward,unsplit", "--iters", "2"]
    assert bt.main(args + ["--packaged", "--json", str(tmp_path / "p.json")]) == 0
    stats = json.loads((tmp_path / "p.json").read_text())["stats"]
    assert "frozen" not in stats["cache_skips"], stats
    # Each frozen piece compiled and stored once (2 per size: before and after the
    # attention), by the first candidate; the second reuses them; the unsplit one adds
    # its single piece.
    assert stats["compiles"]["2"] == 3 and stats["reused"] >= 2, stats
    err = capsys.readouterr().err
    assert re.search(r"sb python-forward: first calls", err), err
    assert re.search(r"sb unsplit: first calls", err), err
