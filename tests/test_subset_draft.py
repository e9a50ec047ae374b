"""Distilled drafts: a draft whose LM head covers a subset of the target's vocabulary (FR-Spec), built from the
target's own layers, stored without what it shares with the target, and distilled on the target's probabilities.
Greedy output equals the target's own decoding (fp32) with such a draft on the lean and transformers backends;
sampled positions follow the target's exact marginals (chi-square)."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.models import fingerprint, vocab_size
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.engine.subset_head import SubsetLMHead
from specdec_ext.training import draft_train
from specdec_ext.training.draft_store import is_stored_draft, load_draft, save_draft
from models import make_target
from stats import assert_follows
from support import exact_marginals, greedy_against_target, head_for, perturbed


def subset_draft(target, ids, noise: float = 0.3, seed: int = 1):
    """A draft of ``target``'s first layer (noisy) with a :class:`SubsetLMHead` over ``ids``."""
    draft = draft_train.new_draft(target, torch.as_tensor(ids), layers=(0,))
    return perturbed(draft, draft_train.trainable(draft), noise, seed)


@pytest.fixture(scope="module")
def pair():
    """A 64-id target and a draft over 35 of its ids, scattered (every third id and the first 20)."""
    target = make_target("llama", vocab=64, layers=2)
    ids = sorted(set(range(20)) | set(range(20, 64, 3)))
    return target, subset_draft(target, ids)


def test_the_subset_head_computes_its_rows_and_gives_the_rest_minus_infinity():
    w = torch.randn(4, 8)
    head = SubsetLMHead(w, torch.tensor([7, 0, 3, 9]), 12)
    h = torch.randn(2, 5, 8)
    out = head(h)
    assert out.shape == (2, 5, 12)
    torch.testing.assert_close(out[..., [7, 0, 3, 9]], h @ w.T)
    others = [i for i in range(12) if i not in (7, 0, 3, 9)]
    assert torch.isneginf(out[..., others]).all()
    with pytest.raises(ValueError, match=r"token_ids must be distinct ids in \[0, 12\)"):
        SubsetLMHead(w, torch.tensor([7, 0, 3, 12]), 12)
    with pytest.raises(ValueError, match="token_ids must be distinct"):
        SubsetLMHead(w, torch.tensor([7, 0, 3, 3]), 12)
    with pytest.raises(ValueError, match=r"weight must be \[N, H\] with N = len\(token_ids\) = 3"):
        SubsetLMHead(w, torch.tensor([7, 0, 3]), 12)


def test_the_draft_shares_the_targets_embedding_and_speaks_its_vocabulary(pair):
    target, draft = pair
    assert vocab_size(draft) == vocab_size(target) == 64
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[draft.lm_head.token_ids])
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))}
    with pytest.raises(ValueError, match="layers must be indices of the target's 2 decoder layers"):
        draft_train.new_draft(target, torch.arange(10), layers=(0, 5))


def test_the_lean_model_computes_what_transformers_computes_for_a_subset_draft(pair):
    from specdec_ext.engine.model import LeanModel

    _, draft = pair
    lean = LeanModel(draft, packed=False)
    x = torch.tensor([[0, 5, 7, 33, 9, 61]])
    cache = lean.cache(1, 32)
    logits, _ = lean.forward(cache, x, keep=6, start=0)
    with torch.no_grad():
        ref = draft(x).logits
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(logits), fin) and int(fin[0, 0].sum()) == 35
    torch.testing.assert_close(logits[fin], ref[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6})],
                         ids=["fixed", "specdecpp"])
def test_greedy_equals_the_targets_own_decoding_with_a_subset_draft(pair, lean, policy, kw):
    target, draft = pair
    if policy == "specdecpp":
        kw = dict(kw, head=head_for(draft))
    gen = SpeculativeGenerator(target, draft, policy=policy, fast_target=lean, fast_draft=lean, **kw)
    emitted = greedy_against_target(gen, target, prompt_ids=64, pad_left=((1, 2),))
    outside = ~torch.isin(emitted, draft.lm_head.token_ids)
    assert int(outside.sum()) > 0, "the target never emitted an id outside the draft's subset: the case tests nothing"


N_ROWS = 3000
N_POS = 3


@pytest.mark.slow
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_sampling_follows_the_target_with_a_subset_draft(lean):
    """Target V = 12, a draft over ids {0, 2, 3, 5, 8, 9, 11}: the residual keeps the target's mass on the rest."""
    target = make_target("llama", vocab=12, ctx=48)
    draft = subset_draft(target, [0, 2, 3, 5, 8, 9, 11], noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    cfg = SamplingConfig(1.0)
    marginals = exact_marginals(target, prompt, cfg, N_POS)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, fast_target=lean, fast_draft=lean)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=1.0, seed=7)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marginals[i], f"subset draft, position {i + 1}")
    assert int(torch.isin(toks, torch.tensor([1, 4, 6, 7, 10])).sum()) > 0, "no sampled token outside the subset"
    assert out.stats.accepted > 0 and out.stats.discarded > 0


def test_a_stored_draft_keeps_only_its_own_tensors_and_loads_onto_its_target(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "d", fingerprint(target), {"note": "test"})
    assert is_stored_draft(out) and not is_stored_draft(tmp_path)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or n == "lm_head.weight" for n in names)
    assert {n for n in names if n.endswith(".int8")} and "lm_head.token_ids" in names
    back = load_draft(out, target)
    x = torch.tensor([[0, 5, 7, 33, 9, 61, 2, 2, 40]])
    with torch.no_grad():
        a, b = draft(x).logits, back(x).logits
    fin = torch.isfinite(a)
    assert torch.equal(fin, torch.isfinite(b))
    torch.testing.assert_close(b[fin], a[fin], rtol=0.05, atol=0.05)  # int8 rows: about 0.4% of each row's range
    assert back.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    other = make_target("llama", vocab=64, layers=2, seed=5)
    with pytest.raises(ValueError, match="distilled for another target"):
        load_draft(out, other)


def test_distillation_moves_the_draft_towards_the_target(tmp_path):
    """Teacher probabilities of a target on its own greedy continuations, then 40 steps of training: the
    held-out KL falls and the greedy agreement rises (a draft that learned nothing fails this)."""
    target = make_target("llama", vocab=64, layers=2, seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 64, (48, 6), generator=g)
    cont = target.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=None)
    seqs = [(row.tolist(), 6) for row in cont]
    ids = draft_train.choose_vocabulary(seqs, 64, 48, always=[1])
    assert ids.numel() == 48 and 1 in ids.tolist() and torch.equal(ids, ids.sort().values)
    teacher = draft_train.teacher_targets(target, seqs, ids, tmp_path, k=draft_train.TOP_K)
    assert (tmp_path / "teacher.pt").is_file() and len(teacher["idx"]) == 48
    draft = subset_draft(target, ids, noise=1.0)
    report = draft_train.train(draft, seqs, teacher, tmp_path, lr=3e-3, held_out=0.2, log=lambda m: None, steps=40)
    assert report["steps"] == 40
    assert report["after"]["kl"] < 0.7 * report["before"]["kl"]
    assert report["after"]["greedy_agreement"] > report["before"]["greedy_agreement"]
    assert (tmp_path / "checkpoint.pt").is_file()
