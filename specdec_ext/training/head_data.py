"""Training data for the acceptance head, in two recipes that share one data set format.

For each prompt the target writes a response X (greedy, or sampled at the data set's temperature /
top-k / top-p), and at every response position i the draft proposes a candidate Y_i from its
distribution q_i at context prompt + X_<i, with a label for that candidate:

* decoding ``"greedy"``: Y_i = argmax q_i, label 1 iff Y_i equals the target's argmax at i. These are
  exactly the contexts speculative greedy decoding tests: a candidate's acceptance matters only when
  every candidate before it was accepted, i.e. when its context is a prefix of the target's output.
* decoding ``"sample"``: Y_i ~ q_i, soft label min(1, p_i(Y_i) / q_i(Y_i)) with p and q the *processed*
  distributions (temperature, top-k, top-p), the probability that rejection sampling accepts Y_i
  (Leviathan et al. 2023, Alg. 1). The contexts are the target's samples; in a speculative round a
  candidate's context ends in accepted candidates, distributed as min(p, q) / beta rather than p:
  close, not exact.

How the head reads this (``AcceptanceHead.input_position``) is decided at feature time
(``training/head_features.py``):

* recipe ``"deployment"`` (this project's): the draft state at the proposal position (P + i - 1) and
  the confidence features of (q_i, Y_i), at every response position;
* recipe ``"paper"`` (SpecDec++ Sec. 4): sampled data at temperature 1; the head's input sequence mixes
  tokens, Z_i = X_i with probability r (``mix_ratio``, paper 0.15) and Y_i otherwise; the loss counts
  the positions where Z_i = Y_i, where the head reads the draft state after Z_i ("candidate" position).

A data set is one safetensors file (flat tensors with per-example offsets) whose metadata records the
models and settings that made it. Generation is resumable: a partial file is written every few
batches and extended on the next run with the same settings; prompt j always gets seed
``seed * 1_000_003 + j``, so batching and restarts do not change its data, and neither does generating
it in shards (``shard=(i, n)``: a contiguous share of the prompts each) that are merged afterwards.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..engine import SpeculativeGenerator
from ..engine.models import fingerprint, hidden_size, model_name
from ..engine.sampling import SamplingConfig, process_logits
from ..engine.runner import model_device
from ..prompts import encode_prompt

DECODING = ("greedy", "sample")


@dataclass
class HeadDataConfig:
    decoding: str = "greedy"          # "greedy" or "sample"
    temperature: float = 1.0          # sampling temperature (decoding == "sample")
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    max_new_tokens: int = 128         # response length limit
    mix_ratio: float = 0.15           # r of the paper recipe: probability that Z_i is the target's token X_i
    max_prompt_tokens: int = 384      # prompts are truncated on the left to this many tokens
    batch_size: int = 8               # prompts per generation batch
    seed: int = 0
    chat: bool = False                # prompts go through the tokenizer's chat template (as at run time)

    def __post_init__(self):
        if self.decoding not in DECODING:
            raise ValueError(f"decoding must be one of {DECODING}, got {self.decoding!r}")
        if not 0.0 <= self.mix_ratio < 1.0:
            raise ValueError(f"mix_ratio r must lie in [0, 1), got {self.mix_ratio}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")
        if self.decoding == "sample":
            SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(0.0) if self.decoding == "greedy" else SamplingConfig(self.temperature, self.top_k,
                                                                                      self.top_p)


@dataclass
class HeadDataset:
    """Flat storage; example e spans ``input_ids[offsets[e]:offsets[e+1]]`` (prompt + target response X).

    response_start: [E] index of X_1 in each example. At response positions (elsewhere -1 / NaN / False):
    target_tokens: X; candidates: the draft's candidate Y; labels: float32 label of Y (1/0 greedy,
    min(1, p/q) sampled); accept_sample: one sampled accept/reject outcome (u < label; greedy: the label);
    take_target: the paper recipe's mixing, True where Z_i = X_i. meta: models and settings.
    """

    input_ids: torch.Tensor
    offsets: torch.Tensor
    response_start: torch.Tensor
    target_tokens: torch.Tensor
    candidates: torch.Tensor
    labels: torch.Tensor
    accept_sample: torch.Tensor
    take_target: torch.Tensor
    meta: dict

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def example(self, e: int) -> slice:
        return slice(int(self.offsets[e]), int(self.offsets[e + 1]))

    @property
    def config(self) -> HeadDataConfig:
        return HeadDataConfig(**self.meta["config"])

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"input_ids": self.input_ids.to(torch.int32), "offsets": self.offsets,
                   "response_start": self.response_start, "target_tokens": self.target_tokens.to(torch.int32),
                   "candidates": self.candidates.to(torch.int32), "labels": self.labels,
                   "accept_sample": self.accept_sample.to(torch.uint8), "take_target": self.take_target.to(torch.uint8)},
                  str(tmp), metadata={"specdec_ext": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "HeadDataset":
        t = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("specdec_ext", "{}"))
        if "candidates" not in t:
            raise ValueError(f"{path}: a head data set of an older format (no candidates); generate it again")
        return cls(t["input_ids"].long(), t["offsets"], t["response_start"], t["target_tokens"].long(),
                   t["candidates"].long(), t["labels"], t["accept_sample"].bool(), t["take_target"].bool(), meta)

    @classmethod
    def concat(cls, parts: Sequence["HeadDataset"], meta: dict) -> "HeadDataset":
        offsets, base = [torch.zeros(1, dtype=torch.int64)], 0
        for d in parts:
            offsets.append(d.offsets[1:] + base)
            base += int(d.offsets[-1])
        cat = lambda name: torch.cat([getattr(d, name) for d in parts])  # noqa: E731
        return cls(cat("input_ids"), torch.cat(offsets), cat("response_start"), cat("target_tokens"), cat("candidates"),
                   cat("labels"), cat("accept_sample"), cat("take_target"), meta)


@torch.inference_mode()
def label_response(target_logits: torch.Tensor, draft_logits: torch.Tensor, cfg: HeadDataConfig,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits ``[n, V]`` of both models at the n response positions: candidates Y ``[n]``, labels ``[n]``
    and sampled outcomes ``[n]`` (see the module docstring)."""
    if cfg.decoding == "greedy":
        y = draft_logits.argmax(-1)
        lab = (y == target_logits.argmax(-1)).float()
        return y, lab, lab.bool()
    p = process_logits(target_logits, cfg.sampling)
    q = process_logits(draft_logits, cfg.sampling)
    y = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    py = p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    qy = q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    lab = torch.clamp(py / qy, max=1.0)
    return y, lab, torch.rand(lab.shape, generator=gen) < lab


