"""Acceptance head: data (labels, contexts, mixing, resume), features at both input positions, the
acceptance-history feature, loss, training signal, replay, checkpoints, fused-op agreement, pipeline."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dataclasses import replace

from specdec_ext import AcceptanceHead, ops
from specdec_ext.engine.models import fingerprint
from specdec_ext.head.features import CONFIDENCE_FEATURES, history_after_accepts, history_offline, history_update
from specdec_ext.training.head_data import HeadDataConfig, HeadDataset, generate_head_data
from specdec_ext.training.head_features import draft_features
from specdec_ext.training.head_train import HeadTrainConfig, binary_kl, roc_auc, train_head, weighted_bce
from specdec_ext.training.pipeline import run_pipeline
from specdec_ext.training.replay import flat_costs, replay, soft_label_scorer
from models import make_pair
from support import DigitTokenizer


def tiny_prompts(n, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g))
            for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", vocab=32, noise=0.6)


@pytest.fixture(scope="module")
def sample_data(pair):
    target, draft = pair
    cfg = HeadDataConfig(decoding="sample", temperature=0.8, max_new_tokens=40, batch_size=16, seed=3)
    return generate_head_data(target, draft, DigitTokenizer(), tiny_prompts(160, 32), cfg, progress=False)


@pytest.fixture(scope="module")
def greedy_data(pair):
    target, draft = pair
    cfg = HeadDataConfig(decoding="greedy", max_new_tokens=40, batch_size=16, seed=3)
    return generate_head_data(target, draft, DigitTokenizer(), tiny_prompts(160, 32, seed=1), cfg, progress=False)


def test_sample_labels_recomputed_independently(pair, sample_data):
    """At every response position: Y_i is the stored candidate, label = min(1, p_i(Y_i) / q_i(Y_i)) from
    fresh forwards of both models over prompt + X at the processed distributions (temperature 0.8)."""
    target, draft = pair
    checked = 0
    for e in range(6):
        sl = sample_data.example(e)
        ids, P = sample_data.input_ids[sl], int(sample_data.response_start[e])
        with torch.no_grad():
            p = torch.softmax(target(ids.unsqueeze(0)).logits[0].double() / 0.8, -1)
            q = torch.softmax(draft(ids.unsqueeze(0)).logits[0].double() / 0.8, -1)
        for i in range(P, ids.numel()):
            y = int(sample_data.candidates[sl][i])
            want = min(1.0, float(p[i - 1, y] / q[i - 1, y]))
            assert abs(float(sample_data.labels[sl][i]) - want) < 1e-4
            checked += 1
    assert checked > 50


def test_greedy_data_is_the_targets_greedy_output_with_argmax_labels(pair, greedy_data):
    """Responses equal transformers' greedy generate; Y_i = argmax q_i; label 1 iff it is the target's argmax."""
    target, draft = pair
    for e in range(4):
        sl = greedy_data.example(e)
        ids, P = greedy_data.input_ids[sl], int(greedy_data.response_start[e])
        ref = target.generate(ids[:P].unsqueeze(0), max_new_tokens=ids.numel() - P, do_sample=False, pad_token_id=1,
                              eos_token_id=None)[0]
        assert torch.equal(ref, ids)
        with torch.no_grad():
            qa = draft(ids.unsqueeze(0)).logits[0, P - 1 : -1].argmax(-1)
            pa = target(ids.unsqueeze(0)).logits[0, P - 1 : -1].argmax(-1)
        assert torch.equal(greedy_data.candidates[sl][P:], qa)
        assert torch.equal(greedy_data.labels[sl][P:], (qa == pa).float())
        assert torch.equal(greedy_data.accept_sample[sl][P:], qa == pa)
    assert 0.05 < float(greedy_data.labels.nanmean()) < 0.95  # both classes, for the AUC tests


def test_data_do_not_depend_on_batching_and_resume(pair, tmp_path):
    """Per-prompt seeds: batch size and an interrupted, resumed generation give the same data set."""
    target, draft = pair
    prompts = tiny_prompts(10, 32, seed=4)
    cfg = HeadDataConfig(decoding="sample", max_new_tokens=12, batch_size=4, seed=1)
    whole = generate_head_data(target, draft, DigitTokenizer(), prompts, cfg, progress=False)
    other = generate_head_data(target, draft, DigitTokenizer(), prompts, replace(cfg, batch_size=3), progress=False)

    class Interrupt(Exception):
        pass

    class Failing(DigitTokenizer):
        calls = 0

        def __call__(self, text, **kw):
            Failing.calls += 1
            if Failing.calls > 6:
                raise Interrupt
            return super().__call__(text, **kw)

    path = tmp_path / "d.safetensors"
    with pytest.raises(Interrupt):
        generate_head_data(target, draft, Failing(), prompts, replace(cfg, batch_size=2), progress=False, path=path,
                           save_every=1)
    assert HeadDataset.load(path).meta["prompts_done"] == 6
    resumed = generate_head_data(target, draft, DigitTokenizer(), prompts, replace(cfg, batch_size=2), progress=False,
                                 path=path, log=lambda *a: None)
    for d in (other, resumed):
        for name in ("input_ids", "offsets", "candidates", "accept_sample", "take_target"):
            assert torch.equal(getattr(whole, name), getattr(d, name)), name
        assert torch.equal(whole.labels.nan_to_num(-1), d.labels.nan_to_num(-1))


def test_mixing_ratio_is_respected(sample_data):
    resp = sample_data.target_tokens >= 0
    take = sample_data.take_target[resp]
    n = int(take.numel())
    sigma = math.sqrt(0.15 * 0.85 / n)
    assert n > 500 and abs(float(take.float().mean()) - 0.15) < 5 * sigma


def test_features_at_the_proposal_and_candidate_positions(pair, greedy_data, sample_data):
    """Hidden states and confidence features equal fresh forwards: the proposal state at P + i - 1; the
    paper's state after Z_i, counted where Z_i = Y_i; and, on target contexts, after Y_i at X_<i."""
    _, draft = pair
    H = {}
    hook = draft.get_output_embeddings().register_forward_pre_hook(lambda m, a: H.__setitem__("h", a[0]))
    try:
        f = draft_features(draft, greedy_data, "proposal", progress=False)
        e = 2
        sl = greedy_data.example(e)
        ids, P = greedy_data.input_ids[sl], int(greedy_data.response_start[e])
        with torch.no_grad():
            q = torch.softmax(draft(ids.unsqueeze(0)).logits[0].float(), -1)
        rows = (f["example"] == e).nonzero().squeeze(-1)
        torch.testing.assert_close(f["hidden"][rows], H["h"][0, P - 1 : -1].float())
        y = greedy_data.candidates[sl][P:]
        torch.testing.assert_close(f["features"][rows, 0], q[P - 1 : -1].gather(-1, y.unsqueeze(-1)).squeeze(-1))
        torch.testing.assert_close(f["features"][rows, 3], history_offline(greedy_data.accept_sample[sl][P:]))

        c = draft_features(draft, sample_data, "candidate", progress=False)
        sl = sample_data.example(e)
        P = int(sample_data.response_start[e])
        z = sample_data.input_ids[sl].clone()
        z[P:] = torch.where(sample_data.take_target[sl][P:], sample_data.target_tokens[sl][P:], sample_data.candidates[sl][P:])
        with torch.no_grad():
            draft(z.unsqueeze(0))
        counted = z[P:] == sample_data.candidates[sl][P:]
        rows = (c["example"] == e).nonzero().squeeze(-1)
        torch.testing.assert_close(c["hidden"][rows], H["h"][0, P:][counted].float())

        t = draft_features(draft, greedy_data, "candidate", contexts="target", progress=False)
        sl = greedy_data.example(e)
        ids, P = greedy_data.input_ids[sl], int(greedy_data.response_start[e])
        rows = (t["example"] == e).nonzero().squeeze(-1)
        i = int(((greedy_data.candidates[sl][P:] != ids[P:]).nonzero()[0]))  # a rejected candidate
        with torch.no_grad():
            draft(torch.cat([ids[: P + i], greedy_data.candidates[sl][P + i : P + i + 1]]).unsqueeze(0))
        torch.testing.assert_close(t["hidden"][rows[i]], H["h"][0, -1].float())
    finally:
        hook.remove()


