"""The engine as transformers' `custom_generate` (specdec_ext.hf): greedy output equals target-only
`generate()` token for token, sampled output follows target-only sampling (chi-square per position), and
settings the engine does not reproduce are refused by name."""

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
    target, draft = make_pair("llama", vocab=12, noise=0.5)
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
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"num_beams": 2}, "num_beams"),
    ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"),
])
def test_unsupported_settings_are_refused_by_name(pair, kwargs, match):
    target, draft = pair
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=match):
        target.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1, custom_generate=speculative_generate,
                        draft_model=draft, policy="fixed", k=2, **kwargs)


def test_missing_draft_is_named(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="draft_model"):
        target.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, pad_token_id=1,
                        custom_generate=speculative_generate, policy="fixed", k=2)
