"""The verification budget across a batch: ``threshold="auto"`` at batch size > 1.

Its arithmetic against hand computation, its decisions against the cost table (cheap verification: deep
rounds; dear verification: rounds of plain decoding), greedy output equal to target-only decoding, the
chi-square test of its sampled output (including the rounds that keep no slot), and batch size 1 untouched."""

from __future__ import annotations

import math

import pytest
import torch

from models import make_pair
from stats import assert_follows
from support import TEST_BATCH_COSTS, TEST_COSTS, constant_head, exact_marginals, head_for
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.policies.budget import EARLY_ROUNDS, LONG_SAMPLES, READS_FREE_STEPS, BatchBudget
from specdec_ext.policies.costs import BatchCosts
from specdec_ext.policies.drift import DriftFilter

# verification that grows fast with tokens (a CPU with many rows): slots rarely pay
DEAR = BatchCosts([1, 8192], [[10.0 + 10.5 * k for k in range(9)]] * 2, [[10.0 * n for n in range(1, 10)]] * 2)
# in between: the batch drafts a few candidates and drops the slots whose survival does not pay
MID = BatchCosts([1, 8192], [[10.0 + 2.5 * k for k in range(9)]] * 2, [[10.0 + 2.0 * (n - 1) for n in range(1, 10)]] * 2)


def go_on(budget, k: int, survival: torch.Tensor) -> bool:
    """The one-step rule as the round's head rule applies it (``policies/specdecpp.py``): the batch drafts candidate
    k + 1 while its rows' summed survivals S_bk ``[B]`` reach :meth:`BatchBudget.go_threshold`."""
    return float(survival.double().sum()) >= budget.go_threshold(survival.shape[0], k)


def test_batch_costs_interpolate_by_rows_and_tokens():
    c = BatchCosts([1, 4, 16], [[1.0, 2.0], [2.0, 3.0], [8.0, 12.0]],
                   [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [8.0, 16.0, 24.0]])
    assert c.verify(4, 2) == 4.0 and c.verify(10, 1) == pytest.approx(5.0)   # halfway from 4 to 16 rows
    assert c.verify(32, 3) == pytest.approx(48.0) and c.verify(16, 5) == pytest.approx(40.0)  # beyond: scaled
    assert c.round(10, 1) == pytest.approx(7.5) and c.round(4, 3) == pytest.approx(5.0) and c.round(1, 0) == 1.0
    assert BatchCosts.from_json(c.to_json()).round_ms == c.round_ms
    with pytest.raises(ValueError, match="increasing sizes"):
        BatchCosts([4, 1], [[1.0], [1.0]], [[1.0], [1.0]])


def test_batch_costs_grow_with_the_cache_width():
    c = BatchCosts([1, 4], [[5.0, 20.0, 30.0]] * 2, [[10.0, 12.0, 14.0]] * 2, {}, 100, 500, [[30.0, 40.0, 50.0]] * 2)
    assert c.verify(4, 1) == 10.0 and c.verify(4, 1, 100) == 10.0
    assert c.verify(4, 1, 300) == pytest.approx(20.0) and c.verify(4, 2, 300) == pytest.approx(26.0)
    assert c.verify(4, 1, 900) == pytest.approx(50.0)     # beyond the wide width: the same slope
    assert c.verify(4, 1, 0) == pytest.approx(5.0) and c.verify(4, 1, -10**4) == pytest.approx(2.5)  # floor: a quarter
    # a round moves with the width by what its verification (k + 1 tokens) moves
    assert c.round(4, 1, 300) == pytest.approx(20.0 + 26.0 - 12.0) and c.round(4, 0, 300) == pytest.approx(15.0)
    back = BatchCosts.from_json(c.to_json())
    assert (back.context, back.wide_context, back.verify(4, 2, 300)) == (100, 500, pytest.approx(26.0))
    with pytest.raises(ValueError, match="wide_context"):
        BatchCosts([1], [[1.0]], [[1.0]], {}, 0, 500, [[2.0]])


def test_rows_of_the_table_equal_its_single_entries_and_the_budget_recomputes_them_after_a_measurement():
    """``round_row`` / ``verify_row`` (every depth at once, as the budget reads them each round) give exactly what
    ``round`` / ``verify`` give one depth at a time, at every batch size and width; the budget's per-round copy of
    its modelled costs follows a new measurement and a new width."""
    c = BatchCosts([1, 4, 16], [[5.0, 20.0, 30.0], [6.0, 21.0, 33.0], [9.0, 30.0, 45.0]],
                   [[10.0, 12.0, 14.0], [11.0, 13.0, 16.0], [15.0, 19.0, 26.0]], {}, 100, 500,
                   [[30.0, 40.0, 50.0], [31.0, 43.0, 52.0], [40.0, 60.0, 80.0]])
    narrow = BatchCosts(c.sizes, c.round_ms, c.verify_ms)
    for table in (c, narrow):
        for B in (1, 3, 4, 9, 16, 40):
            for width in (None, 0, 100, 137, 500, 2000, -10**4):
                assert table.round_row(B, 4, width) == [table.round(B, k, width) for k in range(5)], (B, width)
                assert table.verify_row(B, 5, width) == [table.verify(B, n, width) for n in range(1, 6)], (B, width)
    b = BatchBudget(c, depth_max=4)
    b.reset(4)
    b.width = 137
    before = [b._round(4, k) for k in range(5)]
    assert before == [c.round(4, k, 137) for k in range(5)]   # nothing measured: the table's costs
    b.log_ratio = [0.0, math.log(2.0), None, None, None]      # depth 1 measured at twice depth 0's ratio
    assert [b._round(4, k) for k in range(5)] == [before[0]] + [2.0 * x for x in before[1:]]
    b.update(4, 0, 0, 4)
    b._cold = False
    b.observe(4.0 * c.round(4, 0, 137))                       # a plain step at 4x the table: depth 0's ratio moves
    assert b._round(4, 0) == pytest.approx(before[0]) and b._round(4, 1) < 2.0 * before[1]
    b.width = 300
    assert b._round(4, 2) == pytest.approx(c.round(4, 2, 300) * b.calibration(2))


def test_plan_drafts_only_when_a_depth_pays_and_probes_at_doubling_intervals():
    b = BatchBudget(DEAR, probe=3, measure=False)  # the table decides
    b.reset(8)
    plans = [b.plan(8, 64) for _ in range(14)]
    assert plans == [False] * 3 + [True] + [False] * 6 + [True] + [False] * 3, plans
    assert b.width == 64
    b.update(8, 1, 1, 12, torch.full((8, 1), 0.9))  # a probe whose slot paid: the interval starts again
    assert [b.plan(8, 64) for _ in range(8)] == [True] + [False] * 6 + [True]
    cheap = BatchBudget(TEST_BATCH_COSTS, measure=False)  # nothing measured: the table decides, no plain probes
    cheap.reset(8)
    assert all(cheap.plan(8, 64) for _ in range(20)) and cheap.cap == 8
    # the running mean survival of each slot follows the drafted rounds: the prior counts as one round, then
    # weights 1/3, 1/4 and from the fourth round on 0.2
    cheap.update(8, 2, 2, 20, torch.tensor([[1.0, 0.5]] * 8))
    assert cheap.gain[:3] == pytest.approx([0.5 * 0.7 + 0.5, 0.5 * 0.49 + 0.25, 0.343])
    for _ in range(5):
        cheap.update(8, 1, 1, 12, torch.full((8, 1), 0.6))
    g = 0.85
    for w in (1 / 3, 1 / 4, 0.2, 0.2, 0.2):
        g = (1 - w) * g + w * 0.6
    assert cheap.gain[0] == pytest.approx(g)


def _play(b, B, true_ms, rounds, survival=0.8):
    """Plan ``rounds`` rounds; every drafted slot has survival ``survival`` (S_bj = survival ** j) and the head is
    right on average, so a round drafting c candidates emits B (1 + sum_{j<=c} survival ** j) tokens; it takes
    ``true_ms(c)`` ms, whatever the table says. Returns each round's cap."""
    caps = []
    for _ in range(rounds):
        b.plan(B, 64)
        c = b.cap
        caps.append(c)
        S = torch.tensor([survival ** j for j in range(1, c + 1)], dtype=torch.float64).expand(B, c)
        b.update(B, c, c, round(B * (1 + float(S[0].sum()))), S if c else None)
        b.observe(true_ms(c))
    return caps