def test_history_feature_online_matches_offline():
    """The run-time history (tested outcomes only, in-round accepts assumed) equals the offline average
    over every earlier outcome, in rounds that end in a rejection: K = 3, 3, 4 with 1, 2 and 3 accepted.
    (After a fully accepted round the bonus position's outcome is never observed at run time: the one
    documented difference.)"""
    outcomes = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    off = history_offline(outcomes)
    v = torch.tensor([0.75])
    pos = 0
    for K, acc in ((3, 1), (3, 2), (4, 3)):
        for j in range(acc + 1):  # candidate j of the round is scored assuming the j before it accepted
            torch.testing.assert_close(history_after_accepts(v, j), off[pos + j : pos + j + 1])
        v = history_update(v, torch.tensor([K]), torch.tensor([acc]))
        pos += acc + 1
    assert pos == outcomes.numel()


def test_loss_matches_hand_computation():
    z = torch.tensor([0.3, -1.2, 2.0])
    y = torch.tensor([1.0, 0.25, 0.0])
    w = 6.0
    s = [1 / (1 + math.exp(-v)) for v in z.tolist()]
    num = -sum(yi * math.log(si) + w * (1 - yi) * math.log(1 - si) for yi, si in zip(y.tolist(), s))
    den = sum(yi + w * (1 - yi) for yi in y.tolist())
    assert abs(weighted_bce(z, y, w).item() - num / den) < 1e-6


