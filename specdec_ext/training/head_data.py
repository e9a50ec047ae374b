"""Training data for the acceptance head (SpecDec++, Huang et al. 2024, Sec. 4).

For each prompt the target samples a response X (temperature 1 by default, up to a length limit).
At every response position i the draft samples Y_i ~ q(. | prompt, X_<i), and the soft label is
p_acc,i = min(1, p(Y_i | prompt, X_<i) / q(Y_i | prompt, X_<i)), both from one forward pass of
each model over prompt + X. The head's input sequence mixes tokens: Z_i = X_i with probability r
(default 0.15), else Y_i; the loss counts only positions where Z_i = Y_i, where the head reads the
draft's hidden state after Z_i, exactly what it sees when judging a candidate during decoding.

The data set is stored as one safetensors file (flat tensors with per-example offsets) whose
metadata records the models and settings that made it, so training can rerun without the target.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..engine import SpeculativeGenerator
from ..engine.sampling import SamplingConfig, process_logits


@dataclass
class HeadDataConfig:
    max_new_tokens: int = 128     # response length limit
    temperature: float = 1.0      # of the target's responses and of the labels' distributions
    mix_ratio: float = 0.15       # r: probability that Z_i is the target's token X_i
    max_prompt_tokens: int = 384  # prompts are truncated on the left to this many tokens
    batch_size: int = 8
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.mix_ratio < 1.0:
            raise ValueError(f"mix_ratio r must lie in [0, 1), got {self.mix_ratio}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")


@dataclass
class HeadDataset:
    """Flat storage; example e spans ``input_ids[offsets[e]:offsets[e+1]]``.

    input_ids: int64 prompt + mixed tokens Z. response_start: [E] index of Z_1 in each example.
    labels: float32 soft labels min(1, p/q) at response positions (NaN elsewhere).
    counted: bool, positions where Z_i = Y_i (the loss and metrics use only these).
    accept_sample: bool, one sampled accept/reject outcome per position (u < label), for ROC AUC.
    target_tokens: int64, the target's response X at response positions (-1 elsewhere).
    meta: models and settings.
    """

    input_ids: torch.Tensor
    offsets: torch.Tensor
    response_start: torch.Tensor
    labels: torch.Tensor
    counted: torch.Tensor
    accept_sample: torch.Tensor
    target_tokens: torch.Tensor
    meta: dict

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def example(self, e: int) -> slice:
        return slice(int(self.offsets[e]), int(self.offsets[e + 1]))

    def save(self, path: str | Path) -> None:
        save_file({"input_ids": self.input_ids.to(torch.int32), "offsets": self.offsets,
                   "response_start": self.response_start, "labels": self.labels,
                   "counted": self.counted.to(torch.uint8), "accept_sample": self.accept_sample.to(torch.uint8),
                   "target_tokens": self.target_tokens.to(torch.int32)},
                  str(path), metadata={"specdec_ext": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: str | Path) -> "HeadDataset":
        from safetensors import safe_open

        t = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("specdec_ext", "{}"))
        return cls(t["input_ids"].long(), t["offsets"], t["response_start"], t["labels"], t["counted"].bool(),
                   t["accept_sample"].bool(), t["target_tokens"].long(), meta)


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


@torch.inference_mode()
def soft_labels(target_logits: torch.Tensor, draft_logits: torch.Tensor, response: torch.Tensor,
                cfg: SamplingConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits ``[n, V]`` predicting the n response tokens: draft samples Y ``[n]`` and labels min(1, p(Y)/q(Y))."""
    p = process_logits(target_logits, cfg)
    q = process_logits(draft_logits, cfg)
    y = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    py = p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    qy = q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return y, torch.clamp(py / qy, max=1.0)


