"""Continuous batching (``SpeculativeGenerator.generate_continuous``): finished requests leave their slots to
queued ones mid-generation, prefilled into them.

A request's output equals target-only decoding (greedy) and its own ``generate()`` alone (seeded sampling)
for every policy, both draft backends, a GPT-2 pair and sliding-window models; admissions really happen
mid-stream; transformers' caches stay as narrow as the live requests need; the draft reads each request once,
when it first drafts, and what plain steps committed before the next drafting round; the budgeted path (rows
coupled) passes the chi-square test; bad input is refused, naming the argument."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from stats import assert_follows
from support import (EACH_WAY, PIDS, POLICIES, TEST_BATCH_COSTS, TEST_COSTS, exact_marginals, head_for, make_gen,
                     spy_draft_reads, target_only)
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine import backends, round as round_module
from specdec_ext.engine.backends import _right_aligned
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.engine.scheduler import Scheduler
from specdec_ext.policies import CandidateLengthPolicy


def queue(V, n=7, seed=1, longest=9):
    """``n`` prompts of 1 .. longest - 1 tokens (one-token prompts included: they have no prefill)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, longest - 1] + [int(torch.randint(1, longest, (1,), generator=g)) for _ in range(n - 2)]
    return [torch.randint(2, V, (t,), generator=g) for t in lengths]


def mixed_rounds(stats, first: int) -> int:
    """Rounds in which a request of the first group ran beside a request admitted later."""
    return sum(1 for r in stats.rounds if min(r.rows) < first <= max(r.rows))


# every policy with both draft runners of a Llama pair; a GPT-2 pair (transformers' forward on both sides, learned
# positions) with one policy of each way of running rounds (support.EACH_WAY)
CONTINUOUS = [(name, kw, arch, fast_draft, f"{pid}-{aid}") for arch, fast_draft, aid in
              [("llama", True, "llama-fast-draft"), ("llama", False, "llama-hf-draft"), ("gpt2", False, "gpt2")]
              for (name, kw), pid in zip(POLICIES, PIDS) if arch == "llama" or pid in EACH_WAY]


@pytest.mark.parametrize("name,kw,arch,fast_draft", [c[:4] for c in CONTINUOUS], ids=[c[4] for c in CONTINUOUS])
def test_each_request_equals_its_output_alone(name, kw, arch, fast_draft):
    target, draft = make_pair(arch)
    V = target.config.vocab_size
    prompts = queue(V)
    coupled = kw.get("threshold") == "auto"  # rows coupled by the budget, the calibration and the selection
    sampled_kw = dict(kw, batch_budget=False, calibrate=False, select=False) if coupled else kw
    for temperature, kwargs in ((0.0, kw), (1.0, sampled_kw)):
        gen = make_gen(target, draft, name, kwargs, fast_draft=fast_draft)
        out = gen.generate_continuous(prompts, batch_size=3, max_new_tokens=14, temperature=temperature, seed=5)
        assert len(out.new_tokens) == len(prompts)
        for i, p in enumerate(prompts):
            if temperature == 0:
                ref = target_only(target, p, 14)
            else:
                ref = gen.generate(p.view(1, -1), max_new_tokens=14, temperature=1.0, seed=5 + i).new_tokens[0]
            assert out.new_tokens[i] == ref, f"request {i} (T = {temperature}) differs from its output alone"
        assert out.stats.new_tokens == 14 * len(prompts)
        assert all(a <= f for a, f in zip(out.admitted_ms, out.finished_ms))
        assert max(out.admitted_ms) > 0  # later requests waited for a free row


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_models_equal_target_only(arch):
    target, draft = make_pair(arch)
    V = target.config.vocab_size
    prompts = queue(V, n=6, longest=12)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=16, temperature=0)
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 16), f"{arch}: request {i} differs from target-only decoding"


@pytest.mark.parametrize("arch,fast_draft,fast_target", [("llama", True, True), ("llama", False, False),
                                                         ("mistral", False, True)])
def test_a_longer_request_joining_later_gets_room(arch, fast_draft, fast_target):
    """Requests much longer than the first ones join later: transformers' cache widens when one is written into it,
    the static cache was sized for the call's longest request; every request equals target-only decoding."""
    target, draft = make_pair(arch)
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, V, (t,), generator=g) for t in (1, 2, 3, 30, 1, 24, 2)]
    widths = []
    replace = CausalLMRunner.replace_rows

    def spy(self, slots, other, rows=None):
        before = self.length
        replace(self, slots, other, rows)
        if self.name == "target":
            widths.append((before, self.length))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(CausalLMRunner, "replace_rows", spy)
        gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, fast_draft=fast_draft, fast_target=fast_target)
        out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=6, temperature=0)
    if gen.fast_target:
        assert gen._backend("target").cache.max_len >= 30 + 6 + 3 and not widths
    else:
        assert any(after > before for before, after in widths), "no admission widened the cache"
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 6), f"request {i} differs from target-only decoding"


