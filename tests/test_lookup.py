"""Prompt lookup (engine/lookup.py): the proposer's matching, greedy decoding equal to target-only decoding under
every policy that takes it, sampled tokens that follow the target's distribution (chi-square per position, with a
negative control that lets the copied candidates through), and its bad input refused in one line."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import PromptLookup, SpeculativeGenerator
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.policies import LookupStop, make_policy
from specdec_ext.policies.base import RoundContext, RoundPlan, RoundResult
from specdec_ext.policies.costs import CostModel
from specdec_ext.policies.lookup import EXPLORE_EVERY, PLAIN_AFTER, AcceptanceTable
from models import make_pair
from stats import assert_follows, chi_square
from support import exact_marginals, head_for, target_only


def test_the_longest_earlier_match_is_copied_from_its_most_recent_occurrence():
    look = PromptLookup(ngram_min=1, ngram_max=3, k_max=4)
    state = look.new_state()
    ctx = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # suffix [5, 6, 7] occurred at 0 (followed by 8, 9, 1, 6); [6, 7] more recently at 6 (followed by 2), but the
    # longest match wins
    assert look.propose(state, ctx, 8) == ([8, 9, 1, 6], 3)
    ctx += [4]  # the suffix [4] never occurred before
    assert look.propose(state, ctx, 8) == ([], 0)
    ctx += [6]  # [4, 6] and [7, 4, 6] unseen; [6] last seen at 11, followed by 7, 4, 6 (the context's end)
    assert look.propose(state, ctx, 8) == ([7, 4, 6], 1)
    assert look.propose(state, ctx, 2) == ([7, 4], 1)
    # the index read incrementally equals one built from the whole context at once
    fresh = look.new_state()
    assert look.propose(fresh, ctx, 8) == look.propose(state, ctx, 8)
    assert fresh.seen == state.seen


@pytest.mark.parametrize("kw,named", [({"ngram_min": 0}, "ngram_min"), ({"ngram_max": 2, "ngram_min": 3}, "ngram_max"),
                                      ({"k_max": 0}, "k_max"), ({"k_max": 1.5}, "k_max")])
def test_bad_proposer_arguments_are_refused(kw, named):
    with pytest.raises(ValueError, match=f"^{named} must be"):
        PromptLookup(**kw)


def test_bad_drafts_and_policies_are_refused_in_one_line():
    target, draft = make_pair("llama", vocab=48)
    with pytest.raises(ValueError, match="draft: expected"):
        SpeculativeGenerator(target, "eagle")
    with pytest.raises(ValueError, match="hidden state") as e:
        SpeculativeGenerator(target, "ngram", policy="specdecpp", head=head_for(draft), threshold=0.5)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs draft='ngram'"):
        SpeculativeGenerator(target, draft, policy="lookup")
    for bad in (1.5, -0.1, "x", True):
        with pytest.raises(ValueError, match="^threshold: expected"):
            LookupStop(threshold=bad)
    with pytest.raises(ValueError, match="^k_max must be"):
        LookupStop(k_max=0)


def test_the_acceptance_table_counts_each_candidate_tried():
    """Candidate t is tried when candidates 1 .. t - 1 were accepted: a copy of 4 with 2 accepted tried 3."""
    table = AcceptanceTable(k_max=6)
    key = ("greedy", 2, False)
    table.add(key, 4, 2)
    table.add(key, 3, 3)
    assert table.counts[key] == ([2, 2, 2, 0, 0, 0], [2, 2, 1, 0, 0, 0])
    a = table.rates(key, 5)
    pooled = (5 + 2 * 0.5) / (6 + 2)
    assert a == pytest.approx([(2 + 4 * pooled) / 6, (2 + 4 * pooled) / 6, (1 + 4 * pooled) / 6, pooled, pooled])
    assert table.rates(("greedy", 1, True), 3) == pytest.approx([0.5] * 3)  # unseen: the prior


def test_the_stop_rule_verifies_what_pays():
    """h: up to the first candidate whose cumulative rejection probability exceeds h (SpecDec++'s rule). auto:
    the depth of the best expected tokens per ms: deep where verification is nearly flat and copies are accepted,
    none where each verified token costs a step and copies are rejected."""
    assert LookupStop(threshold=0.25).depth([0.9] * 6) == 3  # 1 - 0.9^3 = 0.271 > 0.25
    assert LookupStop(threshold=1.0).depth([0.1] * 4) == 4
    flat, steep = CostModel([10.0 + 0.1 * n for n in range(9)], 0.01), CostModel([10.0 * (n + 1) for n in range(9)], 0.01)
    auto = LookupStop(threshold="auto", k_max=8)
    auto.configure(SamplingConfig(0.0), flat)
    assert auto.depth([0.9] * 8) == 8
    assert auto.depth([0.9, 0.9, 0.01, 0.9]) == 2
    auto.configure(SamplingConfig(0.0), steep)
    assert auto.depth([0.3] * 8) == 0
    # a round's plan: rows without a match do not draft; a row's streak follows its last copy
    pol = make_policy("lookup", threshold=0.6)
    pol.reset(2, torch.device("cpu"))
    plan = pol.plan(RoundContext(2, room=[5, 4], matches=[3, 0]))
    assert plan.row_caps == [2, 0] and plan.cap == 2  # the prior 0.5: 1 - 0.5^2 > 0.6 first at t = 2
    pol.observe(RoundResult([2, 0], [2, 0], steps=2, plan=plan))
    assert pol.streak == [True, False]
    assert pol.table.counts[("greedy", 3, False)] == ([1, 1] + [0] * 6, [1, 1] + [0] * 6)


# a prompt that repeats itself, so that lookups match from the first round
PROMPT = torch.tensor([[0, 5, 7, 3, 9, 12, 5, 7, 3, 9, 12, 5]])


@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 1}), ("fixed", {"k": 5}), ("heuristic", {}),
                                       ("confidence", {}), ("adaedl", {}), ("specdecpp", {"threshold": "auto"}),
                                       ("specdecpp", {"threshold": 0.5})])
def test_greedy_equals_target_only_decoding(policy, kw):
    target, _ = make_pair("llama", vocab=48)
    g = torch.Generator().manual_seed(3)
    prompts = [PROMPT[0]] + [torch.randint(2, 48, (9,), generator=g) for _ in range(2)]
    gen = SpeculativeGenerator(target, "ngram", policy=policy, **kw)
    accepted = discarded = 0
    for p in prompts:
        out = gen.generate(p.view(1, -1), max_new_tokens=40, temperature=0)
        assert out.new_tokens[0] == target_only(target, p, 40), f"{policy} {kw}: greedy output differs"
        accepted, discarded = accepted + out.stats.accepted, discarded + out.stats.discarded
    assert accepted > 0 and discarded > 0, "prompt lookup was not exercised"
    # a left-padded batch: each row what it is alone
    batch = torch.stack([prompts[1], prompts[2]])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = gen.generate(batch, attention_mask=mask, max_new_tokens=24, temperature=0)
    assert out.new_tokens[0] == target_only(target, prompts[1][3:], 24)
    assert out.new_tokens[1] == target_only(target, prompts[2], 24)


def test_continuous_batching_gives_each_request_its_own_output():
    target, _ = make_pair("llama", vocab=48)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 48, (int(n),), generator=g).tolist() for n in (6, 11, 8, 5, 9)]
    gen = SpeculativeGenerator(target, "ngram", policy="fixed", k=3)
    out = gen.generate_continuous(prompts, max_new_tokens=20, batch_size=2, temperature=0)
    for p, toks in zip(prompts, out.new_tokens):
        assert toks == target_only(target, torch.tensor(p), 20)


N_ROWS, N_POS = 3000, 3
COSTS = CostModel([1.0 + 0.05 * n for n in range(21)], 0.2, 0.01, 0.1)  # verification nearly flat, a draft step 0.2
SAMPLING = [SamplingConfig(1.0), SamplingConfig(0.6, top_k=6)]


@pytest.fixture(scope="module")
def target_and_marginals():
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9, 5, 7, 3]])  # [3] occurred before, followed by 9, 5, 7, 3
    return target, prompt, {cfg: exact_marginals(target, prompt, cfg, N_POS) for cfg in SAMPLING}, draft


@pytest.mark.slow
@pytest.mark.parametrize("cfg,policy", [(SAMPLING[0], {"policy": "fixed", "k": 3}),
                                        (SAMPLING[1], {"policy": "fixed", "k": 3}),
                                        (SAMPLING[0], {"policy": "specdecpp", "threshold": "auto",
                                                       "costs": CostModel([1.0 + 0.05 * n for n in range(21)], 0.01)}),
                                        (SAMPLING[0], {"policy": "fixed", "k": 3, "lookup": True, "costs": COSTS})],
                         ids=["T1", "T0.6-topk6", "T1-auto", "T1-copy-or-draft"])
def test_sampling_is_lossless(target_and_marginals, cfg, policy):
    target, prompt, marg, draft = target_and_marginals
    gen = SpeculativeGenerator(target, draft if policy.get("lookup") else "ngram", **policy)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=cfg.temperature, top_k=cfg.top_k,
                       seed=1000)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marg[cfg][i], f"prompt lookup {cfg}, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0, "prompt lookup was not exercised"
    if policy.get("lookup"):  # rounds of copies and rounds of the draft model both ran
        tried = [sum(sum(t) for t, _ in table.counts.values()) for table in (gen.policy.copy.table, gen.policy.drafted)]
        assert min(tried) > 0, tried


@pytest.mark.slow
def test_chi_square_catches_copied_candidates_let_through(target_and_marginals, monkeypatch):
    """Negative control: a verification that accepts every copied candidate (the proposal passed through) fails
    against the target's marginals at the same rows, so the test above could catch a broken acceptance."""
    from specdec_ext.engine import steps

    def accept_all(cands, draft_logits, target_logits, temperature, n, uniforms=None, check=True):
        B, K = cands.shape
        out = torch.cat([cands, target_logits[:, -1].argmax(-1, keepdim=True)], 1)
        return out, n.clone()

    monkeypatch.setattr(steps.ops, "chain_verify_logits", accept_all)
    target, prompt, marg, _ = target_and_marginals
    gen = SpeculativeGenerator(target, "ngram", policy="fixed", k=3)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=1.0, seed=1000)
    toks = torch.tensor(out.new_tokens)
    failures = sum(chi_square(toks[:, i], marg[SamplingConfig(1.0)][i])[0] >
                   chi_square(toks[:, i], marg[SamplingConfig(1.0)][i])[2] for i in range(N_POS))
    assert failures >= 1, "the chi-square test cannot tell copied candidates let through from the target's samples"


