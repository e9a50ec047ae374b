"""Pairs whose embedding sizes differ: a draft with fewer rows than the target (Qwen2.5 0.5B's 151,936 against 7B's
152,064) or more. Greedy output equals the target's own decoding (fp32) on the lean and the transformers backends,
including tokens the target emits from rows the draft lacks; sampled positions follow the target's exact marginals
(chi-square); the pair is accepted with a warning naming the extra rows, or checked against the tokenizers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.models import check_vocabularies, stand_in_id
from specdec_ext.engine.sampling import SamplingConfig
from models import make_target
from stats import assert_follows
from support import exact_marginals, greedy_against_target, head_for


def resized_draft(target, rows: int, noise: float = 0.3, seed: int = 1):
    """A draft of ``target`` with ``rows`` embedding rows: the target's first rows (rows beyond are new, random),
    plus noise, so that it agrees with the target often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        draft.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * (p.std() if p.numel() > 1 else 1.0))
    return draft.eval()


def generator(target, draft, **kw):
    with pytest.warns(UserWarning, match="taken as padding"):
        return SpeculativeGenerator(target, draft, **kw)


@pytest.fixture(scope="module")
def narrow_pair():
    """A target of 64 rows and a draft of its first 48: the target's greedy argmax falls on rows 48..63 often."""
    target = make_target("llama", vocab=64)
    return target, resized_draft(target, 48)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.6})],
                         ids=["fixed", "specdecpp"])
def test_greedy_equals_the_targets_own_decoding_with_a_smaller_draft(narrow_pair, lean, policy, kw):
    target, draft = narrow_pair
    if policy == "specdecpp":
        kw = dict(kw, head=head_for(draft))
    gen = generator(target, draft, policy=policy, fast_target=lean, fast_draft=lean, **kw)
    emitted = greedy_against_target(gen, target)
    assert int((emitted >= 48).sum()) > 0, "the target never emitted a row the draft lacks: the case tests nothing"


def test_continuous_batching_with_a_smaller_draft_equals_the_target_alone(narrow_pair):
    target, draft = narrow_pair
    gen = generator(target, draft, policy="fixed", k=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 9, 5, 6, 4)]  # ids the draft lacks too
    out = gen.generate_continuous(prompts, 2, max_new_tokens=20, temperature=0)
    for p, toks in zip(prompts, out.new_tokens):
        ref = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=1,
                              eos_token_id=None)
        assert toks == ref[0, len(p):].tolist()


N_ROWS = 3000
N_POS = 3


@pytest.mark.slow
@pytest.mark.parametrize("rows,lean", [(9, True), (9, False), (15, True)],
                         ids=["draft-smaller-lean", "draft-smaller-transformers", "draft-larger-lean"])
@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=5)], ids=["T1", "T0.8-topk5"])
def test_sampling_follows_the_target_when_embedding_sizes_differ(rows, lean, cfg):
    """Target V = 12; a draft of 9 rows never proposes ids 9..11 (the residual keeps the target's mass there), a
    draft of 15 rows has its 3 extra rows cut from its proposals; on the lean and the transformers backends."""
    target = make_target("llama", vocab=12, ctx=48)
    draft = resized_draft(target, rows, noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marginals = exact_marginals(target, prompt, cfg, N_POS)
    gen = generator(target, draft, policy="fixed", k=3, fast_target=lean, fast_draft=lean)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=cfg.temperature, top_k=cfg.top_k,
                       seed=7)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marginals[i], f"draft of {rows} rows, {cfg}, position {i + 1}")
    if rows < 12:
        assert int((toks >= rows).sum()) > 0, "no sampled token beyond the draft's rows"
    assert out.stats.accepted > 0 and out.stats.discarded > 0


def test_special_ids_beyond_the_smaller_model_are_refused():
    target = make_target("llama", vocab=64)
    draft = resized_draft(target, 48)
    draft.config.eos_token_id = 50  # an id the draft's own config names but cannot embed
    with pytest.raises(ValueError, match=r"V = 64 .* V = 48.*special token ids \[50\]"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2)


def test_the_warning_names_the_extra_rows(narrow_pair):
    target, draft = narrow_pair
    with pytest.warns(UserWarning, match=r"the target's rows 48\.\.63 are taken as padding"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2)
    assert stand_in_id(draft) == 1  # its padding id


class _Tokenizer:
    """The part of a tokenizer the check reads."""

    def __init__(self, n: int, specials=("<s>", "</s>")):
        self.vocab = {f"t{i}": i for i in range(n)}
        self.all_special_tokens = list(specials)

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def test_tokenizers_decide_when_given(narrow_pair):
    target, draft = narrow_pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matching tokenizers: accepted without a warning
        check_vocabularies(target, draft, (_Tokenizer(40), _Tokenizer(40)))
    with pytest.raises(ValueError, match="differ in their vocabulary"):
        check_vocabularies(target, draft, (_Tokenizer(40), _Tokenizer(41)))
    with pytest.raises(ValueError, match="special tokens differ"):
        check_vocabularies(target, draft, (_Tokenizer(40), _Tokenizer(40, ("<s>", "<pad>"))))
    with pytest.raises(ValueError, match=r"ids up to 59 but the target has V = 64 embedding rows and the draft V = 48"):
        check_vocabularies(target, draft, (_Tokenizer(60), _Tokenizer(60)))
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2, tokenizers=(_Tokenizer(40), _Tokenizer(40)))
    assert gen.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4).new_tokens[0]


def test_the_ops_read_a_narrower_draft_as_probability_zero_beyond_its_rows():
    """The verification ops take the draft's distribution at its own width V_draft < V: the same result as the
    distribution padded to V with zeros (probabilities) or -inf (logits)."""
    from specdec_ext import ops
    from support import make_case

    ids, q, p, n, u = make_case(4, 3, 40, seed=2)
    q = q[..., :30] / q[..., :30].sum(-1, keepdim=True)
    ids = ids.clamp_max(29)
    wide = torch.nn.functional.pad(q, (0, 10))
    for a, b in zip(ops.chain_verify(ids, q, p, n, uniforms=u), ops.chain_verify(ids, wide, p, n, uniforms=u)):
        assert torch.equal(a, b)
    logits_q, logits_p = torch.log(q), torch.log(p)
    t = torch.tensor([1.0, 0.0, 0.7, 1.0])
    padded = torch.nn.functional.pad(logits_q, (0, 10), value=float("-inf"))
    for a, b in zip(ops.chain_verify_logits(ids, logits_q, logits_p, t, n, uniforms=u),
                    ops.chain_verify_logits(ids, padded, logits_p, t, n, uniforms=u)):
        assert torch.equal(a, b)
    r = ops.residual_sample(p[:, 0], q[:, 0], uniforms=u[:, 0])
    assert torch.equal(r, ops.residual_sample(p[:, 0], wide[:, 0], uniforms=u[:, 0]))
    with pytest.raises(ValueError, match="vocabulary mismatch"):  # a wider draft is the caller's to cut
        ops.chain_verify(ids, p[:, :3], p[..., :30], uniforms=u)