def runners_of(model):
    """``(make, fresh)`` for transformers' runner tests: ``make()`` a new runner of ``model``, ``fresh(prompt)`` one
    that has read ``prompt`` ``[B, T]`` but its last token."""

    def make():
        return CausalLMRunner(model, "draft")

    def fresh(prompt):
        r = make()
        r.start(prompt.shape[0])
        if prompt.shape[1] > 1:
            r.forward(prompt[:, :-1])
        return r

    return make, fresh


@pytest.mark.parametrize("old_len,new_len", [(1, 4), (6, 3), (3, 9)], ids=["empty-cache", "narrower", "wider"])
def test_replace_rows_gives_the_new_row_the_state_of_its_prompt_alone(old_len, new_len):
    """A row written into a slot computes what a runner that read only its prompt computes; the other row is
    untouched. Covers a cache that holds nothing yet, a narrower and a wider new prompt."""
    target, draft = make_pair("llama")
    _, fresh = runners_of(draft)
    g = torch.Generator().manual_seed(0)
    old = torch.randint(2, 40, (2, old_len), generator=g)
    new = torch.randint(2, 40, (1, new_len), generator=g)
    nxt = torch.randint(2, 40, (2, 1), generator=g)

    batch, incoming = fresh(old), fresh(new)
    batch.replace_rows(torch.tensor([1]), incoming)
    got, _ = batch.forward(torch.stack([torch.cat([old[0, -1:], nxt[0]]), torch.cat([new[0, -1:], nxt[1]])]), keep=1)
    alone_new, _ = fresh(new).forward(torch.cat([new[0, -1:], nxt[1]]).view(1, -1), keep=1)
    alone_old, _ = fresh(old[:1]).forward(torch.cat([old[0, -1:], nxt[0]]).view(1, -1), keep=1)
    torch.testing.assert_close(got[1], alone_new[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[0], alone_old[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("old_len", [1, 6], ids=["empty-cache", "filled"])
def test_replace_rows_takes_some_rows_of_a_runner_that_stays_usable(old_len):
    """``replace_rows(slots, other, rows=...)`` (admission="ahead"): rows of a runner that read several prompts of
    different lengths, taken one at a time, compute what a runner that read only their prompt computes; the other
    runner keeps its rows (its remaining row still computes what it would alone)."""
    target, draft = make_pair("llama")
    make, fresh = runners_of(draft)
    g = torch.Generator().manual_seed(1)
    old = torch.randint(2, 40, (2, old_len), generator=g)
    pooled = [torch.randint(2, 40, (n,), generator=g) for n in (3, 8, 5)]
    nxt = torch.randint(2, 40, (3, 1), generator=g)

    def alone(prompt, token):
        return fresh(prompt.view(1, -1)).forward(torch.cat([prompt[-1:], token]).view(1, -1), keep=1)[0][0]

    pool = make()
    pool.start(3)
    toks, mask = _right_aligned([p.tolist() for p in pooled], 8)
    pool.forward(toks[:, :-1], mask[:, :-1])
    batch = fresh(old)
    batch.replace_rows(torch.tensor([1]), pool, rows=torch.tensor([0]))
    batch.replace_rows(torch.tensor([0]), pool, rows=torch.tensor([2]))
    assert pool.mask is not None  # still usable
    got, _ = batch.forward(torch.stack([torch.cat([pooled[2][-1:], nxt[0]]), torch.cat([pooled[0][-1:], nxt[1]])]),
                           keep=1)
    torch.testing.assert_close(got[0], alone(pooled[2], nxt[0]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], alone(pooled[0], nxt[1]), rtol=1e-4, atol=1e-5)
    rest, _ = pool.forward(torch.stack([torch.cat([p[-1:], nxt[2]]) for p in pooled]), keep=1)
    torch.testing.assert_close(rest[1], alone(pooled[1], nxt[2]), rtol=1e-4, atol=1e-5)


def test_replacing_every_row_in_order_takes_the_other_runner_whole():
    """When every row is replaced, in order (plain decoding's requests finish together), the runner takes the
    other's storage instead of copying it row by row, and computes what the other would; any other order of slots
    still writes the rows."""
    target, draft = make_pair("llama")
    _, fresh = runners_of(draft)
    storage = (lambda r: r.cache)
    g = torch.Generator().manual_seed(0)
    old, new = torch.randint(2, 40, (2, 7), generator=g), torch.randint(2, 40, (2, 4), generator=g)
    nxt = torch.randint(2, 40, (2, 1), generator=g)
    alone, _ = fresh(new).forward(torch.cat([new[:, -1:], nxt], 1), keep=1)
    for slots, whole in (([0, 1], True), ([1, 0], False)):
        batch, incoming = fresh(old), fresh(new)
        theirs = storage(incoming)
        batch.replace_rows(torch.tensor(slots), incoming)
        assert (storage(batch) is theirs) == whole, slots
        assert incoming.mask is None and batch.length == 3  # spent; its width
        got, _ = batch.forward(torch.cat([new[:, -1:], nxt], 1)[slots], keep=1)
        torch.testing.assert_close(got, alone[slots], rtol=1e-4, atol=1e-5)


def test_plain_decoding_refills_a_whole_batch_by_taking_the_new_runner():
    """transformers' runner: when both rows of a batch are refilled in one group, the batch takes the new runner
    whole instead of copying its rows."""
    target, _ = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=6)
    taken = []
    replace = CausalLMRunner.replace_rows

    def spy(self, slots, other, rows=None):
        kv = getattr(other, type(other)._state[0])  # the KV storage: the cache, or the lean runner's key buffers
        replace(self, slots, other, rows)
        taken.append(getattr(self, type(self)._state[0]) is kv)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(CausalLMRunner, "replace_rows", spy)
        gen = SpeculativeGenerator(target, policy="autoregressive", fast_target=False)
        out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=5, temperature=0, admission="eager")
    assert taken and all(taken), taken  # every refill replaced both rows at once
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 5), f"request {i} differs from target-only decoding"


