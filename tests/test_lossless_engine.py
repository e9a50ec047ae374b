"""Losslessness of the whole engine: under every policy, the generated tokens follow target-only
sampling. The exact marginal of each of the first three generated positions is enumerated from the
target (all V^2 prefixes), and N independent rows (one seed each) are tested per position with
the chi-square test of tests/stats.py."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.sampling import SamplingConfig, process_logits, sample_with_uniforms
from models import make_pair
from stats import assert_follows
from support import EACH_WAY, PIDS, POLICIES, exact_marginals, make_gen

N_ROWS = 3000
N_POS = 3


SETTINGS = [SamplingConfig(1.0), SamplingConfig(0.6, top_k=6), SamplingConfig(1.0, top_p=0.8)]


@pytest.fixture(scope="module")
def pair_and_marginals():
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    return target, draft, prompt, {cfg: exact_marginals(target, prompt, cfg, N_POS) for cfg in SETTINGS}


# Every policy at T = 1; the processed distributions (top-k, top-p) with one policy of each way of running rounds
# (support.EACH_WAY): the processing is the same for every rule.
CASES = [(name, kw, cfg, f"{pid}-{cid}") for (name, kw), pid in zip(POLICIES, PIDS)
         for cfg, cid in zip(SETTINGS, ["T1", "T0.6-topk6", "topp0.8"]) if cid == "T1" or pid in EACH_WAY]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw,cfg", [c[:3] for c in CASES], ids=[c[3] for c in CASES])
def test_engine_sampling_is_lossless(pair_and_marginals, name, kw, cfg):
    target, draft, prompt, marg = pair_and_marginals
    gen = make_gen(target, draft, name, kw)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=cfg.temperature, top_k=cfg.top_k,
                       top_p=cfg.top_p, seed=1000)
    toks = torch.tensor(out.new_tokens)
    assert toks.shape == (N_ROWS, N_POS)
    for i in range(N_POS):
        assert_follows(toks[:, i], marg[cfg][i], f"{name} {cfg}, position {i + 1}")
    if name != "autoregressive":
        assert out.stats.accepted > 0 and out.stats.discarded > 0, "speculation was not exercised"


@pytest.mark.parametrize("cfg", SETTINGS + [SamplingConfig(0.7, top_k=3, top_p=0.5)])
def test_processing_matches_transformers_warpers(cfg):
    logits = torch.randn(4, 50) * 3
    x = logits.clone()
    x = TemperatureLogitsWarper(cfg.temperature)(None, x)
    if cfg.top_k:
        x = TopKLogitsWarper(cfg.top_k)(None, x)
    if cfg.top_p:
        x = TopPLogitsWarper(cfg.top_p)(None, x)
    torch.testing.assert_close(process_logits(logits, cfg), torch.softmax(x, -1))


@pytest.mark.slow
def test_chi_square_tells_draft_from_target(pair_and_marginals):
    """Negative control: sampling from the draft alone must fail against the target's marginals,
    so a verifier that let the draft's distribution through would be caught."""
    from stats import chi_square

    target, draft, prompt, marg = pair_and_marginals
    out = SpeculativeGenerator(draft, policy="autoregressive").generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS,
                                                                       temperature=1.0, seed=1000)
    toks = torch.tensor(out.new_tokens)
    failures = 0
    for i in range(N_POS):
        stat, df, thr = chi_square(toks[:, i], marg[SamplingConfig(1.0)][i])
        failures += stat > thr
    assert failures >= 1, "the chi-square test cannot tell the draft's distribution from the target's"


@pytest.mark.parametrize("seed", range(4))
def test_per_row_masks_equal_the_call_wide_processing(seed):
    """Rows of one batch with their own temperature, top-k and top-p: each row's processed distribution equals
    process_logits at its own settings (greedy rows: softmax at temperature 1, unmasked), and draws with given
    uniforms equal the call-wide sampler's."""
    from specdec_ext.engine.sampling import RowSampling, draw_tokens, mask_logits, row_probs

    g = torch.Generator().manual_seed(seed)
    V = 50
    logits = torch.randn(5, V, generator=g) * 3
    logits[1, :10] = float("-inf")  # masked tokens in a row stay masked
    configs = [SamplingConfig(0.7, 5, None), SamplingConfig(1.0, None, 0.8), SamplingConfig(0.0, 3, 0.5),
               SamplingConfig(1.3, 7, 0.9), SamplingConfig(1.0, None, None)]
    rows = RowSampling.of(configs, V, "cpu")
    assert rows.masks and not rows.greedy
    masked = mask_logits(logits, rows)
    q = row_probs(masked, rows)
    u = torch.rand(5, generator=g).clamp_min(1e-6)
    got = draw_tokens(masked, rows, u)
    for b, cfg in enumerate(configs):
        want = torch.softmax(logits[b], -1) if cfg.greedy else process_logits(logits[b : b + 1], cfg)[0]
        torch.testing.assert_close(q[b], want, rtol=1e-5, atol=1e-7)
        wanted = int(logits[b].argmax()) if cfg.greedy else int(sample_with_uniforms(want.view(1, -1), u[b : b + 1]))
        assert int(got[b]) == wanted
    plain = RowSampling.of([SamplingConfig(0.0)] * 2, V, "cpu")
    assert plain.greedy and not plain.masks and torch.equal(mask_logits(logits[:2], plain), logits[:2])
    assert torch.equal(draw_tokens(logits[:2], plain, u[:2]), logits[:2].argmax(-1))
    three = mask_logits(logits.unsqueeze(1).expand(5, 3, V), rows)  # [B, n, V]: each position as the row's
    assert torch.equal(three, masked.unsqueeze(1).expand(5, 3, V))