def test_metrics_known_values():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert binary_kl(torch.tensor([0.3]), torch.tensor([0.3])) < 1e-12
    assert abs(binary_kl(torch.tensor([1.0]), torch.tensor([0.5])) - math.log(2)) < 1e-9


@pytest.mark.parametrize("kind", ["proposal+features", "paper"])
def test_trained_head_beats_constant_predictor(pair, greedy_data, sample_data, kind):
    _, draft = pair
    if kind == "paper":
        feats = draft_features(draft, sample_data, "candidate", progress=False)
        cfg = HeadTrainConfig(epochs=40, batch_size=256, lr=3e-3, held_out_frac=0.2, input_position="candidate",
                              rejection_weight=6.0)
    else:
        feats = draft_features(draft, greedy_data, "proposal", progress=False)
        cfg = HeadTrainConfig(epochs=40, batch_size=256, lr=3e-3, held_out_frac=0.2, features=CONFIDENCE_FEATURES)
    head, report = train_head(feats, cfg, progress=False)
    ho = report["held_out"]
    assert ho["positions"] > 200
    assert ho["head"]["roc_auc"] > ho["constant"]["roc_auc"] + 0.05, ho
    assert report["history"][-1]["train_loss"] < report["history"][0]["train_loss"]


def test_unweighted_head_is_better_calibrated_than_constant(pair, sample_data):
    """With w = 6 the loss's optimum is y / (y + 6 (1 - y)), deliberately below the label; with w = 1
    the head estimates the label itself and must beat the constant on KL and Brier score. (Under sampling
    the proposal state does not know which token was drawn: the head reads q(y) and the other features.)"""
    _, draft = pair
    feats = draft_features(draft, sample_data, "proposal", progress=False)
    _, report = train_head(feats, HeadTrainConfig(epochs=40, batch_size=256, lr=3e-3, held_out_frac=0.2,
                                                  rejection_weight=1.0, seed=0, features=CONFIDENCE_FEATURES),
                           progress=False)
    ho = report["held_out"]
    assert ho["head"]["binary_kl"] < ho["constant"]["binary_kl"], ho
    assert ho["head"]["brier"] < ho["constant"]["brier"], ho


def test_training_is_reproducible(pair, greedy_data):
    _, draft = pair
    feats = draft_features(draft, greedy_data, progress=False)
    cfg = HeadTrainConfig(epochs=2, batch_size=256, seed=5, features=("margin", "recent_accept"))
    h1, _ = train_head(feats, cfg, progress=False)
    h2, _ = train_head(feats, cfg, progress=False)
    for a, b in zip(h1.state_dict().values(), h2.state_dict().values()):
        assert torch.equal(a, b)