def test_requests_join_mid_generation_and_eos_frees_their_rows():
    target, draft = make_pair("llama", noise=0.1)
    V = target.config.vocab_size
    prompts = queue(V, n=8)
    ref = [target_only(target, p, 20) for p in prompts]
    eos = ref[0][4]  # a token that request 0 emits early: rows end at different rounds
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    out = gen.generate_continuous(prompts, batch_size=3, max_new_tokens=20, temperature=0, eos_token_id=eos)
    for i, r in enumerate(ref):
        cut = r[: r.index(eos) + 1] if eos in r else r
        assert out.new_tokens[i] == cut
    assert mixed_rounds(out.stats, 3) > 0, "no round ran a first-group request beside a later one"
    assert max(len(r.rows) for r in out.stats.rounds) == 3


@pytest.mark.parametrize("name,kw", [("autoregressive", {}), ("fixed", {"k": 3}),
                                     ("specdecpp", {"threshold": "auto"})], ids=["plain", "fixed", "budget"])
def test_each_request_stops_at_its_own_max_new_tokens(name, kw):
    """Per-request max_new_tokens (a server's requests ask for different lengths): each request's output is its
    greedy output alone at its own limit, so rows finish at different rounds even in plain decoding."""
    target, draft = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=7)
    limits = [3, 17, 1, 9, 12, 5, 20]
    gen = make_gen(target, draft, name, kw)
    out = gen.generate_continuous(prompts, batch_size=3, max_new_tokens=limits, temperature=0)
    for i, (p, n) in enumerate(zip(prompts, limits)):
        assert out.new_tokens[i] == target_only(target, p, n), f"request {i} (max_new_tokens {n})"
    assert out.stats.new_tokens == sum(limits)
    assert len({round(f, 6) for f in out.finished_ms}) > 2  # requests ended at different rounds


@pytest.mark.parametrize("name,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6})], ids=["fixed", "h0.6"])
def test_requests_sample_with_their_own_settings(name, kw):
    """Per-request temperature, top-k and top-p in one continuous batch (greedy rows beside sampling ones, fp32):
    each request's tokens equal its output alone with its own settings and seed, so each row keeps the lossless
    distribution of its own settings."""
    target, draft = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=6)
    temps, top_k, top_p = [0.0, 1.0, 0.0, 0.7, 1.3, 0.0], [None, 5, None, None, 12, None], [None, None, None, 0.9,
                                                                                           None, None]
    gen = make_gen(target, draft, name, kw)
    out = gen.generate_continuous(prompts, batch_size=3, max_new_tokens=12, temperature=temps, top_k=top_k,
                                  top_p=top_p, seed=40)
    for i, p in enumerate(prompts):
        alone = gen.generate(p.view(1, -1), max_new_tokens=12, temperature=temps[i], top_k=top_k[i], top_p=top_p[i],
                             seed=40 + i).new_tokens[0]
        assert out.new_tokens[i] == alone, f"request {i}"
    with pytest.raises(ValueError, match=r"temperature must be one value or a sequence of one per prompt \(6\)"):
        gen.generate_continuous(prompts, batch_size=3, temperature=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"prompts\[1\]: top_k must be a positive integer"):
        gen.generate_continuous(prompts, batch_size=3, top_k=[None, 0, None, None, None, None])


