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
            "--repeat", "2", "--passes", "2", "--json", str(out),
            "--plot", str(tmp_path / "bench.svg")]
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads  # --threads is undone on the way out
    printed = capsys.readouterr().out
    assert "tokens identical: yes" in printed
    assert "output tokens/s" in printed
    data = json.loads(out.read_text())
    assert data["tokens_identical"] is True and data["token_mismatches"] == []
    assert set(data["variants"]) == set(variants.split(","))
    # The CPU is named (results differ by CPU more than by run), and how passes took turns.
    capability = torch.backends.cpu.get_cpu_capability()
    assert data["machine"]["torch_cpu_capability"] == capability
    assert f"CPU: {data['machine']['model_name']}" in printed and capability in printed
    assert data["interleaved_turn"] == {"steps": bench.CHUNK_STEPS, "warm_calls": bench.WARM_CALLS}
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
    # Interleaved passes: each variant's step seconds per pass, pass i of the base over
    # pass i of the variant, and their median; against the best peer where one ran.
    base_passes = data["variants"][base]["all_interleaved_seconds"]
    for name, row in data["variants"].items():
        assert len(row["all_interleaved_seconds"]) == 2 and min(row["all_interleaved_seconds"]) > 0
        passes = [b / a for a, b in zip(row["all_interleaved_seconds"], base_passes)]
        assert row[f"passes_vs_{base}"] == passes
        assert row[f"interleaved_vs_{base}"] == statistics.median(passes)
    assert "interleaved: the same" in printed and f"ratios vs {base} pass by pass" in printed
    best = data["variants"]["sizebackend"].get("interleaved_vs_best_peer")
    if "dynamic" in variants:
        assert best["peer"] in ("dynamic", "specialize") and best["ratio"] > 0
        assert "sizebackend / best compiled peer" in printed and "interleaved:" in printed
    else:
        assert best is None
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


def _small_run(tmp_path, variants: str, *more: str) -> list[str]:
    """argv of a quick run on the tiny model (Dynamo without codegen), JSON to bench.json."""
    return ["--model", "tiny", "--requests", "4", "--input-len", "8", "--output-len", "4",
            "--max-num-seqs", "2", "--variants", variants, "--compiler", "eager",
            "--repeat", "1", "--json", str(tmp_path / "bench.json"), *more]


def test_interleaved_passes_run_every_variant_on_every_chunk_in_turn(monkeypatch):
    monkeypatch.setattr(bench, "CHUNK_STEPS", 2)
    monkeypatch.setattr(bench, "WARM_CALLS", 1)
    clock = [0.0]  # one second per call: the timed seconds count the timed calls
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    model = build_model("tiny")
    model.allocate_kv_cache(2, 8)
    calls = []

    def variant(name):
        def forward(ids, positions, slots):
            calls.append((name, int(ids[0])))
            clock[0] += 1.0
            return torch.zeros(len(ids), 4)
        return forward

    variants = [(variant(n), bench.Result(n, 0.0, {})) for n in ("a", "b", "c")]
    steps = [((torch.tensor([k, k]), torch.tensor([0, 1]), torch.tensor([0, 0])),
              torch.tensor([1])) for k in range(4)]
    bench.interleaved_runs(model, variants, steps, passes=2)
    # Every chunk of steps by every variant, the first to go rotating from chunk to
    # chunk; each turn starts with an untimed call of its first step.
    chunks = [("abc", (0, 1)), ("bca", (2, 3))]
    assert calls == [(n, k) for order, ks in chunks for n in order
                     for k in (ks[0], *ks)] * 2
    assert [r.interleaved for _, r in variants] == [[4.0, 4.0]] * 3  # the warm calls untimed


@pytest.mark.parametrize("given, message", [
    ("{'compile_sizes': [2]}", "compile_sizes come from --compile-sizes"),
    ("{'splitting_op': []}", "did you mean 'splitting_ops'"),
    ("[1, 2]", "must be a dict"),
    ("{'strict': 'yes'}", "strict"),
])
def test_sb_options_are_checked_before_anything_runs(capsys, given, message):
    with pytest.raises(SystemExit):
        bench.main(["--sb-options", given])
    assert message in capsys.readouterr().err


def test_sb_options_reach_the_backend(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = _small_run(tmp_path, "eager,sizebackend", "--passes", "0",
                      "--sb-options", "{'splitting_ops': []}")
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    init = data["sizebackend_stats"]["init"]
    # Nothing to split at: each graph is one piece.
    assert init["splits"] == 0 and init["pieces"] == init["graphs"] >= 1
    assert data["config"]["sb_options"] == {"splitting_ops": []}
    assert "all_interleaved_seconds" not in data["variants"]["sizebackend"]
    assert "more options: {'splitting_ops': []}" in capsys.readouterr().out


def test_split_and_unsplit_sizebackend_in_one_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = _small_run(tmp_path, "dynamic,sizebackend,sizebackend-unsplit", "--passes", "1")
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    split, unsplit = data["sizebackend_stats"], data["sizebackend_unsplit_stats"]
    # Each counted apart: the default splits each graph at the tiny model's 2 layers.
    assert split["init"]["pieces"] == 3 * split["init"]["graphs"] and split["init"]["splits"] > 0
    assert unsplit["init"]["pieces"] == unsplit["init"]["graphs"] and unsplit["init"]["splits"] == 0
    assert sum(split["run"]["calls"].values()) == sum(unsplit["run"]["calls"].values()) \
        == data["schedule"]["steps"]
    printed = capsys.readouterr().out
    for name in ("sizebackend", "sizebackend-unsplit"):
        assert f"{name} calls in one run" in printed
        assert f"{name} / best compiled peer (dynamic), interleaved" in printed
        assert data["variants"][name]["interleaved_vs_best_peer"]["peer"] == "dynamic"


def test_a_peer_that_cannot_run_is_reported_with_its_traceback(tmp_path, capsys, caplog,
                                                               monkeypatch):
    make = bench.make_variant

    def failing(name, *args, **kwargs):
        if name == "specialize":
            raise AttributeError("'NoneType' object has no attribute 'f_code'")
        return make(name, *args, **kwargs)

    monkeypatch.setattr(bench, "make_variant", failing)
    out = tmp_path / "bench.json"
    argv = _small_run(tmp_path, "dynamic,specialize,sizebackend", "--passes", "1")
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"dynamic", "sizebackend"}
    assert data["failed_variants"] == {
        "specialize": "AttributeError (AttributeError: 'NoneType' object has no attribute "
                      "'f_code')"}
    assert "[specialize] not run: AttributeError" in capsys.readouterr().out
    (record,) = [r for r in caplog.records if r.getMessage() == "specialize could not run"]
    assert record.exc_info and "in failing" in caplog.text