@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 3}), ("heuristic", {}), ("specdecpp", {"threshold": 0.7})])
def test_copy_or_draft_equals_target_only_decoding(policy, kw):
    """lookup=True beside a draft model: each round copies or drafts (CopyOrDraft); greedy, every policy of the
    draft's rounds gives target-only decoding's tokens, alone, in a left-padded batch and in continuous batching,
    and both kinds of round ran."""
    target, draft = make_pair("llama", vocab=48)
    if policy == "specdecpp":
        kw = {**kw, "head": head_for(draft)}
    g = torch.Generator().manual_seed(3)
    prompts = [PROMPT[0]] + [torch.randint(2, 48, (9,), generator=g) for _ in range(2)]
    gen = SpeculativeGenerator(target, draft, policy=policy, lookup=True, costs=COSTS, **kw)
    for p in prompts:
        assert gen.generate(p.view(1, -1), max_new_tokens=40, temperature=0).new_tokens[0] == target_only(target, p, 40)
    copies = sum(sum(tried) for tried, _ in gen.policy.copy.table.counts.values())
    drafts = sum(sum(tried) for tried, _ in gen.policy.drafted.counts.values())
    assert copies > 0 and drafts > 0, (copies, drafts)
    batch = torch.stack([prompts[1], prompts[2]])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = gen.generate(batch, attention_mask=mask, max_new_tokens=24, temperature=0)
    assert out.new_tokens == [target_only(target, prompts[1][3:], 24), target_only(target, prompts[2], 24)]
    served = gen.generate_continuous([p.tolist() for p in prompts], max_new_tokens=20, batch_size=2, temperature=0)
    assert served.new_tokens == [target_only(target, p, 20) for p in prompts]