def test_measured_costs_steer_the_depth_and_its_neighbours_are_probed():
    """Measured rounds correct the table per drafted depth: the budget measures each depth 0..4 once (nearest the
    table's best first), then drafts at the depth of best expected goodput under the measured costs, and plays
    its two neighbours again at doubling intervals."""
    # the table says every candidate costs 1.6 ms (drafting 8 pays); the rounds say 10 ms per candidate
    # explore_within=0.5: depth 1 (measured 10-30% below plain) is still probed
    b = BatchBudget(TEST_BATCH_COSTS, probe=2, explore_within=0.5)
    dear_slots = lambda c: 10.0 + 10.0 * c
    # goodput by depth at survival 0.8: (1 + 0.8 + ... ) / (10 + 10 c): c = 1: 0.09, c = 2: 0.08, c = 0: 0.1 per row
    # per ms, so plain steps are best; with survival 0.95 and 4 ms per candidate, c = 4..5 are best
    caps = _play(b, 4, dear_slots, 40)
    # the call's first round is not measured (cold), so it explores nothing: the table's best depth (prior survival
    # 0.7 ** j, 1.6 ms per candidate: 3) with one more slot for the one-step rule (headroom); then each depth 0..4
    # once, the unmeasured one nearest the best first (4 once slot 3 was seen to survive)
    assert caps[:6] == [4, 3, 4, 2, 1, 0], caps
    assert caps[6:].count(0) >= 26 and max(caps[6:]) == 1, caps
    probes = [i for i, c in enumerate(caps) if c == 1 and i > 6]
    gaps = [j - i for i, j in zip(probes, probes[1:])]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0], caps
    assert b.calibration(1) == pytest.approx(20.0 / 11.6 / (10.0 / 10.0))  # depth 1's own rounds' ratio

    b = BatchBudget(TEST_BATCH_COSTS, probe=2)
    caps = _play(b, 4, lambda c: 10.0 + 4.0 * c, 40, survival=0.95)
    # plain steps and rounds of one candidate are expected to do more than 15% worse than the best depth
    # (explore_within): they are never explored
    assert sorted(caps[1:4]) == [2, 3, 4] and b.log_ratio[0] is None and b.log_ratio[1] is None, caps
    settled = caps[6:]
    assert 0 not in settled and min(settled) >= 2 and sum(c >= 4 for c in settled) >= 20, caps
    # without measurements the table decides, and drafting is never capped
    table_only = BatchBudget(TEST_BATCH_COSTS, measure=False)
    table_only.reset(4)
    assert set(_play(table_only, 4, dear_slots, 10)) == {8} and table_only.log_ratio == [None] * 9


def test_a_neighbour_far_below_the_best_is_not_probed_once_its_first_rounds_set_its_cost():
    """Probes, like explorations, are spent only on a neighbour expected within ``explore_within`` of the best
    depth: a depth measured far below plain decoding (at B = 64 on a 2-core CPU, depth 1 measured 10-40% below,
    and each probe made the draft read every unread row's context) is not played again while it stays there, once
    its first ``EARLY_ROUNDS`` rounds have set its cost. Until then it is probed on the neighbours' schedule: one
    round alone may have stalled (on the bundled pair at B = 4, bf16, 2-core AMD EPYC, a trial budget without the
    one-step rule's extra slot measured depth 2 once, at about half its goodput, and never played it again)."""
    very_dear = lambda c: 10.0 + 25.0 * c  # depth 1 at survival 0.8: 1.8 / 35 per row and ms, 49% below plain's 0.1
    for within, probed in ((0.15, False), (0.6, True)):
        b = BatchBudget(TEST_BATCH_COSTS, probe=2, explore_within=within)
        caps = _play(b, 4, very_dear, 60)
        explored = caps.index(1)  # depth 1's first round (an exploration), then plain steps are best
        assert caps[explored + 1] == 0 and max(caps[explored + 1 :]) == 1, caps
        ones = [i for i, c in enumerate(caps) if c == 1]
        # probed at doubling intervals until its first rounds are measured, and with a wide explore_within after
        assert len(ones) == EARLY_ROUNDS if not probed else len(ones) > EARLY_ROUNDS, (within, caps)
        gaps = [j - i for i, j in zip(ones, ones[1:])]
        assert gaps == sorted(gaps) and gaps[-1] > gaps[0], caps
        assert len(b._early[1]) == EARLY_ROUNDS and b.log_ratio[1] > b.log_ratio[0] + math.log(2.0)


def test_probes_of_drafting_from_plain_decoding_wait_until_the_reads_they_need_are_a_small_share():
    """While plain steps are best, a probe of drafting would first make the draft read every unread live row's
    context (``draft_reads``; at B = 64 on a 2-core CPU some 110 ms, four plain steps, and the probe broke plain
    decoding's lockstep); it waits until those reads are at most ``probe_read_share`` of the plain steps' measured
    ms since the batch last drafted. With nothing to read, or reads worth at most READS_FREE_STEPS plain steps,
    probes keep their doubling schedule."""
    dear = lambda c: 10.0 + 10.0 * c  # plain steps best at survival 0.8 (test above)

    def probes(read_ms, share=0.02):
        b = BatchBudget(TEST_BATCH_COSTS, probe=2, explore_within=0.5, probe_read_share=share)
        caps = []
        for _ in range(160):
            b.read_ms = read_ms
            caps += _play(b, 4, dear, 1)
        settled = next(i for i, c in enumerate(caps) if c == 0) + 1
        return [i for i, c in enumerate(caps) if c >= 1 and i >= settled]

    free = probes(0.0)
    assert len(free) >= 3, free  # the doubling schedule: 2, 4, 8, ... rounds
    assert probes(500.0) == []  # 500 ms of reads: 2% of 25 s of plain steps, never reached in 160 rounds of 10 ms
    assert probes(READS_FREE_STEPS * 10.0 - 1.0) == free  # reads worth fewer plain steps than that: no wait
    spaced = probes(45.0, share=0.1)  # 45 ms of reads: one probe per 45 ms / 0.1 = 450 ms of plain steps at most
    assert 2 <= len(spaced) < len(free) and all(j - i >= 45 for i, j in zip(spaced, spaced[1:])), (spaced, free)
    waited = probes(45.0, share=1.0)  # reads up to the whole of the plain time: the schedule, some 5 steps later
    assert len(waited) == len(free) and all(0 < w - f <= 6 for w, f in zip(waited, free)), (waited, free)
    with pytest.raises(ValueError, match="probe_read_share"):
        BatchBudget(TEST_BATCH_COSTS, probe_read_share=0.0)


def test_survival_estimates_revert_to_their_long_run_means_where_a_round_samples_none():
    """A plain step samples no survival, a round of one candidate none of slot 2: there the short running means
    (weight 0.2) move ``revert`` of the way back to the long-run means (weight ``long_decay``), so a stretch of poor
    rounds does not keep the batch in plain steps until a probe happens to sample better. A new call starts from
    the long-run means of the slots sampled in at least LONG_SAMPLES rounds, from the prior elsewhere."""
    def budget(revert):
        b = BatchBudget(TEST_BATCH_COSTS, probe=1000, explore_within=0.5, score_every=1, revert=revert)
        b.reset(4)
        _play(b, 4, lambda c: 10.0 + 1.0 * c, 40, survival=0.9)  # cheap slots: deep rounds, every one scored
        _play(b, 4, lambda c: 10.0 + 1.0 * c, 6, survival=0.3)   # a poor stretch
        return b

    b, kept = budget(0.2), budget(0.0)
    long = b._long_gain()
    # every round a fair sample: the long-run means are the means over the 46 rounds so far (weight 1/n until
    # 1/n falls to long_decay)
    assert long[:2] == pytest.approx([(40 * 0.9 + 6 * 0.3) / 46, (40 * 0.81 + 6 * 0.09) / 46], abs=0.02)
    low, kept_low = list(b.gain[:2]), list(kept.gain[:2])
    assert low[0] < long[0] - 0.2 and kept_low[0] < long[0] - 0.2
    for _ in range(5):
        b.update(4, 0, 0, 4)      # plain steps
        kept.update(4, 0, 0, 4)
    assert kept.gain[:2] == pytest.approx(kept_low)  # revert=0: as they were
    moved = [(g - l) / (h - l) for g, l, h in zip(b.gain[:2], low, long)]
    assert moved == pytest.approx([1 - 0.8 ** 5] * 2)  # 0.2 of the way back per plain step
    b.plan(4, 64), b.update(4, 1, 1, 6, torch.full((4, 1), 0.3, dtype=torch.float64))  # slot 1 sampled, slot 2 not
    assert b.gain[1] == pytest.approx(long[1] - 0.8 ** 6 * (long[1] - low[1]))
    long = b._long_gain()
    b.reset(4)
    assert b.gain[:2] == pytest.approx(long[:2]) and b._seen >= 2
    sparse = BatchBudget(TEST_BATCH_COSTS, probe=1000, explore_within=0.5, score_every=1)
    sparse.reset(4)
    _play(sparse, 4, lambda c: 10.0 + 1.0 * c, LONG_SAMPLES - 1, survival=0.9)
    sparse.reset(4)
    assert sparse._long_gain()[0] is None and sparse.gain[0] == pytest.approx(0.7)  # too few samples: the prior
    with pytest.raises(ValueError, match="revert"):
        BatchBudget(TEST_BATCH_COSTS, revert=1.5)
    with pytest.raises(ValueError, match="long_decay"):
        BatchBudget(TEST_BATCH_COSTS, long_decay=0.0)


