"""The benchmark's scheduler and an end-to-end ``sizebackend bench`` run on the tiny model."""
import json
import statistics
from xml.etree import ElementTree

import pytest
import torch

from dynamo_sizebackend.app import bench
from dynamo_sizebackend.models.llama import build_model
from dynamo_sizebackend.app.scheduler import Scheduler, make_requests, plan, size_histogram


def _drive(requests, max_num_seqs, max_num_batched_tokens):
    """Run the scheduler with made-up tokens, checking slot ownership at every step."""
    scheduler = Scheduler(requests, max_num_seqs, max_num_batched_tokens)
    owner: dict[int, int] = {}  # slot -> request id while that request runs
    steps = 0
    while (step := scheduler.schedule()) is not None:
        steps += 1
        assert 0 < step.num_tokens <= max(max_num_batched_tokens, len(requests[0].prompt))
        assert len(step.positions) == len(step.slots) == step.num_tokens
        assert len(step.sequences) <= max_num_seqs
        for seq in step.sequences:
            assert 0 <= seq.slot < max_num_seqs
            owned_by = owner.setdefault(seq.slot, seq.request.id)
            assert owned_by == seq.request.id, "slot reused while busy"
        # Each sequence's tokens are contiguous in the batch and its sample index is its last.
        for seq, last in zip(step.sequences, step.sample_indices):
            assert step.slots[last] == seq.slot
        sampled = [1000 * seq.request.id + len(seq.generated) for seq in step.sequences]
        scheduler.update(step, sampled)
        for seq in step.sequences:
            if seq.done:
                del owner[seq.slot]
    assert not owner and not scheduler.running and not scheduler.waiting
    return scheduler.outputs, steps


def test_every_request_gets_exactly_its_output_length():
    requests = make_requests(20, input_len=5, output_len=12, vocab_size=50, seed=3)
    assert len({r.output_len for r in requests}) > 1  # lengths vary, so finishes stagger
    outputs, _ = _drive(requests, max_num_seqs=4, max_num_batched_tokens=64)
    assert sorted(outputs) == [r.id for r in requests]
    for r in requests:
        # update() appended the made-up tokens in order: the prefill's, then each decode's.
        assert outputs[r.id] == [1000 * r.id + i for i in range(r.output_len)]


def test_positions_continue_each_sequence():
    requests = make_requests(6, input_len=3, output_len=4, vocab_size=50, seed=1)
    scheduler = Scheduler(requests, max_num_seqs=2, max_num_batched_tokens=64)
    seen: dict[int, list[int]] = {}
    while (step := scheduler.schedule()) is not None:
        start = 0
        for seq in step.sequences:
            n = 1 if seq.generated else len(seq.request.prompt)
            seen.setdefault(seq.request.id, []).extend(step.positions[start:start + n])
            if not seq.generated:
                assert step.input_ids[start:start + n] == list(seq.request.prompt)
            start += n
        scheduler.update(step, [7] * len(step.sequences))
    for r in requests:  # the last generated token is never fed back
        assert seen[r.id] == list(range(len(r.prompt) + r.output_len - 1))


def test_batch_sizes_vary_and_the_plan_is_deterministic():
    requests = make_requests(24, input_len=8, output_len=16, vocab_size=50, seed=0)
    steps = plan(requests, max_num_seqs=6, max_num_batched_tokens=128)
    histogram = size_histogram(steps)
    decode_sizes = {s.num_tokens for s in steps if s.num_prefills == 0}
    assert len(decode_sizes) >= 3, decode_sizes  # the tail shrinks the batch step by step
    assert any(s.num_prefills and len(s.sequences) > s.num_prefills for s in steps), \
        "some prefill should share its step with decodes"
    again = plan(make_requests(24, input_len=8, output_len=16, vocab_size=50, seed=0), 6, 128)
    assert [s.num_tokens for s in again] == [s.num_tokens for s in steps]
    # Steps x tokens add up: every prompt token once, every generated token but the last once.
    assert sum(t * n for t, n in histogram.items()) == sum(
        len(r.prompt) + r.output_len - 1 for r in requests
    )


def test_token_budget_limits_admissions():
    requests = make_requests(8, input_len=10, output_len=3, vocab_size=50, seed=0)
    steps = plan(requests, max_num_seqs=8, max_num_batched_tokens=25)
    assert max(s.num_tokens for s in steps) <= 25
    assert steps[0].num_prefills == 2


