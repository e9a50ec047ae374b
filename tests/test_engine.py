"""The engine: greedy equality with target-only decoding, batches, EOS, streaming, stats, errors."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_ext import AcceptanceHead, SpeculativeGenerator
from specdec_ext.policies import FixedK
from models import make_pair, make_target
from support import PIDS, POLICIES, TEST_COSTS, constant_head, head_for, make_gen

def prompts(B, V, T=6, seed=0, ragged=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    if ragged and B > 1:
        for b in range(1, B):
            mask[b, : b % (T - 1)] = 0
            ids[b, : b % (T - 1)] = 1
    return ids, mask


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("name,kw", POLICIES, ids=PIDS)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("fast_draft", [True, False], ids=["fast-draft", "hf-draft"])
def test_greedy_equals_target_only(pair, name, kw, B, fast_draft):
    target, draft = pair
    V = target.config.vocab_size
    if fast_draft and target.config.model_type != "llama":
        pytest.skip("the lean draft runner is for Llama drafts")
    gen = make_gen(target, draft, name, kw, fast_draft=fast_draft)
    assert gen.fast_draft == fast_draft
    accepted = discarded = 0
    for seed in range(3):
        ids, mask = prompts(B, V, seed=seed)
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=1,
                              eos_token_id=None)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=24, temperature=0, pad_token_id=1)
        assert torch.equal(out.sequences, ref), f"{name}: greedy output differs from target-only decoding (seed {seed})"
        accepted += out.stats.accepted
        discarded += out.stats.discarded
    if name != "autoregressive":
        # the cases must exercise speculation: accepted candidates and rejected ones
        assert accepted > 0, "no candidate was ever accepted"
        assert discarded > 0, "no candidate was ever rejected"


@pytest.mark.parametrize("name,kw", POLICIES, ids=PIDS)
@pytest.mark.parametrize("fast_draft", [True, False], ids=["fast-draft", "hf-draft"])
def test_batch_equals_rows_alone(name, kw, fast_draft):
    target, draft = make_pair("llama")
    V = target.config.vocab_size
    ids, mask = prompts(4, V, seed=3)
    if kw.get("threshold") == "auto":  # the batch budget and the survivals' calibration couple rows (see SpecDecPP)
        kw = dict(kw, batch_budget=False, calibrate=False, select=False)
    gen = make_gen(target, draft, name, kw, fast_draft=fast_draft)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=20, temperature=1.0, seed=11)
    for b in range(4):
        real = ids[b, mask[b].bool()].unsqueeze(0)
        alone = gen.generate(real, max_new_tokens=20, temperature=1.0, seed=11 + b)
        assert out.new_tokens[b] == alone.new_tokens[0], f"row {b} differs between batch and alone"


@pytest.mark.parametrize("name,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6, "_head": "proposal"}),
                                     ("heuristic", {})], ids=["fixed", "specdecpp", "heuristic"])
def test_a_seeded_row_alone_in_a_batch_of_8_and_in_continuous_batching_gives_identical_tokens(name, kw):
    """Each row draws from its own Philox stream: its sampled tokens (T = 1, top-k and top-p too) are the same alone,
    at any place in a left-padded batch of 8, and as a request of a continuous batch beside other requests."""
    target, draft = make_pair("llama")
    V = target.config.vocab_size
    ids, mask = prompts(8, V, seed=7)
    gen = make_gen(target, draft, name, kw)
    for sampling in ({"temperature": 1.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}):
        batch = gen.generate(ids, attention_mask=mask, max_new_tokens=16, seed=40, **sampling).new_tokens
        rows = [ids[b, mask[b].bool()] for b in range(8)]
        cont = gen.generate_continuous(rows[::-1], batch_size=3, max_new_tokens=16,
                                       seed=[40 + b for b in range(8)][::-1], **sampling).new_tokens[::-1]
        for b in range(8):
            alone = gen.generate(rows[b].view(1, -1), max_new_tokens=16, seed=40 + b, **sampling).new_tokens[0]
            assert batch[b] == alone == cont[b], (sampling, b)
        assert len({tuple(t) for t in batch}) > 1  # the rows sampled, differently


def test_eos_and_max_new_tokens_end_where_target_only_does():
    target, draft = make_pair("llama", noise=0.1)
    V = target.config.vocab_size
    ids, mask = prompts(3, V, seed=5)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=1,
                          eos_token_id=None)
    # choose as EOS a token that target-only greedy emits mid-way in row 0
    eos = int(ref[0, ids.shape[1] + 5])
    ref_eos = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=1,
                              eos_token_id=eos)
    for name, kw in POLICIES:
        gen = make_gen(target, draft, name, kw)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=30, temperature=0, eos_token_id=eos, pad_token_id=1)
        assert torch.equal(out.sequences, ref_eos[:, : out.sequences.shape[1]]), name
        assert bool((ref_eos[:, out.sequences.shape[1]:] == 1).all()), name
        for toks in out.new_tokens:
            assert len(toks) <= 30 and (eos not in toks[:-1])
    for m in (1, 2, 7):
        out = SpeculativeGenerator(target, draft, policy="fixed", k=5).generate(ids, attention_mask=mask, max_new_tokens=m,
                                                                               temperature=0)
        assert all(len(t) == m for t in out.new_tokens)
        assert torch.equal(out.sequences, ref[:, : ids.shape[1] + m])


class Collect:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_token():
    target, draft = make_pair("gpt2")
    ids, _ = prompts(1, target.config.vocab_size)
    s = Collect()
    out = SpeculativeGenerator(target, draft, policy="fixed", k=3).generate(ids, max_new_tokens=16, temperature=0,
                                                                           streamer=s)
    assert s.ended and s.chunks[0] == ids[0].tolist()
    assert sum(s.chunks[1:], []) == out.new_tokens[0]
    assert len(s.chunks) - 1 == len(out.stats.rounds)  # one chunk per round


def test_streamer_with_transformers_text_streamer():
    from transformers import TextIteratorStreamer

    class Tok:  # the smallest tokenizer the streamer needs
        def decode(self, ids, **kw):
            return "".join(chr(65 + (int(i) % 26)) for i in ids)

    target, draft = make_pair("llama")
    ids, _ = prompts(1, target.config.vocab_size)
    streamer = TextIteratorStreamer(Tok(), skip_prompt=True)
    out = SpeculativeGenerator(target, draft, policy="fixed", k=2).generate(ids, max_new_tokens=10, temperature=0,
                                                                           streamer=streamer)
    assert "".join(streamer) == Tok().decode(out.new_tokens[0])


def test_statistics_are_consistent():
    target, draft = make_pair("llama")
    ids, mask = prompts(3, target.config.vocab_size)
    out = SpeculativeGenerator(target, draft, policy="fixed", k=4).generate(ids, attention_mask=mask, max_new_tokens=25,
                                                                           temperature=0)
    st = out.stats
    assert st.new_tokens == sum(len(t) for t in out.new_tokens) == 75
    assert st.target_calls == len(st.rounds) + 1  # one prefill
    assert all(n == 4 or e < 5 for r in st.rounds for n, e in zip(r.candidates, r.emitted))
    assert st.accepted == sum(sum(r.accepted) for r in st.rounds)
    assert st.discarded == st.drafted - st.accepted
    rates = st.acceptance_rate_per_position()
    assert len(rates) >= 1 and all(0.0 <= a <= 1.0 for a in rates)
    assert st.wall_ms >= st.draft_ms + st.verify_ms > 0
    assert st.tokens_per_s > 0
    s = st.summary()
    assert s["rounds"] == len(st.rounds) and s["new_tokens"] == 75


def test_policy_object_and_per_call_override():
    target, draft = make_pair("llama")
    ids, _ = prompts(1, target.config.vocab_size)
    gen = SpeculativeGenerator(target, draft, policy=FixedK(2))
    a = gen.generate(ids, max_new_tokens=12, temperature=0)
    b = gen.generate(ids, max_new_tokens=12, temperature=0, policy="fixed", k=5)
    assert a.new_tokens == b.new_tokens
    assert max(max(r.candidates) for r in a.stats.rounds) <= 2
    assert max(max(r.candidates) for r in b.stats.rounds) <= 5


def test_runner_attention_backends_leave_cudnn_out_on_cuda_only():
    """engine/runner.py's context for a forward: on CUDA, torch's SDPA may not pick cuDNN (a plan per new shape);
    torch's global choice comes back afterwards; on the CPU nothing changes."""
    from specdec_ext.engine import runner

    before = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with runner.sdpa_backends(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    with runner.sdpa_backends(torch.device("cpu")):
        assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


def test_draft_and_target_in_different_dtypes():
    target, draft = make_pair("llama")
    draft = draft.to(torch.bfloat16)
    V = target.config.vocab_size
    ids, mask = prompts(2, V)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1, eos_token_id=None)
    for fast in (True, False):
        for name, kw in (("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.5})):
            gen = SpeculativeGenerator(target, draft, policy=name, head=head_for(draft), fast_draft=fast, **kw)
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=20, temperature=0, pad_token_id=1)
            assert torch.equal(out.sequences, ref), (fast, name)
            assert out.stats.accepted > 0


def test_top_k_top_p_greedy_equivalents():
    target, draft = make_pair("llama")
    ids, _ = prompts(2, target.config.vocab_size, ragged=False)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    # top_k = 1 is greedy whatever the temperature
    a = gen.generate(ids, max_new_tokens=15, temperature=0.8, top_k=1, seed=1)
    b = gen.generate(ids, max_new_tokens=15, temperature=0)
    assert a.new_tokens == b.new_tokens


# ------------------------------------------------------------------------------ bad input
def test_bad_input_errors():
    target, draft = make_pair("llama")
    V = target.config.vocab_size
    ids, _ = prompts(1, V)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    other = make_target(vocab=V + 3)
    other.config.eos_token_id = V + 1  # a special id the target cannot embed: no shared tokenizer
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        SpeculativeGenerator(target, other, policy="fixed")
    with pytest.raises(ValueError, match="another draft model"):
        SpeculativeGenerator(target, draft, policy="specdecpp", head=AcceptanceHead(7))
    with pytest.raises(ValueError, match="needs an acceptance head"):
        SpeculativeGenerator(target, draft, policy="specdecpp")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeGenerator(target, None, policy="fixed")
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        gen.generate(torch.randint(0, V, (1, 300)), max_new_tokens=4)
    with pytest.raises(ValueError, match="context"):
        gen.generate(ids, max_new_tokens=255)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        gen.generate(ids, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate(ids, top_p=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate(ids + V)
    with pytest.raises(ValueError, match="left"):
        gen.generate(ids, attention_mask=torch.cat([torch.ones(1, 5), torch.zeros(1, 1)], 1).long())
    with pytest.raises(ValueError, match="batch size 1"):
        gen.generate(ids.repeat(2, 1), streamer=Collect())
    with pytest.raises(ValueError, match="unknown policy"):
        SpeculativeGenerator(target, draft, policy="magic")
    with pytest.raises(ValueError, match="k \\(candidate length\\) must be"):
        SpeculativeGenerator(target, draft, policy="fixed", k=0)
    with pytest.raises(ValueError, match="meta device"):
        meta = make_target().to("meta")
        SpeculativeGenerator(target, meta, policy="fixed").generate(ids, max_new_tokens=3)


def specdecpp_length(p_accept, h, k_min, k_max):
    """The round length the SpecDec++ rule gives with a constant prediction, worked out by hand: the
    test after scoring k candidates stops when k + 1 >= k_max, or k + 1 >= k_min and 1 - p^k > h; the
    round then has k + 1 candidates (the last one drawn from the same draft forward)."""
    if k_max == 1:
        return 1
    k = 1
    while not (k + 1 >= k_max or (k + 1 >= k_min and 1 - p_accept**k > h)):
        k += 1
    return k + 1


@pytest.mark.parametrize("p_accept,h,k_min,k_max,expected", [
    (0.8, 0.5, 2, 20, 5), (0.8, 0.5, 7, 20, 7), (0.8, 0.5, 2, 3, 3), (0.3, 0.5, 2, 20, 2),
    (0.99, 0.5, 1, 6, 6), (0.99, 0.5, 1, 1, 1)])
@pytest.mark.parametrize("fast_draft", [True, False], ids=["fast-draft", "hf-draft"])
def test_specdecpp_round_lengths_follow_the_stop_rule(p_accept, h, k_min, k_max, expected, fast_draft):
    assert specdecpp_length(p_accept, h, k_min, k_max) == expected
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=constant_head(draft, p_accept),
                               fast_draft=fast_draft, threshold=h, k_min=k_min, k_max=k_max)
    _check_round_lengths(gen, target, lambda remaining: expected)


def _check_round_lengths(gen, target, expected_of):
    """Every round of a batch of 3 has min(expected, remaining - 1) candidates per row, and the draft ran
    exactly K forwards per round of K candidates (none in a round where no row may draft: a plain step)."""
    ids, mask = prompts(3, target.config.vocab_size)
    max_new = 40
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, temperature=0, pad_token_id=1)
    remaining = [max_new] * 3
    rounds_checked = 0
    calls = 1  # the prompt's prefill
    for r in out.stats.rounds:
        live = [b for b in range(3) if remaining[b] > 0]
        assert sorted(r.rows) == live and len(r.candidates) == len(live)  # rows in the order the batch keeps them
        for i, b in enumerate(r.rows):
            want = min(expected_of(remaining[b]), remaining[b] - 1)  # never draft past max_new_tokens
            assert r.candidates[i] == want, (r, b, remaining[b])
            remaining[b] -= r.emitted[i]
        calls += max(r.candidates)
        rounds_checked += 1
    assert remaining == [0, 0, 0] and rounds_checked >= 4
    # K draft forwards per round of K candidates, as for a fixed K: no forward beyond the last candidate
    assert out.stats.draft_calls == calls


def proposal_length(p_accept, h, k_min, k_max):
    """A "proposal" head scores candidate k at step k: stop at the first k with k >= k_max, or k >= k_min
    and 1 - p^k > h; the round has exactly k candidates (K = 1 is reachable)."""
    k = 1
    while not (k >= k_max or (k >= k_min and 1 - p_accept**k > h)):
        k += 1
    return k


@pytest.mark.parametrize("p_accept,h,k_min,k_max,expected", [
    (0.8, 0.5, 1, 20, 4), (0.3, 0.5, 1, 20, 1), (0.8, 0.5, 6, 20, 6), (0.8, 0.5, 1, 3, 3), (0.99, 0.5, 1, 7, 7)])
@pytest.mark.parametrize("fast_draft", [True, False], ids=["fast-draft", "hf-draft"])
def test_proposal_head_round_lengths_follow_the_stop_rule(p_accept, h, k_min, k_max, expected, fast_draft):
    assert proposal_length(p_accept, h, k_min, k_max) == expected
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=constant_head(draft, p_accept, "proposal"),
                               fast_draft=fast_draft, threshold=h, k_min=k_min, k_max=k_max)
    _check_round_lengths(gen, target, lambda remaining: expected)