def test_a_near_tie_between_plain_steps_and_drafting_keeps_the_batch_where_it_is():
    """switch_margin: the batch goes from plain steps to drafting, or back, only when the other side's best depth is
    expected to do better by more than the margin (each switch to drafting costs the draft's catch-up on the tokens
    it missed); a near tie keeps it where it is, a clear gain moves it. From plain steps (a batch size's first round
    counts as such), a depth not measured yet must do better by more than explore_within."""
    costs = BatchCosts([1, 64], [[10.0 + 6.0 * k for k in range(9)]] * 2, [[10.0] * 9] * 2)

    def cap(previous, g1, margin=0.03):  # plain step: 4 / 10 tokens per ms; one candidate: 4 (1 + g1) / 16
        b = BatchBudget(costs, probe=1000, headroom=0.0, switch_margin=margin)
        b.reset(4)
        b.log_ratio = [0.0] * 9  # every depth measured at the table's cost: no exploration
        b.gain, b._seen = [g1] + [0.0] * 7, 8
        b._best, b._cold = previous, False
        b.plan(4, None)
        return b.cap

    assert cap(0, 0.61) == 0 and cap(0, 0.61, margin=0.0) == 1  # drafting 0.6% better: plain steps go on
    assert cap(0, 0.70) == 1                                     # 6% better: the batch drafts
    assert cap(1, 0.59) == 1 and cap(1, 0.59, margin=0.0) == 0  # plain steps 0.6% better: drafting goes on
    assert cap(1, 0.50) == 0                                     # 6% better: plain steps
    with pytest.raises(ValueError, match="switch_margin"):
        BatchBudget(costs, switch_margin=-0.1)

    def first_cap(g1, measured):  # a batch size's first round (counts as plain steps), depth 1 measured or not
        b = BatchBudget(costs, probe=1000, headroom=0.0)
        b.reset(4)
        if measured:
            b.log_ratio = [0.0] * 9
        b.gain, b._seen = [g1] + [0.0] * 7, 8
        b.plan(4, None)
        return b.cap

    # a depth not measured must beat plain steps by more than explore_within (0.15), the table's trusted error
    assert first_cap(0.76, measured=False) == 0 and first_cap(0.92, measured=False) == 1  # +10%, +20%
    assert first_cap(0.76, measured=True) == 1  # measured: the switch margin alone


def test_rows_in_lockstep_leave_plain_steps_only_for_a_clear_gain():
    """lockstep (off by default): while the engine says the rows are together (rows_together), from plain steps (or a
    call's first round) the batch drafts only where its best depth is expected to beat plain steps by more than
    explore_within, measured or not, and it neither explores nor probes a drafting depth; out of lockstep, or with
    lockstep=False, the switch margin alone decides, as before; a batch already drafting goes on."""
    costs = BatchCosts([1, 64], [[10.0 + 6.0 * k for k in range(9)]] * 2, [[10.0] * 9] * 2)

    def cap(g1, together, previous=0, cold=False, lockstep=True, measured=True):
        b = BatchBudget(costs, probe=1000, headroom=0.0, lockstep=lockstep)
        b.reset(4)
        # every depth measured at the table's cost (no exploration), or plain steps alone
        b.log_ratio = [0.0] * 9 if measured else [0.0] + [None] * 8
        b.gain, b._seen = [g1] + [0.0] * 7, 8
        b._best, b._cold, b.together = previous, cold, together
        b.plan(4, None)
        return b.cap, b.forced

    # plain step: 4 / 10 tokens per ms; one candidate: 4 (1 + g1) / 16
    assert cap(0.76, together=False) == (1, False)                  # +10%: out of lockstep the batch drafts
    assert cap(0.76, together=True) == (0, False)                   # together: +10% is not enough
    assert cap(0.76, together=True, previous=1, cold=True) == (0, False)  # nor in a call's first round
    assert cap(0.76, together=True, lockstep=False) == (1, False)   # the rule switched off
    assert cap(0.92, together=True) == (1, False)                   # +20%: the batch drafts
    assert cap(0.76, together=True, previous=1) == (1, False)       # already drafting: it goes on
    # an unmeasured depth 1 expected 10% below plain steps, within explore_within: explored out of lockstep only
    assert cap(0.44, together=False, measured=False) == (1, True)
    assert cap(0.44, together=True, measured=False) == (0, False)


def test_an_unmeasured_depth_takes_the_nearest_measured_ratio():
    """Each depth's cost ratio is its own estimate; a depth not measured takes the nearest measured depth's (the lower
    on a tie), and with nothing measured every ratio is 0 (the table as it is)."""
    costs = BatchCosts([1, 64], [[10.0 + 4.0 * k for k in range(9)]] * 2, [[10.0 + 2.0 * (n - 1) for n in range(1, 10)]] * 2)
    b = BatchBudget(costs)
    b.reset(4)
    assert all(b.calibration(j) == 1.0 for j in range(9))
    b.log_ratio = [0.0, None, 0.5, None, None, None, None, None, -0.2]
    b._measured()
    assert b.calibration(3) == b.calibration(4) == pytest.approx(math.exp(0.5)) and b.calibration(1) == 1.0
    assert b.calibration(5) == pytest.approx(math.exp(0.5)) and b.calibration(6) == pytest.approx(math.exp(-0.2))


def test_measured_costs_carry_over_to_the_next_call_at_the_same_batch_size():
    """The per-depth cost ratios and the head's calibration are the pair's and the machine's: a second call at the
    same batch size starts from them (no depth is measured again first); a call at another batch size does not.
    The running survivals start from the prior until a slot has been sampled in LONG_SAMPLES rounds (then from its
    long-run mean: the test after this one)."""
    b = BatchBudget(TEST_BATCH_COSTS, probe=2, explore_within=0.5)
    b.reset(4)                                # a call of 4 rows
    first = _play(b, 4, lambda c: 10.0 + 10.0 * c, 12)
    assert sorted(first[1:6]) == [0, 1, 2, 3, 4]
    ratios, calibrations = list(b.log_ratio), [b.calibration(k) for k in range(9)]
    b.reset(4)
    assert b.log_ratio == ratios and b.gain[0] == pytest.approx(0.7)
    # the head's calibration was measured in fewer than LONG_SAMPLES rounds: the next call starts from the prior
    # (the test of the calibration's long-run terms below)
    assert b._long["calibrated"] < LONG_SAMPLES and b.head_scale == 1.0
    assert [b.calibration(k) for k in range(9)] == calibrations  # the line's weights carried over too
    schedule = (list(b._every), b._best)
    again = _play(b, 4, lambda c: 10.0 + 10.0 * c, 6)
    # plain steps from the start, depth 1 at most probed as a neighbour on the schedule the first call left
    assert again[0] == 0 and set(again) <= {0, 1}, again
    assert schedule[1] == 0 and schedule[0][1] > 2  # the neighbour kept losing in the first call: probed less often
    b.reset(8)
    assert b.log_ratio == [None] * 9 and b.head_scale == 1.0
    b.reset(4)
    assert all(r is not None for r in b.log_ratio[:5])
    table_only = BatchBudget(TEST_BATCH_COSTS, measure=False)
    table_only.reset(4)
    _play(table_only, 4, lambda c: 10.0 + 10.0 * c, 4)
    table_only.reset(4)
    assert table_only.log_ratio == [None] * 9


def test_the_heads_calibration_carries_over_only_from_enough_rounds():
    """The head's calibration a (accepted tokens over predicted survival) keeps long-run terms that are a mean over
    their first rounds, then a running mean, and that a plain step reverts the short terms to and a new call starts
    from only once LONG_SAMPLES rounds measured them, so one round that accepted nothing (the bench's warm-up call)
    cannot hold a near 0 for the rounds after it."""
    b = BatchBudget(TEST_BATCH_COSTS, probe=1000, explore_within=0.5)
    b.reset(4)
    half = torch.full((4, 1), 0.5)  # each row's one verified slot predicted to survive with 0.5: 2.0 tokens

    def round_(accepted):  # a round of one candidate per row that accepted ``accepted`` tokens over the batch
        b.plan(4, None)
        b.update(4, 1, 1, 4 + accepted, half)
        b.observe(10.0)

    round_(0)                          # the first round accepts nothing: a = 0, clipped to 1/2
    assert b.head_scale == 0.5
    b.reset(4)
    assert b.head_scale == 1.0         # one round: not carried over
    for _ in range(LONG_SAMPLES):
        round_(3)                      # then rounds that accept 1.5x what the head predicts
    long_accepted = 3.0 * LONG_SAMPLES / (LONG_SAMPLES + 1)  # the mean of 0 and LONG_SAMPLES 3s
    assert b._long_calibration() == pytest.approx((long_accepted, 2.0))
    assert b.head_scale == pytest.approx(1.5)     # the short terms: from the first of these rounds on
    b.reset(4)
    assert b.head_scale == pytest.approx(long_accepted / 2.0)  # from the long-run terms
    b.accuracy, b._accepted, b._predicted = 0.5, 1.0, 2.0  # a stretch put the short terms low: plain steps revert
    for _ in range(10):                                   # them, 0.2 of the way a step, to the long-run terms
        b.plan(4, None)
        b.update(4, 0, 0, 4)
    assert b.head_scale == pytest.approx((1.0 + (long_accepted - 1.0) * (1 - 0.8 ** 10)) / 2.0)


