"""threshold="auto"'s choice of stop rule by measured goodput (``policies/select.py``): the counterfactual rounds, the
cost fit, the bandit's choice, and the survivals the engine reads back for them (eager and from recorded graphs)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.policies.costs import CostModel
from specdec_ext.policies.select import (GOODPUT, PLAIN, PLAIN_AFTER, RoundTime, StopSelector, first_stop,
                                        threshold_at)
from models import make_pair
from support import TEST_COSTS, head_for


def prompts(V: int, T: int = 6, seed: int = 0) -> torch.Tensor:
    """One prompt ``[1, T]`` of ids in [2, V)."""
    return torch.randint(2, V, (1, T), generator=torch.Generator().manual_seed(seed))


def test_first_stop_is_the_first_depth_below_the_threshold():
    S = [0.9, 0.7, 0.45, 0.3, 0.1]
    assert first_stop(S, 5, 1, 0.5) == 3
    assert first_stop(S, 5, 4, 0.5) == 4  # no stop before lo
    assert first_stop(S, 2, 1, 0.5) == 2  # not below within the drafted candidates: the round's own length
    assert first_stop(S, 5, 1, [0.95, 0.0, 0.0, 0.0, 0.0]) == 1  # one threshold per depth
    assert first_stop(S, 5, 2, [0.95, 0.0, 0.5, 0.0, 0.0]) == 3
    assert first_stop(S, 0, 1, 0.5) == 0
    assert first_stop(S, 5, 1, ([0.5, 0.5, 1.0, 1.0, 1.0], 0.5)) == 3  # the goodput rule's: margins times a rate
    assert threshold_at(([0.5, 0.5, 1.0], 0.5), 3) == 0.5 and threshold_at([0.1, 0.2], 2) == 0.2


def test_round_time_recovers_the_costs_it_measures():
    """ms = 4 + 1.5 steps + 0.25 verified, with noise, from rounds of varied steps and widths: the fit finds the
    coefficients; before any round it is the prior."""
    fit = RoundTime((10.0, 1.0, 0.0))
    assert fit.ms(3, 3) == pytest.approx(13.0)
    rng = random.Random(0)
    for _ in range(400):
        s = rng.randint(0, 8)
        v = rng.randint(0, s) if rng.random() < 0.5 else s
        fit.add(s, v, 4.0 + 1.5 * s + 0.25 * v + rng.gauss(0.0, 0.1))
    for s, v in ((0, 0), (2, 2), (4, 4), (8, 2), (6, 0)):  # every kind of round it saw, within 3%
        assert fit.ms(s, v) == pytest.approx(4.0 + 1.5 * s + 0.25 * v, rel=0.03)
    assert fit.c == pytest.approx([4.0, 1.5, 0.25], abs=0.15)


def _round(selector, played, S, accepted, lo=1, k_max=20):
    """One round of one row with survivals S (the played arm's length from its threshold) for the selector."""
    arms = selector.arms
    t = [1.0 - a.h for a in arms]
    d = first_stop(S, min(len(S), k_max), lo, t[played])
    selector.observe(played, [[x] for x in t], [[(x, x)] for x in t], lo, [S], [d], [min(accepted, d)],
                     lambda k: k, lambda k: k, 10.0 + d, d, d)
    return d


def test_a_played_arm_teaches_the_arms_it_dominates_and_no_other():
    """A round played with h = 0.8 (threshold 0.2) updates h = 0.5 (0.5 >= 0.2: it stops no later) with the tokens it
    would have emitted, and leaves h = 0.9 (threshold 0.1: it could have drafted deeper) untouched."""
    sel = StopSelector((0.5, 0.8, 0.9), goodput_arm=False, every=1)
    S = [0.9, 0.6, 0.4, 0.15, 0.05]
    d = _round(sel, 1, S, accepted=5)  # h = 0.8 stops at S < 0.2: candidate 4
    assert d == 4
    half, eight, nine = sel.arms
    fit, w = sel.time, eight.w  # one round each, of weight w
    assert [v / w for v in eight.s[:2]] == pytest.approx([5, fit.ms(4, 4)])  # 4 accepted + the bonus, priced by the fit
    assert half.w == w and [v / w for v in half.s[:2]] == pytest.approx([4, fit.ms(3, 3)])  # S < 0.5: candidate 3
    assert eight.s[2:] == half.s[:2] == half.s[2:]  # each paired with the reference, h = 0.5, on the same round
    assert nine.w == 0
    _round(sel, 0, S, accepted=1)  # h = 0.5 played: teaches no deeper arm
    assert (half.w, eight.w, nine.w) == (pytest.approx(w * (1 + 1 / sel.discount)), w, 0)  # a later round weighs more


class _Env:
    """Rounds of a simulated pair: candidate i is accepted with probability alpha (independently, until the first
    rejection), the head predicts p_hat = q for every candidate (miscalibrated when q != alpha), a round of K
    candidates takes 10 + 3 K ms (noisy)."""

    def __init__(self, alpha, q, seed=0):
        self.alpha, self.q, self.rng = alpha, q, random.Random(seed)

    def survivals(self, k_max):
        return [self.q ** k for k in range(1, k_max + 1)]

    def accepted(self, k):
        n = 0
        while n < k and self.rng.random() < self.alpha:
            n += 1
        return n

    def ms(self, k):
        return (10.0 + 3.0 * k) * math.exp(self.rng.gauss(0.0, 0.1))

    def goodput(self, h, k_max=20):
        """The long-run tokens/ms of a fixed h (exact: expected tokens over expected ms)."""
        K = first_stop(self.survivals(k_max), k_max, 1, 1.0 - h)
        tokens = sum(self.alpha ** i for i in range(K + 1))
        return tokens / (10.0 + 3.0 * K)


@pytest.mark.parametrize("alpha,q", [(0.9, 0.6), (0.5, 0.85), (0.75, 0.75)], ids=["under", "over", "calibrated"])
def test_the_bandit_plays_the_best_threshold_of_a_miscalibrated_head(alpha, q):
    """Over 3,000 rounds of a head that under- or over-predicts acceptance, the arms' goodput from the rounds it
    played is within 2.5% of the best fixed h's (whose h differs from case to case), and it plays that arm or one
    within 5% of it in at least 90% of the last 1,000 rounds."""
    hs = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    env = _Env(alpha, q)
    best = max(env.goodput(h) for h in hs)
    good = {i for i, h in enumerate(hs) if env.goodput(h) >= 0.95 * best}
    sel = StopSelector(hs, goodput_arm=False, prior=(10.0, 3.0, 0.0))
    order = list(range(len(hs)))[::-1]
    tokens = ms = 0.0
    late = []
    for r in range(3000):
        a = sel.choose(order)
        S = env.survivals(20)
        t = [1.0 - h for h in hs]
        d = first_stop(S, 20, 1, t[a])
        acc = env.accepted(d)
        took = env.ms(d)
        tokens, ms = tokens + acc + 1, ms + took
        sel.observe(a, [[x] for x in t], [[(x, x)] for x in t], 1, [S], [d], [acc], lambda k: k, lambda k: k, took,
                    d, d)
        if r >= 2000:
            late.append(a in good)
    assert tokens / ms >= 0.975 * best, (tokens / ms, best, sel.estimates())
    assert sum(late) >= 0.9 * len(late), sel.shares(1000)
    depths = [first_stop(env.survivals(20), 20, 1, 1.0 - hs[a]) for a in list(sel.history)[-1000:]]
    d = max(set(depths), key=depths.count)  # the depth most played: the fit prices it within 5%
    assert sel.time.ms(d, d) == pytest.approx((10.0 + 3.0 * d) * math.exp(0.005), rel=0.05)
    assert min(env.goodput(h) for h in hs) < 0.95 * best  # the checks above can fail: the arms differ


class _Seen(list):
    """The rounds an arm learned from (their credit's arguments), with ``times``: every round's measured ms."""

    times: list


def _recording(gen, every: int = 1):
    """Wrap the policy's selector so that the arguments of every round it learns from are kept (``every``: one round
    in ``every``; 1: all of them), and each round's measured time."""
    sel = gen.policy.selector
    sel.every = every
    seen, times = _Seen(), []
    credit, tick = sel.credit, sel.tick

    def record(*args):
        seen.append(args)
        return credit(*args)

    def ticking(played, ms, steps, verified, tokens=0):
        times.append(ms)
        return tick(played, ms, steps, verified, tokens)

    sel.credit, sel.tick = record, ticking
    seen.times = times
    return seen


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "recorded-graphs"])
def test_read_back_survivals_are_the_ones_the_round_stopped_on(graphs):
    """Each round's read-back survivals, under the played arm's thresholds, give the length every row drafted: a row
    below its room stopped at the first depth whose survival fell below the threshold (and not before), a row at its
    room had not stopped before it. Eagerly and through recorded graphs (the survivals are written inside the
    captured steps: a read of a copy made before the round would give the previous round's)."""
    target, draft = make_pair("llama")
    head = head_for(draft, kind="proposal", bias=0.8)
    kw = dict(policy="specdecpp", head=head, threshold="auto", k_max=8, costs=TEST_COSTS)
    gen = SpeculativeGenerator(target, draft, **kw)
    if graphs:
        from specdec_ext.engine.round import BUCKETS, StepRunner
        gen.steps = StepRunner(BUCKETS, cuda_graphs="emulate")
    seen = _recording(gen)
    ids = prompts(target.config.vocab_size)
    for seed in range(3):
        gen.generate(ids, max_new_tokens=40, temperature=0.0 if seed == 0 else 1.0, seed=seed)
    stopped_inside = 0
    lengths = set()
    for played, thresholds, bounds, lo, survivals, drafted, accepted, *_ in seen:
        for b, d in enumerate(drafted):
            t, S = thresholds[played][b], survivals[b]
            lengths.add(d)
            at = lambda k: threshold_at(t, k)  # noqa: E731
            assert all(S[k - 1] >= at(k) for k in range(lo, d)), (played, S, t, d)
            if bounds[played][b][0] != math.inf and S[d - 1] < at(d):
                stopped_inside += 1
            assert all(x >= y for x, y in zip(S[:d], S[1:d])) and 0.0 < S[0] <= 1.0  # a running product
    assert stopped_inside >= 3 and len(lengths) >= 3, (stopped_inside, lengths)
    assert {s[0] for s in seen} != {seen[0][0]}  # several arms played