def auto_lengths(p_accept, costs, mean_accept, k_max, rounds, calibrate=True):
    """The goodput rule worked out by hand for a constant prediction p and one row: lambda starts at the
    best fixed K's tokens/ms at mean_accept (weight 20 ms) and follows exponential averages (weight 0.2)
    of tokens emitted and of T(K) = round_ms + K (draft_ms + step_ms) + verify(K + 1); the round stops after
    candidate k when c p^k < lambda * (draft_ms + step_ms + verify(k + 2) - verify(k + 1)), or at k_max. The
    survivals' calibration c: accepted over predicted candidates (sum of p^j over a round's K candidates), sums
    that keep 0.98 of themselves per round and start at 25 each, c held within [0.5, 2]; 1 without ``calibrate``.
    ``rounds``: each round's (accepted, candidates drafted)."""
    v = lambda n: costs.verify_ms[min(n, len(costs.verify_ms)) - 1]  # noqa: E731
    T = lambda k: costs.round_ms + k * (costs.draft_ms + costs.step_ms) + v(k + 1)  # noqa: E731
    best = max([1.0 / (costs.round_ms + v(1))] + [sum(mean_accept**j for j in range(k + 1)) / T(k) for k in range(1, k_max + 1)])
    tok, tim = best * 20.0, 20.0
    acc_sum = pred_sum = 25.0
    out = []
    for accepted, drafted in rounds:
        c = min(max(acc_sum / pred_sum, 0.5), 2.0) if calibrate else 1.0
        k = 1
        while k < k_max and not c * p_accept**k < tok / tim * (costs.draft_ms + costs.step_ms + v(k + 2) - v(k + 1)):
            k += 1
        out.append(k)
        tok, tim = 0.8 * tok + 0.2 * (min(accepted, k) + 1), 0.8 * tim + 0.2 * T(k)
        acc_sum = 0.98 * acc_sum + accepted
        pred_sum = 0.98 * pred_sum + sum(p_accept**j for j in range(1, drafted + 1))
    return out, min(max(acc_sum / pred_sum, 0.5), 2.0)


