"""The engine as transformers' `custom_generate` (specdec_ext.hf): greedy output equals target-only
`generate()` token for token, sampled output follows target-only sampling (chi-square per position), and
the logits processors generate() builds (repetition penalty, n-gram bans, min new tokens) give generate()'s
output, sampling with a processor follows the processed target, and settings the engine does not reproduce
are refused by name."""

from __future__ import annotations

import pytest
import torch

from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.hf import speculative_generate
from models import make_pair
from stats import assert_follows
from support import exact_marginals, head_for


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def ragged_prompts(B, V, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, B):
        mask[b, : b % (T - 1)] = 0
        ids[b, : b % (T - 1)] = 1
    return ids, mask


@pytest.mark.parametrize("policy,extra", [("specdecpp", {"threshold": 0.6, "k_max": 6}), ("fixed", {"k": 3})])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_equals_target_only_generate(pair, policy, extra, B):
    target, draft = pair
    head = head_for(draft, kind="proposal")
    for seed in range(2):
        ids, mask = ragged_prompts(B, target.config.vocab_size, seed=seed)
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1,
                              eos_token_id=None)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1,
                              eos_token_id=None, custom_generate=speculative_generate, draft_model=draft, head=head,
                              policy=policy, **extra)
        assert torch.equal(out, ref), f"{policy}: custom_generate differs from greedy generate() (seed {seed})"


def test_return_dict_in_generate(pair):
    target, draft = pair
    ids, mask = ragged_prompts(2, target.config.vocab_size)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=1, eos_token_id=None,
                          return_dict_in_generate=True, custom_generate=speculative_generate, draft_model=draft,
                          policy="fixed", k=2)
    assert out.sequences.shape == (2, ids.shape[1] + 5)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.6, top_k=6)], ids=["T1", "T0.6-topk6"])
def test_sampling_follows_the_target(cfg):
    """do_sample, temperature and top_k reach the engine: the first two positions follow target-only sampling."""
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marg = exact_marginals(target, prompt, cfg, 2)
    n = 3000
    out = target.generate(prompt.expand(n, -1), attention_mask=torch.ones(n, 5, dtype=torch.long), max_new_tokens=2,
                          min_new_tokens=0, do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k or 0, top_p=1.0, pad_token_id=0,
                          eos_token_id=None, custom_generate=speculative_generate, draft_model=draft,
                          head=head_for(draft, kind="proposal"), policy="specdecpp", threshold=0.6, seed=500)
    for i in range(2):
        assert_follows(out[:, 5 + i], marg[i], f"custom_generate {cfg}, position {i + 1}")


@pytest.mark.parametrize("kwargs,match", [
    ({"do_sample": True, "typical_p": 0.5}, "TypicalLogitsWarper"),
    ({"do_sample": False, "num_beams": 2}, "num_beams"),
    ({"do_sample": False, "max_time": 5.0}, "MaxTimeCriteria"),
])
def test_unsupported_settings_are_refused_by_name(pair, kwargs, match):
    target, draft = pair
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=match):
        target.generate(ids, max_new_tokens=4, pad_token_id=1, custom_generate=speculative_generate,
                        draft_model=draft, policy="fixed", k=2, **kwargs)


def test_missing_draft_is_named(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="draft_model"):
        target.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, pad_token_id=1,
                        custom_generate=speculative_generate, policy="fixed", k=2)


PROCESSING = [{"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2}, {"repetition_penalty": 1.3, "min_new_tokens": 6}]


@pytest.mark.parametrize("settings", PROCESSING, ids=["rep1.5", "ngram2", "rep1.3-min6"])
def test_logits_processors_greedy_equal_generate(pair, settings):
    """Processors generate() builds are applied to draft and target alike, each position with its own prefix:
    greedy output equals generate() with the same settings (which differs from generate() without them)."""
    target, draft = pair
    head = head_for(draft, kind="proposal")
    changed = False
    for seed in range(2):
        ids, mask = ragged_prompts(1, target.config.vocab_size, seed=seed)
        common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1, eos_token_id=3)
        ref = target.generate(ids, **common, **settings)
        changed |= not torch.equal(ref, target.generate(ids, **common))
        for policy, extra in (("autoregressive", {}), ("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6})):
            out = target.generate(ids, **common, **settings, custom_generate=speculative_generate, draft_model=draft,
                                  head=head, policy=policy, **extra)
            assert torch.equal(out, ref), f"{policy} {settings}: differs from generate() (seed {seed})"
    assert changed, f"{settings} never changed the output: the test would not see it ignored"


def test_logits_processors_with_a_batch_are_refused(pair):
    target, draft = pair
    ids, mask = ragged_prompts(3, target.config.vocab_size)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor with a batch of 3 rows"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1,
                        repetition_penalty=1.5, custom_generate=speculative_generate, draft_model=draft,
                        policy="fixed", k=2)


def processed_marginals(target, prompt, processor, temperature):
    """Exact distributions of generated positions 1 and 2 under target-only sampling with ``processor``
    applied before the temperature (enumerating the first token)."""
    def dist(ids):
        with torch.no_grad():
            logits = target(ids).logits[:, -1].float()
        return torch.softmax(processor(ids, logits) / temperature, -1)[0]

    p1 = dist(prompt)
    p2 = sum(p1[x] * dist(torch.cat([prompt, torch.tensor([[x]])], 1)) for x in range(p1.numel()))
    return [p1, p2]


@pytest.mark.slow
def test_sampling_with_a_logits_processor_follows_the_processed_target():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from specdec_ext import SpeculativeGenerator

    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    proc = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    marg = processed_marginals(target, prompt, proc, 0.8)
    n = 3000
    gen = SpeculativeGenerator(target, draft, policy="specdecpp", head=head_for(draft, kind="proposal"), threshold=0.6)
    out = gen.generate(prompt.expand(n, -1), max_new_tokens=2, temperature=0.8, seed=900, logits_processor=proc)
    toks = torch.tensor(out.new_tokens)
    for i in range(2):
        assert_follows(toks[:, i], marg[i], f"repetition penalty 2.0, T=0.8, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0, "speculation was not exercised"
