"""``sizebackend bench --tp 2`` as a user runs it: the command spawns its two ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dynamo_sizebackend.app import bench


def test_bench_tp2_spawns_its_ranks_and_reports_one_table(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "dynamo_sizebackend", "bench", "--tp", "2", "--model", "tiny",
            "--requests", "4", "--input-len", "8", "--output-len", "4", "--max-num-seqs", "2",
            "--variants", "eager,sizebackend", "--compiler", "eager", "--repeat", "1",
            "--json", str(out)]
    # The timeout fails a hang; the ranks' own (SIZEBACKEND_TP_TIMEOUT) ends what is left.
    env = {**os.environ, "SIZEBACKEND_TP_TIMEOUT": "60"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    # Rank 0 alone prints: one table, one verdict.
    assert printed.count("throughput: fastest of 1 full runs") == 1
    assert "tensor parallel over 2 rank(s)" in printed
    assert "tokens identical: yes" in printed
    assert "sizebackend on 2 ranks: same graphs, pieces and calls per size on every rank" in printed
    data = json.loads(out.read_text())
    assert data["config"]["tp"] == 2 and data["tokens_identical"] is True
    calls = data["sizebackend_stats"]["run"]["calls"]
    assert sum(calls.values()) == data["schedule"]["steps"]
    assert data["sizebackend_stats"]["run"]["fallbacks"] == {}


def test_bench_tp_that_does_not_split_the_model_is_refused_before_spawning(capsys):
    # tiny has 2 kv heads: 4 ranks cannot each hold whole ones.
    with pytest.raises(SystemExit):
        bench.main(["--tp", "4", "--model", "tiny"])
    assert "--tp: tensor parallel over 4 ranks needs num_kv_heads divisible by 4, got 2" in (
        capsys.readouterr().err)