@pytest.mark.parametrize("calibrate", [True, False])
@pytest.mark.parametrize("p_accept", [0.2, 0.6, 0.9])
def test_auto_rule_round_lengths_follow_the_goodput_rule(p_accept, calibrate):
    """Round by round, the candidate lengths of the hand-worked rule (auto_lengths), with the survivals' calibration
    read from the predictions that came back with the rounds' tokens; the calibration moves up where the head
    under-predicts this pair's acceptance (p = 0.2) and down where it over-predicts it (p = 0.6, 0.9)."""
    target, draft = make_pair("llama")
    head = constant_head(draft, p_accept, "proposal")
    head.mean_accept = 0.7
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=12,
                               costs=TEST_COSTS, calibrate=calibrate, select=False)
    ids, _ = prompts(1, target.config.vocab_size)
    out = gen.generate(ids, max_new_tokens=60, temperature=0)
    rounds = out.stats.rounds
    want, c = auto_lengths(p_accept, TEST_COSTS, 0.7, 12, [(r.accepted[0], r.candidates[0]) for r in rounds],
                           calibrate)
    remaining = 60
    for r, w in zip(rounds, want):
        assert r.candidates[0] == min(w, remaining - 1), (r, w)
        remaining -= r.emitted[0]
    assert len(set(want)) >= 1 and len(rounds) >= 4
    if calibrate:
        scale = gen.policy.calibration.scale
        assert scale == pytest.approx(c, rel=1e-6)
        assert (scale > 1.05) if p_accept == 0.2 else (scale < 0.95), scale
        gen.policy.reset_adaptation()
        assert gen.policy.calibration.scale == 1.0
    else:
        assert gen.policy.calibration is None