def test_copy_or_draft_runs_the_round_that_promises_more():
    """The copy's expected goodput (its table at the row's match) against the draft rounds' (their table): a copy
    accepted whole so far wins over a draft rejected so far, and the other way round; without a copy the round
    drafts, or takes a plain step where drafts were rejected; the sub-policies learn only from their own rounds."""
    from specdec_ext.policies import CopyOrDraft

    def trained(copied: int, drafted: int):
        """A CopyOrDraft whose copies of 4 had ``copied`` accepted and whose drafts of 3 ``drafted``, PLAIN_AFTER times."""
        pol = CopyOrDraft(make_policy("fixed", k=3))
        pol.configure(SamplingConfig(0.0), COSTS)
        pol.reset(1, torch.device("cpu"))
        for _ in range(PLAIN_AFTER):
            pol.copy.table.add(("greedy", 3, False), 4, copied)
            pol.drafted.add(("draft", "greedy"), 3, drafted)
        return pol

    pol, ctx = trained(4, 0), RoundContext(1, room=[10], matches=[3], copies=[4])
    plan = pol.plan(ctx)
    assert plan.proposer and plan.row_caps == [4]
    pol.observe(RoundResult([4], [1], steps=4, plan=plan))
    n = PLAIN_AFTER
    assert pol.copy.table.counts[("greedy", 3, False)][0][:2] == [n + 1, n + 1]
    assert pol.drafted.counts[("draft", "greedy")][0][0] == n
    plan = pol.plan(RoundContext(1, room=[10], matches=[0], copies=[0]))  # nothing to copy, drafts rejected: plain
    assert not plan.proposer and plan.cap == 0
    pol.observe(RoundResult([0], [0], steps=0, plan=plan))
    assert pol.drafted.counts[("draft", "greedy")][0][0] == n
    fresh = CopyOrDraft(make_policy("fixed", k=3))  # without that evidence, an unlucky start still drafts
    fresh.configure(SamplingConfig(0.0), COSTS)
    fresh.reset(1, torch.device("cpu"))
    for _ in range(8):
        fresh.drafted.add(("draft", "greedy"), 3, 0)
    assert fresh.plan(RoundContext(1, room=[10], matches=[0], copies=[0])).cap == 3
    pol = trained(0, 3)
    plan = pol.plan(ctx)
    assert not plan.proposer and plan.cap == 3
    pol.observe(RoundResult([3], [2], steps=3, plan=plan))
    assert pol.drafted.counts[("draft", "greedy")][0][:3] == [n + 1] * 3
    assert pol.plan(RoundContext(1, room=[10], matches=[0], copies=[0])).cap == 3  # nothing to copy: the draft


