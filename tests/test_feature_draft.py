"""Feature drafts (EAGLE): a one-layer draft reading the target's hidden states. The backend's step logits equal
the draft's teacher-forced forward over the target's features (and its own predictions past what the target has
verified); greedy output equals the target's own decoding (fp32) under every policy, batched and continuous;
sampled positions follow the target's exact marginals (chi-square); storing, loading and training."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.backends import LeanBackend
from specdec_ext.engine.feature_draft import FeatureBackend, FeatureDraft, shifted
from specdec_ext.engine.models import fingerprint
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.training import feature_train
from specdec_ext.training.draft_store import is_stored_draft, load_draft, save_draft
from models import make_target
from stats import assert_follows
from support import exact_marginals, greedy_against_target, perturbed

IDS = sorted(set(range(20)) | set(range(20, 64, 3)))


def feature_draft(target, ids, noise: float = 0.3, seed: int = 1) -> FeatureDraft:
    """The target's first layer as a feature draft over ``ids``, its trained parameters perturbed."""
    draft = feature_train.new_feature_draft(target, torch.as_tensor(ids), 0)
    return perturbed(draft, feature_train.trainable(draft), noise, seed)


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=64, layers=2)
    return target, feature_draft(target, IDS)


def _oracle(target, draft, ctx: list, own: dict = ()) -> torch.Tensor:
    """The draft's subset logits at the last position of ``ctx``, teacher-forced on the target's features, except
    the positions in ``own`` whose feature is given (the draft's predictions)."""
    with torch.no_grad():
        f = target.model(torch.tensor([ctx])).last_hidden_state
        feats = shifted(f)
        for pos, h in dict(own).items():
            feats[0, pos] = h
        return draft(torch.tensor([ctx]), feats)[0][0, -1]


def test_the_backend_reads_the_targets_features_and_recomputes_what_the_target_verified(pair):
    target, draft = pair
    tb = LeanBackend(target, "target")
    fb = FeatureBackend(draft, tb, vocab=64)
    tb.start(1, 64)
    fb.start(1, 64)
    prompt = [0, 5, 7, 33, 9, 61, 2, 40, 12, 8]
    N = len(prompt)
    tb.append([0], [prompt[:-1]], [0])  # the target holds all but the last token, the draft all but two
    fb.append([0], [prompt[:-2]], [0])
    ids = torch.tensor(IDS)

    def close(logits, ref):
        torch.testing.assert_close(logits[0, -1, ids], ref, rtol=1e-4, atol=1e-4)

    l1, h1 = fb.forward(torch.tensor([prompt[-2:]]))
    close(l1, _oracle(target, draft, prompt))
    c1 = int(l1[0, -1].argmax())
    l2, h2 = fb.forward(torch.tensor([[c1]]))  # its feature: the draft's own prediction at N - 1
    close(l2, _oracle(target, draft, prompt + [c1], {N: h1[0, -1]}))
    c2 = int(l2[0, -1].argmax())
    l3, _ = fb.forward(torch.tensor([[c2]]))
    close(l3, _oracle(target, draft, prompt + [c1, c2], {N: h1[0, -1], N + 1: h2[0, -1]}))
    c3 = int(l3[0, -1].argmax())
    tb.forward(torch.tensor([[prompt[-1], c1, c2, c3]]), keep=4)  # the verification: c1 and c2 kept, then x
    x = 3
    tb.rollback(torch.tensor([1]))
    fb.rollback(torch.tensor([1]))  # the draft holds the context but its last two tokens
    assert fb.lens[0] == N + 1 and fb.exact[0] == N
    l4, _ = fb.forward(torch.tensor([[c2, x]]))  # c1's position is recomputed from the target's feature
    close(l4, _oracle(target, draft, prompt + [c1, c2, x]))
    assert fb.exact[0] == N + 3


@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 3}), ("confidence", {"threshold": 0.4}),
                                       ("fixed", {"k": 5, "lookup": True})],
                         ids=["fixed", "confidence", "copy-or-draft"])
def test_greedy_equals_the_targets_own_decoding_with_a_feature_draft(pair, policy, kw):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, policy=policy, **kw)
    greedy_against_target(gen, target, prompt_ids=64)  # asserts candidates were accepted and rejected


def test_continuous_batching_with_a_feature_draft_equals_plain_decoding(pair):
    """Rows leave and join (select, the store's rows move with the target's): each equals its own plain decoding."""
    target, draft = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (5, 11, 7, 3, 9, 6)]
    limits = [12, 4, 20, 9, 15, 7]
    plain = SpeculativeGenerator(target, None, policy="autoregressive")
    ref = plain.generate_continuous(prompts, batch_size=3, max_new_tokens=limits, temperature=0)
    out = SpeculativeGenerator(target, draft, policy="fixed", k=3).generate_continuous(
        prompts, batch_size=3, max_new_tokens=limits, temperature=0)
    assert [list(map(int, t)) for t in out.new_tokens] == [list(map(int, t)) for t in ref.new_tokens]
    assert out.stats.accepted > 0


