"""The static decode path (``engine/static.py``): the static cache's forward computes what the lean runner does,
speculative rounds over it are lossless (greedy equality with transformers' generate in fp32; chi-square of sampled
positions against the exact marginals), SpecDec++'s stop rule decides on the device, and each step compiles with
``torch.compile(fullgraph=True)`` (the CPU's proxy for CUDA-graph capture: no graph break, no host sync)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models import noisy_copy
from stats import assert_follows
from support import exact_marginals
from specdec_ext.engine.fast_llama import FastLlamaRunner
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.engine.static import (HeadStep, StaticCache, StaticSpeculator, draft_steps, forward_static,
                                       verify_step)
from specdec_ext.head import AcceptanceHead
from specdec_ext.head.features import CONFIDENCE_FEATURES


@torch.inference_mode(False)
def llama_pair(kv_heads: int = 2, vocab: int = 48, sharpen: float = 8.0):
    """A tiny Llama target (sharpened outputs) and a noisy copy as its draft, made outside inference mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)  # greedy margins well above float32 rounding; samples not uniform
    return target, noisy_copy(target, 0.3)


def confidence_head(draft, bias: float = 1.0) -> AcceptanceHead:
    """A random SpecDec++ head reading the proposing hidden state and the three confidence features."""
    torch.manual_seed(3)
    head = AcceptanceHead(draft.config.hidden_size, num_layers=2, features=CONFIDENCE_FEATURES,
                          input_position="proposal", mean_accept=0.7)
    head.set_feature_normalization(torch.tensor([0.5, 0.3, 2.0]), torch.tensor([0.3, 0.3, 1.0]))
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head.eval()


@torch.inference_mode()
def test_forward_static_computes_what_the_lean_runner_computes():
    target, _ = llama_pair()
    ids = torch.randint(2, 48, (3, 7), generator=torch.Generator().manual_seed(1))
    step = torch.randint(2, 48, (3, 4), generator=torch.Generator().manual_seed(2))
    lean = FastLlamaRunner(target, "target", packed=False)
    lean.start(3)
    want_prefill, _ = lean.forward(ids, keep=7)
    want_step, _ = lean.forward(step, keep=4)
    cache = StaticCache.allocate(lean, 3, 32)
    got_prefill, _ = forward_static(lean, cache, ids)
    got_step, _ = forward_static(lean, cache, step)
    assert cache.lengths.tolist() == [11, 11, 11]
    torch.testing.assert_close(got_prefill, want_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=1e-4)
    cache.rollback(torch.tensor([2, 0, 4]))  # rows hold their own lengths; the next write overwrites
    assert cache.lengths.tolist() == [9, 11, 7]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("policy", ["fixed", "specdecpp"])
def test_static_greedy_speculation_equals_transformers_generate(kv_heads, policy):
    target, draft = llama_pair(kv_heads)
    ids = torch.randint(2, 48, (3, 6), generator=torch.Generator().manual_seed(4))
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           pad_token_id=1, eos_token_id=None)[:, 6:].tolist()
    kw = {"head": confidence_head(draft), "threshold": 0.6} if policy == "specdecpp" else {}
    got = StaticSpeculator(target, draft, k=4, **kw).generate(ids, max_new_tokens=24, temperature=0)
    assert got == want


@torch.inference_mode()
def test_the_stop_rule_decides_each_rows_candidates_on_the_device():
    """h = 0 stops every row at K_min (any rejection risk exceeds it); h = 1 never stops before the cap K."""
    target, draft = llama_pair()
    run = FastLlamaRunner(draft, "draft", packed=False)
    head = confidence_head(draft)
    last = torch.tensor([5, 9, 17])
    so = torch.zeros(4, 2, dtype=torch.int64)
    temp = torch.zeros(3)
    for h, k_min, want in ((0.0, 2, 2), (1.0, 1, 4)):
        cache = StaticCache.allocate(run, 3, 16)
        step = HeadStep.from_head(head, k_min, 4, h, last.device)
        cands, logits, num = draft_steps(run, cache, last, 4, temp, so, step)
        assert num.tolist() == [want] * 3 and cands.shape == (3, 4) and logits.shape == (3, 4, 48)
        assert cache.lengths.tolist() == [5, 5, 5]  # K steps and the K-th candidate's forward
    with pytest.raises(ValueError, match="input_position='proposal'"):
        HeadStep.from_head(AcceptanceHead(64, num_layers=1), 1, 4, 0.5, last.device)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "specdecpp"])
