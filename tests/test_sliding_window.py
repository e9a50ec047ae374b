"""Sliding-window and hybrid-cache models (Mistral: every layer sliding; Gemma-2: sliding and full layers
alternate; Qwen2 with use_sliding_window): speculative rollback once the window is full, greedy
equality with transformers' generate() row by row (batch 1 and 3, left-padded), sampling chi-square
with a prompt longer than the window, and a clear refusal for attention that cannot be rolled back."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.runner import sliding_layout
from specdec_ext.engine.sampling import SamplingConfig
from models import make_pair
from stats import assert_follows
from support import exact_marginals, make_gen

ARCHS = ["mistral", "gemma2", "qwen2"]
POLICIES = [("autoregressive", {}), ("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6, "_head": "proposal"}),
            ("specdecpp", {"threshold": 0.3, "k_min": 2})]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_pair(request.param, window=5)


def batch_of(rows):
    T = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.ones(T - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(T - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                        for r in rows])
    return ids, mask


@pytest.mark.parametrize("name,kw", POLICIES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POLICIES)])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_equals_generate_beyond_the_window(pair, name, kw, B):
    arch, target, draft = pair
    assert sliding_layout(target)["window"] == 5
    g = torch.Generator().manual_seed(B)
    rows = [torch.randint(2, target.config.vocab_size, (L,), generator=g) for L in (7, 9, 6)[:B]]
    gen = make_gen(target, draft, name, kw)
    ids, mask = batch_of(rows)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=24, temperature=0)
    for b, r in enumerate(rows):  # each row against generate() on that row alone (the window is 5 < 31 tokens)
        ref = target.generate(r.unsqueeze(0), max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=None)
        assert out.new_tokens[b] == ref[0, len(r):].tolist(), f"{arch} {name}: row {b} differs from generate()"
    if name != "autoregressive":
        assert out.stats.accepted > 0 and out.stats.discarded > 0, "rollback was not exercised"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sampling_is_lossless_with_a_prompt_longer_than_the_window(arch):
    target, draft = make_pair(arch, vocab=12, noise=0.5, window=4, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9, 2, 8]])  # 7 tokens > window 4: every generated token sees a cut window
    cfg = SamplingConfig(1.0)
    marg = exact_marginals(target, prompt, cfg, 3)
    for name, kw in (("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6, "_head": "proposal"})):
        gen = make_gen(target, draft, name, kw)
        out = gen.generate(prompt.expand(3000, -1), max_new_tokens=3, temperature=1.0, seed=77)
        toks = torch.tensor(out.new_tokens)
        for i in range(3):
            assert_follows(toks[:, i], marg[i], f"{arch} {name}, position {i + 1}")
        assert out.stats.accepted > 0 and out.stats.discarded > 0


def test_attention_that_cannot_roll_back_is_refused_by_name():
    target, draft = make_pair("gemma2", window=5)
    target.config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="Gemma2ForCausalLM .gemma2. has attention layers of types"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2).generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