def test_most_frequent_sizes_skip_one():
    assert bench.most_frequent_sizes({1: 50, 8: 40, 5: 3, 39: 7, 2: 3}, 3) == [2, 8, 39]


@pytest.mark.parametrize("variants", ["eager,sizebackend", "eager,dynamic,sizebackend,specialize"])
def test_bench_end_to_end(tmp_path, capsys, variants):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    argv = ["--model", "tiny", "--requests", "6", "--input-len", "8", "--output-len", "6",
            "--max-num-seqs", "3", "--variants", variants, "--compiler", "eager",
            "--repeat", "2", "--json", str(out), "--plot", str(tmp_path / "bench.svg")]
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads  # --threads is undone on the way out
    printed = capsys.readouterr().out
    assert "tokens identical: yes" in printed
    assert "output tokens/s" in printed
    data = json.loads(out.read_text())
    assert data["tokens_identical"] is True and data["token_mismatches"] == []
    assert set(data["variants"]) == set(variants.split(","))
    for row in data["variants"].values():
        for key in ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s",
                    "init_seconds", "run_seconds", "vs_eager"):
            assert row[key] > 0, key
    # Round by round: run i of the base over run i of the variant, and their median.
    base = "dynamic" if "dynamic" in data["variants"] else "eager"
    base_runs = data["variants"][base]["all_run_seconds"]
    for name, row in data["variants"].items():
        rounds = [b / a for a, b in zip(row["all_run_seconds"], base_runs)]
        assert len(rounds) == 2 and row[f"rounds_vs_{base}"] == rounds
        assert row[f"median_round_vs_{base}"] == statistics.median(rounds)
    assert f"ratios vs {base} round by round" in printed
    # The picture: one bar per variant in each panel (tokens/s, init s), each bar's
    # tooltip the figure the JSON holds.
    svg = ElementTree.parse(tmp_path / "bench.svg").getroot()
    bars = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "bar"]
    tips = [r.find("{http://www.w3.org/2000/svg}title").text for r in bars]
    assert len(bars) == 2 * len(data["variants"])
    for name, row in data["variants"].items():
        assert f"{name} fastest run: {row['output_tokens_per_s']:.4g} tokens/s" in tips
        assert f"{name} init: {row['init_seconds']:.4g} seconds" in tips
    steps = data["schedule"]["steps_per_size"]
    histogram = {int(t): n for t, n in steps.items()}
    assert data["compile_sizes"] == bench.most_frequent_sizes(histogram, 4)
    # One graph call per step, split between listed sizes and the general pieces (plus
    # Dynamo's own graph for T=1, keyed "1").
    calls = data["sizebackend_stats"]["run"]["calls"]
    assert sum(calls.values()) == data["schedule"]["steps"]
    listed = set(data["compile_sizes"])
    specialized = sum(n for key, n in calls.items() if key != "dynamic" and int(key) in listed)
    assert specialized == sum(n for t, n in histogram.items() if t in listed)


def test_bench_rejects_a_plot_it_cannot_write_before_running(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--plot", "out.pdf"])
    assert "must end in .svg or .png" in capsys.readouterr().err
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # .png needs it: said at once, with the way out
        with pytest.raises(SystemExit):
            bench.main(["--plot", "out.png"])
        assert "needs matplotlib" in capsys.readouterr().err


def test_bench_rejects_unknown_variant():
    with pytest.raises(SystemExit):
        bench.main(["--variants", "eager,fast"])


def test_a_real_mismatch_is_not_a_tie():
    """A token the model would not pick has a clear logit gap: reported, and not a tie."""
    model = build_model("tiny")
    requests = make_requests(2, input_len=4, output_len=3, vocab_size=256, seed=0)
    steps = plan(requests, 2, 64)
    w = bench.Workload(requests, 2, 64, dict(size_histogram(steps)))
    model.allocate_kv_cache(2, w.max_len)
    with torch.no_grad():
        outputs, _, _ = bench.generate(model, w, "test")
        reference = bench.Result("eager", 0.0, outputs)
        wrong = {i: list(tokens) for i, tokens in outputs.items()}
        wrong[1][1] = (wrong[1][1] + 1) % 256
        mismatches = bench.compare_tokens(model, w, reference, bench.Result("other", 0.0, wrong))
    assert [(m["request"], m["index"]) for m in mismatches] == [(1, 1)]
    assert mismatches[0]["logit_gap"] > bench.TIE_TOLERANCE and not mismatches[0]["tie"]
