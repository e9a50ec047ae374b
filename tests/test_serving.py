"""Serving under arrivals (``generate_continuous(arrival_ms=...)``, ``specdec_ext/serving.py``): requests join only
once they arrive, the call's clock skips idle time instead of sleeping, each request still produces its solo
tokens, and the latency summaries (TTFT, TPOT, ITL, end to end) follow from the tokens' emission times."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from models import make_pair
from support import TEST_BATCH_COSTS, TEST_COSTS, DigitTokenizer, head_for
from specdec_ext import SpeculativeGenerator, serving
from specdec_ext.zoo import ModelPair


def test_arrival_times_follow_the_rate():
    assert serving.arrival_times(5, math.inf) == [0.0] * 5
    t = serving.arrival_times(4000, 20.0, seed=1)  # Poisson: mean gap 50 ms, gaps' coefficient of variation 1
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert 47.0 < mean < 53.0 and 0.93 < sd / mean < 1.07
    bursty = serving.arrival_times(4000, 20.0, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    bmean = sum(bgaps) / len(bgaps)
    assert 45.0 < bmean < 55.0  # the same rate, burstier: cv = 1 / sqrt(0.25) = 2
    assert (sum((g - bmean) ** 2 for g in bgaps) / len(bgaps)) ** 0.5 / bmean > 1.7
    for bad in (0, -1.0, float("nan"), "8"):
        with pytest.raises(ValueError, match="rate must be a positive number"):
            serving.arrival_times(3, bad)
    with pytest.raises(ValueError, match="burstiness must be a positive finite number"):
        serving.arrival_times(3, 2.0, burstiness=0)


def test_summaries_and_latencies_by_hand():
    s = serving.summarize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    assert s == {"mean": 6.0, "median": 6.0, "p90": 10.0, "p99": pytest.approx(10.9)}
    assert serving.summarize([])["p99"] is None
    out = SimpleNamespace(arrival_ms=[0.0, 10.0], token_ms=[[5.0, 9.0, 9.0, 20.0], [30.0]])
    lat = serving.latencies(out)
    assert lat["ttft"] == [5.0, 20.0] and lat["e2e"] == [20.0, 20.0]
    assert lat["tpot"] == [5.0]  # (20 - 5) / 3; a one-token request has none
    assert lat["itl"] == [4.0, 0.0, 11.0]  # 0 inside a round's burst
    stats = SimpleNamespace(rounds=[SimpleNamespace(candidates=[3, 1], accepted=[2, 0]),
                                    SimpleNamespace(candidates=[2, 0], accepted=[2, 0])])
    assert serving.acceptance_by_position(stats, 4) == [2 / 3, 1.0, 0.0, None]


def test_requests_join_when_they_arrive_and_keep_their_solo_tokens():
    """Arrivals spread over time, one far in the future: every request's greedy tokens equal its tokens alone, no
    request is admitted or emits before it arrives, token times never go back, and the idle wait for the last
    request is skipped on the call's clock (the call does not sleep)."""
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 48, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (6,), generator=g)]
    arrivals = [0.0, 0.0, 5.0, 40.0, 41.0, 600_000.0]
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    t0 = time.perf_counter()
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=9, temperature=0, arrival_ms=arrivals)
    assert time.perf_counter() - t0 < 120.0  # not ten minutes
    assert out.arrival_ms == arrivals
    for i, p in enumerate(prompts):
        alone = gen.generate(torch.tensor([p]), max_new_tokens=9, temperature=0).new_tokens[0]
        assert out.new_tokens[i] == alone
        times = out.token_ms[i]
        assert len(times) == len(alone) and times == sorted(times)
        assert out.admitted_ms[i] >= arrivals[i] and times[0] >= arrivals[i]
    assert out.admitted_ms[5] >= 600_000.0


def test_bad_arrivals_are_refused_by_name():
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    for bad in ([0.0], [5.0, 1.0], [0.0, -1.0], [0.0, float("inf")], "0,1"):
        with pytest.raises(ValueError, match=r"arrival_ms"):
            gen.generate_continuous([[3, 4], [5, 6]], batch_size=2, max_new_tokens=3, temperature=0, arrival_ms=bad)


def test_serve_benchmark_runs_every_method_at_every_rate(tmp_path):
    """``serving.run`` (what ``specdec bench --serve`` calls): every method at every rate, with latencies in ms,
    per-position acceptance, the table and both plots."""
    target, draft = make_pair("llama", vocab=64, noise=0.3)
    pair = ModelPair(target, draft, DigitTokenizer(), head_for(draft, kind="proposal"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (8,), generator=g)]
    rows = serving.run(pair, prompts, [200.0, math.inf], 4, 8, k=2, log=None, costs=TEST_COSTS,
                       batch_costs=TEST_BATCH_COSTS)
    assert [(r["method"], r["rate"]) for r in rows] == \
        [(m, 200.0) for m in ("plain", "fixed K=2", "specdec++ auto", "budget (auto)")] + \
        [(m, math.inf) for m in ("budget (auto)", "specdec++ auto", "fixed K=2", "plain")]
    for r in rows:
        assert r["tokens"] == 8 * 8 and len(r["requests"]["ttft"]) == 8
        assert 0 < r["ttft"]["median"] <= r["e2e"]["median"] and r["tpot"]["p99"] >= r["tpot"]["median"] > 0
        assert r["itl_ms"] and min(r["itl_ms"]) >= 0 and r["itl"]["p99"] >= r["itl"]["median"]
    spec = next(r for r in rows if r["method"] == "fixed K=2")
    assert spec["acceptance_by_position"][0] is not None and spec["mean_accepted_length"] > 0
    assert all(a is None for a in next(r for r in rows if r["method"] == "plain")["acceptance_by_position"])
    table = serving.format_table(rows)
    assert "| fixed K=2 | 200 |" in table and "all at once" in table
    assert serving.plot(rows, tmp_path, "serve") == ["serve-latency.png", "serve-itl-cdf.png"]
    assert (tmp_path / "serve-latency.png").stat().st_size > 0