def test_auto_rule_follows_the_costs():
    """A draft step that costs nothing against a flat verification drafts to K_max; a draft step that
    costs more than a whole target forward stops at K = 1."""
    target, draft = make_pair("llama")
    head = constant_head(draft, 0.7, "proposal")
    ids, _ = prompts(1, target.config.vocab_size)
    cheap = TEST_COSTS.__class__([10.0] * 30, 1e-4, 0.0, 0.0)
    dear = TEST_COSTS.__class__([10.0] * 30, 50.0, 0.0, 0.0)
    for costs, k in ((cheap, 9), (dear, 1)):
        gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=9, costs=costs,
                                   select=False)
        out = gen.generate(ids, max_new_tokens=40, temperature=0)
        remaining = 40
        for r in out.stats.rounds:
            assert r.candidates[0] == min(k, remaining - 1), (k, [r.candidates for r in out.stats.rounds])
            remaining -= r.emitted[0]


def test_head_mapping_picks_the_head_of_the_decoding_mode():
    target, draft = make_pair("llama")
    greedy, sample = constant_head(draft, 0.95, "proposal"), constant_head(draft, 0.2, "proposal")
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head={"greedy": greedy, "sample": sample},
                               threshold=0.5, k_max=8)
    ids, _ = prompts(1, target.config.vocab_size)
    g = gen.generate(ids, max_new_tokens=30, temperature=0).stats
    s = gen.generate(ids, max_new_tokens=30, temperature=1.0).stats
    assert g.mean_candidate_length > 5 and s.mean_candidate_length == 1.0
    only_greedy = SpeculativeGenerator(target, draft, policy="specdecpp", head={"greedy": greedy}, threshold=0.5)
    with pytest.raises(ValueError, match="no acceptance head for sample decoding"):
        only_greedy.generate(ids, max_new_tokens=5, temperature=1.0)