def test_static_sampling_follows_the_target_distribution(policy):
    """T = 1: the first three positions of 4,000 sampled continuations of one prompt against the exact marginals
    of target-only sampling (chi-square per position, tests/stats.py)."""
    target, draft = llama_pair(vocab=12, sharpen=2.0)
    prompt = torch.tensor([[3, 7, 5]])
    kw = {"head": confidence_head(draft, bias=0.5), "threshold": 0.5} if policy == "specdecpp" else {}
    out = StaticSpeculator(target, draft, k=3, **kw).generate(prompt.expand(4000, -1), max_new_tokens=3,
                                                             temperature=1.0, seed=11)
    toks = torch.tensor(out)
    with torch.no_grad():
        marg = exact_marginals(target, prompt, SamplingConfig(temperature=1.0), 3)
    for i in range(3):
        assert_follows(toks[:, i], marg[i], f"static {policy}, position {i + 1}")


def test_a_verifier_that_ignores_rejections_fails_the_same_check(monkeypatch):
    """Negative control: verification that accepts every candidate (the draft's distribution, not the target's)
    is caught by the chi-square check above."""
    from specdec_ext.engine import static

    target, draft = llama_pair(vocab=12, sharpen=2.0)
    draft = noisy_copy(target, 3.0)  # far from the target, so accepting blindly shows
    real = static.ops.chain_verify_logits

    def accept_all(cands, q, p, temperature, num, **kw):
        out, acc = real(cands, q, p, temperature, num, **kw)
        B, K = cands.shape
        return torch.cat([cands, out[:, -1:]], 1), torch.full((B,), K, dtype=acc.dtype)

    monkeypatch.setattr(static.ops, "chain_verify_logits", accept_all)
    prompt = torch.tensor([[3, 7, 5]])
    out = StaticSpeculator(target, draft, k=3).generate(prompt.expand(4000, -1), max_new_tokens=1, temperature=1.0,
                                                        seed=11)
    with torch.no_grad():
        marg = exact_marginals(target, prompt, SamplingConfig(temperature=1.0), 1)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_follows(torch.tensor(out)[:, 0], marg[0], "accept-all verifier")


@torch.inference_mode()
def test_each_step_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) traces the draft steps (with the head's step) and the verification, ops and
    cache writes included, with no graph break; compiled rounds give the eager rounds' tokens and cache lengths."""
    import torch._dynamo

    target, draft = llama_pair()
    spec = StaticSpeculator(target, draft, k=3, head=confidence_head(draft), threshold=0.6, packed=False)
    ids = torch.randint(2, 48, (2, 5), generator=torch.Generator().manual_seed(6))
    want = spec.generate(ids, max_new_tokens=10, temperature=0)
    torch._dynamo.reset()
    spec.draft_steps = torch.compile(draft_steps, fullgraph=True, backend="aot_eager")
    spec.verify_step = torch.compile(verify_step, fullgraph=True, backend="aot_eager")
    assert spec.generate(ids, max_new_tokens=10, temperature=0) == want
    # later calls meet the same shapes, strides and tensors (the caches and `last` are kept): no recompilation, as
    # CUDA-graph replay needs
    with torch._dynamo.config.patch(error_on_recompile=True):
        other = torch.randint(2, 48, (2, 5), generator=torch.Generator().manual_seed(7))
        spec.generate(other, max_new_tokens=10, temperature=0)
        sampled = [spec.generate(ids, max_new_tokens=6, temperature=1.0, seed=s) for s in (1, 1)]
    assert sampled[0] == sampled[1]  # the same Philox (seed, offset) tensors give the same draws


def test_bad_input_is_named():
    target, draft = llama_pair()
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        StaticSpeculator(target, draft, k=0)
    spec = StaticSpeculator(target, draft, k=2)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\] with T >= 1"):
        spec.generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match="max_len must be in"):
        StaticCache.allocate(spec.target, 1, 10_000)
    with pytest.raises(ValueError, match="max_len 16: this call needs 25 cache columns"):
        StaticSpeculator(target, draft, k=2, max_len=16).generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=16)