def test_a_feature_draft_is_refused_where_it_cannot_read_the_targets_features(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="fast_target=True"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, fast_target=False)
    with pytest.raises(ValueError, match="cuda_graphs=True.*FeatureDraft run eagerly"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="draft_context: a FeatureDraft reads the whole context"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, draft_context=8)
    with pytest.raises(ValueError, match=r"fc must map 2H = 128 features to H = 64"):
        FeatureDraft(draft.model, torch.nn.Linear(64, 64))


N_ROWS = 3000
N_POS = 3


@pytest.mark.slow
def test_sampling_follows_the_target_with_a_feature_draft():
    """Target V = 12, a feature draft over ids {0, 2, 3, 5, 8, 9, 11}: every sampled position follows the target's
    exact marginal (the residual keeps the target's mass on the ids the draft never proposes)."""
    target = make_target("llama", vocab=12, ctx=48)
    draft = feature_draft(target, [0, 2, 3, 5, 8, 9, 11], noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marginals = exact_marginals(target, prompt, SamplingConfig(1.0), N_POS)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    out = gen.generate(prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=1.0, seed=7)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marginals[i], f"feature draft, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0


def test_a_stored_feature_draft_loads_onto_its_target(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "d", fingerprint(target), {"kind": "eagle"})
    assert is_stored_draft(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "fc.bias"} <= names and any(n.endswith(".int8") for n in names)
    assert not any("embed" in n or n == "lm_head.weight" for n in names)
    back = load_draft(out, target)
    assert isinstance(back, FeatureDraft)
    x = torch.tensor([[0, 5, 7, 33, 9, 61, 2, 2, 40]])
    f = torch.randn(1, 9, 64)
    with torch.no_grad():
        a, b = draft(x, f)[0], back(x, f)[0]
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)  # the layer's int8 rows
    assert back.get_input_embeddings().weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


def test_training_moves_the_feature_draft_towards_the_target(tmp_path):
    """The target's features over its own greedy continuations, then 40 steps: the held-out loss falls and the
    agreement with the target's argmax rises, reading the target's features and reading its own."""
    target = make_target("llama", vocab=64, layers=2, seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 64, (48, 6), generator=g)
    cont = target.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=None)
    seqs = [(row.tolist(), 6) for row in cont]
    feats = feature_train.target_features(target, seqs, tmp_path)
    assert (tmp_path / "features-0000.pt").is_file() and len(feats) == 48 and feats[0].shape == (30, 64)
    draft = feature_draft(target, list(range(64)), noise=1.0)
    report = feature_train.train(draft, seqs, feats, tmp_path, lr=3e-3, held_out=0.2, log=lambda m: None, steps=40)
    before, after = report["before"], report["after"]
    assert report["steps"] == 40 and (tmp_path / "eagle-checkpoint.pt").is_file()
    assert after["loss"] < 0.7 * before["loss"]
    assert after["agreement_target_features"] > before["agreement_target_features"]
    assert after["agreement_own_features"] > before["agreement_own_features"]


def test_the_benchmark_runs_the_feature_draft_arms(pair):
    """``specdec bench --eagle-ks``: the feature draft at fixed K, under the confidence stop and beside prompt lookup,
    every greedy text equal to plain decoding's."""
    from specdec_ext.benchmark import run_benchmark, standard_methods, summarize
    from specdec_ext.zoo import ModelPair
    from support import DigitTokenizer

    from models import noisy_copy

    target, draft = pair
    bench_pair = ModelPair(target, noisy_copy(target), DigitTokenizer(), None, feature=draft)
    methods = standard_methods(None, ks=(), thresholds=(), hf=False, adaptive=False, oracle=False, auto=False,
                               lookup_ks=(), feature_ks=(3,))
    assert [(m.name, m.draft) for m in methods] == [
        ("plain", "model"), ("eagle K=3", "eagle"), ("eagle confidence", "eagle"),
        ("copy or eagle, confidence", "eagle+lookup")]
    records = run_benchmark(bench_pair, ["5 9 12 33 7 5 9 12", "40 41 2 8 16 23"], methods, max_new_tokens=16,
                            progress=False)
    rows = {r["method"]: r for r in summarize(records, methods)}
    assert set(rows) == {m.name for m in methods}
    for name, r in rows.items():
        assert r["greedy_mismatches"] == [], name
    assert rows["eagle K=3"]["draft_calls_per_token"] > 0
