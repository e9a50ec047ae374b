"""Packed verification (``engine/packing.py``): a forward over the real tokens of rows of different lengths, packed
into one sequence, computes what the padded forward computes (logits and the cache a next forward reads); the
runner packs only where it can; the engine's greedy output with packed per-row depths equals target-only
decoding and its sampled output follows the target (chi-square); the budget's global top-N (``BatchBudget.depths``)
keeps a prefix per row by the goodput rule."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from models import make_pair, make_target
from stats import assert_follows
from support import exact_marginals, head_for
from specdec_ext import SpeculativeGenerator, ops
from specdec_ext.engine import packing
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.policies.goodput import BatchCosts

needs_ext = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")
# verification cost linear in tokens per row (as on a CPU at large batch sizes): dropping slots pays
LINEAR = BatchCosts([1, 8192], [[10.0 + 6.0 * k for k in range(9)]] * 2, [[10.0 + 5.0 * (n - 1) for n in range(1, 10)]] * 2)


def qwen2_full(vocab=48, hidden=64, layers=2, seed=0):
    """A tiny Qwen2 without a sliding window, with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()


def test_spread_and_gather_invert_each_other():
    valid = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    plan = packing.PackedRows.from_valid(valid)
    assert plan.rows.tolist() == [0, 0, 1, 2, 2, 2] and plan.slots.tolist() == [0, 1, 0, 0, 1, 2]
    x = torch.randn(1, 4, 6, 5)  # [1, H, N, D]
    padded = plan.spread(x, 2)
    assert padded.shape == (3, 4, 3, 5)
    assert (padded[0, :, 2] == 0).all() and (padded[1, :, 1:] == 0).all()
    torch.testing.assert_close(padded[2, :, 1], x[0, :, 4])
    torch.testing.assert_close(plan.gather(padded, 2), x)
    assert packing.current() is None
    with packing.packed(plan):
        assert packing.current() is plan
    assert packing.current() is None


def test_a_verification_packs_only_where_enough_slots_are_holes():
    share = packing.PACK_MAX_REAL_SHARE
    assert 0.5 < share < 1.0
    assert not packing.worth_packing(32, 32)  # every slot real: nothing to save, the spreading to pay
    assert not packing.worth_packing(31, 32)  # one row's slot a hole (measured dearer packed)
    assert packing.worth_packing(24, 32)  # a quarter holes
    assert packing.worth_packing(int(share * 100), 100) and not packing.worth_packing(int(share * 100) + 1, 100)
    assert not packing.worth_packing(0, 32)


def _run(model, prompt, prompt_valid, tokens, valid, removed, packed):
    """Prefill, one forward of ``tokens`` with ``valid`` (packed or padded), a rollback of ``removed`` per row, and a
    forward of one token per row: the logits of both forwards."""
    r = CausalLMRunner(model, "target")
    r.start(prompt.shape[0])
    r.forward(prompt, prompt_valid, keep=1)
    first, _ = r.forward(tokens, valid, keep=tokens.shape[1], packed=packed)
    r.rollback(removed)
    nxt, _ = r.forward(torch.tensor([[5], [6], [7]]), keep=1)
    return first, nxt, r


@needs_ext
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forward_computes_what_the_padded_one_does(arch, dtype):
    model = (make_target("llama") if arch == "llama" else qwen2_full()).to(dtype)
    model.set_attn_implementation("specdec_decode")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 48, (3, 6), generator=g)
    prompt_valid = torch.ones(3, 6, dtype=torch.bool)
    prompt_valid[1, :3] = prompt_valid[2, :1] = False  # left padding
    tokens = torch.randint(2, 48, (3, 4), generator=g)
    valid = torch.arange(4).unsqueeze(0) <= torch.tensor([[2], [0], [3]])  # 3, 1 and 4 real tokens
    removed = torch.tensor([1, 0, 2])
    padded = _run(model, prompt, prompt_valid, tokens, valid, removed, packed=False)
    packed = _run(model, prompt, prompt_valid, tokens, valid, removed, packed=True)
    tol = 0 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed[0][valid], padded[0][valid], atol=tol, rtol=tol)
    assert (packed[0][~valid] == 0).all()  # the holes' logits are zeros, not computed
    torch.testing.assert_close(packed[1], padded[1], atol=tol, rtol=tol)
    assert torch.equal(packed[2].mask, padded[2].mask) and torch.equal(packed[2].next_pos, padded[2].next_pos)