def test_copy_or_draft_prices_the_draft_rounds_as_they_ran():
    """At one row, draft rounds whose measured cycles emit fewer tokens per ms than plain steps give way: with a copy,
    the copy's round; without, a plain step, and a draft round once in EXPLORE_EVERY rounds; rounds that run faster
    than plain steps keep drafting. The profile's model alone (its verification nearly flat) keeps drafting."""
    from specdec_ext.policies import CopyOrDraft

    def measured(draft_ms: float):
        pol = CopyOrDraft(make_policy("fixed", k=3))
        pol.configure(SamplingConfig(0.0), COSTS)
        pol.reset(1, torch.device("cpu"))
        for _ in range(PLAIN_AFTER):  # drafts of 3 with 1 accepted: 2 tokens a round, modelled at 2 / 1.9 tokens/ms
            plan = pol.plan(RoundContext(1, room=[10], matches=[0], copies=[0]))
            assert plan.cap == 3 and not plan.proposer
            pol.observe(RoundResult([3], [1], steps=3, plan=plan, cycle_ms=draft_ms))
        return pol

    fast, slow = measured(1.5), measured(4.0)  # 1.33 and 0.5 tokens/ms against plain's modelled 1 / 1.1
    assert fast.draft_pays() and not slow.draft_pays()
    assert fast.plan(RoundContext(1, room=[10], matches=[0], copies=[0])).cap == 3
    caps = []
    for _ in range(2 * EXPLORE_EVERY):
        plan = slow.plan(RoundContext(1, room=[10], matches=[0], copies=[0]))
        caps.append(plan.cap)
        slow.observe(RoundResult([plan.cap], [0], steps=plan.cap, plan=plan, cycle_ms=4.0 if plan.cap else 1.0))
    assert caps.count(3) == 2 and set(caps) == {0, 3}  # plain steps, a draft round once in EXPLORE_EVERY
    assert slow.rates.plain[1] > 0 and not slow.draft_pays()
    plan = slow.plan(RoundContext(1, room=[10], matches=[3], copies=[4]))  # a copy: its round, not the draft's
    assert plan.proposer
    batch = slow.plan(RoundContext(2, room=[10, 10], matches=[0, 0], copies=[0, 0]))  # two rows: the model decides
    assert batch.cap == 3
    slow.reset(1, torch.device("cpu"))  # the next call keeps the measure; reset_adaptation forgets it
    assert not slow.draft_pays()
    slow.reset_adaptation()
    assert slow.draft_pays() and slow.plan(RoundContext(1, room=[10], matches=[0], copies=[0])).cap == 3


def test_copy_or_draft_refuses_what_it_cannot_do():
    from specdec_ext.policies import CopyOrDraft

    target, draft = make_pair("llama", vocab=48)
    with pytest.raises(ValueError, match="^lookup: prompt lookup beside a draft model needs the draft model"):
        SpeculativeGenerator(target, "ngram", lookup=True)
    with pytest.raises(ValueError, match="^lookup: expected True, False or a PromptLookup"):
        SpeculativeGenerator(target, draft, lookup="yes")
    with pytest.raises(ValueError, match="^cuda_graphs=True: rounds with prompt lookup"):
        SpeculativeGenerator(target, draft, lookup=True, cuda_graphs=True)
    with pytest.raises(TypeError, match="^draft: expected the policy of a draft model's rounds"):
        CopyOrDraft(make_policy("autoregressive"))
    with pytest.raises(TypeError, match="^copy: expected a LookupStop"):
        CopyOrDraft(make_policy("fixed", k=2), copy=make_policy("fixed", k=2))
