"""The benchmark's machinery on a tiny pair: every method runs, greedy texts agree, the oracle is an
upper bound on accepted length per draft call, summaries and the cost-model replay are consistent."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from specdec_ext.benchmark import (Oracle, balanced_order, format_table, load_results, run_benchmark,
                                   save_json, standard_methods, summarize)
from specdec_ext.benchmark_cli import cost_model_replay
from specdec_ext.engine import weights
from specdec_ext.zoo import ModelPair
from models import make_pair
from support import TEST_COSTS, DigitTokenizer, head_for, spy_draft_reads


@pytest.fixture(scope="module")
def run():
    target, draft = make_pair("llama", vocab=64, noise=0.3)
    pair = ModelPair(target, draft, DigitTokenizer(), head_for(draft, kind="proposal"))
    prompts = ["5 9 12 33 7", "40 41 2 8 16 23", "3 3 3 9"]
    methods = standard_methods(pair.head, ks=(1, 3), thresholds=(0.7,), hf_ks=(3,), paper_head=head_for(draft),
                               paper_thresholds=(0.3,), fp32_plain=True, hf_static=True)
    records = run_benchmark(pair, prompts, methods, max_new_tokens=20, progress=False, costs=TEST_COSTS)
    return pair, prompts, methods, records


def test_every_method_ran_and_greedy_texts_agree(run):
    pair, prompts, methods, records = run
    rows = summarize(records, methods, reference="plain fp32")
    assert {r["method"] for r in rows} == {m.name for m in methods}
    assert {"specdec++ auto", "specdec++ h=0.7", "specdec++ paper head h=0.3", "plain fp32",
            "hf static cache"} <= {r["method"] for r in rows}  # transformers' static cache: the same greedy text
    for r in rows:
        assert r["greedy_mismatches"] == [], r["method"]
        assert r["speedup_vs_reference"] > 0
        assert r["prompts"] == len(prompts)
        assert r["tokens_per_s"] > 0 and r["target_calls_per_token"] > 0
    plain = next(r for r in rows if r["method"] == "plain")
    assert plain["speedup"] == 1.0 and plain["draft_calls_per_token"] == 0


def test_oracle_drafts_exactly_to_the_first_rejection(run):
    _, _, methods, records = run
    for r in records:
        if r.method == "oracle":
            for cand, acc in r.rounds[:-1]:  # the last round may be cut by max_new_tokens
                assert cand == acc + 1 or cand == acc, (cand, acc)
    rows = {r["method"]: r for r in summarize(records, methods)}
    # the oracle wastes at most one draft token per round
    assert rows["oracle"]["discard_rate"] <= rows["oracle"]["verification_rate"] + 1e-9


def test_table_json_and_cost_model(run, tmp_path):
    _, _, methods, records = run
    rows = summarize(records, methods)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "DIFFERS" not in table
    replay = cost_model_replay(records, rows, [0.0, 0.1])
    for r in replay:
        recs = [x for x in records if x.method == r["method"]]
        tokens = sum(x.new_tokens for x in recs)
        assert abs(r["c=0"] - tokens / sum(x.target_calls for x in recs)) < 1e-9
        assert r["c=0.1"] <= r["c=0"] + 1e-12
    save_json(tmp_path / "b.json", records, rows, {"x": 1})
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["runs"]) == len(records) and data["summary"][0]["method"] == rows[0]["method"]
    save_json(tmp_path / "b.json.gz", records, rows, {"x": 1})
    assert load_results(tmp_path / "b.json.gz") == load_results(tmp_path / "b.json") == data


def test_the_run_reports_the_stop_rule_auto_chose(run, tmp_path):
    """``specdec bench``'s report of auto's choice: its arms, the one played in each round (as many as its rounds
    over the run, warm-up included), the arm of the last quarter's largest share, each arm's estimates and the cost
    fit, one line per auto arm and a plot; a method without a selector is not in it."""
    import math

    from specdec_ext.benchmark_cli import selection

    _, _, methods, records = run
    report, lines, plot = selection(methods, tmp_path, prefix="t-")
    auto = next(m for m in methods if m.name == "specdec++ auto")
    sel = auto.instance().selector
    assert list(report) == ["specdec++ auto"] and len(lines) == 1 and lines[0].startswith("specdec++ auto: settled on")
    got = report["specdec++ auto"]
    assert got["arms"] == [a.name for a in sel.arms] + ["plain"] and got["played"] == list(sel.history)
    assert len(got["played"]) >= sum(len(r.rounds) for r in records if r.method == "specdec++ auto")
    assert got["settled"] == max(got["late_shares"], key=got["late_shares"].get)
    assert math.isclose(sum(got["late_shares"].values()), 1.0)
    assert [e["arm"] for e in got["estimates"]] == got["arms"][:-1] and got["cost_fit_ms"]["round"] == sel.time.c[0]
    assert got["selection_us_per_round"] > 0 and 0 < got["selection_share_of_round"] < 1  # measured in the run
    assert got["selection_us_per_round"] == sel.spent_s * 1e6 / sel.now
    assert plot == "t-auto-arms.png" and (tmp_path / plot).stat().st_size > 0
    json.dumps(report)  # it goes into the results' JSON


def test_mismatch_replaces_speed_in_table(run):
    _, _, methods, records = run
    rows = summarize(records, methods)
    rows[1] = dict(rows[1], greedy_mismatches=[2])
    assert "text differs from plain decoding on prompts [2]" in format_table(rows)


def test_bf16_text_differences_are_counted_and_speed_kept(run):
    """With a bf16 target (exact=False) a method whose text differs on some prompts keeps its speed; the
    table gives the share of prompts with plain decoding's text and the mean first-difference position."""
    _, _, methods, records = run
    name = "fixed K=3"
    changed = [copy.copy(r) for r in records]
    for r in changed:
        if r.method == name and r.prompt in (0, 2):
            r.tokens = r.tokens[:5] + [r.tokens[5] + 1] + r.tokens[6:] if r.prompt == 0 else r.tokens[:9] + [63]
    rows = {r["method"]: r for r in summarize(changed, methods, exact=False)}
    row = rows[name]
    assert row["greedy_mismatches"] == [0, 2] and abs(row["same_text_share"] - 1 / 3) < 1e-9
    assert row["first_difference_mean"] == (5 + 9) / 2
    line = next(line for line in format_table(list(rows.values())).splitlines() if line.startswith(f"| {name} |"))
    assert "same on 1/3 (first difference at token 7 on average)" in line and f"{row['speedup']:.2f}×" in line
    assert "DIFFERS" not in line
    # with a float32 target the same difference is a defect: no speed
    exact = {r["method"]: r for r in summarize(changed, methods, exact=True)}
    assert "DIFFERS" in format_table([exact[name]])