@torch.inference_mode()
def generate_head_data(target, draft, tokenizer, prompts: Sequence[str], cfg: Optional[HeadDataConfig] = None,
                       progress: bool = True) -> HeadDataset:
    """Build the head's training set from ``prompts`` (see the module docstring)."""
    cfg = cfg or HeadDataConfig()
    if len(prompts) == 0:
        raise ValueError("prompts is empty: the head's training data needs at least one prompt")
    scfg = SamplingConfig(cfg.temperature)
    gen = torch.Generator().manual_seed(cfg.seed)
    responder = SpeculativeGenerator(target, policy="autoregressive")
    eos = tokenizer.eos_token_id
    ids_all, offsets, starts, labels_all, counted_all, accept_all, x_all = [], [0], [], [], [], [], []
    dev_t = target.get_input_embeddings().weight.device
    dev_d = draft.get_input_embeddings().weight.device
    bar = tqdm(range(0, len(prompts), cfg.batch_size), desc="head data", disable=not progress, unit="batch")
    for i0 in bar:
        batch = [tokenizer(p, add_special_tokens=False)["input_ids"][-cfg.max_prompt_tokens :] for p in prompts[i0 : i0 + cfg.batch_size]]
        batch = [b if b else [eos] for b in batch]
        T = max(len(b) for b in batch)
        pad = eos if eos is not None else 0
        ids = torch.tensor([[pad] * (T - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (T - len(b)) + [1] * len(b) for b in batch])
        out = responder.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 temperature=cfg.temperature, eos_token_id=eos, seed=cfg.seed * 1_000_003 + i0)
        for b, prompt_ids in enumerate(batch):
            x = out.new_tokens[b]
            if not x:
                continue
            seq = torch.tensor(prompt_ids + x).unsqueeze(0)
            P, n = len(prompt_ids), len(x)
            t_logits = target(seq.to(dev_t)).logits[0, P - 1 : P - 1 + n].float().cpu()
            d_logits = draft(seq.to(dev_d)).logits[0, P - 1 : P - 1 + n].float().cpu()
            y, lab = soft_labels(t_logits, d_logits, torch.tensor(x), scfg, gen)
            xs = torch.tensor(x)
            take_x = torch.rand(n, generator=gen) < cfg.mix_ratio
            z = torch.where(take_x, xs, y)
            counted = z == y
            accept = torch.rand(n, generator=gen) < lab
            full_labels = torch.full((P + n,), float("nan"))
            full_labels[P:] = lab
            full_counted = torch.zeros(P + n, dtype=torch.bool)
            full_counted[P:] = counted
            full_accept = torch.zeros(P + n, dtype=torch.bool)
            full_accept[P:] = accept
            ids_all.append(torch.cat([torch.tensor(prompt_ids), z]))
            x_all.append(torch.cat([torch.full((P,), -1, dtype=torch.int64), xs]))
            labels_all.append(full_labels)
            counted_all.append(full_counted)
            accept_all.append(full_accept)
            starts.append(P)
            offsets.append(offsets[-1] + P + n)
        bar.set_postfix(examples=len(starts))
    if not starts:
        raise ValueError("the target produced no response tokens for any prompt")
    meta = {"target_model": _model_name(target), "draft_model": _model_name(draft), "config": asdict(cfg),
            "num_prompts": len(prompts), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "draft_hidden_size": draft.get_output_embeddings().weight.shape[1]}
    return HeadDataset(torch.cat(ids_all), torch.tensor(offsets), torch.tensor(starts), torch.cat(labels_all),
                       torch.cat(counted_all), torch.cat(accept_all), torch.cat(x_all), meta)


@torch.inference_mode()
def draft_features(draft, data: HeadDataset, batch_tokens: int = 8192, progress: bool = True) -> dict[str, torch.Tensor]:
    """The frozen draft's last hidden state (its LM head's input) at every counted position, computed
    once in inference mode. Returns hidden ``[M, H]`` float32, labels ``[M]``, accept ``[M]``, example ``[M]``."""
    captured = {}
    hook = draft.get_output_embeddings().register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0]))
    dev = draft.get_input_embeddings().weight.device
    hs, labs, accs, exs = [], [], [], []
    try:
        order = list(range(len(data)))
        bar = tqdm(total=len(order), desc="draft features", disable=not progress, unit="ex")
        i = 0
        while i < len(order):
            group = [order[i]]
            while i + len(group) < len(order) and (len(group) + 1) * max(
                    data.example(e).stop - data.example(e).start for e in group + [order[i + len(group)]]) <= batch_tokens:
                group.append(order[i + len(group)])
            L = max(data.example(e).stop - data.example(e).start for e in group)
            ids = torch.zeros(len(group), L, dtype=torch.long)
            mask = torch.zeros(len(group), L, dtype=torch.long)
            for r, e in enumerate(group):
                s = data.input_ids[data.example(e)]
                ids[r, : s.numel()] = s
                mask[r, : s.numel()] = 1
            draft(input_ids=ids.to(dev), attention_mask=mask.to(dev))
            h = captured["h"].float().cpu()
            for r, e in enumerate(group):
                sl = data.example(e)
                c = data.counted[sl]
                hs.append(h[r, : c.numel()][c])
                labs.append(data.labels[sl][c])
                accs.append(data.accept_sample[sl][c])
                exs.append(torch.full((int(c.sum()),), e, dtype=torch.int64))
            i += len(group)
            bar.update(len(group))
        bar.close()
    finally:
        hook.remove()
    return {"hidden": torch.cat(hs), "labels": torch.cat(labs), "accept": torch.cat(accs), "example": torch.cat(exs)}
