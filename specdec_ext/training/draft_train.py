"""Distilling a small draft for a given target (``specdec train-draft``).

The draft is a Llama of the target's width with a few decoder layers, initialised from the target's own layers
(by default its first two), reading the target's token embedding and writing logits through the target's
output rows of the N tokens the target emits most often (:class:`~specdec_ext.engine.subset_head.SubsetLMHead`,
FR-Spec). Embedding and output rows stay frozen and equal to the target's, so they are taken from the target at load
time and never shipped: what is trained and stored is the decoder layers and the final norm.

The loss. Speculative sampling accepts a candidate with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan
et al. 2023, section 3.5), and greedy verification accepts it when the draft's argmax is the target's. DistillSpec
(Zhou et al. 2023, section 4 and table 2) finds no divergence best everywhere; total variation itself is what the
acceptance rate measures but its gradient is a sign, zero almost everywhere a draft is far off. We minimise the
forward KL(p || q) over the subset: it bounds TV from above (Pinsker: TV <= sqrt(KL / 2)), its gradient q - p is
dense, and it is mode-covering, so the target's argmax keeps mass in q (greedy acceptance). The data is on-policy
for the target (its own continuations, :mod:`.draft_data`), the text the draft is asked to predict when it drafts.

Teacher probabilities are computed once (the target in bfloat16, top-``k`` of its distribution renormalised over the
subset) and kept in ``work/teacher.pt``; training checkpoints into ``work/checkpoint.pt`` every few hundred steps,
and a rerun resumes from it.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..engine.models import output_rows
from .draft_store import attach_target_rows

TOP_K = 32  # teacher probabilities kept per position


def choose_vocabulary(seqs: list[tuple[list[int], int]], vocab_size: int, n: int, always=()) -> torch.Tensor:
    """The ``n`` ids most frequent in ``seqs`` (prompt and continuation tokens alike; ties by id), ``always``
    included (special tokens such as EOS), sorted ascending: ``[n]`` int64."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for toks, _ in seqs:
        counts += torch.bincount(torch.tensor(toks), minlength=vocab_size).double()
    for i in always:
        counts[i] = float("inf")
    order = torch.argsort(-counts, stable=True)
    return order[: min(n, vocab_size)].sort().values


def new_draft(target, token_ids: torch.Tensor, layers=(0, 1)):
    """A draft for ``target`` (a Llama-family ``transformers`` model): ``len(layers)`` decoder layers copied from the
    target's layers at those indices, the target's final norm, its token embedding shared (frozen) and a
    :class:`SubsetLMHead` over ``token_ids`` made of the target's output rows (frozen). float32.

    Raises ValueError for a layer index outside the target's layers."""
    from transformers import AutoModelForCausalLM

    n = len(target.model.layers)
    picked = [i % n if -n <= i < n else None for i in layers]
    if not picked or None in picked:
        raise ValueError(f"layers must be indices of the target's {n} decoder layers, got {list(layers)}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(picked)
    cfg.tie_word_embeddings = False
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in picked]
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = torch.float32
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for mine, theirs in zip(draft.model.layers, picked):
            mine.load_state_dict({k: v.float() for k, v in target.model.layers[theirs].state_dict().items()})
        draft.model.norm.weight.copy_(target.model.norm.weight.float())
    attach_target_rows(draft, target, token_ids)
    return draft


def trainable(draft) -> list[torch.nn.Parameter]:
    """What distillation trains and a shipped draft stores: the decoder layers and the final norm."""
    return list(draft.model.layers.parameters()) + list(draft.model.norm.parameters())


def _batches(seqs, batch_tokens: int, rng: torch.Generator):
    """Sequences shuffled and packed into batches of about ``batch_tokens`` tokens, each padded to its longest."""
    order = torch.randperm(len(seqs), generator=rng).tolist()
    batch, longest = [], 0
    for i in order:
        n = len(seqs[i][0])
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    if batch:
        yield batch