def test_replay_by_hand():
    """Two responses with known outcomes; rounds worked out by hand under unit costs (verify 1, draft 0.1);
    as in the engine, a round never drafts past the response's end (K <= remaining - 1)."""
    acc = torch.tensor([1, 1, 0, 1, 1, 1,   0, 1, 1], dtype=torch.bool)
    feats = {"example": torch.tensor([0] * 6 + [1] * 3), "index": torch.tensor(list(range(6)) + list(range(3))),
             "accept": acc}
    costs = flat_costs(0.1)
    # K = 2. Response 0: [1,1] emits 3, [1,1] emits 3: 2.4 time units. Response 1: [0] emits 1 (1.2),
    # then K = 1 (one token left after it): [1] emits 2 (1.1).
    r = replay(feats, None, costs, "K=2")
    assert r.mean_candidates == (2 + 2 + 2 + 1) / 4 and r.mean_accepted == (2 + 2 + 0 + 1) / 4
    assert abs(r.median_speedup - (6 / 2.4 + 3 / 2.3) / 2) < 1e-9
    assert abs(r.aggregate_speedup - 9 / (2.4 + 2.3)) < 1e-9
    # oracle: up to and including the first rejection. Response 0: K = 3 (2 accepted), then K = 2 (the end):
    # 1.3 + 1.2. Response 1: K = 1 (rejected), K = 1: 1.1 + 1.1.
    o = replay(feats, None, costs, "oracle")
    assert o.mean_candidates == (3 + 2 + 1 + 1) / 4 and o.mean_accepted == (2 + 2 + 0 + 1) / 4
    assert abs(o.median_speedup - (6 / 2.5 + 3 / 2.2) / 2) < 1e-9
    # SpecDec++'s threshold with a perfect predictor: the survival drops at the first rejection
    perfect = lambda rows, hist: acc[rows].float().clamp(0.01, 0.99)  # noqa: E731
    t = replay(feats, perfect, costs, "h=0.5")
    assert (t.mean_candidates, t.mean_accepted) == (o.mean_candidates, o.mean_accepted)
    # greedy labels are the outcomes, so the auto rule fed them (the bound of any head) is the oracle
    feats["labels"] = acc.float()
    b = replay(feats, soft_label_scorer(feats), costs, "auto", mean_accept=float(acc.float().mean()))
    assert (b.mean_candidates, b.mean_accepted, b.median_speedup) == (o.mean_candidates, o.mean_accepted,
                                                                      o.median_speedup)
    # soft labels: a candidate the bound scores at 0.05 ends the round there; one it scores at 1 never does
    feats["labels"] = torch.tensor([1, 1, 0.05, 1, 1, 1, 0.05, 1, 1])
    s = replay(feats, soft_label_scorer(feats), costs, "auto", mean_accept=0.8)
    assert (s.mean_candidates, s.mean_accepted) == (o.mean_candidates, o.mean_accepted)


def test_save_load_round_trip(tmp_path):
    head = AcceptanceHead(24, 3, features=("token_prob", "recent_accept"), input_position="proposal",
                          decoding="greedy", draft_model="d", target_model="t", training={"rejection_weight": 6.0})
    head.set_feature_normalization(torch.tensor([0.4, 0.7]), torch.tensor([0.2, 0.1]))
    head.mean_accept = 0.8  # set after construction, saved all the same
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hidden_size"] == 24 and cfg["num_layers"] == 3 and cfg["draft_model"] == "d"
    assert cfg["mean_accept"] == 0.8 and cfg["features"] == ["token_prob", "recent_accept"]
    loaded = AcceptanceHead.from_pretrained(tmp_path)
    for (k1, v1), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert loaded.training_config == {"rejection_weight": 6.0} and loaded.input_position == "proposal"
    x, f = torch.randn(5, 24), torch.rand(5, 2)
    assert torch.equal(head(x, f), loaded(x, f))
    with pytest.raises(ValueError, match="another draft model"):
        loaded.check_draft(32)