def test_the_runner_packs_only_where_it_can():
    llama = make_target("llama")
    assert not CausalLMRunner(llama, "target").packs  # sdpa attention
    llama.set_attn_implementation("specdec_decode")
    assert CausalLMRunner(llama, "target").packs
    for arch in ("mistral", "gpt2"):  # a sliding window; another family
        other = make_target(arch)
        other.set_attn_implementation("specdec_decode")
        assert not CausalLMRunner(other, "target").packs, arch
    r = CausalLMRunner(make_target("gpt2"), "target")
    r.start(2)
    with pytest.raises(ValueError, match="cannot pack"):
        r.forward(torch.tensor([[3, 4], [5, 6]]), packed=True)


def test_fractional_verification_is_linear_between_whole_depths():
    assert LINEAR.verify(4, 1.5) == pytest.approx((LINEAR.verify(4, 1) + LINEAR.verify(4, 2)) / 2)
    assert LINEAR.round(4, 3, None, 0.5) == pytest.approx(LINEAR.round(4, 3) - (LINEAR.verify(4, 4) - LINEAR.verify(4, 1.5)))


def _spy_packed(monkeypatch):
    calls = []
    real = CausalLMRunner._packed_forward

    def spy(self, tokens, valid, position_ids):
        calls.append(valid.clone())
        return real(self, tokens, valid, position_ids)

    monkeypatch.setattr(CausalLMRunner, "_packed_forward", spy)
    return calls


@needs_ext
@pytest.mark.parametrize("policy,kw", [("specdecpp", {"threshold": 0.5, "k_max": 8}),
                                       ("confidence", {"threshold": 0.5, "max_k": 8})], ids=["head", "per-row-stops"])
def test_packed_greedy_equals_target_only(monkeypatch, policy, kw):
    target, draft = make_pair("llama", noise=0.3)
    target.set_attn_implementation("specdec_decode")
    ids = torch.randint(2, target.config.vocab_size, (6, 6), generator=torch.Generator().manual_seed(0))
    plain = SpeculativeGenerator(target, policy="autoregressive").generate(ids, max_new_tokens=24, temperature=0)
    calls = _spy_packed(monkeypatch)
    if policy == "specdecpp":  # a head whose survivals straddle the threshold: rows stop at different depths
        kw = dict(kw, head=head_for(draft, bias=0.0, kind="proposal"))
    gen = SpeculativeGenerator(target, draft, policy=policy, fast_target=False, **kw)  # transformers' runner packs
    out = gen.generate(ids, max_new_tokens=24, temperature=0)
    assert out.new_tokens == plain.new_tokens
    assert calls and any(len(set(v.sum(1).tolist())) > 1 for v in calls), \
        "no round verified rows of different depths packed"
    for v in calls:  # packed only where enough of the padded layout was holes (worth_packing)
        assert packing.worth_packing(int(v.sum()), v.numel()), v
    assert any(len({c for c in r.candidates}) > 1 for r in out.stats.rounds)  # rows verified different depths


@pytest.mark.slow
@needs_ext
def test_packed_sampling_is_lossless(monkeypatch):
    target, draft = make_pair("llama", vocab=12, noise=0.5)
    target.set_attn_implementation("specdec_decode")
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    cfg = SamplingConfig(1.0)
    marg = exact_marginals(target, prompt, cfg, 3)
    calls = _spy_packed(monkeypatch)
    # SpecDec++ at a fixed threshold: each row stops where its own head says, so rows verify different depths, packed
    gen = SpeculativeGenerator(target, draft, fast_target=False, policy="specdecpp",
                               head=head_for(draft, bias=0.0, kind="proposal"), threshold=0.5, k_max=6)
    out = gen.generate(prompt.expand(3000, -1), max_new_tokens=3, temperature=1.0, seed=1000)
    toks = torch.tensor(out.new_tokens)
    for i in range(3):
        assert_follows(toks[:, i], marg[i], f"packed verification, position {i + 1}")
    assert calls and out.stats.accepted > 0 and out.stats.discarded > 0
    assert any(len(set(r.candidates)) > 1 for r in out.stats.rounds), "no round verified rows to different depths"