def _pad(seqs, idx):
    T = max(len(seqs[i][0]) for i in idx)
    ids = torch.zeros(len(idx), T, dtype=torch.int64)
    mask = torch.zeros(len(idx), T, dtype=torch.bool)
    for r, i in enumerate(idx):
        toks = seqs[i][0]
        ids[r, : len(toks)] = torch.tensor(toks)
        mask[r, : len(toks)] = True
    return ids, mask


@torch.inference_mode()
def teacher_targets(target, seqs, token_ids: torch.Tensor, work: Path, batch_tokens: int = 4096, k: int = TOP_K,
                    progress: Optional[Callable] = None) -> dict:
    """Top-``k`` of the target's next-token distribution renormalised over ``token_ids``, at every position of every
    sequence but the last: ``{"idx": [n_i - 1, k] int16 (positions in the subset), "logp": [n_i - 1, k] float16}``
    per sequence, kept in ``work/teacher.pt`` (computed once). The target runs as it is loaded (bfloat16 for speed)."""
    path = Path(work) / "teacher.pt"
    if path.exists():
        blob = torch.load(path)
        if blob["token_ids"].equal(token_ids) and len(blob["idx"]) == len(seqs):
            return blob
    rows = output_rows(target, token_ids)  # [N, H]
    idx_out: list = [None] * len(seqs)
    logp_out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    bar = progress(total=sum(len(s[0]) for s in seqs), desc="teacher probabilities", unit="tok") if progress else None
    batch = []
    for j, i in enumerate(order):
        batch.append(i)
        if j + 1 < len(order) and len(seqs[order[j + 1]][0]) * (len(batch) + 1) <= batch_tokens:
            continue
        ids, mask = _pad(seqs, batch)
        h = target.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # [b, T, H]
        logits = F.linear(h, rows).float()  # [b, T, N]
        lp, ix = logits.log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
        lp = lp - lp.logsumexp(-1, keepdim=True)  # renormalised over the top k
        for r, i2 in enumerate(batch):
            n = len(seqs[i2][0])
            idx_out[i2] = ix[r, : n - 1].to(torch.int16)
            logp_out[i2] = lp[r, : n - 1].to(torch.float16)
        if bar is not None:
            bar.update(int(mask.sum()))
        batch = []
    if bar is not None:
        bar.close()
    blob = {"token_ids": token_ids, "idx": idx_out, "logp": logp_out}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)
    return blob


def _draft_logits(draft, ids, mask):
    """Subset logits ``[b, T, N]`` of the draft over padded ``ids``."""
    h = draft.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    return F.linear(h, draft.lm_head.weight).float()


def _loss_and_agreement(logits, mask, batch, teacher):
    """Forward KL(p || q) summed over positions, the number of positions, and how many of them have the draft's
    argmax equal to the teacher's (greedy acceptance) and sum_x min(p, q) over the teacher's top k (T = 1)."""
    logq = logits.log_softmax(-1)
    T, k = logits.shape[1], teacher["idx"][batch[0]].shape[-1]
    idx = torch.zeros(len(batch), T, k, dtype=torch.int64)
    logp = torch.full((len(batch), T, k), float("-inf"))
    for r, i in enumerate(batch):
        n = teacher["idx"][i].shape[0]
        idx[r, :n] = teacher["idx"][i].long()
        logp[r, :n] = teacher["logp"][i].float()
    valid = F.pad(mask[:, 1:], (0, 1), value=False)  # position t predicts token t + 1
    p = logp.exp()
    lq = logq.gather(-1, idx)
    kl = (p * (logp.clamp_min(-80) - lq)).sum(-1)
    kl = (kl * valid).sum()
    count = int(valid.sum())
    with torch.no_grad():
        agree = ((logits.argmax(-1) == idx[..., 0]) & valid).sum().item()
        overlap = (torch.minimum(p, lq.exp()).sum(-1) * valid).sum().item()
    return kl, count, agree, overlap


def _select(seqs, teacher, indices: list[int]) -> tuple[list, dict]:
    """The sequences at ``indices`` and their teacher probabilities, in that order."""
    return ([seqs[i] for i in indices],
            {key: [teacher[key][i] for i in indices] for key in ("idx", "logp")})