def test_caches_stay_as_wide_as_the_live_requests_need(monkeypatch):
    target, draft = make_pair("llama")
    V = target.config.vocab_size
    widths = []
    forward = CausalLMRunner.forward

    def spy(self, *args, **kwargs):  # the cache width every forward of the batch's runners runs over
        if self.mask is not None and self.mask.shape[0] == 2:
            widths.append(self.length)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CausalLMRunner, "forward", spy)
    prompts = queue(V, n=14, longest=8)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=4, fast_draft=False)
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=10, temperature=1.0, seed=3)
    assert out.stats.admissions >= 6 and len(widths) > 12
    # without dropping the columns of requests that left, the width would grow with every request served; a
    # forward runs over a prompt (<= 8), its tokens so far (< 10), up to 4 drafted candidates and 2 pending tokens
    assert max(widths) <= 8 + 10 + 4 + 2, widths
    assert sum(len(t) for t in out.new_tokens) == 140


N_ROWS, N_POS = 1500, 3


@pytest.mark.slow
@pytest.mark.parametrize("in_round", [True, False], ids=["in-round", "blind"])
def test_budgeted_continuous_sampling_is_lossless(in_round):
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([0, 5, 7, 3, 9])
    cfg = SamplingConfig(1.0)
    marg = exact_marginals(target, prompt.view(1, -1), cfg, N_POS)
    # rows in lockstep (one prompt, one length) may take plain steps only (BatchBudget's lockstep rule, on measured
    # times): without the rule the budget explores its depths, so the rows draft and finish at different rounds
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"),
                               threshold="auto", k_max=6, costs=TEST_COSTS, batch_costs=TEST_BATCH_COSTS,
                               budget_options={"lockstep": False, "in_round": in_round})
    out = gen.generate_continuous([prompt] * N_ROWS, batch_size=64, max_new_tokens=N_POS, temperature=1.0, seed=7)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marg[i], f"continuous batching with the budget, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0


@pytest.mark.slow
def test_continuous_sampling_with_eos_is_lossless():
    """Requests that end at EOS leave their slots to queued ones: each generated position follows target-only
    sampling over the requests still running there (chi-square per position; EOS a likely token, so rows end and
    new ones join at every round), for fixed K and SpecDec++ with its per-row rule."""
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([0, 5, 7, 3, 9])
    cfg = SamplingConfig(1.0)
    first = exact_marginals(target, prompt.view(1, -1), cfg, 1)[0]
    eos = int(first.argmax())  # the likeliest first token: about a third of the requests end there
    marg = exact_marginals(target, prompt.view(1, -1), cfg, N_POS, eos=eos)
    for name, kw in (("fixed", {"k": 3}), ("specdecpp", {"threshold": "auto", "k_max": 6, "batch_budget": False,
                                                          "_head": "proposal"})):
        gen = make_gen(target, draft, name, kw)
        out = gen.generate_continuous([prompt] * N_ROWS, batch_size=16, max_new_tokens=N_POS, temperature=1.0,
                                      seed=13, eos_token_id=eos)
        ended = sum(t[-1] == eos and len(t) < N_POS for t in out.new_tokens)
        assert ended > N_ROWS // 10 and out.stats.admissions > 50, (ended, out.stats.admissions)
        for i in range(N_POS):
            toks = torch.tensor([t[i] for t in out.new_tokens if len(t) > i])
            assert_follows(toks, marg[i], f"{name}: continuous batching with EOS, position {i + 1}")
        assert out.stats.accepted > 0 and out.stats.discarded > 0


@pytest.mark.parametrize("fast_draft", [True, False], ids=["lean", "transformers"])
def test_a_draft_that_reads_a_recent_window_keeps_the_target_output(monkeypatch, fast_draft):
    """draft_context=W: the draft reads at most the last W tokens of a request's context (its prefill feeds W - 1 of
    them, the last being the pending token), and greedy output still equals target-only decoding."""
    target, draft = make_pair("llama", noise=0.3)
    prompts = queue(target.config.vocab_size, n=6, longest=9)
    widths = spy_draft_reads(monkeypatch)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, fast_draft=fast_draft, draft_context=4)
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=10, temperature=0)
    assert widths and max(widths) == 4, widths  # the longest read: a window of 4 tokens
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 10), f"request {i} differs from target-only decoding"
    assert out.stats.accepted > 0
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="draft_context"):
            SpeculativeGenerator(target, draft, policy="fixed", k=3, draft_context=bad)


@pytest.mark.slow
def test_sampling_with_a_windowed_draft_is_lossless():
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([0, 5, 7, 3, 9])
    marg = exact_marginals(target, prompt.view(1, -1), SamplingConfig(1.0), N_POS)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, draft_context=2)
    out = gen.generate_continuous([prompt] * N_ROWS, batch_size=64, max_new_tokens=N_POS, temperature=1.0, seed=11)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marg[i], f"draft reading a 2-token window, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0


class PerRow(CandidateLengthPolicy):
    name = "per-row"
    max_candidates = 2

    def should_stop(self, info):
        return torch.ones(info.batch_size, dtype=torch.bool)

    def select_rows(self, index):
        pass