def test_calibration_scales_speculative_costs_by_what_was_measured():
    """Measured rounds twice as dear as the table says (plain steps as the table says) double every modelled cost of
    a speculative round: the batch drafts and verifies less deep than a twin that trusts the table."""
    batch = BatchCosts([1, 64], [[10.0, 13.0, 16.0, 19.0, 22.0]] * 2, [[10.0, 11.0, 12.0, 13.0, 14.0]] * 2)
    S = torch.tensor([[0.9, 0.45, 0.15], [0.9, 0.45, 0.15]])
    b, twin = BatchBudget(batch), BatchBudget(batch, measure=False)
    for x in (b, twin):
        x.reset(2)
        for ms in (10.0 ** 6, 10.0):                 # the first round is not measured (cold); then a plain step
            x.update(2, 0, 0, 2)                     # as modelled
            x.observe(ms)
    assert b.calibration(3) == 1.0                   # only depth 0 measured: every depth takes its ratio
    for _ in range(30):
        for x in (b, twin):
            x.update(2, 3, 3, 5, S)
            x.observe(2 * 19.0)                      # a round of 3 candidates: twice the table's 19 ms
    assert b.calibration(3) == pytest.approx(2.0) and twin.calibration(3) == 1.0
    assert b.calibration(2) == pytest.approx(2.0)    # unmeasured depths take the nearest measured depth's ratio
    assert b.calibration(1) == 1.0                   # ... the lower one on a tie (depth 0)
    assert b._round(2, 3) == pytest.approx(38.0) and b._round(2, 0) == pytest.approx(10.0)
    # the head's calibration: 3 accepted tokens for survivals summing to 3.0 over the verified slots
    assert b.head_scale == pytest.approx(1.0) and twin.head_scale == 1.0
    # the twin: lambda 5 / 19 tokens/ms, slot 3 pays for its 1 ms of verification, slot 2 for its 3 ms round cost
    assert int(twin.depth(S)) == 3 and go_on(twin, 1, torch.tensor([0.9, 0.9]))
    # calibrated: lambda at plain decoding's 0.2 tokens per plain-step ms (the rounds, 5 tokens in 38, do worse),
    # every speculative ms counted twice
    assert int(b.depth(S)) == 2 and not go_on(b, 1, torch.tensor([0.9, 0.9]))
    b.observe(10.0 ** 6)                             # nothing to attribute it to (no round updated since): ignored
    assert b.calibration(3) == pytest.approx(2.0)


def test_the_heads_measured_calibration_scales_the_expected_tokens():
    """Rows that accept twice the tokens their survivals predict count their slots twice (clipped to [1/2, 2])."""
    b = BatchBudget(TEST_BATCH_COSTS)
    b.reset(2)
    S = torch.tensor([[0.5, 0.25], [0.5, 0.25]])
    b.update(2, 2, 2, 2 + 3, S)                      # 3 accepted where the survivals sum to 1.5
    assert b.head_scale == pytest.approx(2.0)
    b.update(2, 2, 2, 2 + 6, S)
    assert b.head_scale == 2.0                       # the running ratio is 2.4: clipped
    g = b._survival_sums()[2]
    assert b.expected_goodput(2, 2) == pytest.approx(2 * (1 + 2.0 * g) / b._round(2, 2))
    b.accuracy = 0.1
    assert b.head_scale == 0.5 and b.expected_goodput(2, 2) == pytest.approx(2 * (1 + 0.5 * g) / b._round(2, 2))


def test_budget_depth_and_go_on_by_hand():
    batch = BatchCosts([1, 64], [[10.0, 15.5, 21.0, 26.5]] * 2, [[10.0, 14.0, 18.0, 22.0]] * 2)
    b = BatchBudget(batch)
    b.reset(2)
    lam = 2 / 10.0  # plain decoding's goodput: 2 rows per 10 ms
    assert b.rate == pytest.approx(lam)
    # slot k + 1 costs T(k + 1) - T(k) = 5.5 ms: worth 1.1 tokens at lambda = 0.2; it is expected to add
    # sum_b S_b1 * rho_1, rho_1 = g_2 / g_1 = 0.7 from the prior mean survivals 0.7, 0.49
    assert b._next_ratio(1) == pytest.approx(0.7)
    assert go_on(b, 1, torch.tensor([0.8, 0.8])) and not go_on(b, 1, torch.tensor([0.75, 0.75]))
    # depth: gains 0, 1.5, 2.1, 2.3 against lambda * verify = 2.0, 2.8, 3.6, 4.4 -> values -2, -1.3, -1.5, -2.1
    S = torch.tensor([[0.9, 0.4, 0.1], [0.6, 0.2, 0.1]])
    assert int(b.depth(S)) == 1
    assert int(b.depth(torch.full((2, 3), 0.05))) == 0  # nothing pays for its verification: plain decoding
    b.update(2, drafted=3, depth=1, emitted=4)  # the round cost T(3) less the verification it did not do
    assert b.rate == pytest.approx((0.8 * 10 + 0.2 * 4) / (0.8 * 50 + 0.2 * (26.5 - (22.0 - 14.0))))


def _ids(B, V, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, V, (B, T), generator=g)


@pytest.mark.parametrize("batch", [TEST_BATCH_COSTS, MID, DEAR], ids=["flat", "mid", "dear"])
def test_budget_greedy_equals_target_only_and_follows_the_costs(batch):
    target, draft = make_pair("llama", noise=0.3)
    head = head_for(draft, kind="proposal")
    ids = _ids(6, target.config.vocab_size)
    plain = SpeculativeGenerator(target, policy="autoregressive").generate(ids, max_new_tokens=24, temperature=0)
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=8,
                               costs=TEST_COSTS, batch_costs=batch, measured_costs=False)  # decisions from the table
    seen = []
    observe = gen.policy.observe
    gen.policy.observe = lambda result: (seen.append(result.ms), observe(result))
    out = gen.generate(ids, max_new_tokens=24, temperature=0)
    assert out.new_tokens == plain.new_tokens
    assert seen == [r.total_ms for r in out.stats.rounds]  # the engine reports every round's measured time
    lengths = [max(r.candidates) for r in out.stats.rounds]
    if batch is DEAR:
        assert max(lengths) == 0   # every round one token per row: no slot pays for its verification
        # and the draft does not run in most of them (plain steps; the draft catches up when it probes)
        assert out.stats.draft_calls < len(out.stats.rounds) / 2, (out.stats.draft_calls, len(out.stats.rounds))
    elif batch is TEST_BATCH_COSTS:
        assert sum(lengths) / len(lengths) > 3 and out.stats.accepted > 0
    else:
        assert 0 < sum(lengths) / len(lengths) < 8
    # rows of a round verify the same number of slots (the budget is a depth), capped by what each may still emit
    remaining = [24] * 6
    for r in out.stats.rounds:
        D = max(r.candidates)
        for row, c, e in zip(r.rows, r.candidates, r.emitted):
            assert c == D or c == remaining[row] - 1, (r, remaining)
            remaining[row] -= e


def test_batch_size_one_keeps_the_per_row_rule():
    target, draft = make_pair("llama", noise=0.3)
    head = constant_head(draft, 0.7, "proposal")
    ids = _ids(1, target.config.vocab_size)
    runs = [SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=8,
                                 costs=TEST_COSTS, batch_costs=b).generate(ids, max_new_tokens=30, temperature=0)
            for b in (DEAR, TEST_BATCH_COSTS)]
    assert [r.candidates for r in runs[0].stats.rounds] == [r.candidates for r in runs[1].stats.rounds]
    assert runs[0].stats.mean_candidate_length > 1


N_ROWS, N_POS = 3000, 3


@pytest.mark.slow
@pytest.mark.parametrize("batch", [MID, DEAR], ids=["mid", "dear"])
def test_budgeted_sampling_is_lossless(batch):
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    cfg = SamplingConfig(1.0)
    marg = exact_marginals(target, prompt, cfg, N_POS)
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"),
                               threshold="auto", k_max=6, costs=TEST_COSTS, batch_costs=batch)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=1.0, seed=1000)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marg[i], f"budget {batch.verify(1, 2)}, position {i + 1}")
    depths = [max(r.candidates) for r in out.stats.rounds]
    assert (0 in depths) if batch is DEAR else (out.stats.accepted > 0 and out.stats.discarded > 0)


def test_profiles_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The single-row and the batch profiles of a tiny pair: positive, of the documented shapes, cached as JSON
    and read back (not measured again); the batch table measures only the sizes a call needs and adds a larger
    call's sizes to the cached ones; a damaged cache file is measured again."""
    from specdec_ext.engine import profile

    target, draft = make_pair("llama", noise=0.3)
    real = profile.profile_batches
    measured_sizes = []

    def small(t, d, f, sizes, log=None, generator_cls=None, fast_target=True):
        measured_sizes.append(list(sizes))
        return real(t, d, f, sizes=sizes, ks=(0, 1, 3), tokens=4, reps=1, context=8, generator_cls=generator_cls,
                    fast_target=fast_target)

    monkeypatch.setattr(profile, "profile_batches", small)
    kw = dict(directory=tmp_path, progress=False, generator_cls=SpeculativeGenerator)
    assert profile.sizes_for(1) == [1] and profile.sizes_for(3) == [1, 2, 4] and profile.sizes_for(100) == \
        [1, 2, 4, 8, 16, 32, 64, 100]
    batch = profile.cached_batch_profile(target, draft, sizes=profile.sizes_for(2), **kw)
    assert batch.sizes == [1, 2] and [len(r) for r in batch.round_ms] == [4, 4] and len(batch.verify_ms[0]) == 4
    assert all(x > 0 for r in batch.round_ms + batch.verify_ms for x in r)
    wider = profile.cached_batch_profile(target, draft, sizes=profile.sizes_for(3), **kw)
    assert measured_sizes == [[1, 2], [4]] and wider.sizes == [1, 2, 4]
    assert wider.round_ms[:2] == batch.round_ms and wider.verify_ms[:2] == batch.verify_ms
    costs = profile.cached_profile(target, draft, k_max=3, **kw)
    assert len(costs.verify_ms) == 4 and costs.draft_ms > 0
    files = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len(files) == 2 and sum(f.endswith("-batch4.json") for f in files) == 1

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(profile, "profile_batches", fail)
    monkeypatch.setattr(profile, "profile_pair", fail)
    assert profile.cached_batch_profile(target, draft, sizes=[1, 4], **kw).round_ms == wider.round_ms
    assert profile.cached_profile(target, draft, k_max=3, **kw).verify_ms == costs.verify_ms
    with pytest.raises(AssertionError, match="measured again"):  # a size the cache lacks
        profile.cached_batch_profile(target, draft, sizes=[8], **kw)
    bad = next(p for p in (tmp_path / "profiles").iterdir() if p.name.endswith("-batch4.json"))
    bad.write_text("{not json")
    with pytest.raises(AssertionError, match="measured again"):
        profile.cached_batch_profile(target, draft, sizes=[1], **kw)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        profile.sizes_for(0)