def test_loading_a_missing_head_names_the_directory(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no acceptance head in"):
        AcceptanceHead.from_pretrained(tmp_path / "nothing")
    AcceptanceHead(8, 1).save_pretrained(tmp_path / "h")
    AcceptanceHead.from_pretrained(tmp_path / "h")
    assert capsys.readouterr().out == ""  # nothing but generated text belongs on stdout


def test_blocks_are_independent():
    head = AcceptanceHead(8, 3)
    ptrs = {b.linear.weight.data_ptr() for b in head.blocks}
    assert len(ptrs) == 3  # the official code's blocks share one module; ours do not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", ["hidden", "hidden+features", "features"])
def test_head_forward_equals_fused_op(dtype, inputs):
    torch.manual_seed(0)
    feats = () if inputs == "hidden" else ("token_prob", "margin", "entropy")
    head = AcceptanceHead(40, 3, features=feats, use_hidden=inputs != "features")
    if feats:  # a normalisation that is not the identity, folded into the op's feature weights
        head.set_feature_normalization(torch.tensor([0.5, 0.3, 2.0]), torch.tensor([0.2, 0.1, 1.5]))
    hidden = torch.randn(7, 40).to(dtype)
    probs = torch.softmax(torch.randn(7, 50) * 3, -1)
    tokens = probs.argmax(-1)
    f = head.features_of(probs, tokens)
    cum = torch.full((7,), 0.9)
    p, _ = ops.acceptance_head_step(hidden if head.use_hidden else None, f, *head.fused_weights(), cum, 1, 1, 20, 0.5)
    torch.testing.assert_close(p, head.predict(hidden.float(), f), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cum, 0.9 * p)


def test_dataset_round_trip(tmp_path, sample_data):
    sample_data.save(tmp_path / "d.safetensors")
    back = HeadDataset.load(tmp_path / "d.safetensors")
    for name in ("input_ids", "offsets", "response_start", "candidates", "accept_sample", "target_tokens", "take_target"):
        assert torch.equal(getattr(sample_data, name), getattr(back, name)), name
    assert torch.equal(sample_data.labels.isnan(), back.labels.isnan())
    assert back.meta["config"]["mix_ratio"] == 0.15 and back.meta["config"]["decoding"] == "sample"


@pytest.mark.parametrize("recipe", ["deployment", "paper"])
def test_pipeline_writes_head_metrics_and_plot(pair, tmp_path, recipe):
    target, draft = pair
    logs = []
    report = run_pipeline(target, draft, DigitTokenizer(), tiny_prompts(30, 32, seed=9), tmp_path, recipe=recipe,
                          data_cfg=HeadDataConfig(max_new_tokens=16, batch_size=12),
                          train_cfg=HeadTrainConfig(epochs=2, held_out_frac=0.3) if recipe == "paper" else
                          HeadTrainConfig(epochs=2, held_out_frac=0.3, features=CONFIDENCE_FEATURES),
                          eval_prompts=tiny_prompts(6, 32, seed=11), eval_max_new_tokens=12, progress=False,
                          log=logs.append)
    for f in ("config.json", "model.safetensors", "metrics.json", "calibration.png"):
        assert (tmp_path / f).exists(), f
    head = AcceptanceHead.from_pretrained(tmp_path)
    head.check_draft(draft.get_output_embeddings().weight.shape[1])
    assert head.input_position == ("proposal" if recipe == "deployment" else "candidate")
    assert head.draft_fingerprint == fingerprint(draft) and head.mean_accept is not None
    if recipe == "deployment":  # w chosen among the recipe's candidates by the validation replay
        assert [row["rejection_weight"] for row in report["selection"]] == [1.0, 2.0, 4.0]
        assert all("validation_replay" in row for row in report["selection"])
        assert head.decoding == "greedy"
    else:
        assert report["chosen_rejection_weight"] == 6.0 and head.decoding == "sample"
    for mode in ("greedy", "sample-T1"):
        ev = report["evaluation"][mode]
        assert {"head", "q_y", "q_margin", "constant"} <= set(ev) and ev["positions"] > 30
        if recipe == "deployment":  # proposal-position heads are replayed, beside the bound of any head
            assert ev["replay"]["label_bound_vs_best_fixed"] > 0
            if mode == "greedy":  # greedy labels are the outcomes: the bound is the oracle
                assert ev["replay"]["label_bound_vs_best_fixed"] == ev["replay"]["oracle_vs_best_fixed"]
    assert any("evaluation, greedy" in line for line in logs)


def test_data_generated_in_shards_and_merged_equal_the_whole_set(pair, tmp_path):
    """Shard i of n takes a contiguous share with each prompt's own seed; a later call without a shard merges
    complete shards into exactly the data set of an unsharded run."""
    from specdec_ext.training.head_data import shard_path, shard_range

    target, draft = pair
    prompts = tiny_prompts(11, 32, seed=5)
    cfg = HeadDataConfig(decoding="sample", max_new_tokens=10, batch_size=4, seed=2)
    whole = generate_head_data(target, draft, DigitTokenizer(), prompts, cfg, progress=False)
    path = tmp_path / "d.safetensors"
    assert [len(shard_range(11, i, 3)) for i in range(3)] == [3, 4, 4]
    for i in range(3):
        part = generate_head_data(target, draft, DigitTokenizer(), prompts, replace(cfg, batch_size=2), progress=False,
                                  path=path, shard=(i, 3))
        assert len(part) == len(shard_range(11, i, 3)) and shard_path(path, i, 3).exists()
    assert not path.exists()
    merged = generate_head_data(target, draft, DigitTokenizer(), prompts, cfg, progress=False, path=path,
                                log=lambda *a: None)
    assert merged.meta["merged_from"] == 3 and path.exists()
    for name in ("input_ids", "offsets", "response_start", "target_tokens", "candidates", "labels", "accept_sample",
                 "take_target"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)) or \
            torch.allclose(getattr(merged, name), getattr(whole, name), equal_nan=True), name
    # shards of other settings are not merged: a different seed generates afresh
    other = generate_head_data(target, draft, DigitTokenizer(), prompts, replace(cfg, seed=9), progress=False,
                               path=tmp_path / "e.safetensors")
    assert "merged_from" not in other.meta