def _settings(cfg: HeadDataConfig, target, draft, prompts: Sequence[str]) -> dict:
    import hashlib

    digest = hashlib.sha1("\x00".join(prompts).encode()).hexdigest()[:16]
    return {"config": asdict(cfg), "target_model": model_name(target), "draft_model": model_name(draft),
            "draft_fingerprint": fingerprint(draft), "num_prompts": len(prompts), "prompts_sha1": digest,
            "draft_hidden_size": hidden_size(draft)}


def shard_range(num_prompts: int, shard: int, num_shards: int) -> range:
    """The contiguous share of prompts of shard ``shard`` of ``num_shards`` (0-based)."""
    if not (num_shards >= 1 and 0 <= shard < num_shards):
        raise ValueError(f"shard must be I/N with 0 <= I < N, got {shard}/{num_shards}")
    return range(shard * num_prompts // num_shards, (shard + 1) * num_prompts // num_shards)


def shard_path(path: str | Path, shard: int, num_shards: int) -> Path:
    """Where shard ``shard`` of ``num_shards`` of the data set ``path`` is written."""
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{shard}-of-{num_shards}{path.suffix}")


def _without_batch_size(settings: dict) -> dict:
    """Settings that decide the data (the batch size does not: rows are independent)."""
    cfg = settings.get("config")
    return dict(settings, config={k: v for k, v in cfg.items() if k != "batch_size"}) if isinstance(cfg, dict) else settings


def merge_shards(path: str | Path, settings: dict, log: Optional[Callable[[str], None]] = None) -> Optional[HeadDataset]:
    """Join complete shards of the data set ``path`` made with ``settings`` (in prompt order) and save the
    result to ``path``; None when no complete set of shards with those settings exists."""
    path = Path(path)
    for cand in sorted(path.parent.glob(f"{path.stem}.shard-0-of-*{path.suffix}")):
        n = int(cand.stem.rsplit("-of-", 1)[1])
        files = [shard_path(path, i, n) for i in range(n)]
        if not all(f.exists() for f in files):
            continue
        parts = [HeadDataset.load(f) for f in files]
        ok = all(_without_batch_size({k: d.meta.get(k) for k in settings}) == _without_batch_size(settings)
                 and d.meta.get("shard") == [i, n]
                 and d.meta.get("prompts_done") == len(shard_range(settings["num_prompts"], i, n))
                 for i, d in enumerate(parts))
        if not ok:
            continue
        meta = dict(settings, prompts_done=settings["num_prompts"], merged_from=n,
                    created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        data = HeadDataset.concat(parts, meta)
        data.save(path)
        if log is not None:
            log(f"[train-head] merged {n} shards into {path}")
        return data
    return None


@torch.inference_mode()
def generate_head_data(target, draft, tokenizer, prompts: Sequence[str], cfg: Optional[HeadDataConfig] = None,
                       progress: bool = True, path: Optional[str | Path] = None, save_every: int = 10,
                       log: Optional[Callable[[str], None]] = None,
                       shard: Optional[tuple[int, int]] = None) -> HeadDataset:
    """Build (or, with ``path`` holding a partial data set of the same settings, resume) the head's data
    set for ``prompts``; saved to ``path`` every ``save_every`` batches and at the end.

    ``shard=(i, n)``: only shard i of n (a contiguous share of ``prompts``, each prompt with the seed it
    has in the whole set), written to :func:`shard_path`; run the n shards anywhere (``torchrun``, other
    machines), then a call without ``shard`` and the same ``path`` merges complete shards into the data set
    an unsharded run would have made."""
    cfg = cfg or HeadDataConfig()
    if len(prompts) == 0:
        raise ValueError("prompts is empty: the head's training data needs at least one prompt")
    settings = _settings(cfg, target, draft, prompts)
    share = range(len(prompts))
    if shard is not None:
        share = shard_range(len(prompts), *shard)
        settings["shard"] = [shard[0], shard[1]]
        path = shard_path(path, *shard) if path is not None else None
    elif path is not None and not Path(path).exists():
        merged = merge_shards(path, settings, log)
        if merged is not None:
            return merged
    lo, todo = share.start, [prompts[j] for j in share]
    parts: list[HeadDataset] = []
    done = 0
    if path is not None and Path(path).exists():
        old = HeadDataset.load(path)
        old_settings = {k: old.meta.get(k) for k in settings}
        if isinstance(old_settings.get("config"), dict):  # settings added since: their defaults
            old_settings["config"] = {**asdict(HeadDataConfig()), **old_settings["config"]}
        same = old_settings == settings
        if same:
            parts, done = [old], int(old.meta.get("prompts_done", old.meta["num_prompts"]))
            if log is not None and done < len(todo):
                log(f"[train-head] resuming the data set in {path}: {done} of {len(todo)} prompts done")
        elif log is not None:
            log(f"[train-head] {path} was made with other settings or prompts: generating it again")
    if done >= len(todo):
        return parts[0]
    # any lossless method writes the target's responses; fixed K = 4 is a fast one
    responder = SpeculativeGenerator(target, draft, policy="fixed", k=4)
    eos = tokenizer.eos_token_id
    pad = eos if eos is not None else 0
    dev_t = model_device(target)
    dev_d = model_device(draft)
    rows: dict[str, list] = {k: [] for k in ("ids", "starts", "x", "y", "lab", "acc", "take")}
    t0 = time.time()

    def snapshot(n_done: int) -> HeadDataset:
        meta = dict(settings, prompts_done=n_done, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if not rows["ids"]:
            new = None
        else:
            lengths = [t.numel() for t in rows["ids"]]
            new = HeadDataset(torch.cat(rows["ids"]), torch.tensor([0] + lengths).cumsum(0), torch.tensor(rows["starts"]),
                              torch.cat(rows["x"]), torch.cat(rows["y"]), torch.cat(rows["lab"]), torch.cat(rows["acc"]),
                              torch.cat(rows["take"]), meta)
        pieces = parts + ([new] if new is not None else [])
        if not pieces:
            raise ValueError("the target produced no response tokens for any prompt")
        return HeadDataset.concat(pieces, meta)

    starts = range(done, len(todo), cfg.batch_size)
    bar = tqdm(starts, desc=f"head data ({cfg.decoding})", disable=not progress, unit="batch")
    for bi, i0 in enumerate(bar):
        idx = list(range(i0, min(i0 + cfg.batch_size, len(todo))))
        batch = [encode_prompt(tokenizer, todo[j], cfg.chat)[-cfg.max_prompt_tokens:] or [pad] for j in idx]
        T = max(len(b) for b in batch)
        ids = torch.tensor([[pad] * (T - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (T - len(b)) + [1] * len(b) for b in batch])
        seeds = [cfg.seed * 1_000_003 + lo + j for j in idx]  # the prompt's index in the whole set
        out = responder.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 temperature=cfg.sampling.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                 eos_token_id=eos, seed=seeds)
        for b, prompt_ids in enumerate(batch):
            x = out.new_tokens[b]
            if not x:
                continue
            gen = torch.Generator().manual_seed(seeds[b])
            seq = torch.tensor(prompt_ids + x).unsqueeze(0)
            P, n = len(prompt_ids), len(x)
            t_logits = target(seq.to(dev_t)).logits[0, P - 1 : P - 1 + n].float().cpu()
            d_logits = draft(seq.to(dev_d)).logits[0, P - 1 : P - 1 + n].float().cpu()
            y, lab, acc = label_response(t_logits, d_logits, cfg, gen)
            take = torch.rand(n, generator=gen) < cfg.mix_ratio

            def full(v, fill, dtype):
                t = torch.full((P + n,), fill, dtype=dtype)
                t[P:] = v
                return t

            rows["ids"].append(seq[0])
            rows["starts"].append(P)
            rows["x"].append(full(torch.tensor(x), -1, torch.int64))
            rows["y"].append(full(y, -1, torch.int64))
            rows["lab"].append(full(lab, float("nan"), torch.float32))
            rows["acc"].append(full(acc, False, torch.bool))
            rows["take"].append(full(take, False, torch.bool))
        n_done = idx[-1] + 1
        bar.set_postfix(examples=len(rows["starts"]) + sum(len(p) for p in parts),
                        prompts_per_s=f"{(n_done - done) / max(1e-9, time.time() - t0):.2f}")
        if path is not None and (bi + 1) % save_every == 0:
            snapshot(n_done).save(path)
    data = snapshot(len(todo))
    if path is not None:
        data.save(path)
    return data