def test_prepare_measures_what_the_policy_needs_before_the_first_call(tmp_path, monkeypatch):
    """SpeculativeGenerator.prepare(B): the single-row table, and the batch table at the sizes a call of B rows
    needs, for threshold="auto"; nothing for a policy without costs; a bad batch size is named."""
    from specdec_ext.engine import profile

    target, draft = make_pair("llama", noise=0.3)
    calls = []
    monkeypatch.setattr(profile, "cached_profile", lambda *a, **k: calls.append("pair") or TEST_COSTS)
    def table(*a, sizes, **k):
        calls.append(tuple(sizes))
        n = len(sizes)
        return BatchCosts(list(sizes), [TEST_BATCH_COSTS.round_ms[0]] * n, [TEST_BATCH_COSTS.verify_ms[0]] * n)

    monkeypatch.setattr(profile, "cached_batch_profile", table)
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=constant_head(draft, 0.8), threshold="auto")
    assert gen.prepare(3) >= 0 and calls == ["pair", (1, 2, 4)]
    first = gen.batch_costs(3)
    assert gen.batch_costs(2) is first and calls == ["pair", (1, 2, 4)]  # covered: the same table, not measured again
    assert gen.batch_costs(5).sizes == [1, 2, 4, 8] and calls[-1] == (1, 2, 4, 8)
    calls.clear()
    SpeculativeGenerator(target, draft, policy="fixed", k=2).prepare(4)
    assert calls == []
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        gen.prepare(0)


def test_a_modelled_round_never_falls_below_a_quarter_of_its_own_target_forward():
    """Whole rounds and target forwards are profiled apart; on small noisy timings a round can be measured cheaper
    than the forward inside it. The modelled round (also one that verifies fewer slots than it drafted) never falls
    below a quarter of its own forward (never to zero or below), and the budget's measured calibration stays
    finite (it raised a math domain error once, in the batch benchmark's test on a loaded machine)."""
    consistent = BatchCosts([1, 4], [[10.0, 13.0, 16.0, 19.0]] * 2, [[8.0, 9.0, 10.0, 11.0]] * 2)
    assert consistent.round(4, 3) == 19.0 and consistent.round(4, 3, verified=1) == 19.0 - (11.0 - 9.0)
    noisy = BatchCosts([1, 4], [[1.0, 1.1, 1.2, 1.3]] * 2, [[3.0, 4.0, 5.0, 6.0]] * 2)
    assert noisy.round(4, 0) == 1.0 and noisy.round(4, 3) == 1.5    # the table's 1.0; 1.3 below 6.0 / 4
    assert noisy.round(4, 3, verified=0) == 0.75   # 1.3 - (6.0 - 3.0) would be -1.7 ms
    b = BatchBudget(noisy)
    b.reset(4)
    for drafted, depth in ((0, 0), (0, 0), (3, 0), (3, 3)):  # the first round is not measured (cold)
        b.update(4, drafted, depth, 4, torch.full((4, drafted), 0.5) if drafted else None)
        b.observe(2.0)
    assert math.isfinite(b.calibration(3)) and b.calibration(3) > 0


def test_rounds_that_measure_a_depth_reach_it_and_an_unreachable_depth_is_tried_twice():
    """An exploration or probe round drafts to its cap whatever the survivals (else the depth it is to measure
    never is: go_on stopped such rounds at depth 1 and the budget explored for ever); rows that lack the room to
    reach a depth leave it unmeasured after two tries; at the best depth the rule decides again."""
    b = BatchBudget(TEST_BATCH_COSTS, probe=100)
    b.reset(4)
    nothing = torch.zeros(4)
    b.plan(4, 64)
    assert not b.forced  # a call's first round measures nothing (cold), so it explores nothing
    b.update(4, b.cap, b.cap, 8, torch.full((4, b.cap), 0.9))
    b.observe(20.0)
    b.plan(4, 64)
    assert b.forced and b.cap >= 2 and go_on(b, 1, nothing)   # exploring: on to the cap despite zero survivals
    assert not go_on(b, b.cap, torch.ones(4))
    # every round drafts only 2 candidates (the rows' room): depths 3 and 4 stay unmeasured, each tried twice
    caps = []
    for _ in range(12):
        b.plan(4, 64)
        caps.append(b.cap)
        d = min(b.cap, 2)
        b.update(4, d, d, 4 + 2 * d, torch.full((4, d), 0.9) if d else None)
        b.observe(10.0 + 2.0 * d)
    assert caps.count(3) <= 2 and caps.count(4) <= 2 and b.log_ratio[3] is None and b.log_ratio[4] is None, caps
    assert not b.forced and b.cap == caps[-1] and not go_on(b, 1, nothing)  # settled: the rule decides below the cap


def test_steady_rounds_score_the_capped_slot_one_round_in_score_every():
    b = BatchBudget(TEST_BATCH_COSTS, probe=100, score_every=4)
    b.reset(4)
    b.log_ratio = [0.0] * 9          # every depth measured: no exploration
    b.plan(4, 64)
    best = b.cap
    scored = []
    for _ in range(12):
        b.plan(4, 64)
        assert b.cap == best and b.forced == b.score_last  # a scored round drafts to the cap (a fair sample)
        scored.append(b.score_last)
    assert sum(scored) == 3 and scored.index(True) < 4, scored
    # a round whose survivals cover fewer slots than it verified updates those slots' means, not the head's scale
    g1, g2 = b.gain[0], b.gain[1]
    b.update(4, 2, 2, 4 + 6, torch.full((4, 1), 0.9))
    assert b.gain[0] != g1 and b.gain[1] == g2 and b.accuracy is None
    b.update(4, 2, 2, 4 + 6, torch.full((4, 2), 0.5))
    assert b.accuracy == pytest.approx(6 / 4.0)
    # slot 2 of a round the one-step rule carried on to (its slot-1 survivals were high) is not a fair sample of
    # slot 2's survival: only a round that drafted to its cap (forced) feeds slots past the first
    for forced in (False, True):
        b.forced = forced
        g1, g2 = b.gain[0], b.gain[1]
        b.update(4, 2, 2, 4 + 6, torch.full((4, 2), 0.95))
        assert b.gain[0] > g1 and (b.gain[1] > g2) == forced
    with pytest.raises(ValueError, match="score_every"):
        BatchBudget(TEST_BATCH_COSTS, score_every=0)


def play_round(pol, infos: list, accepted: list, ms: float = 0.0):
    """One round of policy ``pol`` as the engine plays it on 3 rows: ``plan``, its rule over the draft steps ``infos``
    (DraftStep, on the CPU), the rule's depth, its read-back as host lists, ``observe`` (with ``ms`` 0 the budget
    keeps the round's table cost, ``_last``, as a measured time would consume it). Returns the rule's stop flags per
    step (whether every row stopped), each row's verified count and the plan."""
    from specdec_ext.policies.base import RoundContext, RoundResult

    plan = pol.plan(RoundContext(3, 64, [8, 8, 8]))
    steps = min(len(infos), plan.cap)
    drafted = torch.full((3,), steps, dtype=torch.int64)
    stops, n, readback = [], drafted, []
    if plan.rule is not None:
        plan.rule.begin(3, torch.device("cpu"))
        stops = [bool(plan.rule.step(info).all()) for info in infos[:steps]]
        n = plan.rule.depth(drafted, steps)
        n = drafted if n is None else n
        readback = [t.tolist() for t in plan.rule.readback()]
    pol.observe(RoundResult(n.tolist(), accepted, steps, int(n.max()), readback, ms))
    return stops, n.tolist(), plan