def test_the_goodput_rules_thresholds_are_rate_times_marginal_ms():
    """GoodputRule.thresholds: entry [k - 1, b] is lambda_b marginal_ms(k) / c for k_min <= k < k_max, -inf elsewhere,
    float32 in the op's layout (a row per draft step), written into the columns of a kept buffer when given."""
    import math

    from specdec_ext.policies.goodput import GoodputRule
    from support import TEST_COSTS

    rule = GoodputRule(TEST_COSTS, 0.7, 8)
    rule.reset(3)
    rule.update(torch.tensor([2, 5, 0]), torch.tensor([1, 5, 0]))
    listed = GoodputRule(TEST_COSTS, 0.7, 8)
    listed.reset(3)
    listed.update([2, 5, 0], [1, 5, 0])  # lists, as the policy passes them: the same state
    assert listed.tokens == rule.tokens and listed.time == rule.time
    got = rule.thresholds(6, 2, 5)
    assert got.shape == (6, 3) and got.dtype == torch.float32
    for b in range(3):
        rate = rule.tokens[b] / rule.time[b]
        for k in range(1, 7):
            want = rate * TEST_COSTS.marginal_ms(k) if 2 <= k < 5 else -math.inf
            assert got[k - 1, b].item() == pytest.approx(want, rel=1e-6, abs=0)
    assert rule.thresholds(6, 2, 5) is not got and torch.equal(rule.thresholds(6, 2, 5), got)
    scaled = rule.thresholds(6, 2, 5, scale=2.0)  # the survivals' calibration c: stop once c S_k < lambda m_k
    assert torch.allclose(scaled[1:4], got[1:4] / 2.0, rtol=1e-6, atol=0)
    assert torch.equal(scaled[4:], got[4:]) and torch.equal(scaled[0], got[0])  # -inf where no stop
    buf = torch.full((8, 5), 7.0)  # a kept buffer: more steps and rows than this call's; only [:6, :3] written
    assert rule.thresholds(6, 2, 5, out=buf).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:6, :3], got) and bool((buf[6:] == 7.0).all()) and bool((buf[:, 3:] == 7.0).all())
    one = GoodputRule(TEST_COSTS, 0.7, 8)  # one row: a multiplication by a Python number, the same values
    one.reset(1)
    one.update([3], [2])
    col = torch.zeros(6, 1)
    one.thresholds(6, 2, 5, scale=1.5, out=col)
    rate = one.tokens[0] / (one.time[0] * 1.5)
    assert col[:, 0].tolist() == pytest.approx([rate * TEST_COSTS.marginal_ms(k) if 2 <= k < 5 else -math.inf
                                                for k in range(1, 7)], rel=1e-6)


def test_survival_calibration_follows_accepted_over_predicted_within_bounds():
    from specdec_ext.policies.goodput import SurvivalCalibration

    cal = SurvivalCalibration(decay=0.1, prior=5.0, lo=0.5, hi=2.0)
    assert cal.scale == 1.0
    for _ in range(200):  # a head that predicts 2 accepted candidates per round where 3 are accepted
        cal.update(2.0, 3.0)
    assert cal.scale == pytest.approx(1.5, rel=1e-6) and cal.rounds == 200
    for _ in range(200):  # then prompts where it predicts 4 and 1 is accepted: held at lo
        cal.update(4.0, 1.0)
    assert cal.scale == 0.5
    cal.reset()
    assert cal.scale == 1.0 and cal.rounds == 0
    for bad in (dict(decay=0.0), dict(decay=1.5), dict(prior=0.0), dict(lo=1.2), dict(hi=0.9), dict(lo=0.0)):
        with pytest.raises(ValueError, match="SurvivalCalibration: "):
            SurvivalCalibration(**bad)