def test_bad_input_is_refused_with_the_argument_named():
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    ok = [torch.tensor([3, 4, 5])]
    with pytest.raises(ValueError, match="batch_size"):
        gen.generate_continuous(ok, batch_size=0)
    with pytest.raises(ValueError, match="prompts"):
        gen.generate_continuous([], batch_size=2)
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        gen.generate_continuous(ok + [torch.tensor([], dtype=torch.int64)], batch_size=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]: a prompt is 1-D"):
        gen.generate_continuous([torch.tensor([[3, 4]])], batch_size=2)
    with pytest.raises(ValueError, match=r"prompts\[0\].*outside the vocabulary"):
        gen.generate_continuous([[3, 10**6]], batch_size=2)
    with pytest.raises(ValueError, match="seed"):
        gen.generate_continuous(ok * 3, batch_size=2, seed=[1, 2])
    with pytest.raises(ValueError, match=r"max_new_tokens .*one per prompt \(3\)"):
        gen.generate_continuous(ok * 3, batch_size=2, max_new_tokens=[4, 4])
    with pytest.raises(ValueError, match=r"max_new_tokens .*one per prompt"):
        gen.generate_continuous(ok * 3, batch_size=2, max_new_tokens=torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError, match=r"prompts\[1\]: max_new_tokens must be an integer >= 1, got 0"):
        gen.generate_continuous(ok * 3, batch_size=2, max_new_tokens=[4, 0, 4])
    with pytest.raises(NotImplementedError, match="add_rows"):
        SpeculativeGenerator(target, draft, policy=PerRow()).generate_continuous(
            ok * 3, batch_size=1, max_new_tokens=3, temperature=0)


def test_length_groups_bound_the_padding_of_each_prefill():
    from specdec_ext.engine.backends import length_groups

    lengths = [39, 365, 120, 127, 60, 300, 41, 2, 1, 140, 128, 250]
    groups = length_groups(lengths, padding=0.25, slack=0)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    widths = [max(lengths[i] for i in g) for g in groups]
    assert widths == sorted(widths, reverse=True)  # the widest group first: later groups never widen the cache
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert len(g) * lengths[g[0]] - real <= 0.25 * real and lengths[g[0]] == max(lengths[i] for i in g), g
    assert len(groups) > 1 and length_groups(lengths, padding=10.0) == [sorted(range(12), key=lambda i: -lengths[i])]
    assert length_groups([5, 5, 5]) == [[0, 1, 2]] and length_groups([7]) == [[0]]
    assert length_groups([2, 1, 30], padding=0.0, slack=100) == [[2, 0, 1]]  # a few padding tokens are allowed


@pytest.mark.parametrize("arch,fast_draft", [("llama", True), ("llama", False), ("mistral", False)])
def test_prompts_of_very_different_lengths_are_prefilled_in_groups(arch, fast_draft, monkeypatch):
    """The first batch and each admission prefill their prompts in groups of similar length, each group into its
    slots; every request still equals target-only decoding."""
    monkeypatch.setattr(backends, "PREFILL_SLACK", 0)
    seen = []
    groups = backends.length_groups
    monkeypatch.setattr(backends, "length_groups", lambda *a: (seen.append(groups(*a)), seen[-1])[1])
    target, draft = make_pair(arch)
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, V, (t,), generator=g) for t in (2, 28, 5, 17, 1, 30, 9, 3, 24)]
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, fast_draft=fast_draft)
    out = gen.generate_continuous(prompts, batch_size=4, max_new_tokens=8, temperature=0)
    assert len(seen[0]) >= 2, seen  # the first batch (2, 28, 5, 17 tokens) in more than one group
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 8), f"{arch}: request {i} differs from target-only decoding"


class Intermittent(CandidateLengthPolicy):
    """Drafts K = 3 candidates in the rounds ``drafting(round)`` says, plain steps in the others."""

    name = "intermittent"
    max_candidates = 3

    def __init__(self, drafting):
        self.drafting, self.round = drafting, -1

    def draft_round(self, width):
        self.round += 1
        return self.drafting(self.round)

    def should_stop(self, info):
        return torch.zeros(info.batch_size, dtype=torch.bool)


