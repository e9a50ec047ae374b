"""What a generation call's arguments become before the scheduler sees them (per-request values, seeds, EOS ids,
arrival times, the logits processor checked) and the :class:`GenerationOutput` made of what it generated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .stats import GenerationStats


@dataclass
class GenerationOutput:
    """sequences: ``[B, T + L]`` int64, prompt then generated tokens, right-padded with ``pad_token_id``.
    new_tokens: the generated token ids of each row. stats: :class:`GenerationStats`."""

    sequences: torch.Tensor
    new_tokens: list[list[int]]
    stats: GenerationStats


def arrivals(arrival_ms, n: int) -> list:
    """``arrival_ms`` checked: one finite time >= 0 per prompt, non-decreasing (None: every request at 0)."""
    if arrival_ms is None:
        return [0.0] * n
    if isinstance(arrival_ms, (str, bytes, torch.Tensor)) or not isinstance(arrival_ms, Sequence) \
            or len(arrival_ms) != n:
        raise ValueError(f"arrival_ms must be a sequence of {n} times in ms, one per prompt, got {arrival_ms!r}")
    out = []
    for i, t in enumerate(arrival_ms):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 \
                or (out and t < out[-1]):
            raise ValueError(f"arrival_ms[{i}] must be a finite time in ms >= 0 and >= the one before, got {t!r}")
        out.append(float(t))
    return out


def check_processor(logits_processor) -> None:
    if logits_processor is not None and not callable(logits_processor):
        raise TypeError(f"logits_processor must be callable (input_ids, scores) -> scores, got "
                        f"{type(logits_processor).__name__}")


def eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def per_request(name: str, value, n: int) -> list:
    """``value`` for each of ``n`` requests: the value itself for every one, or a sequence of one per request.

    Raises ValueError for a sequence of another length."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be one value or a sequence of one per prompt ({n}), got {len(value)}")
        return list(value)
    return [value] * n


def seeds_for(seed, n: int) -> list[int]:
    """Each request's Philox seed: ``seed + i``, or ``seed[i]``."""
    seeds = [seed + i for i in range(n)] if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"seed: need one seed per row ({n}), got {len(seeds)}")
    return seeds


def make_output(input_ids, generated, eos, pad_token_id, stats) -> GenerationOutput:
    B, T = input_ids.shape
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    L = max(len(g) for g in generated)
    seq = torch.full((B, T + L), pad, dtype=torch.int64)
    seq[:, :T] = input_ids.cpu()
    for b, g in enumerate(generated):
        seq[b, T : T + len(g)] = torch.tensor(g, dtype=torch.int64)
    return GenerationOutput(seq, generated, stats)
