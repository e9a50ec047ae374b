"""Measure the bundled pair: sizes and training (from ``zoo_meta.json``), single-token decode time
of target and draft, and the draft's greedy agreement with the target on HumanEval prompts.

Greedy agreement: for each prompt the target decodes greedily; along prompt + that continuation,
the fraction of continuation positions where the draft's argmax equals the target's (teacher
forcing), and the expected acceptance sum_x min(p(x), q(x)) at temperature 1 at the same positions.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from . import PAIR_DIR, load_pair


def decode_ms(backend_factory, context: int = 256, vocab: int = 8192, repeats: int = 60) -> float:
    """Median ms of one single-token forward with a ``context``-token KV cache, through the backend
    ``backend_factory()`` makes (``engine/backends.py``)."""
    b = backend_factory()
    b.start(1, context + 1)
    b.append([0], [torch.randint(0, vocab, (context,)).tolist()], [0])
    one = torch.tensor([1], device=b.device)
    ts = []
    for _ in range(repeats):
        x = torch.randint(0, vocab, (1, 1), device=b.device)
        t0 = time.perf_counter()
        b.forward(x, 1, context + 1)
        ts.append(time.perf_counter() - t0)
        b.rollback(one)
    b.close()
    return 1e3 * statistics.median(ts)


@torch.inference_mode()
def greedy_agreement(pair, prompts: list[str], new_tokens: int = 64) -> dict:
    from ..engine import SpeculativeGenerator

    plain = SpeculativeGenerator(pair.target, policy="autoregressive")
    agree = total = 0
    accept = 0.0
    for text in prompts:
        ids = torch.tensor([pair.tokenizer(text, add_special_tokens=False)["input_ids"]])
        cont = plain.generate(ids, max_new_tokens=new_tokens, temperature=0).new_tokens[0]
        seq = torch.cat([ids, torch.tensor([cont])], 1)
        P = ids.shape[1]
        tl = pair.target(seq).logits[0, P - 1 : P - 1 + len(cont)].float()
        dl = pair.draft(seq).logits[0, P - 1 : P - 1 + len(cont)].float()
        agree += int((tl.argmax(-1) == dl.argmax(-1)).sum())
        accept += float(torch.minimum(tl.softmax(-1), dl.softmax(-1)).sum(-1).sum())
        total += len(cont)
    return {"positions": total, "greedy_agreement": agree / total, "expected_acceptance_T1": accept / total,
            "prompts": len(prompts), "new_tokens": new_tokens}


def pair_report(num_prompts: int = 40, path: Path = PAIR_DIR) -> dict:
    from ..prompts import load_prompts
    from ..engine.backends import HFBackend, LeanBackend

    pair = load_pair(target_dtype=torch.float32, path=path)
    meta = json.loads((path / "zoo_meta.json").read_text()) if (path / "zoo_meta.json").exists() else {}
    V = pair.target.config.vocab_size
    t_ms = decode_ms(lambda: HFBackend(pair.target, "target"), vocab=V)
    d_ms = decode_ms(lambda: HFBackend(pair.draft, "draft"), vocab=V)
    f_ms = decode_ms(lambda: LeanBackend(pair.draft, "draft"), vocab=V)
    out = {
        "target_params": sum(p.numel() for p in pair.target.parameters()),
        "draft_params": sum(p.numel() for p in pair.draft.parameters()),
        "training": {k: meta.get(k) for k in ("target", "draft", "heads", "corpus", "notes")},
        "decode_ms_target": t_ms, "decode_ms_draft_transformers": d_ms, "decode_ms_draft_fast": f_ms,
        "decode_ratio_transformers": t_ms / d_ms, "decode_ratio_fast": t_ms / f_ms,
        "humaneval": greedy_agreement(pair, load_prompts("humaneval", limit=num_prompts)),
        "threads": torch.get_num_threads(),
    }
    out["heads"] = {}
    for name in sorted(pair.heads):
        m = path / "heads" / name / "metrics.json"
        if m.exists():
            met = json.loads(m.read_text())
            out["heads"][name] = {"validation": met["held_out"], "evaluation": met.get("evaluation", {})}
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    out["shipped_megabytes"] = size / 2**20
    return out


def format_report(r: dict) -> str:
    t, d = r["training"].get("target") or {}, r["training"].get("draft") or {}
    he = r["humaneval"]
    lines = [
        "| | target | draft |", "|---|---|---|",
        f"| parameters | {r['target_params'] / 1e6:.1f}M | {r['draft_params'] / 1e6:.1f}M |",
        f"| tokens trained | {t.get('tokens', 0) / 1e6:.1f}M | {d.get('tokens', 0) / 1e6:.1f}M (distilled) |",
        f"| training time | {t.get('train_minutes', 0):.0f} min | {d.get('train_minutes', 0):.0f} min |",
        f"| held-out loss (nats/token) | {t.get('held_out_loss', float('nan')):.3f} | {d.get('held_out_loss', float('nan')):.3f} |",
        f"| single-token decode, 256-token cache (ms) | {r['decode_ms_target']:.2f} | "
        f"{r['decode_ms_draft_transformers']:.2f} (transformers), {r['decode_ms_draft_fast']:.2f} (lean model) |",
        "",
        f"- decode-time ratio target/draft: {r['decode_ratio_transformers']:.1f}× with transformers' forward for both, "
        f"{r['decode_ratio_fast']:.1f}× with the lean draft model",
        f"- draft's greedy agreement with the target on {he['prompts']} HumanEval prompts ({he['positions']} positions): "
        f"{he['greedy_agreement']:.3f} per token; expected acceptance Σ min(p, q) at T = 1: {he['expected_acceptance_T1']:.3f}",
        f"- shipped size: {r['shipped_megabytes']:.1f} MB",
    ]
    for name, h in r.get("heads", {}).items():
        for mode, ev in h["evaluation"].items():
            lines.append(f"- head `{name}` on HumanEval ({mode}, {ev['positions']} positions): ROC AUC "
                         f"{ev['head']['roc_auc']:.3f} (q(y) {ev['q_y']['roc_auc']:.3f}, margin "
                         f"{ev['q_margin']['roc_auc']:.3f}), Brier {ev['head']['brier']:.3f} "
                         f"(q(y) {ev['q_y']['brier']:.3f}, margin {ev['q_margin']['brier']:.3f})")
    return "\n".join(lines)