def test_oracle_rejects_wrong_batch():
    with pytest.raises(ValueError, match="one reference sequence per row"):
        Oracle([[1, 2]]).reset(2, torch.device("cpu"))


def test_sampled_runs_are_not_reported_as_greedy_checked(run):
    _, _, methods, records = run
    table = format_table(summarize(records, methods, greedy=False))
    assert "| same |" not in table
    assert table.count("– (sampling)") == len(methods) - 1 and "– (fp32 reference)" in table


def test_cli_sweeps_parse_and_reject_bad_lists():
    import argparse

    from specdec_ext.benchmark import DEFAULT_KS
    from specdec_ext.benchmark_cli import _command_line, add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--ks", "1,2,8", "--thresholds", "0.3,0.9"])
    assert args.ks == (1, 2, 8) and args.thresholds == (0.3, 0.9) and args.hf_ks is None
    assert ap.parse_args([]).ks == DEFAULT_KS == tuple(range(1, 9))
    for bad in (["--ks", "two"], ["--thresholds", ""]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    assert _command_line(ap.parse_args(["--ks", "1,2,8", "--max-new-tokens", "64"])) == (
        "specdec bench --dataset humaneval --max-new-tokens 64 --temperature 0.0 --ks 1,2,8 "
        "--thresholds 0.5,0.6,0.7,0.8,0.9 --paper-thresholds 0.3,0.7,0.9 --lookup-ks 2,4,8")
    assert _command_line(ap.parse_args(["--no-hf", "--auto-uncalibrated", "--auto-copies", "2", "--ks", "3"])).endswith(
        "--ks 3 --thresholds 0.5,0.6,0.7,0.8,0.9 --paper-thresholds 0.3,0.7,0.9 --lookup-ks 2,4,8 --no-hf "
        "--auto-uncalibrated "
        "--auto-copies 2")  # the arms' flags too: the command reproduces the run's methods
    methods = standard_methods(None, ks=(1, 2), hf_ks=None)
    assert [m.param for m in methods if m.family == "hf-fixed"] == [1, 2]
    assert "hf-static" not in [m.family for m in methods]  # transformers' static cache: asked for, or on a GPU
    static = [m for m in standard_methods(None, ks=(1,), hf_static=True) if m.family == "hf-static"]
    assert len(static) == 1 and static[0].hf_generate == {"cache_implementation": "static"}
    assert ap.parse_args([]).hf_static is None and ap.parse_args(["--no-hf-static"]).hf_static is False
    copies = [m for m in standard_methods(object(), ks=(1,), hf=False, auto_copies=2)
              if m.family in ("specdecpp-auto", "specdecpp-auto-copy")]  # each its own policy, the same settings
    assert [m.name for m in copies] == ["specdec++ auto", "specdec++ auto copy 1", "specdec++ auto copy 2"]


@pytest.mark.parametrize("refill", [True, False], ids=["continuous", "static"])
def test_batch_benchmark_rows_texts_and_request_times(run, tmp_path, refill):
    """Requests served in batches: every method at every batch size; greedy requests equal plain decoding's
    texts and their own output at B = 1; a request's time is within its call; the JSON keeps a batch_size per
    summary row and run."""
    from specdec_ext.batch_bench import (STREAM_BATCHES, batch_plot, format_batch_table, run_batch_benchmark,
                                         summarize_batches)

    pair, prompts, methods, _ = run
    ours = [m for m in methods if m.family in ("plain", "fixed", "specdecpp", "specdecpp-auto", "heuristic")]
    prompts = prompts + ["1 2 3", "9 8 7 6 5"]
    N = len(prompts)
    records = run_batch_benchmark(pair, prompts, ours, [1, 2, 5], max_new_tokens=12, progress=False, costs=TEST_COSTS,
                                  refill=refill)
    size = (lambda B: STREAM_BATCHES * B) if refill else (lambda B: B)
    assert len(records) == len(ours) * sum(-(-N // size(B)) for B in (1, 2, 5))
    rows = summarize_batches(records, ours)
    assert {(r["method"], r["batch_size"]) for r in rows} == {(m.name, b) for m in ours for b in (1, 2, 5)}
    for r in rows:
        assert r["requests"] == N and r["same_text_share"] == 1.0, r
        assert r["tokens_per_s"] > 0 and r["per_request_tokens_per_s"] > 0
    plain = [r for r in rows if r["method"] == "plain"]
    assert all(r["speedup"] == 1.0 and r["mean_accepted_length"] == 0 for r in plain)
    alone = [t for r in sorted((r for r in records if r.batch_size == 1 and r.method == "fixed K=3"),
                               key=lambda r: r.prompt) for t in r.row_tokens]
    together = [t for r in sorted((r for r in records if r.batch_size == 5 and r.method == "fixed K=3"),
                                  key=lambda r: r.prompt) for t in r.row_tokens]
    assert together == alone  # a request's output in a batch equals it alone
    for r in records:
        assert len(r.row_finish_s) == len(r.row_tokens) == min(size(r.batch_size), N - r.prompt * size(r.batch_size))
        assert all(0 < s <= r.wall_s for s in r.row_finish_s)
    assert format_batch_table(rows).count("\n") == len(rows) + 1
    save_json(tmp_path / "b.json", records, rows, {"batch_sizes": [1, 2, 5]})
    data = load_results(tmp_path / "b.json")
    assert {r["batch_size"] for r in data["summary"]} == {1, 2, 5} and "row_finish_s" in data["runs"][0]
    assert (tmp_path / batch_plot(rows, tmp_path / "p.png")).stat().st_size > 0
    with pytest.raises(ValueError, match="batch_sizes must be integers >= 1"):
        run_batch_benchmark(pair, prompts, ours, [0], progress=False, costs=TEST_COSTS)
    with pytest.raises(ValueError, match="this engine's policies only"):
        run_batch_benchmark(pair, prompts, methods, [1], progress=False, costs=TEST_COSTS)


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_order_is_a_williams_design(n):
    """Over a full cycle (n orders for even n, 2n for odd n) every item runs in every position equally often and
    directly after every other item equally often (first-order carry-over balanced); order 0 is the items' own; the
    cycle repeats. A rotation of one order (what the benchmarks used before) fails the second property."""
    items = [f"m{j}" for j in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [balanced_order(items, i) for i in range(cycle)]
    assert rows[0] == items and balanced_order(items, cycle + 3) == rows[3 % cycle]
    assert all(sorted(r) == items for r in rows)
    for pos in range(n):
        assert Counter(r[pos] for r in rows) == {m: cycle // n for m in items}
    follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
    assert follows == {(a, b): cycle // n for a in items for b in items if a != b}
    if n >= 3:  # the rotations of one order: each item follows one other only, n - 1 times in n
        rotated = Counter((a, b) for i in range(n) for r in [items[i:] + items[:i]] for a, b in zip(r, r[1:]))
        assert len(rotated) == n and set(rotated.values()) == {n - 1}


def test_batch_benchmark_repeats_pool_every_pass(run):
    """``repeats=2``: every (method, stream) twice, the method order changed between passes; the summary pools both
    passes (tokens and wall time) and gives each pass's tokens/s; texts are compared pass by pass."""
    from specdec_ext.batch_bench import run_batch_benchmark, summarize_batches

    pair, prompts, methods, _ = run
    ours = [m for m in methods if m.family in ("plain", "fixed")][:3]
    records = run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                                  repeats=2)
    assert sorted((r.method, r.repeat) for r in records) == sorted((m.name, p) for m in ours for p in (0, 1))
    first = [r.method for r in records if r.repeat == 0]
    second = [r.method for r in records if r.repeat == 1]
    assert first != second and sorted(first) == sorted(second)  # reordered, not the same order again
    rows = summarize_batches(records, ours)
    for row in rows:
        runs = [r for r in records if r.method == row["method"]]
        assert row["new_tokens"] == sum(r.new_tokens for r in runs) and row["same_text_share"] == 1.0
        assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / sum(r.wall_s for r in runs))
        # decode tokens/s: the same tokens over the time of the rounds alone, which is part of the wall time
        assert all(0 < r.decode_s < r.wall_s for r in runs)
        assert row["decode_tokens_per_s"] == pytest.approx(row["new_tokens"] / sum(r.decode_s for r in runs))
        assert row["prefill_share"] == pytest.approx(1 - sum(r.decode_s for r in runs) / sum(r.wall_s for r in runs))
        assert row["decode_speedup"] == pytest.approx(
            row["decode_tokens_per_s"] / next(r for r in rows if r["method"] == "plain")["decode_tokens_per_s"])
        assert row["tokens_per_s_by_repeat"] == pytest.approx(
            [sum(r.new_tokens for r in runs if r.repeat == p) / sum(r.wall_s for r in runs if r.repeat == p)
             for p in (0, 1)])
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
            run_batch_benchmark(pair, prompts, ours, [2], progress=False, costs=TEST_COSTS, repeats=bad)


def test_batch_benchmark_passes_the_draft_context_window(run, monkeypatch):
    """``draft_context``: every speculative method's draft reads at most that many tokens of a request's context,
    and greedy texts stay plain decoding's; a bad window is refused, naming it."""
    from specdec_ext.batch_bench import run_batch_benchmark, summarize_batches

    pair, prompts, methods, _ = run
    ours = [m for m in methods if m.family in ("plain", "fixed")][:3]
    widths = spy_draft_reads(monkeypatch)
    records = run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                                  draft_context=3)
    assert widths and max(widths) == 3
    assert all(row["same_text_share"] == 1.0 for row in summarize_batches(records, ours))
    with pytest.raises(ValueError, match="draft_context"):
        run_batch_benchmark(pair, prompts, ours, [2], progress=False, costs=TEST_COSTS, draft_context=0)


def test_batch_benchmark_gives_requests_their_own_lengths(run):
    """``length_spread``: request i asks for ``request_lengths(...)[i]`` tokens (drawn once, seeded, within
    max_new_tokens +- spread), the same for every method and batch size; greedy texts stay plain decoding's; a bad
    spread, or one with static batches, is refused, naming it."""
    from specdec_ext.batch_bench import request_lengths, run_batch_benchmark, summarize_batches

    pair, prompts, methods, _ = run
    ours = [m for m in methods if m.family in ("plain", "fixed")][:3]
    limits = request_lengths(len(prompts), 6, 4, seed=0)
    assert limits == request_lengths(len(prompts), 6, 4, seed=0) and all(2 <= n <= 10 for n in limits)
    assert len(set(limits)) > 1 and request_lengths(3, 6) == [6, 6, 6]
    records = run_batch_benchmark(pair, prompts, ours, [1, 2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                                  length_spread=4)
    eos = pair.tokenizer.eos_token_id
    for B in (1, 2):
        for m in ours:
            runs = sorted((r for r in records if r.method == m.name and r.batch_size == B), key=lambda r: r.prompt)
            got = [n for r in runs for n in r.row_tokens]
            assert len(got) == len(limits) and all(n <= cap for n, cap in zip(got, limits))
            assert any(n == cap != 6 for n, cap in zip(got, limits))  # requests ran to their own limits
            assert got == [n for r in sorted((r for r in records if r.method == "plain" and r.batch_size == B),
                                             key=lambda r: r.prompt) for n in r.row_tokens]
            short = [i for i, (n, cap) in enumerate(zip(got, limits)) if n < cap]  # these must have ended at EOS
            flat = [t for r in runs for t in r.tokens]
            starts = [sum(got[:i]) for i in range(len(got))]
            assert all(flat[starts[i] + got[i] - 1] == eos for i in short), "a request stopped early without EOS"
    assert all(row["same_text_share"] == 1.0 for row in summarize_batches(records, ours))
    for bad in (-1, 6, 2.5):
        with pytest.raises(ValueError, match="length_spread"):
            run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                                length_spread=bad)
    with pytest.raises(ValueError, match="length_spread.*continuous batching"):
        run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                            length_spread=2, refill=False)


def test_finish_times_follow_the_rounds_a_row_was_in():
    from specdec_ext.batch_bench import finish_times_s
    from specdec_ext.engine.stats import GenerationStats, RoundStats

    st = GenerationStats(policy="x", batch_size=3)
    st.prefill_ms = 10.0
    st.rounds = [RoundStats([1] * 3, [0] * 3, [1] * 3, 0, 0, 5.0, [0, 1, 2]),
                 RoundStats([1] * 2, [0] * 2, [1] * 2, 0, 0, 7.0, [0, 2]), RoundStats([1], [0], [1], 0, 0, 3.0, [2])]
    assert finish_times_s(st) == pytest.approx([0.022, 0.015, 0.025])


def _bench_script(name: str):
    """The module of ``bench/<name>.py`` (a script, not a package module)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_comparison_script_by_hand():
    """bench/paired.py: per-prompt ratios of tokens/s, their median, the share faster, and total tokens/s."""
    mod = _bench_script("paired")
    runs = [{"method": "a", "prompt": 0, "new_tokens": 10, "wall_s": 1.0},    # 10 tokens/s
            {"method": "b", "prompt": 0, "new_tokens": 10, "wall_s": 2.0},    # 5: ratio 2
            {"method": "a", "prompt": 1, "new_tokens": 30, "wall_s": 3.0},    # 10
            {"method": "b", "prompt": 1, "new_tokens": 30, "wall_s": 2.0},    # 15: ratio 2/3
            {"method": "a", "prompt": 2, "new_tokens": 8, "wall_s": 1.0},     # 8
            {"method": "b", "prompt": 2, "new_tokens": 8, "wall_s": 2.0},     # 4: ratio 2
            {"method": "b", "prompt": 3, "new_tokens": 8, "wall_s": 2.0},     # b alone: not compared
            {"method": "a", "prompt": 0, "new_tokens": 99, "wall_s": 1.0, "batch_size": 4}]  # a batch run: skipped
    by = mod.per_prompt(runs)
    assert by["a"][0] == (10, 1.0) and 3 not in by["a"]
    p = mod.paired(by["a"], by["b"], reps=200)
    assert p["prompts"] == 3 and p["median_ratio"] == 2.0 and p["faster_on"] == 2
    assert abs(p["total_ratio"] - (48 / 5.0) / (48 / 6.0)) < 1e-12
    assert 2 / 3 <= p["ci95"][0] <= p["ci95"][1] <= 2.0
    with pytest.raises(ValueError, match="share no prompt"):
        mod.paired(by["a"], {9: (1, 1.0)})


def test_budget_paired_script_runs_every_arm_on_the_same_requests():
    """bench/budget_paired.py on a tiny pair: arm names become policies (fixed K, the budget with its options), every
    arm runs every pass, the pooled ratios are over the best fixed K, and a bad arm name is refused, naming it."""
    from types import SimpleNamespace

    from support import TEST_BATCH_COSTS, TEST_COSTS, head_for

    mod = _bench_script("budget_paired")
    target, draft = make_pair("llama", noise=0.3)
    head = head_for(draft, kind="proposal")
    pol = mod.parse_arm("auto:lockstep=false:headroom=0.0", head)
    assert pol.budget_options == {"lockstep": False, "headroom": 0.0}
    assert mod.parse_arm("K3", head).k == 3
    from specdec_ext import Autoregressive
    assert isinstance(mod.parse_arm("plain", head), Autoregressive)
    for bad in ("K", "fixed3", "auto:lockstep", "K2@lazy", "K2#", "#b"):
        with pytest.raises(ValueError, match="--arms"):
            mod.parse_arm(bad, head)
    assert mod.parse_arm("K2@grouped", head).k == 2 and mod.parse_arm("K2@grouped#b", head).k == 2
    assert [mod.arm_admission(a) for a in ("K2", "K2@grouped", "plain@eager", "K2@grouped#b")] == \
        ["ahead", "grouped", "eager", "grouped"]
    pair = SimpleNamespace(target=target, draft=draft, tokenizer=SimpleNamespace(eos_token_id=None),
                           heads={"greedy": head})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, target.config.vocab_size, (int(n),), generator=g) for n in (5, 9, 3, 7, 6, 4)]
    real = mod.SpeculativeGenerator
    windows = []

    def make(t, d, policy, draft_context):
        windows.append(draft_context)
        return real(t, d, policy=policy, costs=TEST_COSTS, batch_costs=TEST_BATCH_COSTS, draft_context=draft_context)

    mod.SpeculativeGenerator = make
    try:
        row = mod.compare(pair, prompts, batch_size=2, arms=["K1", "K2", "auto", "K2@grouped", "K1#b"], passes=2,
                          max_new_tokens=6, rows_per_stream=1, draft_context=4)
    finally:
        mod.SpeculativeGenerator = real
    assert windows == [4, 4, 4, 4, 4]  # --draft-context reaches every arm's generator
    assert len(row["tokens_per_s_by_pass"]) == 2 and row["best_fixed"] in ("K1", "K2", "K2@grouped")  # not K1#b
    assert all(set(p) == {"K1", "K2", "auto", "K2@grouped", "K1#b"} for p in row["tokens_per_s_by_pass"])
    rep = row["replicates"]["K1#b"]  # the A/A control: over its original, pooled, in decoding and per stream
    assert list(row["replicates"]) == ["K1#b"] and rep["of"] == "K1" and len(rep["by_stream"]) == 6
    assert rep["pooled"] == pytest.approx(row["tokens_per_s"]["K1#b"] / row["tokens_per_s"]["K1"])
    assert rep["decoding"] == pytest.approx(row["decode_tokens_per_s"]["K1#b"] / row["decode_tokens_per_s"]["K1"])
    assert min(rep["by_stream"]) * (1 - 1e-9) <= rep["pooled"] <= max(rep["by_stream"]) * (1 + 1e-9)
    lo, hi = rep["ci95"]  # a bootstrap over the six streams: around the pooled ratio, within the streams' range
    assert min(rep["by_stream"]) * (1 - 1e-9) <= lo <= hi <= max(rep["by_stream"]) * (1 + 1e-9)
    assert set(row["over_best_fixed_ci95"]) == {"auto", "K1#b"}  # the arms that are not a fixed K
    lo, hi = row["over_best_fixed_ci95"]["auto"]
    assert 0 < lo <= hi and lo <= row["over_best_fixed"]["auto"] * 1.05
    for arms, message in ((["K1", "K1"], "twice"), (["K1", "K2#b"], "original")):  # refused before any run
        with pytest.raises(ValueError, match=message):
            mod.compare(pair, prompts, batch_size=2, arms=arms, passes=1, max_new_tokens=6, rows_per_stream=1)
    assert all(row["admissions"][a] >= 0 and row["prefill_seconds"][a] > 0 for a in row["admissions"])
    rate = row["tokens_per_s"]
    assert row["over_best_fixed"]["auto"] == pytest.approx(rate["auto"] / rate[row["best_fixed"]])
    assert row["over_best_fixed"][row["best_fixed"]] == 1.0
    streams = row["over_best_fixed_by_stream"]  # three streams of two requests per pass
    assert all(len(v) == 6 for v in streams.values()) and streams[row["best_fixed"]] == [1.0] * 6
    assert min(streams["auto"]) * (1 - 1e-9) <= row["over_best_fixed"]["auto"] <= max(streams["auto"]) * (1 + 1e-9)
    per_row = row["candidates_per_row_round"]
    assert 0 < per_row["K1"] <= 1.0 and per_row["K1"] < per_row["K2"] <= 2.0  # short rows draft less than K
    assert all(row["draft_prefill_seconds"][a] > 0 for a in ("K1", "K2"))
    # long-context requests: the last N tokens of prompts ..., i + 1, i joined (ending with prompt i), cyclic
    joined = mod.long_contexts(prompts, 3, 12)
    assert [len(p) for p in joined] == [12] * 3
    assert torch.equal(joined[0], torch.cat([prompts[2], prompts[1], prompts[0]])[-12:])
    assert torch.equal(mod.long_contexts(prompts, 6, 8)[5], torch.cat([prompts[0], prompts[5]])[-8:])
    with pytest.raises(ValueError, match="context-tokens"):
        mod.long_contexts(prompts, 2, 1)


def test_batch_benchmark_passes_its_admission_to_every_call(run, monkeypatch):
    """``admission`` reaches every ``generate_continuous`` call (grouped admissions keep plain decoding's texts);
    an unknown one, or a grouped one with static batches, is refused, naming it."""
    from specdec_ext.batch_bench import run_batch_benchmark, summarize_batches
    from specdec_ext.engine.generator import SpeculativeGenerator

    pair, prompts, methods, _ = run
    ours = [m for m in methods if m.family in ("plain", "fixed")][:2]
    seen = []
    real = SpeculativeGenerator.generate_continuous

    def spy(self, *args, admission="eager", **kw):
        seen.append(admission)
        return real(self, *args, admission=admission, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "generate_continuous", spy)
    records = run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                                  admission="grouped")
    assert seen and set(seen) == {"grouped"} and len(seen) == len(records)
    assert all(row["same_text_share"] == 1.0 for row in summarize_batches(records, ours))
    with pytest.raises(ValueError, match="admission must be one of"):
        run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                            admission="late")
    with pytest.raises(ValueError, match="admission: static batches"):
        run_batch_benchmark(pair, prompts, ours, [2], max_new_tokens=6, progress=False, costs=TEST_COSTS,
                            admission="grouped", refill=False)


@pytest.mark.slow
def test_installs_script_runs_two_installs_side_by_side_with_the_same_tokens(tmp_path):
    """bench/installs.py with this install on both sides (two worker processes): a row per batch size and method,
    every request's tokens the same on both sides (greedy), and per-prompt or per-pass ratios that are positive."""
    import sys

    mod = _bench_script("installs")
    out = mod.main(["--other", sys.executable, "--batch-sizes", "1,2", "--methods", "plain,K2", "--prompts", "3",
                    "--max-new-tokens", "6", "--out", str(tmp_path / "installs.json")])
    assert [(r["batch_size"], r["method"]) for r in out["rows"]] == [(1, "plain"), (1, "K2"), (2, "plain"), (2, "K2")]
    assert all(r["same_tokens"] == 1.0 and r["total_ratio"] > 0 for r in out["rows"])
    assert all(r["ci95"][0] <= r["median_ratio"] <= r["ci95"][1] for r in out["rows"] if r["batch_size"] == 1)
    assert all(len(r["by_pass"]) == 1 for r in out["rows"] if r["batch_size"] == 2)
    assert out["installs"]["this"] == out["installs"]["other"]
    assert json.loads((tmp_path / "installs.json").read_text())["rows"] == out["rows"]


def test_scale_probe_counts_the_weights_a_step_reads_and_replays_the_eager_steps_logits(tmp_path):
    """bench/scale_probe.py on the CPU (tiny shape, recorded graphs): the bytes a step reads are every weight but the
    untied input embedding, by hand; a replay gives the eager step's logits on the same cache, and the compiled
    forward's replay (as StepRunner(compile=True) compiles it) the same up to rounding; the ratios are those of the
    timings reported; each step's launches are counted (a wider step dispatches as many ops), per layer too; the
    speculative round's row adds K draft steps to a verification; bad arguments are refused."""
    mod = _bench_script("scale_probe")
    h, layers, heads, kv, mlp, vocab, tied = mod.SHAPES["tiny"]
    d = h // heads
    per_layer = h * (heads * d) + 2 * h * (kv * d) + (heads * d) * h + 3 * h * mlp + 2 * h
    model = mod.random_llama("tiny", "cpu")
    assert not tied and mod.weight_bytes(model) == 2 * (layers * per_layer + h + vocab * h)  # bf16; LM head, final norm
    quantized = weights.quantize(mod.random_llama("tiny", "cpu"), "q8")  # as stored: int8 and a float32 scale a row
    rows = heads * d + 2 * kv * d + h + 2 * mlp + h
    assert mod.weight_bytes(quantized) == layers * (per_layer - 2 * h + 4 * rows) + vocab * (h + 4) + 2 * (
        2 * layers * h + h)
    out = mod.main(["--shapes", "tiny", "--context", "24", "--k", "3", "--repeats", "2", "--copy-mib", "4",
                    "--compile", "aot_eager", "--round", "tiny,tiny", "--out", str(tmp_path / "probe.json")])
    assert json.loads((tmp_path / "probe.json").read_text()) == out
    (row,) = out["rows"]
    assert set(row["steps"]) == {"1-token", "4-token"}
    for step in row["steps"].values():
        assert step["max_abs_diff"] == 0.0 and step["eager_ms"] > 0 and step["graph_ms"] > 0
        assert step["graph_compiled_ms"] > 0 and step["compiled_max_abs_diff"] < 1e-2  # the forward compiled, bf16
        # at least the embedding, the layers (one fused call on a CPU), the final norm and the LM head
        assert step["eager_launches"] >= 4 and step["graph_launches"] >= 4
        assert step["eager_launches_per_layer"] == step["eager_launches"] / layers
    assert row["steps"]["1-token"]["eager_launches"] == row["steps"]["4-token"]["eager_launches"]
    bandwidth = out["meta"]["copy_bandwidth_GBps"] * 1e9
    assert row["weight_read_ms"] == pytest.approx(row["weight_bytes"] / bandwidth * 1e3)
    one, wide = row["steps"]["1-token"], row["steps"]["4-token"]
    assert row["graph_k1_over_graph_1"] == pytest.approx(wide["graph_ms"] / one["graph_ms"])
    assert row["graph_1_over_weight_read"] == pytest.approx(one["graph_ms"] / row["weight_read_ms"])
    rnd = out["round"]
    assert (rnd["draft"], rnd["target"], rnd["k"]) == ("tiny", "tiny", 3)
    assert rnd["round_ms"] == pytest.approx(3 * one["graph_ms"] + wide["graph_ms"])
    assert rnd["k1_plain_ms"] == pytest.approx(4 * one["graph_ms"]) and rnd["draft_over_target"] == pytest.approx(1.0)
    assert rnd["break_even_tokens"] == pytest.approx(3 + wide["graph_ms"] / one["graph_ms"])
    assert rnd["compiled_round_ms"] == pytest.approx(3 * one["graph_compiled_ms"] + wide["graph_compiled_ms"])
    for bad in (["--shapes", "70b"], ["--k", "0"], ["--shapes", "tiny", "--round", "tiny,1b"],
                ["--shapes", "tiny", "--coordinate-descent"], ["--shapes", "tiny", "--weights", "q8"]):
        with pytest.raises(SystemExit):
            mod.main(bad)


def test_host_round_counts_one_replay_per_round_of_fixed_k_and_restores_what_it_wraps(tmp_path):
    """bench/host_round.py on the CPU (bundled pair, recorded graphs): plain decoding and fixed K (overlapped, and
    one at a time) replay one graph a round (a fixed-K round is one graph of its draft steps and verification), the
    rounds dispatch eager ops outside the replays and spend host time there, and the methods it wraps to measure are
    restored afterwards."""
    from specdec_ext.engine.graphs import StepGraphs
    from specdec_ext.engine.scheduler import Scheduler

    mod = _bench_script("host_round")
    before = (StepGraphs.replay, Scheduler._launch, Scheduler._launch_ahead, Scheduler._finish, Scheduler._catch_up)
    out = mod.main(["--prompts", "1", "--max-new-tokens", "12", "--repeats", "1", "--arms", "plain|fixed",
                    "--out", str(tmp_path / "host.json")])
    assert json.loads((tmp_path / "host.json").read_text()) == out
    assert set(out["rows"]) == {"plain", "fixed K=3", "fixed K=3, one at a time"}
    for row in out["rows"].values():
        assert row["replays_per_round"] == 1.0 and row["eager_ops_per_round"] > 0 and row["host_us_per_round"] > 0
        assert row["rounds"] >= 12 / 4
    assert (StepGraphs.replay, Scheduler._launch, Scheduler._launch_ahead, Scheduler._finish,
            Scheduler._catch_up) == before


def test_fused_layers_times_both_paths_of_the_lean_forward(tmp_path):
    """bench/fused_layers.py on the CPU (tiny shape): a row per token count with both arms' median ms and their
    ratio, the read time of the same run, the threshold it sets recorded; the JSON written is what it returns."""
    mod = _bench_script("fused_layers")
    out = mod.main(["--shape", "tiny", "--rows", "1x1,2x3", "--repeats", "2", "--context", "8",
                    "--out", str(tmp_path / "fused.json")])
    assert json.loads((tmp_path / "fused.json").read_text()) == out
    assert [(r["batch"], r["tokens"], r["rows"]) for r in out["rows"]] == [(1, 1, 1), (2, 3, 6)]
    for r in out["rows"]:
        assert r["fused_ms"] > 0 and r["torch_ops_ms"] > 0
        assert r["fused_over_torch_ops"] == pytest.approx(r["fused_ms"] / r["torch_ops_ms"])
        assert r["fused_over_read"] == pytest.approx(r["fused_ms"] / out["weight_read_ms"])
    assert out["meta"]["fused_max_rows"] == mod.FUSED_MAX_ROWS[torch.float32] and out["weight_read_ms"] > 0