def test_the_policy_skips_the_head_on_an_unscored_capped_slot(monkeypatch):
    """SpecDecPP under the budget: a round capped at one candidate whose slot goes unscored does not run the
    acceptance head (nor its features), verifies the slot, and still reports the round (tokens, time); a scored
    round runs the head and feeds the slot's running survival."""
    from specdec_ext import ops
    from specdec_ext.policies import SpecDecPP
    from specdec_ext.policies.base import DraftStep

    target, draft = make_pair("llama", noise=0.3)
    pol = SpecDecPP(head_for(draft, kind="proposal"), threshold="auto", k_max=8)
    pol.configure(SamplingConfig(0.0), TEST_COSTS, batch_costs=TEST_BATCH_COSTS)
    pol.reset(3, torch.device("cpu"))
    calls = []
    real = ops.acceptance_head_step
    monkeypatch.setattr(ops, "acceptance_head_step", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    budget = pol.budget
    V, H = target.config.vocab_size, draft.config.hidden_size
    info = DraftStep(1, 3, hidden=torch.randn(3, H), tokens=torch.tensor([1, 2, 3]), logits=torch.randn(3, V),
                     drafting=torch.ones(3, dtype=torch.bool), room=torch.ones(3, dtype=torch.bool))

    def one_round(score):
        def plan(B, width):
            budget.cap, budget.forced, budget.score_last, budget.width = 1, False, score, width
            return True
        monkeypatch.setattr(budget, "plan", plan)
        stops, n, _ = play_round(pol, [info], [1, 0, 1])
        return stops, n

    tokens, g1 = budget.tokens, budget.gain[0]
    stop, n = one_round(score=False)
    assert not calls and stop == [True] and n == [1, 1, 1]
    assert budget.tokens != tokens and budget.gain[0] == g1 and budget._last[0] == 1
    stop, n = one_round(score=True)
    assert len(calls) == 1 and stop == [True] and budget.gain[0] != g1


def test_without_in_round_rounds_outside_the_scored_ones_draft_to_the_cap_without_the_head(monkeypatch):
    """in_round=False: outside the scored rounds the policy plans the budget's cap with no stop rule (no features,
    head, one-step rule or verified depth): the round drafts to the cap, verifies every drafted slot and is
    reported at the depth drafted (fewer where the rows lack the room); a scored round runs the head at every slot;
    with in_round=True the head runs below the cap (the one-step rule's slot)."""
    from specdec_ext import ops
    from specdec_ext.policies import SpecDecPP
    from specdec_ext.policies.base import DraftStep

    target, draft = make_pair("llama", noise=0.3)
    V, H = target.config.vocab_size, draft.config.hidden_size
    calls = []
    real = ops.acceptance_head_step
    monkeypatch.setattr(ops, "acceptance_head_step", lambda *a, **k: (calls.append(a[9]), real(*a, **k))[1])

    def one_round(pol, score, cap=3, steps=3):
        budget = pol.budget

        def plan(B, width):
            budget.cap, budget.forced, budget.score_last, budget.width = cap, score, score, width
            return True
        monkeypatch.setattr(budget, "plan", plan)
        infos = [DraftStep(k, 3, hidden=torch.randn(3, H), tokens=torch.tensor([1, 2, 3]), logits=torch.randn(3, V),
                           drafting=torch.ones(3, dtype=torch.bool), room=torch.ones(3, dtype=torch.bool))
                 for k in range(1, steps + 1)]
        stops, n, played = play_round(pol, infos, [1, 0, 2])
        return stops, n, budget._last[0], played

    pol = SpecDecPP(head_for(draft, kind="proposal"), threshold="auto", k_max=8, budget_options={"in_round": False})
    pol.configure(SamplingConfig(0.0), TEST_COSTS, batch_costs=TEST_BATCH_COSTS)
    pol.reset(3, torch.device("cpu"))
    assert not pol.budget.in_round
    g = list(pol.budget.gain)
    stops, n, last, played = one_round(pol, score=False)
    assert played.rule is None and played.cap == 3 and (n, last) == ([3, 3, 3], 3) and not calls
    assert pol.budget.gain == g  # no survival sampled (and no long-run means yet to revert to)
    stops, n, last, _ = one_round(pol, score=False, steps=2)  # rows out of room: two steps
    assert (n, last) == ([2, 2, 2], 2) and not calls
    stops, n, last, _ = one_round(pol, score=True)
    assert (n, last) == ([3, 3, 3], 3) and calls == [1, 2, 3] and stops == [False, False, True]  # scored: every slot
    assert pol.budget.gain[0] != g[0]
    calls.clear()
    in_round = SpecDecPP(head_for(draft, kind="proposal"), threshold="auto", k_max=8)  # the default
    in_round.configure(SamplingConfig(0.0), TEST_COSTS, batch_costs=TEST_BATCH_COSTS)
    in_round.reset(3, torch.device("cpu"))
    assert in_round.budget.in_round
    below = in_round.budget.go_threshold
    monkeypatch.setattr(in_round.budget, "go_threshold", lambda B, k: -math.inf if k < in_round.budget.cap
                        else below(B, k))  # the one-step rule always goes on below the cap
    assert one_round(in_round, score=False)[0] == [False, False, True] and calls == [1, 2]  # not the slot at the cap


def test_without_in_round_the_scored_round_drafts_one_slot_past_the_plan():
    """in_round=False: a scored round drafts to c* + 1 (forced, every slot scored), so slot c* + 1's survival and cost
    stay measured while the blind rounds draft c*; not where c* + 1 is expected more than explore_within below c*, nor
    with score_deeper=False, and with in_round=True the scored round's cap is the headroom's, as before."""
    tied = BatchCosts([1, 64], [[10.0, 14.0, 18.2, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]] * 2,
                      [[10.0 + n for n in range(1, 10)]] * 2)  # depths 1 and 2 tie, 3 is far below
    b = BatchBudget(tied, probe=100, score_every=2, in_round=False)
    b.reset(4)
    b.log_ratio = [0.0] * 9
    assert b.plan(4, None) and b.cap == 1 and b.blind  # round 1: blind, at the best depth
    assert b.plan(4, None) and b.cap == 2 and b.forced and not b.blind  # round 2: scored, one slot deeper
    far = BatchBudget(tied, probe=100, score_every=2, in_round=False, explore_within=0.0)
    far.reset(4)
    far.log_ratio = [0.0] * 9
    far.plan(4, None)
    far.plan(4, None)
    assert far.score_last and far.cap == 1  # depth 2 expected below depth 1: the scored round stays at c*
    off = BatchBudget(tied, probe=100, score_every=2, in_round=False, score_deeper=False)
    off.reset(4)
    off.log_ratio = [0.0] * 9
    off.plan(4, None)
    off.plan(4, None)
    assert off.score_last and off.cap == 1  # score_deeper=False: the scored round drafts the plan's depth
    in_round = BatchBudget(tied, probe=100, score_every=2)
    in_round.reset(4)
    in_round.log_ratio = [0.0] * 9
    in_round.plan(4, None)
    in_round.plan(4, None)
    assert in_round.score_last and in_round.cap == 2  # the headroom's c* + 1, not c* + 2


def test_without_in_round_a_tied_depth_past_the_best_is_not_drafted_for_the_one_step_rule():
    """headroom needs in_round: without in-round decisions nothing would decide the extra slot, so the cap is the
    best depth, and such a round is blind outside the scored ones (BatchBudget.blind); with measure=False the table's
    rounds always decide in the round."""
    tied = BatchCosts([1, 64], [[10.0, 14.0, 18.2, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]] * 2,
                      [[10.0 + n for n in range(1, 10)]] * 2)  # as in the headroom test below: depths 1 and 2 tie
    for in_round, cap in ((False, 1), (True, 2)):
        b = BatchBudget(tied, probe=100, score_every=1000, in_round=in_round)
        b.reset(4)
        b.log_ratio = [0.0] * 9
        b.plan(4, None)
        assert b.cap == cap and not b.forced and b.blind == (not in_round)
        b.score_last = True
        assert not b.blind  # a scored round reads the head at every slot
    assert not BatchBudget(tied, measure=False, in_round=False).blind and BatchBudget(tied).in_round


def test_headroom_lets_the_one_step_rule_decide_the_slot_past_a_tied_best_depth():
    """When the depth past the best is expected to do nearly as well (within ``headroom``), a steady round's cap
    is one deeper and go_on decides that slot from the round's own survivals; lambda is then the best depth's
    expected goodput (the model's, not the last rounds' luck). A clear best depth keeps its cap."""
    # rounds of 1 and 2 candidates cost what their expected tokens (1.7, 2.19 per row at the prior survivals 0.7,
    # 0.49) make all but equal: 4 * 1.7 / 14 against 4 * 2.19 / 18.2 tokens/ms, 1% apart
    tied = BatchCosts([1, 64], [[10.0, 14.0, 18.2, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]] * 2,
                      [[10.0 + n for n in range(1, 10)]] * 2)
    for headroom, deeper in ((0.03, True), (0.0, False)):
        b = BatchBudget(tied, probe=100, score_every=1000, headroom=headroom)
        b.reset(4)
        b.log_ratio = [0.0] * 9          # every depth measured: no exploration, the table's costs as they are
        b.plan(4, None)
        values = [b.expected_goodput(4, c) for c in range(9)]
        best = max(range(9), key=lambda c: (values[c], -c))
        assert best == 1 and values[2] >= 0.97 * values[1]
        assert b._lambda(4) == pytest.approx(values[1]) and not b.forced
        assert b.cap == (2 if deeper else 1)
        if deeper:  # slot 2 is expected to add a rho_1 sum_b S_b1 = 0.7 sum_b S_b1 tokens, at lambda (T(2) - T(1))
            cut = values[1] * (b._round(4, 2) - b._round(4, 1)) / (b.head_scale * b._next_ratio(1)) / 4
            assert go_on(b, 1, torch.full((4,), cut * 1.05)) and not go_on(b, 1, torch.full((4,), cut * 0.95))
            assert not go_on(b, 2, torch.ones(4))
    clear = BatchBudget(BatchCosts([1, 64], [[10.0, 14.0, 22.0] + tied.round_ms[0][3:]] * 2, tied.verify_ms),
                        probe=100, score_every=1000)
    clear.reset(4)
    clear.log_ratio = [0.0] * 9
    clear.plan(4, None)
    values = [clear.expected_goodput(4, c) for c in range(9)]
    best = max(range(9), key=lambda c: (values[c], -c))
    assert values[best + 1] < 0.97 * values[best] and clear.cap == best
    with pytest.raises(ValueError, match="headroom"):
        BatchBudget(TEST_BATCH_COSTS, headroom=1.0)


def test_the_policy_keeps_its_budget_from_call_to_call(monkeypatch):
    """What the budget measured (per-depth cost ratios, the head's calibration, the probe schedule) is the pair's
    and the machine's: the engine configures the policy at every call, and the budget survives it while the cost
    table and the head stay the same, so a second call at the same batch size does not explore the depths again."""
    target, draft = make_pair("llama", noise=0.3)
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"),
                               threshold="auto", k_max=8, costs=TEST_COSTS, batch_costs=TEST_BATCH_COSTS)
    ids = _ids(4, target.config.vocab_size)
    forced = []
    plan, observe = BatchBudget.plan, BatchBudget.observe
    monkeypatch.setattr(BatchBudget, "plan",
                        lambda self, B, width: (plan(self, B, width),
                                                forced.append(self.forced and (self.cap, self._best)))[0])
    # each round takes its table time (ratio 1): which depths are worth exploring then follows from the cost table
    # alone, not from this machine's clock (CI once measured a slow round, the depths near it fell below the
    # exploration floor and only 3 were explored)
    monkeypatch.setattr(BatchBudget, "observe",
                        lambda self, ms: observe(self, self._last[1] if self._last is not None else ms))
    gen.generate(ids, max_new_tokens=24, temperature=0)
    budget, first = gen.policy.budget, list(forced)
    explored = sum(map(bool, first[:6]))
    assert sum(r is not None for r in budget.log_ratio[:5]) >= 4 and explored >= 3, first  # exploring
    assert not first[0]  # but not in the first round (cold: not measured)
    forced.clear()
    gen.generate(ids[:1], max_new_tokens=4, temperature=0)  # one row: the per-row rule, the budget sits out
    assert not forced and gen.policy.budget is budget
    tries = list(budget._tries)
    gen.generate(ids, max_new_tokens=24, temperature=0)
    assert gen.policy.budget is budget and len(forced) > 3 and any(forced)
    assert budget._tries == tries  # no depth explored again
    # forced rounds are scored rounds at the best depth (or one past it, headroom) and probes of its neighbours
    assert all(abs(cap - best) <= 1 for cap, best in filter(None, forced)), forced
    other = BatchCosts(TEST_BATCH_COSTS.sizes, TEST_BATCH_COSTS.round_ms, TEST_BATCH_COSTS.verify_ms)
    gen.policy.configure(SamplingConfig(0.0), TEST_COSTS, batch_costs=other)
    assert gen.policy.budget is not budget  # another cost table: what was measured against the old one goes