@pytest.mark.parametrize("fast_draft", [True, False], ids=["lean-draft", "hf-draft"])
def test_the_draft_reads_each_row_when_it_first_drafts(fast_draft):
    """The draft is the target itself, so a draft that has read each row's context exactly (prompt and generated
    tokens, positions and all) proposes the target's greedy tokens: every candidate is accepted. Rows join
    mid-stream and take plain steps before their first drafting round, and the batch drafts on and off."""
    target, _ = make_pair("llama")
    V = target.config.vocab_size
    prompts = queue(V, n=9, longest=12)
    refs = [target_only(target, p, 16) for p in prompts]
    def cut(t):
        return [r[: r.index(t) + 1] if t in r else r for r in refs]

    # an EOS token that ends the requests at the most different rounds: rows join and leave mid-stream
    eos = max(sorted({t for r in refs for t in r}), key=lambda t: len({len(r) for r in cut(t)}))
    refs = cut(eos)
    assert len({len(r) for r in refs}) > 2
    for drafting in (lambda r: r % 3 == 2, lambda r: r >= 4, lambda r: r % 2 == 0):
        gen = SpeculativeGenerator(target, target, policy=Intermittent(drafting), fast_draft=fast_draft)
        out = gen.generate_continuous(prompts, batch_size=3, max_new_tokens=16, temperature=0, eos_token_id=eos)
        drafted = [r for r in out.stats.rounds if sum(r.candidates)]
        # drafting rounds of rows admitted at different times: some the draft had read, some it read then
        assert sum(len({out.admitted_ms[i] for i in r.rows}) > 1 for r in drafted) > 0
        assert all(r.accepted == r.candidates for r in drafted), "the draft read a row's context wrongly"
        assert out.stats.draft_prefill_ms > 0
        assert out.new_tokens == refs
    # generate(): left-padded rows, the draft reading them after plain steps
    batch, mask = _right_aligned([p.tolist() for p in prompts[1:4]], max(len(p) for p in prompts[1:4]))
    out = SpeculativeGenerator(target, target, policy=Intermittent(lambda r: r >= 2), fast_draft=fast_draft).generate(
        batch, mask.long(), max_new_tokens=12, temperature=0)
    drafted = [r for r in out.stats.rounds if sum(r.candidates)]
    assert drafted and all(r.accepted == r.candidates for r in drafted)


def test_a_batch_that_never_drafts_never_runs_the_draft():
    """Rows that never draft never pay the draft's prefill: a batch of plain steps (the verification budget where
    speculation does not pay) runs no draft forward at all, and still equals target-only decoding."""
    target, draft = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=6, longest=10)
    for fast_draft in (True, False):
        gen = SpeculativeGenerator(target, draft, policy=Intermittent(lambda r: False), fast_draft=fast_draft)
        out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=9, temperature=0)
        assert out.stats.draft_calls == 0 and out.stats.draft_prefill_ms == 0.0
        for i, p in enumerate(prompts):
            assert out.new_tokens[i] == target_only(target, p, 9)
    drafting = SpeculativeGenerator(target, draft, policy="fixed", k=2).generate_continuous(
        prompts, batch_size=2, max_new_tokens=9, temperature=0)
    assert drafting.stats.draft_calls > 0 and drafting.stats.draft_prefill_ms > 0


@pytest.mark.parametrize("fast_draft", [True, False], ids=["lean-draft", "hf-draft"])
def test_a_drafting_batch_reads_new_requests_with_their_prefill(fast_draft, monkeypatch):
    """admission="ahead" while the batch drafts: the draft reads the queue's next requests in the same go as the
    target's prefill ahead of them (one group, not a few rows at a time when they first draft), so the lazy read
    (_catch_up) reads only the first rows. The draft is the target itself, so a context read wrongly would show as
    a rejected candidate; each request is read once, and the output is target-only decoding's."""
    target, _ = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=7, longest=12)
    lazy = []
    catch_up = Scheduler._catch_up

    def counting(self):
        lazy.append(sum(r.draft_from is None for r in self.live))
        return catch_up(self)

    monkeypatch.setattr(Scheduler, "_catch_up", counting)
    for admission, lazily_read in (("ahead", 2), ("eager", len(prompts))):
        lazy.clear()
        gen = SpeculativeGenerator(target, target, policy="fixed", k=2, fast_draft=fast_draft)
        out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=9, temperature=0, admission=admission)
        drafted = [r for r in out.stats.rounds if sum(r.candidates)]
        assert drafted and all(r.accepted == r.candidates for r in drafted), "the draft read a context wrongly"
        assert sum(lazy) == lazily_read and gen.measured.read_rows == len(prompts), (admission, lazy)
        assert out.stats.draft_prefill_ms > 0 and gen.measured.read_ms == pytest.approx(out.stats.draft_prefill_ms)
        for i, p in enumerate(prompts):
            assert out.new_tokens[i] == target_only(target, p, 9)
    # a window of the context (draft_context): the same tokens the lazy read would take
    gen = SpeculativeGenerator(target, target, policy="fixed", k=2, fast_draft=fast_draft, draft_context=4)
    lazy.clear()
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=9, temperature=0)
    assert sum(lazy) == 2 and all(out.new_tokens[i] == target_only(target, p, 9) for i, p in enumerate(prompts))