def evaluate(draft, seqs, teacher, held: list[int], batch_tokens: int = 4096) -> dict:
    """On the held-out sequences: mean forward KL, greedy agreement with the target's argmax (the per-candidate
    acceptance rate of greedy verification, teacher-forced) and the mean of sum_x min(p, q) (the acceptance rate at
    T = 1, over the teacher's top k)."""
    tot = {"kl": 0.0, "n": 0, "agree": 0.0, "overlap": 0.0}
    sub, sub_teacher = _select(seqs, teacher, held)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in _batches(sub, batch_tokens, torch.Generator().manual_seed(0)):
            ids, mask = _pad(sub, batch)
            kl, n, agree, overlap = _loss_and_agreement(_draft_logits(draft, ids, mask), mask, batch, sub_teacher)
            tot["kl"] += float(kl)
            tot["n"] += n
            tot["agree"] += agree
            tot["overlap"] += overlap
    n = max(tot["n"], 1)
    return {"kl": tot["kl"] / n, "greedy_agreement": tot["agree"] / n, "expected_acceptance_t1": tot["overlap"] / n,
            "positions": tot["n"]}


def train(draft, seqs, teacher, work: Path, minutes: float = 30.0, lr: float = 5e-4, batch_tokens: int = 4096,
          held_out: float = 0.03, seed: int = 0, log: Callable = print, progress: Optional[Callable] = None,
          steps: Optional[int] = None) -> dict:
    """Distil ``draft`` (its :func:`trainable` parameters) for about ``minutes`` of wall time, or exactly ``steps``
    optimizer steps when given (a run that does not depend on the machine's speed): AdamW, bfloat16 autocast, a
    linear warm-up then cosine decay over the steps (with ``minutes``, estimated from the first steps' pace),
    forward KL on the teacher's top-k probabilities (module docstring). Checkpoints to ``work/checkpoint.pt``;
    resumes from it. Returns the held-out metrics (:func:`evaluate`) before and after, and the training log."""
    work = Path(work)
    held, train_idx = held_out_split(len(seqs), held_out, seed)
    params = trainable(draft)
    opt = optimizer(params, lr)
    ckpt = work / "checkpoint.pt"
    state = resumed(ckpt, opt, steps, log, lambda blob: (draft.model.layers.load_state_dict(blob["layers"]),
                                                         draft.model.norm.load_state_dict(blob["norm"])))
    if state["before"] is None:
        state["before"] = evaluate(draft, seqs, teacher, held, batch_tokens)
        log(f"[train-draft] held out before: {state['before']}")
    train_seqs, train_teacher = _select(seqs, teacher, train_idx)

    def step_loss(batch):
        ids, mask = _pad(train_seqs, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = _draft_logits(draft, ids, mask)
        kl, n, agree, _ = _loss_and_agreement(logits, mask, batch, train_teacher)
        return kl / max(n, 1), {"agree": f"{agree / max(n, 1):.2f}"}

    def passes(epoch):
        return _batches(train_seqs, batch_tokens, torch.Generator().manual_seed(seed + 1 + epoch))

    fit(opt, params, state, passes, step_loss, lambda: _save(ckpt, draft, opt, state), minutes, lr, steps,
        "distilling the draft", "kl", 200, progress)
    return training_report(params, state, evaluate(draft, seqs, teacher, held, batch_tokens), held, train_idx, log)


def held_out_split(n: int, held_out: float, seed: int) -> tuple[list, list]:
    """Sequence indices ``0 .. n - 1`` shuffled by ``seed`` and split: ``(held out: at least one, about held_out of
    them; trained on: the rest)``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, int(n * held_out))
    return perm[:n_held], perm[n_held:]


def optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW over ``params`` (made trainable), no weight decay, betas (0.9, 0.98): both draft trainers'."""
    for p in params:
        p.requires_grad_(True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))


