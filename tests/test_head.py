"""Acceptance head: labels, token mixing, loss, training signal, checkpoints, fused-op agreement."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdec_ext import AcceptanceHead, ops
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.head.data import HeadDataConfig, HeadDataset, draft_features, generate_head_data, soft_labels
from specdec_ext.head.pipeline import run_pipeline
from specdec_ext.head.train import HeadTrainConfig, binary_kl, evaluate, roc_auc, train_head, weighted_bce
from models import make_pair


class DigitTokenizer:
    """Text of space-separated integers <-> ids; enough of a tokenizer for the data pipeline."""

    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}


def tiny_prompts(n, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g))
            for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", vocab=32, noise=0.6)


@pytest.fixture(scope="module")
def dataset(pair):
    target, draft = pair
    cfg = HeadDataConfig(max_new_tokens=40, mix_ratio=0.15, batch_size=16, seed=3)
    return generate_head_data(target, draft, DigitTokenizer(), tiny_prompts(160, 32), cfg, progress=False)


def test_soft_labels_equal_min_one_p_over_q():
    g = torch.Generator().manual_seed(0)
    t, d = torch.randn(50, 20, generator=g) * 2, torch.randn(50, 20, generator=g) * 2
    cfg = SamplingConfig(0.8)
    y, lab = soft_labels(t, d, None, cfg, torch.Generator().manual_seed(1))
    p = torch.softmax(t.double() / 0.8, -1)
    q = torch.softmax(d.double() / 0.8, -1)
    want = torch.minimum(torch.ones(50, dtype=torch.float64), p[torch.arange(50), y] / q[torch.arange(50), y])
    torch.testing.assert_close(lab.double(), want, rtol=1e-5, atol=1e-6)


def test_dataset_labels_recomputed_independently(pair, dataset):
    """Labels at counted positions equal min(1, p/q) recomputed from the stored tokens and fresh forwards."""
    target, draft = pair
    checked = 0
    for e in range(5):
        sl = dataset.example(e)
        ids, x = dataset.input_ids[sl], dataset.target_tokens[sl]
        P = int(dataset.response_start[e])
        seq = torch.cat([ids[:P], x[P:]]).unsqueeze(0)  # prompt + the target's response X
        with torch.no_grad():
            p = torch.softmax(target(seq).logits[0].double(), -1)
            q = torch.softmax(draft(seq).logits[0].double(), -1)
        for i in range(P, ids.numel()):
            if dataset.counted[sl][i]:
                y = int(ids[i])  # Z_i = Y_i at counted positions
                want = min(1.0, float(p[i - 1, y] / q[i - 1, y]))
                assert abs(float(dataset.labels[sl][i]) - want) < 1e-4
                checked += 1
    assert checked > 20


def test_mixing_ratio_is_respected(dataset):
    resp = dataset.target_tokens >= 0
    z, x, counted = dataset.input_ids[resp], dataset.target_tokens[resp], dataset.counted[resp]
    took_x = ~counted                  # Z = X and X != Y
    took_y_differs = counted & (z != x)  # Z = Y and Y != X
    n = int(took_x.sum() + took_y_differs.sum())  # positions with X != Y
    frac = float(took_x.sum()) / n
    sigma = math.sqrt(0.15 * 0.85 / n)
    assert n > 500 and abs(frac - 0.15) < 5 * sigma, (frac, n)


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


def test_trained_head_beats_constant_predictor(pair, dataset):
    _, draft = pair
    feats = draft_features(draft, dataset, progress=False)
    head, report = train_head(feats, HeadTrainConfig(epochs=40, batch_size=256, lr=3e-3, held_out_frac=0.2, seed=0),
                              progress=False)
    ho = report["held_out"]
    assert ho["positions"] > 200
    assert ho["head"]["roc_auc"] > ho["constant"]["roc_auc"] + 0.05, ho
    assert report["history"][-1]["train_loss"] < report["history"][0]["train_loss"]


def test_unweighted_head_is_better_calibrated_than_constant(pair, dataset):
    """With w = 6 the loss's optimum is y / (y + 6 (1 - y)), deliberately below the label; with w = 1
    the head estimates the label itself and must beat the constant on KL and Brier score."""
    _, draft = pair
    feats = draft_features(draft, dataset, progress=False)
    _, report = train_head(feats, HeadTrainConfig(epochs=40, batch_size=256, lr=3e-3, held_out_frac=0.2,
                                                  rejection_weight=1.0, seed=0), progress=False)
    ho = report["held_out"]
    assert ho["head"]["binary_kl"] < ho["constant"]["binary_kl"], ho
    assert ho["head"]["brier"] < ho["constant"]["brier"], ho


def test_training_is_reproducible(pair, dataset):
    _, draft = pair
    feats = draft_features(draft, dataset, progress=False)
    cfg = HeadTrainConfig(epochs=2, batch_size=256, seed=5)
    h1, _ = train_head(feats, cfg, progress=False)
    h2, _ = train_head(feats, cfg, progress=False)
    for a, b in zip(h1.state_dict().values(), h2.state_dict().values()):
        assert torch.equal(a, b)


def test_save_load_round_trip(tmp_path):
    head = AcceptanceHead(24, 3, draft_model="d", target_model="t", training={"rejection_weight": 6.0})
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hidden_size"] == 24 and cfg["num_layers"] == 3 and cfg["draft_model"] == "d"
    loaded = AcceptanceHead.from_pretrained(tmp_path)
    for (k1, v1), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert loaded.training_config == {"rejection_weight": 6.0}
    x = torch.randn(5, 24)
    assert torch.equal(head(x), loaded(x))
    with pytest.raises(ValueError, match="another draft model"):
        loaded.check_draft(32)


def test_blocks_are_independent():
    head = AcceptanceHead(8, 3)
    ptrs = {b.linear.weight.data_ptr() for b in head.blocks}
    assert len(ptrs) == 3  # the official code's blocks share one module; ours do not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_forward_equals_fused_op(dtype):
    torch.manual_seed(0)
    head = AcceptanceHead(40, 3)
    hidden = torch.randn(7, 40).to(dtype)
    w, b, ow, ob = head.fused_weights()
    cum = torch.full((7,), 0.9)
    p, _ = ops.acceptance_head_step(hidden, w, b, ow, ob, cum, 1, 1, 20, 0.5)
    torch.testing.assert_close(p, head.predict(hidden.float()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cum, 0.9 * p)


def test_dataset_round_trip(tmp_path, dataset):
    dataset.save(tmp_path / "d.safetensors")
    back = HeadDataset.load(tmp_path / "d.safetensors")
    for name in ("input_ids", "offsets", "response_start", "counted", "accept_sample", "target_tokens"):
        assert torch.equal(getattr(dataset, name), getattr(back, name)), name
    assert torch.equal(dataset.labels.isnan(), back.labels.isnan())
    assert back.meta["config"]["mix_ratio"] == 0.15


def test_pipeline_writes_head_metrics_and_plot(pair, tmp_path):
    target, draft = pair
    report = run_pipeline(target, draft, DigitTokenizer(), tiny_prompts(24, 32, seed=9), tmp_path,
                          HeadDataConfig(max_new_tokens=16, batch_size=12), HeadTrainConfig(epochs=2),
                          progress=False, log=lambda *a: None)
    for f in ("config.json", "model.safetensors", "metrics.json", "calibration.png", "head_data.safetensors"):
        assert (tmp_path / f).exists(), f
    assert "roc_auc" in report["held_out"]["head"]
    head = AcceptanceHead.from_pretrained(tmp_path)
    head.check_draft(draft.get_output_embeddings().weight.shape[1])