def test_budget_options_reach_the_budget_and_bad_ones_are_refused():
    """SpecDecPP(budget_options=...): the options are the budget's keyword arguments (checked when the policy is
    made, naming the option), and only the batch budget takes them; a budgeted generation uses them."""
    from specdec_ext.policies import SpecDecPP

    target, draft = make_pair("llama", noise=0.3)
    head = head_for(draft, kind="proposal")
    pol = SpecDecPP(head, threshold="auto", k_max=4, budget_options={"switch_margin": 0.05, "headroom": 0.0})
    gen = SpeculativeGenerator(target, draft, policy=pol, costs=TEST_COSTS, batch_costs=TEST_BATCH_COSTS)
    ids = torch.randint(2, target.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    out = gen.generate(ids, max_new_tokens=6, temperature=0)
    assert out.stats.new_tokens == 18 and pol.use_budget
    assert pol.budget.switch_margin == 0.05 and pol.budget.headroom == 0.0
    assert SpecDecPP(head, threshold="auto").budget_options == {}
    with pytest.raises(TypeError, match=r"BatchBudget takes no \['cost_model'\]"):
        SpecDecPP(head, threshold="auto", budget_options={"cost_model": "line"})
    with pytest.raises(ValueError, match="switch_margin must be"):
        SpecDecPP(head, threshold="auto", budget_options={"switch_margin": -1.0})
    for kw in (dict(threshold=0.7), dict(threshold="auto", batch_budget=False)):
        with pytest.raises(ValueError, match="budget_options"):
            SpecDecPP(head, budget_options={"headroom": 0.0}, **kw)


def _plain_steps(cost_drift=False):
    """A budget at B = 4 (decay 0.2, ratio_clip 0.25; per-depth running means unless ``cost_drift``), the table's ms
    of a plain step, and ``step(ms)``: plan, update and observe one plain step that took ``ms``."""
    b = BatchBudget(TEST_BATCH_COSTS, decay=0.2, ratio_clip=0.25, cost_drift=cost_drift)
    b.reset(4)

    def step(ms):
        b.plan(4, None)
        b.update(4, 0, 0, 4)
        b.observe(ms)

    return b, b.batch.round(4, 0, None), step


def _first_plain_steps(cost_drift):
    """``_plain_steps`` after the cold round and EARLY_ROUNDS plain steps (1.5x, 1x, 1.2x the table), each checked to
    set the cost of plain decoding to the lower median of the measured steps so far."""
    b, table, step = _plain_steps(cost_drift)
    step(table)                                     # the cold round: not measured
    step(1.5 * table)                               # a stalled first round
    assert b.log_ratio[0] == pytest.approx(math.log(1.5))
    step(table)                                     # the lower of two
    assert b.log_ratio[0] == pytest.approx(0.0)
    step(1.2 * table)                               # the middle of three
    assert b.log_ratio[0] == pytest.approx(math.log(1.2))
    return b, table, step


def test_a_depths_first_rounds_set_its_cost_by_their_lower_median():
    """A depth's first EARLY_ROUNDS measured rounds set its cost to their lower median, so a first round that
    stalled (1.5x) does not stand for the depth: the second, usual, round replaces it at once, where a running mean
    from the first round would keep most of the stall (at B = 16 on a 2-core CPU such a first round of depth 1 made
    plain decoding look best for many probes). A cost set from outside (no early rounds) is followed as a running
    mean."""
    b, table, step = _first_plain_steps(cost_drift=False)
    step(table)                                     # then a running mean
    assert b.log_ratio[0] == pytest.approx(0.8 * math.log(1.2))
    kept = b._early[0]
    b.reset(8)
    b.reset(4)                                      # kept from call to call at the batch size
    assert b._early[0] == kept and b.log_ratio[0] == pytest.approx(0.8 * math.log(1.2))
    c, _, step_c = _plain_steps()
    c.log_ratio = [0.5] + [None] * c.depth_max      # set from outside
    c._cold = False
    step_c(table)
    assert c.log_ratio[0] == pytest.approx(0.8 * 0.5 + 0.2 * 0.25)  # clipped to within 0.25, weight 0.2


def test_with_cost_drift_a_depths_first_rounds_anchor_its_cost_and_leave_the_others():
    """With ``cost_drift`` a depth's first EARLY_ROUNDS rounds set its cost to their lower median as well (the
    filter's ``anchor``), and leave every other depth's estimate where it was: they measure how far the table
    misjudges that depth, not a drift of all of them. Without the anchor the filter read the first rounds of a table
    that put each candidate at 1.6 ms (the rounds took 10 ms a candidate) mostly as a drift common to every depth,
    made plain steps look 2x dearer than they were, and kept drafting 3-4 candidates where plain decoding was best."""
    b, table, step = _first_plain_steps(cost_drift=True)
    step(table)                                     # then the filter: a clipped Kalman step towards 0
    assert 0.0 < b.log_ratio[0] < math.log(1.2)

    dear_slots = lambda c: 10.0 + 10.0 * c
    for drift in (False, True):
        b = BatchBudget(TEST_BATCH_COSTS, probe=2, explore_within=0.5, cost_drift=drift)
        caps = _play(b, 4, dear_slots, 40)
        assert caps[:6] == [4, 3, 4, 2, 1, 0], (drift, caps)  # each depth 0..4 measured once, plain steps last
        assert caps[6:].count(0) >= 30, (drift, caps)  # then plain decoding, the best depth, in most rounds
        for k in range(5):  # every measured depth's cost as its rounds measured it, whatever was measured after
            assert b.log_ratio[k] == pytest.approx(math.log(dear_slots(k) / b._table_round(4, k)), abs=0.05), (drift, k)


def test_a_stalled_round_moves_a_depths_measured_cost_by_a_bounded_step():
    """observe() clips each round's log(measured / table) to within ratio_clip of the running mean: one round that
    stalls (the KV buffers regrowing) moves the mean by decay * ratio_clip at most; a lasting change is followed."""
    b, table, step = _plain_steps()

    step(table)                       # the cold round: not measured
    assert b.log_ratio[0] is None
    for _ in range(EARLY_ROUNDS):     # the first measurements set the mean
        step(2.0 * table)
    assert b.log_ratio[0] == pytest.approx(math.log(2.0))
    step(6.0 * table)                 # a stall: 3x the mean, clipped
    assert b.log_ratio[0] == pytest.approx(math.log(2.0) + 0.2 * 0.25)
    for _ in range(40):               # a lasting change is followed, a bounded step at a time
        step(0.5 * table)
    assert b.log_ratio[0] == pytest.approx(math.log(0.5), abs=0.01)
    for bad in ({"explore_within": -0.1}, {"ratio_clip": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BatchBudget(TEST_BATCH_COSTS, **bad)


def test_the_drafts_reads_count_against_drafting():
    """With the engine's overhead o (ms per emitted token of the draft's reads of requests' contexts,
    ``draft_overhead``) a drafting depth's expected goodput is E / (T + E o), o in plain-step ms (divided by
    exp(ratio_0)); rounds that out-emit plain steps by half still lose to them when o is large, and the budget
    then takes plain steps; without ``count_overhead`` it drafts as before."""
    true_ms = lambda c: 10.0 + 3.0 * c  # the rounds: depth 3 emits 4 (1 + .8 + .64 + .512) = 11.8 tokens in 19 ms
    # table: TEST_BATCH_COSTS says 1.6 ms per candidate; plain steps measure twice the table's 10 ms below
    b = BatchBudget(TEST_BATCH_COSTS)
    b.reset(4)
    for ms in (10.0 ** 6, 20.0, 20.0):  # the first round is cold; then plain steps at twice the table
        b.update(4, 0, 0, 4)
        b.observe(ms)
    b.overhead = 2.0
    assert b.overhead_per_token() == pytest.approx(1.0)  # 2 ms per token measured = 1 ms in plain-step time
    sums = b._survival_sums()
    tokens = 4 * (1 + b.head_scale * sums[2])
    assert b.expected_goodput(4, 2) == pytest.approx(tokens / (b._round(4, 2) + tokens * 1.0))
    assert b.expected_goodput(4, 0) == pytest.approx(4 / b._round(4, 0))  # a plain step pays no reads
    b.count_overhead = False
    assert b.overhead_per_token() == 0.0 and b.expected_goodput(4, 2) == pytest.approx(tokens / b._round(4, 2))

    caps = {}
    for name, kw, overhead in (("free", {}, 0.0), ("reads", {}, 2.0), ("not counted", {"count_overhead": False}, 2.0)):
        b = BatchBudget(TEST_BATCH_COSTS, **kw)
        b.reset(4)
        b.overhead = overhead
        caps[name] = _play(b, 4, true_ms, 40)
    # 11.8 tokens in 19 ms beat plain decoding's 4 in 10 by half; with 2 ms per token of reads, 11.8 / (19 + 23.6)
    # falls 30% below it
    assert min(caps["free"][10:]) >= 2 and caps["not counted"] == caps["free"], caps
    assert caps["reads"][10:].count(0) >= 27, caps["reads"]


def test_the_drift_filter_moves_every_depth_with_a_common_drift_and_learns_their_offsets():
    """DriftFilter: rounds of depth 2 only, all of them 30% slower than before, move the unplayed depths' costs with
    them (a per-depth running mean would keep depth 0 at its old cost); rounds alternating between depths teach the
    filter their true relative costs (o_2 - o_1 = 0.15 here) to within a few hundredths."""
    f = DriftFilter(4)
    for t in range(60):                              # depths 0, 1, 2 in turn: 0.0, -0.05, +0.10 against the table
        k = t % 3
        f.observe(k, (0.0, -0.05, 0.10)[k], clip=0.25)
    assert f.log_ratio(2) - f.log_ratio(1) == pytest.approx(0.15, abs=0.03)
    assert f.log_ratio(0) == pytest.approx(0.0, abs=0.03)
    for _ in range(40):                              # then every round slower by log(1.3), only depth 2 played
        f.observe(2, 0.10 + math.log(1.3), clip=0.25)
    assert f.log_ratio(2) == pytest.approx(0.10 + math.log(1.3), abs=0.02)
    assert f.log_ratio(0) == pytest.approx(math.log(1.3), abs=0.06)  # the unplayed depth followed
    assert f.log_ratio(2) - f.log_ratio(0) == pytest.approx(0.10, abs=0.06)
    f.observe(2, 5.0, clip=0.25)                     # one stalled round: a bounded step
    assert f.log_ratio(2) < 0.10 + math.log(1.3) + 0.25


def test_with_cost_drift_a_slowdown_of_every_round_does_not_send_the_batch_exploring():
    """When every round becomes 40% slower (the machine's load, longer contexts), the per-depth running means raise
    only the played depth's cost, so the unplayed ones (plain decoding, the other depths) look cheaper and are
    played in turn until each has been measured slow as well; with ``cost_drift`` the filter moves them together
    and the batch stays at its best depth (2 here: survival 0.6, 10 + 2.5 c ms)."""
    caps = {}
    for drift in (False, True):
        b = BatchBudget(MID, cost_drift=drift)
        b.reset(4)
        slow = [1.0]
        ms = lambda c: slow[0] * (10.0 + 2.5 * c)
        _play(b, 4, ms, 60, survival=0.6)
        slow[0] = 1.4
        caps[drift] = _play(b, 4, ms, 40, survival=0.6)
    assert caps[True].count(2) >= 36, caps[True]
    assert caps[False].count(2) < caps[True].count(2) - 10, caps[False]   # the default: 0, 1, 3, 4 in turn
    for bad in ({"accuracy_decay": 0.0}, {"accuracy_decay": 1.5}):
        with pytest.raises(ValueError, match="accuracy_decay"):
            BatchBudget(MID, **bad)


def test_accuracy_decay_sets_how_far_one_round_moves_the_heads_calibration():
    """The head's calibration a (accepted over predicted) is a ratio of running means of weight ``accuracy_decay``
    (default ``decay``): after rounds where the head was right, one round that accepted every slot where the head
    predicted half moves a by the running means' weight."""
    moved = {}
    for weight in (None, 0.02):
        b = BatchBudget(MID, accuracy_decay=weight)
        b.reset(4)
        S = torch.full((4, 2), 0.5, dtype=torch.float64)   # predicted: 4 rows x 2 slots x 0.5 = 4 tokens
        for _ in range(10):
            b.plan(4, 64)
            b.update(4, 2, 2, 4 + 4, S)                      # 4 accepted: the head is right
        assert b.head_scale == pytest.approx(1.0)
        b.update(4, 2, 2, 4 + 8, S)                          # every slot accepted: 8 where 4 were predicted
        moved[weight] = b.head_scale - 1.0
    assert moved[None] == pytest.approx(0.2 * 4 / 4)         # (0.8 * 4 + 0.2 * 8) / 4 - 1
    assert moved[0.02] == pytest.approx(0.02 * 4 / 4)


def _budget_and_target_only(options: dict):
    """A generator with the budget (``budget_options=options``, measured times, MID's table) on a tiny pair, six
    prompts, and target-only decoding's greedy output for them (24 tokens)."""
    target, draft = make_pair("llama", noise=0.3)
    ids = _ids(6, target.config.vocab_size)
    plain = SpeculativeGenerator(target, policy="autoregressive").generate(ids, max_new_tokens=24, temperature=0)
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"),
                               threshold="auto", k_max=8, costs=TEST_COSTS, batch_costs=MID, budget_options=options)
    return gen, ids, plain


def test_budget_with_cost_drift_greedy_equals_target_only():
    """The budget with ``cost_drift`` (measured round times, so decisions vary with the machine) in the engine: the
    greedy tokens equal target-only decoding, and the filter measured the rounds (a cost per played depth)."""
    gen, ids, plain = _budget_and_target_only({"cost_drift": True})
    out = gen.generate(ids, max_new_tokens=24, temperature=0)
    assert out.new_tokens == plain.new_tokens
    budget = gen.policy.budget
    assert budget.cost_drift and budget._drift is not None
    played = {min(max(r.candidates), budget.depth_max) for r in out.stats.rounds[1:] if len(r.candidates) == 6}
    assert played and all(budget.log_ratio[k] is not None for k in played), (played, budget.log_ratio)


def test_budget_with_blind_rounds_greedy_equals_target_only(monkeypatch):
    """``in_round=False`` in the engine (blind rounds outside the scored ones): the greedy tokens equal target-only
    decoding, and each drafting round ran the head at none of its slots (blind) or at every one it drafted (scored),
    never below its cap alone as the one-step rule does; some rounds were blind."""
    from specdec_ext import ops

    gen, ids, plain = _budget_and_target_only({"in_round": False})
    calls = []  # per drafting round, the slots the head scored
    real, plan = ops.acceptance_head_step, gen.policy.plan

    def planned(ctx):
        p = plan(ctx)
        if p.cap and max(ctx.room, default=0) > 0:  # a round whose rows have no room runs a plain step
            calls.append([])
        return p

    monkeypatch.setattr(ops, "acceptance_head_step", lambda *a, **k: (calls[-1].append(a[9]), real(*a, **k))[1])
    monkeypatch.setattr(gen.policy, "plan", planned)
    out = gen.generate(ids, max_new_tokens=24, temperature=0)
    assert out.new_tokens == plain.new_tokens
    depths = [max(r.candidates) for r in out.stats.rounds if r.draft_ms > 0]  # the drafting rounds (not plain steps)
    assert len(depths) == len(calls) and out.stats.accepted > 0
    # a scored round scores slots 1 .. its drafted depth and may verify fewer (BatchBudget.depth); a blind one none
    assert all(c == list(range(1, len(c) + 1)) and (not c or len(c) >= d) for c, d in zip(calls, depths)), \
        list(zip(calls, depths))
    assert any(c == [] and d > 0 for c, d in zip(calls, depths))