def test_a_round_after_plain_steps_starts_from_the_last_two_tokens(monkeypatch):
    """Plain steps leave their tokens to the draft; before the next drafting round the draft reads them in a forward
    of its own (counted in draft_deferred_ms, among the draft's reads), so the round's first draft forward feeds two
    tokens a row, as after a drafting round, and a round's time measures its depth alone. The draft is the target,
    so a deferred token read wrongly would show as a rejected candidate."""
    target, _ = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=5, longest=10)
    widths = []
    step = round_module.draft_step

    def recording(forward, tokens, *args, **kwargs):
        if args[1] == 1:  # k: the round's first draft forward
            widths.append(tokens.shape[1])
        return step(forward, tokens, *args, **kwargs)

    monkeypatch.setattr(round_module, "draft_step", recording)
    gen = SpeculativeGenerator(target, target, policy=Intermittent(lambda r: r % 4 == 3))  # 3 plain steps, 1 round
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=12, temperature=0)
    drafted = [r for r in out.stats.rounds if sum(r.candidates)]
    assert drafted and all(r.accepted == r.candidates for r in drafted)
    assert widths and set(widths) == {2} and out.stats.draft_deferred_ms > 0, widths
    assert out.new_tokens == [target_only(target, p, 12) for p in prompts]


class OverheadRecorder(Intermittent):
    """Intermittent, keeping per round what the engine reports before it (RoundContext.draft_overhead's ms per
    token) beside the scheduler's measured reads at that moment (Measured.read_ms, read_rows), the target's measured
    prefill ms per request then (``prefills``: None before one), RoundContext.together (``together``, continuous
    batching only) and RoundContext.draft_reads (``reads``). ``running``: a list whose last entry is the running
    scheduler (:func:`running_schedulers`)."""

    def __init__(self, drafting, running):
        super().__init__(drafting)
        self.running, self.seen, self.reads, self.prefills, self.together = running, [], [], [], []
        self.continuous = True

    def plan(self, ctx):
        m = self.running[-1].measured
        self.seen.append((ctx.draft_overhead, m.read_ms, m.read_rows))
        points = m.admissions
        self.prefills.append(sum(p[2] for p in points) / sum(p[0] for p in points) if points else None)
        if self.continuous:
            self.together.append(ctx.together)
        self.reads.append(ctx.draft_reads)
        return super().plan(ctx)


def running_schedulers(monkeypatch) -> list:
    """The schedulers made from now on, appended as they are made (the last one is the running call's)."""
    from specdec_ext.engine.scheduler import Scheduler

    made, init = [], Scheduler.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Scheduler, "__init__", record)
    return made


def test_the_engine_reports_the_drafts_reads_per_token_while_reads_are_to_come(monkeypatch):
    """draft_overhead: until a read of a row's context (_catch_up) has been measured, the target's measured prefill
    ms per request times the draft's share of the pair's parameters, over max_new_tokens; then the mean ms per row
    read over max_new_tokens while a live row is unread or requests wait; 0 once every live row is read and the
    queue is empty (what was read is paid for). generate(): the same, without a queue. (Eager admission: with
    admission "ahead" a drafting batch's new rows are read as they are prefilled, test below.)"""
    target, draft = make_pair("llama")
    prompts = queue(target.config.vocab_size, n=7, longest=10)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    running = running_schedulers(monkeypatch)
    pol = OverheadRecorder(lambda r: r >= 2, running)
    out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=10, temperature=0, policy=pol,
                                  admission="eager")
    seen = pol.seen
    assert len(seen) == len(out.stats.rounds)
    # nothing read yet: the target's prefills (the first two requests, measured) scaled by the draft's share
    share = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in target.parameters())
    assert 0 < share <= 1 and seen[0][1:] == (0.0, 0) and pol.prefills[0] > 0
    assert seen[0][0] == pytest.approx(pol.prefills[0] * share / 10) and seen[1][0] == pytest.approx(
        pol.prefills[1] * share / 10)
    # the draft's reads: each request's context once (every row is read when it first drafts, after the plain
    # steps, and the batch drafts from then on: nothing is deferred), and their time
    assert gen.measured.read_rows == len(prompts) and gen.measured.read_ms > 0
    assert gen.measured.read_ms + out.stats.draft_deferred_ms == pytest.approx(out.stats.draft_prefill_ms)
    later = seen[3:]
    for (o, ms, rows) in later:  # rows read so far over the tokens a request emits, while the queue is not empty
        assert o == 0.0 or o == pytest.approx(ms / rows / 10)
    unmeasured = [i for i, (_, _, rows) in enumerate(seen) if not rows]
    assert unmeasured == [0, 1, 2]  # the first drafting round (round 2) reads the rows
    assert all(seen[i][0] == pytest.approx(pol.prefills[i] * share / 10) for i in unmeasured)
    assert seen[-1][0] == 0.0  # the tail: every live row read, nothing queued
    # draft_reads: the mean ms per row read times the live rows not read yet (0 before a read was measured)
    assert len(pol.reads) == len(seen)
    assert all(r == 0.0 for r, (_, _, rows) in zip(pol.reads, seen) if not rows)
    unread = [r / (ms / rows) for r, (_, ms, rows) in zip(pol.reads, seen) if rows]
    assert all(u == pytest.approx(round(u)) and 0 <= round(u) <= 2 for u in unread), unread
    assert any(round(u) >= 1 for u in unread) and unread[-1] == 0  # new rows wait to be read; the tail is read
    for i, p in enumerate(prompts):
        assert out.new_tokens[i] == target_only(target, p, 10)

    ids = torch.stack([p[:1] for p in prompts[:3]])  # generate(): every row unread until the first drafting round
    pol = OverheadRecorder(lambda r: r >= 1, running)
    pol.continuous = False
    rows_before = gen.measured.read_rows
    gen.generate(ids, max_new_tokens=6, temperature=0, policy=pol)
    assert pol.seen[0][0] > 0  # measured in the earlier call, and this call's rows are unread
    assert gen.measured.read_rows == rows_before + 3
    # read in round 1: nothing left to read, and no queue
    assert len(pol.seen) > 2 and all(o == 0.0 for o, _, _ in pol.seen[2:])