def test_two_threads_sharing_a_generator_each_get_what_they_would_alone():
    """Calls from two threads on one generator run one at a time: each thread's greedy and seeded outputs equal the
    same calls made alone, however the calls interleave."""
    import threading

    target, draft = make_pair("llama")
    gen = make_gen(target, draft, "specdecpp", {"threshold": 0.5, "_head": "proposal"})
    V = target.config.vocab_size
    jobs = [prompts(3, V, seed=s)[0] for s in range(6)]
    alone = [gen.generate(ids, max_new_tokens=12, temperature=t, seed=5).new_tokens
             for ids, t in zip(jobs, [0, 1.0] * 3)]
    got = {}

    def work(indices):
        for i in indices:
            got[i] = gen.generate(jobs[i], max_new_tokens=12, temperature=[0, 1.0][i % 2], seed=5).new_tokens

    threads = [threading.Thread(target=work, args=(range(j, 6, 2),)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(6)] == alone


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_kv_caches_beyond_the_memory_budget_are_refused_before_any_allocation(monkeypatch, lean):
    """A call whose KV caches exceed what the device has (on a CPU: SPECDEC_MEMORY_BUDGET bytes) is refused up front
    with the bytes needed and available, before any cache is allocated or prompt prefilled; within the budget it
    runs."""
    from specdec_ext.engine import backends, cache

    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2, fast_target=lean, fast_draft=lean)
    ids = torch.randint(2, target.config.vocab_size, (4, 20), generator=torch.Generator().manual_seed(0))
    started = []
    for cls in (backends.LeanBackend, backends.HFBackend):
        monkeypatch.setattr(cls, "start", lambda self, *a, real=cls.start: started.append(a) or real(self, *a))
    monkeypatch.setenv(cache.MEMORY_BUDGET_ENV, "1000")
    with pytest.raises(ValueError, match=r"the KV caches need [\d,]+ bytes on cpu but 1,000 are available "
                                         r"\(SPECDEC_MEMORY_BUDGET\)"):
        gen.generate(ids, max_new_tokens=8)
    assert started == []
    monkeypatch.setenv(cache.MEMORY_BUDGET_ENV, str(64 * 2**20))
    assert len(gen.generate(ids, max_new_tokens=8).new_tokens) == 4 and started
    monkeypatch.setenv(cache.MEMORY_BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="SPECDEC_MEMORY_BUDGET must be a number of bytes"):
        gen.generate(ids, max_new_tokens=8)