def training_report(params, state: dict, after: dict, held: list, train_idx: list, log: Callable) -> dict:
    """A trainer's result: held-out metrics before (``state["before"]``) and ``after``, steps, minutes and history;
    ``params`` are frozen again."""
    log(f"[train-draft] held out after {state['step']} steps: {after}")
    for p in params:
        p.requires_grad_(False)
    return {"before": state["before"], "after": after, "steps": state["step"],
            "minutes": round(state["seconds"] / 60, 2), "history": state["history"], "held_out_sequences": len(held),
            "train_sequences": len(train_idx)}


def resumed(ckpt: Path, opt, steps: Optional[int], log: Callable, restore: Callable) -> dict:
    """A trainer's state (:func:`fit`'s): read back from the checkpoint ``ckpt`` where there is one (``restore(blob)``
    loads the model's part, ``opt`` its own), else a new one for ``steps`` steps (None: set by :func:`fit`)."""
    if not ckpt.exists():
        return {"step": 0, "seconds": 0.0, "total_steps": steps, "history": [], "before": None}
    blob = torch.load(ckpt)
    restore(blob)
    opt.load_state_dict(blob["opt"])
    state = blob["state"]
    log(f"[train-draft] resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)")
    return state


def fit(opt, params, state: dict, batches: Callable, step_loss: Callable, save: Callable, minutes: float, lr: float,
        steps: Optional[int], desc: str, key: str, every: int, progress: Optional[Callable] = None) -> None:
    """The optimisation loop of both draft trainers, from ``state`` (``step``, ``seconds``, ``total_steps``,
    ``history``; updated in place) until about ``minutes`` of training time, or exactly ``steps`` optimizer steps
    where given: ``batches(epoch)`` yields a pass's batches (a new shuffle per pass, seeded by where it starts),
    ``step_loss(batch)`` returns the mean loss and the progress bar's other figures, ``opt`` steps over ``params``
    (gradients clipped to norm 1) at ``lr`` times :func:`lr_scale` (the schedule's length estimated from the first
    20 steps' pace), ``save()`` checkpoints every ``every`` steps and at the end; the running loss is logged as
    ``key`` every 100 steps."""
    budget, warm = minutes * 60.0, 30
    bar = progress(total=int(budget), desc=desc, unit="s") if progress else None
    if bar is not None:
        bar.update(int(state["seconds"]))
    epoch, running, done = state["step"], None, False
    while not done:
        for batch in batches(epoch):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr * lr_scale(state["step"], state["total_steps"], warm)
            loss, shown = step_loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            state["seconds"] += time.perf_counter() - t0
            if state["total_steps"] is None and state["step"] == 20:  # the schedule's length from the measured pace
                state["total_steps"] = max(40, int(budget / (state["seconds"] / 20)))
            value = loss.item()
            running = value if running is None else 0.98 * running + 0.02 * value
            if bar is not None:
                bar.update(int(state["seconds"]) - bar.n)
                bar.set_postfix(**{key: f"{running:.3f}"}, **shown)
            if state["step"] % 100 == 0:
                state["history"].append({"step": state["step"], "minutes": round(state["seconds"] / 60, 2),
                                         key: round(running, 4)})
            finished = state["step"] >= steps if steps is not None else state["seconds"] >= budget
            if state["step"] % every == 0 or finished:
                save()
            if finished:
                done = True
                break
        epoch += 1
    if bar is not None:
        bar.close()


def _save(path: Path, draft, opt, state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"layers": draft.model.layers.state_dict(), "norm": draft.model.norm.state_dict(),
                "opt": opt.state_dict(), "state": state}, tmp)
    tmp.replace(path)


def lr_scale(step: int, total: Optional[int], warm: int = 30) -> float:
    """The learning rate's factor at ``step``: a linear warm-up over ``warm`` steps, then a cosine decay over ``total``
    steps (1 while ``total`` is not known yet), at least 0.02."""
    frac = min(1.0, step / total) if total else 0.0
    return max(min(1.0, (step + 1) / warm) * (0.5 * (1 + math.cos(math.pi * frac)) if total else 1.0), 0.02)