def _in_lockstep(rounds, limits) -> list:
    """Per round of ``rounds`` (RoundStats, in order): whether it had several live rows, each with as many tokens
    left before it, given each request's token limit (the tokens a row commits: its emitted ones, up to its limit)."""
    done = [0] * len(limits)
    out = []
    for r in rounds:
        left = {limits[q] - done[q] for q in r.rows}
        out.append(len(r.rows) > 1 and len(left) == 1)
        for q, n in zip(r.rows, r.emitted):
            done[q] = min(limits[q], done[q] + n)
    return out


def test_the_engine_tells_the_policy_when_its_rows_are_in_lockstep(monkeypatch):
    """rows_together, before each round: True exactly when the batch has several live rows with as many tokens left
    each. Plain steps keep requests of one length together, refills included (the odd last request runs alone);
    requests of their own lengths are never together; drafting rounds part rows that accept different numbers of
    candidates, and the flag follows. generate()'s batches, which no request joins, are not reported."""
    target, draft = make_pair("llama", noise=0.3)
    prompts = queue(target.config.vocab_size, n=5, longest=8)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    running = running_schedulers(monkeypatch)
    for drafting, limits in ((lambda r: False, [4] * 5), (lambda r: False, [3, 5, 4, 6, 2]),
                             (lambda r: True, [6] * 5)):
        pol = OverheadRecorder(drafting, running)
        out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=limits, temperature=0, policy=pol)
        assert pol.together == _in_lockstep(out.stats.rounds, limits)
        if limits == [4] * 5:  # two waves of two together, then the fifth request alone
            assert pol.together == [True] * 8 + [False] * 4
        elif len(set(limits)) > 1:
            assert not any(pol.together)
        else:  # fixed K = 3 on a noisy pair: some round parts the rows
            assert pol.together[0] and not all(pol.together)
    pol = OverheadRecorder(lambda r: True, running)
    out = gen.generate(torch.stack([p[:1] for p in prompts[:3]]), max_new_tokens=5, temperature=0, policy=pol)
    assert out.stats.rounds and not any(pol.together)


@pytest.mark.parametrize("arch,fast_draft", [("llama", True), ("llama", False), ("mistral", False)],
                         ids=["llama-fast-draft", "llama-hf-draft", "mistral"])
def test_chunked_prefills_leave_what_one_forward_leaves(arch, fast_draft, monkeypatch):
    """Prefills in forwards of at most PREFILL_CHUNK_TOKENS tokens (here 3: one column per forward for two or more
    rows, the decode-attention kernel's path; three for one row) through the cache: every request still equals
    target-only decoding (the target's and the draft's prefills, left padding and all, in generate() and continuous
    batching, a sliding-window model included), and the prefills really ran as more forwards."""
    target, draft = make_pair(arch)
    prompts = queue(target.config.vocab_size, n=6, longest=12)
    calls = {}
    for chunk in (None, 3):
        monkeypatch.setattr(backends, "PREFILL_CHUNK_TOKENS", chunk)
        for name, kw in (("fixed", {"k": 2}), ("autoregressive", {})):
            gen = SpeculativeGenerator(target, draft, policy=name, fast_draft=fast_draft, **kw)
            out = gen.generate_continuous(prompts, batch_size=2, max_new_tokens=7, temperature=0)
            for i, p in enumerate(prompts):
                assert out.new_tokens[i] == target_only(target, p, 7), f"{name}, chunk {chunk}: request {i}"
            batch, mask = _right_aligned([p.tolist() for p in prompts[1:4]], 11)  # left padding
            together = gen.generate(batch, mask.long(), max_new_tokens=7, temperature=0)
            for row, p in enumerate(prompts[1:4]):
                assert together.new_tokens[row] == target_only(target, p, 7), f"{name}, chunk {chunk}: row {row}"
            calls[chunk, name] = (out.stats.target_calls, out.stats.draft_calls, together.stats.target_calls)
    for name in ("fixed", "autoregressive"):
        assert calls[3, name][0] > calls[None, name][0] and calls[3, name][2] > calls[None, name][2] + 5
    assert calls[3, "fixed"][1] > calls[None, "fixed"][1]  # the draft's reads too