def test_counterfactual_lengths_follow_the_read_back_survivals():
    """Every arm the played one dominates is credited with the length its own threshold gives on the round's
    survivals and the tokens the round would have emitted at that length: a threshold arm's first depth below 1 - h,
    the goodput arm's first depth below its per-depth thresholds (selector.arms' sums, reproduced by hand)."""
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal", bias=0.8),
                               threshold="auto", k_max=8, costs=TEST_COSTS)
    seen = _recording(gen)
    sel = gen.policy.selector
    sel.discount = 1.0  # plain sums, to compare with the sums counted here
    ids = prompts(target.config.vocab_size)
    gen.generate(ids, max_new_tokens=60, temperature=0)
    credited = {a.name: [0, 0] for a in sel.arms}  # rounds, tokens (undiscounted: recomputed below)
    for played, thresholds, bounds, lo, survivals, drafted, accepted, *_ in seen:
        top = bounds[played][0][1]
        if played != sel.ref and top > bounds[sel.ref][0][0]:
            continue  # the reference not shown: no arm is credited
        for a, arm in enumerate(sel.arms):
            if a != played and top > bounds[a][0][0]:
                continue
            d = drafted[0]
            k = d if a == played else first_stop(survivals[0], d, lo, thresholds[a][0])
            credited[arm.name][0] += 1
            credited[arm.name][1] += min(accepted[0], k) + 1
    for arm in sel.arms:
        assert (arm.w, arm.s[0]) == (credited[arm.name][0], credited[arm.name][1]), arm.name
    assert credited[GOODPUT][0] >= 1 and sum(c[0] for c in credited.values()) > len(seen)