def sequences_and_vocabulary(target, tokenizer, work: Path, prompts: int, max_new_tokens: int, vocab: int,
                             batch_size: int, seed: int, progress: Optional[Callable] = None) -> tuple:
    """A draft's data and vocabulary: the target's continuations of :func:`~.draft_data.draft_prompts` (made once
    under ``work``, :func:`~.draft_data.generate_continuations`) as ``(tokens, prompt length)`` sequences, and the
    ``vocab`` ids most frequent in them, special tokens included. Returns ``(seqs, token_ids, minutes taken)``.

    Raises ValueError for ``vocab`` < 2."""
    from ..engine.models import special_ids, vocab_size
    from .draft_data import generate_continuations, load_sequences

    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    t0 = time.perf_counter()
    paths = generate_continuations(target, tokenizer, work, prompts, max_new_tokens, batch_size, seed=seed,
                                   progress=progress)
    seqs = load_sequences(paths)
    V = vocab_size(target)
    always = [i for i in special_ids(target) + [tokenizer.eos_token_id] if i is not None and 0 <= i < V]
    return seqs, choose_vocabulary(seqs, V, vocab, always), (time.perf_counter() - t0) / 60


def distill_draft(target, tokenizer, out: Path, work: Path, prompts: int = 4096, max_new_tokens: int = 96,
                  vocab: int = 8192, layers=(0, 1), minutes: float = 30.0, batch_size: int = 64, lr: float = 5e-4,
                  seed: int = 0, log: Callable = print, progress: Optional[Callable] = None) -> dict:
    """The whole of ``specdec train-draft``: the target's continuations (:mod:`.draft_data`), the draft's vocabulary
    (the ``vocab`` ids most frequent in them, special tokens included), the teacher's probabilities, a draft of the
    target's ``layers`` distilled for ``minutes``, stored in ``out`` (:mod:`.draft_store`) with ``metrics.json``.
    Every stage resumes from what it finds in ``work``. Returns the metrics.

    Raises ValueError for ``vocab`` < 2 or ``minutes`` <= 0."""
    if vocab < 2 or minutes <= 0:
        raise ValueError(f"vocab must be >= 2 and minutes > 0, got {vocab} and {minutes}")
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    seqs, token_ids, data_minutes = sequences_and_vocabulary(target, tokenizer, work, prompts, max_new_tokens, vocab,
                                                             batch_size, seed, progress)
    new = torch.cat([torch.tensor(toks[p:]) for toks, p in seqs])  # what the target wrote
    coverage = float(torch.isin(new, token_ids).float().mean())
    log(f"[train-draft] {len(seqs)} sequences, {sum(len(s[0]) for s in seqs)} tokens ({new.numel()} generated by the "
        f"target); the draft's {len(token_ids)} ids cover {coverage:.1%} of the generated tokens")
    t1 = time.perf_counter()
    teacher = teacher_targets(target, seqs, token_ids, work, progress=progress)
    t_teacher = time.perf_counter() - t1
    draft = new_draft(target, token_ids, layers)
    report = train(draft, seqs, teacher, work, minutes, lr=lr, seed=seed, log=log, progress=progress)
    record = {"layers_from": list(layers), "vocab_subset": len(token_ids), "coverage_of_generated": round(coverage, 4),
              "prompts": prompts, "max_new_tokens": max_new_tokens, "stage_minutes": {
                  "data": round(data_minutes, 1), "teacher": round(t_teacher / 60, 1), "training": report["minutes"]}}
    return stored(draft, target, out, record, report)


def stored(draft, target, out: Path, record: dict, report: dict) -> dict:
    """Store a trained draft for ``target`` in ``out`` (:func:`~.draft_store.save_draft`, with ``record``) and its
    ``metrics.json`` (the record and the training's ``report``); returns the metrics."""
    from ..engine.models import fingerprint
    from .draft_store import save_draft

    save_draft(draft, out, fingerprint(target), record)
    metrics = {**record, **report}
    (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics
