"""Recipe that trains the bundled target/draft pair on the standard-library corpus.

Stages, each resumable from its last checkpoint under ``work_dir`` and skipped when its output exists:

1. corpus: byte-level BPE tokenizer (8,192 entries) and tokenized train / held-out streams;
2. target: ``LlamaForCausalLM`` 8 layers x 512 (about 29.5M parameters), next-token cross-entropy,
   bf16 autocast, AdamW, linear warm-up then cosine decay;
3. draft: ``LlamaForCausalLM`` 2 layers x 256, distilled from the target's logits with forward
   KL(p_target || q_draft) at temperature 1;
4. heads: the SpecDec++ acceptance heads (``HEADS``: greedy and temperature-1 heads of this project's
   deployment recipe, and one of the paper's recipe), trained with the same pipeline as
   ``specdec train-head`` on every function header of the corpus's training split (HumanEval is kept
   for evaluation).

The finished models are written in bf16 safetensors (with the tokenizer) to ``out_dir/target`` and
``out_dir/draft``; ``out_dir/zoo_meta.json`` records parameters, tokens seen, wall time and held-out loss.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..corpus import build_corpus
from .store import has_unpacked, pack_weights, pair_dir


@dataclass
class StageConfig:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float = 0.1
    ckpt_every: int = 100
    restart_at: int = 0       # > 0: the first cosine phase ends here and a second one (a warm restart,
    restart_lr: float = 0.0   # Loshchilov & Hutter 2017) warms up to restart_lr and decays to min_lr at `steps`


@dataclass
class ZooConfig:
    seed: int = 0
    vocab_size: int = 8192
    target: StageConfig = field(
        default_factory=lambda: StageConfig(8, 512, 1376, 8, steps=1700, batch_size=8, seq_len=512, lr=1.5e-3, min_lr=1e-4, warmup=100)
    )
    draft: StageConfig = field(
        default_factory=lambda: StageConfig(2, 256, 704, 4, steps=2200, batch_size=8, seq_len=512, lr=3e-3, min_lr=1e-4,
                                            warmup=50, restart_at=900, restart_lr=1.5e-3)
    )


def make_config(stage: StageConfig, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=stage.hidden,
        intermediate_size=stage.intermediate,
        num_hidden_layers=stage.layers,
        num_attention_heads=stage.heads,
        num_key_value_heads=stage.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, s: StageConfig) -> float:
    """Linear warm-up then cosine decay to ``min_lr``; with ``restart_at`` two such phases
    (peak ``lr`` until ``restart_at``, then peak ``restart_lr`` until ``steps``)."""
    start, end, peak = 0, s.steps, s.lr
    if s.restart_at:
        if step < s.restart_at:
            end = s.restart_at
        else:
            start, peak = s.restart_at, s.restart_lr
    t = step - start
    if t < s.warmup:
        return peak * (t + 1) / s.warmup
    frac = min(1.0, (t - s.warmup) / max(1, end - start - s.warmup))
    return s.min_lr + 0.5 * (peak - s.min_lr) * (1 + math.cos(math.pi * frac))


def sample_batch(stream: np.ndarray, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.size - seq_len - 1, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1].astype(np.int64) for s in starts]))


@torch.inference_mode()
def held_out_loss(model, stream: np.ndarray, seq_len: int, windows: int = 48) -> float:
    """Mean next-token cross-entropy (nats/token) over fixed, evenly spaced held-out windows."""
    model.eval()
    starts = np.linspace(0, stream.size - seq_len - 2, windows).astype(np.int64)
    total = 0.0
    for i in range(0, windows, 8):
        x = torch.from_numpy(np.stack([stream[s : s + seq_len + 1].astype(np.int64) for s in starts[i : i + 8]]))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return total / (windows * seq_len)


def _train_stage(name: str, stage: StageConfig, model, stream, held_out, work_dir: Path, seed: int, teacher=None, log=print):
    """Train ``model`` (optionally distilling from ``teacher``) with checkpoint/resume. Returns a stats dict."""
    ckpt_path = work_dir / f"{name}.ckpt.pt"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": stage.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=stage.lr, betas=(0.9, 0.95), fused=False,
    )
    gen = torch.Generator().manual_seed(seed)
    step, elapsed = 0, 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, elapsed = ck["step"], ck["elapsed"]
        log(f"[{name}] resumed at step {step} ({elapsed / 60:.1f} min so far)")
    model.train()
    t0 = time.time() - elapsed
    ema = None
    while step < stage.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, stage)
        x = sample_batch(stream, stage.batch_size, stage.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(x[:, :-1]).logits.float(), -1)
                loss = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="none").sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 20 == 0:
            el = time.time() - t0
            tok_s = step * stage.batch_size * stage.seq_len / el
            log(f"[{name}] step {step}/{stage.steps} loss {ema:.3f} lr {lr_at(step, stage):.2e} {tok_s:.0f} tok/s {el / 60:.1f} min")
        if step % stage.ckpt_every == 0 or step == stage.steps:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                        "elapsed": time.time() - t0}, tmp)
            tmp.replace(ckpt_path)
    el = time.time() - t0
    return {"steps": step, "tokens": step * stage.batch_size * stage.seq_len, "train_minutes": el / 60,
            "held_out_loss": held_out_loss(model, held_out, stage.seq_len)}


def _save(model, tok_dir: Path, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)


def _stage_due(out_dir: Path, meta: dict, name: str, stage: StageConfig) -> bool:
    """A stage runs when its model is missing, or was saved after fewer steps than the recipe asks
    for (it then resumes from its checkpoint in the work directory and trains on)."""
    if not (out_dir / name / "config.json").exists():
        return True
    return int(meta.get(name, {}).get("steps", stage.steps)) < stage.steps


def train_pair(out_dir: Path, work_dir: Path, cfg: ZooConfig | None = None, log=print) -> dict:
    """Run every stage; returns the metadata written to ``out_dir/zoo_meta.json``."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg = cfg or ZooConfig()
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    corpus = build_corpus(work_dir, cfg.vocab_size)
    log(f"[corpus] {json.dumps(corpus)}")
    tok = AutoTokenizer.from_pretrained(work_dir / "tokenizer")
    train = np.load(work_dir / "train.npy")
    held = np.load(work_dir / "held_out.npy")
    meta_path = out_dir / "zoo_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"corpus": corpus}

    meta["config"] = asdict(cfg)
    if _stage_due(out_dir, meta, "target", cfg.target):
        torch.manual_seed(cfg.seed)
        target = LlamaForCausalLM(make_config(cfg.target, len(tok), tok.eos_token_id))
        stats = _train_stage("target", cfg.target, target, train, held, work_dir, cfg.seed, log=log)
        stats["params"] = sum(p.numel() for p in target.parameters())
        meta["target"] = stats
        _save(target, work_dir / "tokenizer", out_dir / "target")
        meta_path.write_text(json.dumps(meta, indent=2))
        log(f"[target] {stats}")
    target = LlamaForCausalLM.from_pretrained(pair_dir(out_dir) / "target", dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)

    if _stage_due(out_dir, meta, "draft", cfg.draft):
        torch.manual_seed(cfg.seed + 1)
        draft = LlamaForCausalLM(make_config(cfg.draft, len(tok), tok.eos_token_id))
        stats = _train_stage("draft", cfg.draft, draft, train, held, work_dir, cfg.seed + 1, teacher=target, log=log)
        stats["params"] = sum(p.numel() for p in draft.parameters())
        meta["draft"] = stats
        _save(draft, work_dir / "tokenizer", out_dir / "draft")
        meta_path.write_text(json.dumps(meta, indent=2))
        log(f"[draft] {stats}")
        # the heads and their data sets were made with the old draft's q and hidden states
        shutil.rmtree(out_dir / "heads", ignore_errors=True)
        shutil.rmtree(work_dir / "heads", ignore_errors=True)
    meta.setdefault("heads", {})
    for name in HEADS:
        if not (out_dir / "heads" / name / "config.json").exists():
            meta["heads"][name] = train_pair_head(out_dir, work_dir, name, cfg.seed, log=log)
            meta_path.write_text(json.dumps(meta, indent=2))
    meta["recipe_wall_minutes_this_run"] = (time.time() - t_start) / 60
    meta_path.write_text(json.dumps(meta, indent=2))
    if has_unpacked(out_dir):  # the weights as the repository stores them: xz, with their sha256 in zoo_meta.json
        meta["weights"] = pack_weights(out_dir, log=log)
    return meta


# the bundled heads: name -> (recipe, decoding); all trained on every function header of the corpus's
# training split, evaluated on HumanEval (never trained or selected on)
HEADS = {"greedy": ("deployment", "greedy"), "sample": ("deployment", "sample"), "paper": ("paper", "sample")}


def train_pair_head(out_dir: Path, work_dir: Path, name: str, seed: int = 0, num_prompts: Optional[int] = None,
                    log=print) -> dict:
    """Stage 4: acceptance head ``name`` of ``HEADS`` for the pair in ``out_dir`` (written to
    ``out_dir/heads/<name>``); its data sets are kept (and resumed) in ``work_dir/heads`` so a head can be
    retrained without the target, and the sampling and paper heads share one temperature-1 data set."""
    from ..prompts import load_prompts
    from ..training.head_data import HeadDataConfig
    from ..training.head_train import HeadTrainConfig
    from ..training.pipeline import RECIPES, run_pipeline
    from . import load_models

    recipe, decoding = HEADS[name]
    root = pair_dir(out_dir)
    pair = load_models(root / "target", root / "draft")
    prompts = load_prompts("stdlib-train", limit=num_prompts)
    t0 = time.time()
    report = run_pipeline(pair.target, pair.draft, pair.tokenizer, prompts, out_dir / "heads" / name, recipe=recipe,
                          data_cfg=HeadDataConfig(decoding=decoding, seed=seed),
                          train_cfg=HeadTrainConfig(features=RECIPES[recipe]["features"], seed=seed),
                          eval_prompts=load_prompts("humaneval"), work_dir=work_dir / "heads",
                          target_name="specdec_ext/zoo target", draft_name="specdec_ext/zoo draft", log=log)
    return {"recipe": recipe, "decoding": decoding, "validation": report["held_out"],
            "chosen_rejection_weight": report["chosen_rejection_weight"],
            "evaluation": {m: {k: r[k] for k in ("head", "q_y", "q_margin") if k in r}
                           for m, r in report.get("evaluation", {}).items()},
            "minutes": (time.time() - t0) / 60, "prompts": len(prompts)}


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Train the bundled target/draft pair on the standard library.")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "pair")
    ap.add_argument("--work-dir", type=Path, default=Path(".zoo_work"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_pair(args.out, args.work_dir, ZooConfig(seed=args.seed))


if __name__ == "__main__":
    main()