def test_rounds_carry_their_measured_time_and_the_choice_carries_across_calls():
    """A round's cycle time is measured from the end of the call's previous round (0 for a call's first); every round
    goes into the cost fit and the record, the arms learn from one round in four (``every``, by the round's index);
    the selector keeps what it learned from call to call and forgets it with reset_adaptation; select=False plays
    the goodput rule alone (no selector)."""
    target, draft = make_pair("llama")
    head = head_for(draft, kind="proposal")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=8,
                               costs=TEST_COSTS)
    seen = _recording(gen, every=4)
    ids = prompts(target.config.vocab_size)
    gen.generate(ids, max_new_tokens=30, temperature=0)
    first = len(seen.times)
    gen.generate(ids, max_new_tokens=30, temperature=0)
    times = seen.times
    assert times[0] == 0.0 and times[first] == 0.0 and all(t > 0 for i, t in enumerate(times) if i not in (0, first))
    sel = gen.policy.selector
    assert sel.now == len(times) and sel.time.rounds == len(times) - 2 and len(seen) == len(times) // 4
    assert "stop rule" in gen.policy.describe()
    gen.policy.reset_adaptation()
    assert sel.now == 0 and all(a.w == 0 for a in sel.arms) and sel.time.rounds == 0
    plain = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", select=False)
    assert plain.policy.selector is None


