"""benchmarks/bench_hf.py end to end as a logic check (Dynamo without codegen, a tiny
Llama): every variant runs generate() at every batch, tokens equal eager's, and the
JSON says what ran."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_hf_runs_every_variant_with_equal_tokens(tmp_path):
    out = tmp_path / "hf.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_hf.py"), "--compiler", "eager",
         "--layers", "1", "--hidden", "64", "--batches", "1,2", "--prompt", "4",
         "--new-tokens", "3", "--repeat", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                 SIZEBACKEND_CACHE_DIR="none"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    variants = ["eager", "stock", "dynamic-tuned", "sizebackend", "sizebackend-unbacked"]
    assert result["failed"] == {}
    assert sorted(result["tokens_equal"]) == sorted(variants)
    assert all(result["tokens_equal"].values())
    assert all(result["tok_s"][v] > 0 for v in variants)
    assert all(0 < result["forward_share"][v] < 1 for v in variants)
    assert all(result["tok_s_by_batch"][v]["2"] > 0 for v in variants)
    # The backend served generate()'s forward calls: prefill and decode at both batches,
    # (1 init + 1 timed) x 3 steps x 2 batches, each variant counted apart.
    for name in ("sizebackend", "sizebackend-unbacked"):
        calls = result["evidence"][name]["calls"]
        assert sum(calls.values()) == 2 * 3 * 2, (name, calls)
    # Batch 1 first: backed, its prefill and decode are static graphs and batch 2 brings
    # the dynamic ones (4); unbacked, one prefill and one decode graph serve both (2),
    # batch 1 on the listed size-1 pieces.
    assert result["evidence"]["sizebackend"]["graphs"] == 4
    assert result["evidence"]["sizebackend-unbacked"]["graphs"] == 2
    assert result["evidence"]["sizebackend-unbacked"]["calls"]["1"] == 2 * 3
    # Each compiled variant's forward is a code object of its own: Dynamo's entries on
    # it are that variant's graphs alone (on one shared code object every variant's
    # lookup walked the others' entries, and Dynamo's record of the dims that changed
    # carried over from one variant to the next).
    entries = result["dynamo_entries"]
    assert sorted(entries) == sorted(variants[1:])
    assert entries["sizebackend"] == result["evidence"]["sizebackend"]["graphs"]
    assert entries["sizebackend-unbacked"] == result["evidence"]["sizebackend-unbacked"]["graphs"]
    assert all(1 <= n <= 4 for n in entries.values()), entries
    assert "sizebackend" in done.stdout and "tokens" in done.stdout


def _run(tmp_path, *argv):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_hf.py"), "--compiler", "eager",
         "--layers", "1", "--hidden", "64", "--batches", "1,2", "--prompt", "4",
         "--new-tokens", "2", "--repeat", "1", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                 SIZEBACKEND_CACHE_DIR="none"))


def test_bench_hf_passes_sb_options_to_the_backend(tmp_path):
    out = tmp_path / "hf.json"
    done = _run(tmp_path, "--variants", "eager,sizebackend", "--json", str(out),
                "--sb-options", "{'splitting_ops': []}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(result["tokens_equal"].values())
    evidence = result["evidence"]["sizebackend"]
    # Nothing split: one piece per graph where the default splits at the layer's attention.
    assert (evidence["graphs"], evidence["pieces"], evidence["splits"]) == (4, 4, 0)
    bad = _run(tmp_path, "--sb-options", "{'compile_sizes': [3]}")
    assert bad.returncode == 2 and "compile_sizes come from --batches" in bad.stderr