def test_plain_steps_replace_the_rounds_where_the_played_rounds_give_fewer_tokens_per_ms_than_a_plain_step():
    """After PLAIN_AFTER rounds, every arm observed, the played rounds' measured tokens per ms below one token per
    plain step's ms (the prior's, then the measured one) say drafting does not pay; measured plain steps that are
    slower say it pays again; the arms' modelled goodputs do not decide it; the record names plain steps."""
    sel = StopSelector(prior=(5.0, 1.0, 1.0))
    for arm in sel.arms:
        for _ in range(10):
            arm.add(1.0, 1.0, 1.0, 1.0, 1.0)  # modelled at 1 token/ms: far above a plain step, and not what counts
    for _ in range(PLAIN_AFTER - 1):
        sel.tick(0, 8.0, 3, 4, 1)  # measured: 1 token per 8 ms, against 1 per 5 for a plain step
    assert not sel.plain_pays()  # fewer than PLAIN_AFTER rounds seen
    sel.tick(0, 8.0, 3, 4, 1)
    assert sel.plain_ms() == 5.0 and sel.plain_pays()
    sel.played_plain(9.0)
    sel.played_plain(9.0)  # plain steps measured at 9 ms: 0.111 tokens/ms, below the rounds' 0.125
    assert sel.plain_ms() == pytest.approx(9.0) and not sel.plain_pays()
    assert sel.names()[-1] == PLAIN and sel.shares() == {sel.arms[0].name: PLAIN_AFTER / (PLAIN_AFTER + 2),
                                                         PLAIN: 2 / (PLAIN_AFTER + 2)}
    sel.played_plain(1.0)
    sel.played_plain(1.0)
    assert sel.plain_pays()
    sel.arms[0].w = sel.arms[0].w2 = 0.0  # an arm not yet observed keeps drafting on
    assert not sel.plain_pays()
    untimed = StopSelector(prior=(5.0, 1.0, 1.0))
    for _ in range(PLAIN_AFTER):
        untimed.tick(0, 0.0, 3, 4, 1)  # rounds without a measured time (a call's first) say nothing
    assert not untimed.plain_pays()


def test_a_draft_that_does_not_pay_gives_way_to_plain_steps_and_the_text_stays_exact():
    """A draft far from its target, a plain step priced near zero: after PLAIN_AFTER rounds the policy runs plain
    steps between the selector's rounds, and the greedy tokens equal target-only decoding."""
    target, draft = make_pair("llama", noise=3.0)
    head = head_for(draft, kind="proposal")
    cheap = CostModel([0.01] * 30, 1.5, 0.0, 0.0, {"kind": "test"})
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=8, costs=cheap)
    ids = prompts(target.config.vocab_size)[:1]
    out = gen.generate(ids, max_new_tokens=120, temperature=0)
    ref = target.generate(ids, max_new_tokens=120, do_sample=False, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    assert gen.policy.selector.shares().get(PLAIN, 0.0) > 0.3


def test_bad_selector_arguments_are_named():
    with pytest.raises(ValueError, match="thresholds must lie in"):
        StopSelector((0.5, 1.5))
    with pytest.raises(ValueError, match="no arm"):
        StopSelector((), goodput_arm=False)
    with pytest.raises(ValueError, match="discount"):
        StopSelector(discount=0.0)
    with pytest.raises(ValueError, match="min_rounds"):
        StopSelector(min_rounds=0)
    with pytest.raises(ValueError, match="hold must be an integer >= 1"):
        StopSelector(hold=0)


def test_the_goodput_rule_takes_the_measured_costs():
    """GoodputRule.measured: a round of k candidates priced c0 + (c1 + c2) k ms, one more candidate c1 + c2, in the
    thresholds and in lambda's averages; with the selector, the policy hands the rule its fit every 32 measured rounds
    (and at a call's start once it has them)."""
    from specdec_ext.policies.goodput import GoodputRule

    rule = GoodputRule(TEST_COSTS, 0.7, 6)
    rule.reset(1)
    before = rule.thresholds(6, 1, 6)[:, 0].tolist()
    rule.measured((4.0, 1.5, 0.5))
    assert rule.margins(6, 1, 6)[:5] == [2.0] * 5 and rule.margins(6, 1, 6)[5] == -math.inf
    rate = rule.rates()[0]
    assert rule.thresholds(6, 1, 6)[:5, 0].tolist() == pytest.approx([2.0 * rate] * 5) and before[0] != 2.0 * rate
    time_before = rule.time[0]
    rule.update([3], [2])
    assert rule.time[0] == pytest.approx(0.8 * time_before + 0.2 * (4.0 + 2.0 * 3))
    rule.measured((1.0, -2.0, 0.5))  # a fit gone wrong: never free, never below 1 us
    assert rule.margins(2, 1, 3) == [1e-3, 1e-3]

    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"),
                               threshold="auto", k_max=6, costs=TEST_COSTS)
    calls, real = [], GoodputRule.measured

    def recording(self, c):
        calls.append((gen.policy.selector.time.rounds, tuple(c)))
        return real(self, c)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(GoodputRule, "measured", recording)
        gen.generate(prompts(target.config.vocab_size), max_new_tokens=120, temperature=0)
        assert calls and all(n % 32 == 0 and n >= 32 for n, _ in calls)
        per = max(calls[-1][1][1] + calls[-1][1][2], 1e-3)
        assert gen.policy.rule.margins(3, 1, 4) == [per] * 3
        before, rounds = len(calls), gen.policy.selector.time.rounds
        gen.generate(prompts(target.config.vocab_size, seed=1), max_new_tokens=8, temperature=0)
        assert calls[before][0] == rounds  # the next call's rule starts from the fit, before its first round
