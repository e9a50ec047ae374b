"""The static decode path: speculative rounds as functions of fixed-shape tensors over a static KV cache.

Each step here has what CUDA-graph capture needs (gpt-fast's, vLLM's and SGLang's rule): no host synchronisation
(no ``.item()``, no Python branch on a tensor's value), no shape that depends on data, no allocation that grows,
and randomness from a Philox (seed, offset) tensor that the ops read on the device. On a CPU the same steps run
eagerly, and ``torch.compile(fullgraph=True)`` compiles each without a graph break (``tests/test_static.py``).

- :class:`StaticCache`: per layer ``[B, kv_heads, max_len, head_dim]`` keys and values allocated once, and each
  row's length ``[B]`` int64 on the device. Row b's tokens occupy columns 0 .. lengths[b] - 1 (positions equal
  columns: no holes); a forward writes its n tokens at lengths[b] .. lengths[b] + n - 1 and advances the
  lengths; roll-back subtracts from them, in place.
- :func:`forward_static`: the lean runner's model's forward over ``[B, n]`` tokens (the lean runner's fused weights,
  ``engine/fast_llama.py``) with attention over the whole buffer under a per-row causal mask.
- :func:`draft_steps`: the round's K candidates and one more forward (so the draft's cache holds every
  candidate however many are accepted), each step with the draft's confidence features and, for SpecDec++, the
  acceptance head's step (Huang et al. 2024, Sec. 3.2): a row's candidate count is where its stop flag first
  rose, decided on the device; the draft runs to the cap K whatever the flags say.
- :func:`verify_step`: the target over ``[last, candidates]`` (K + 1 tokens), the fused verification op with
  ragged candidate counts, and the roll-back of both caches to the committed prefix.

:class:`StaticSpeculator` runs these rounds; it reads back to the host once per round (the emitted tokens), and
is the loop that CUDA graphs replay on a GPU (``docs/gpu.md``). It serves the pairs the lean runner serves
(Llama, Qwen2, Qwen3) on one device with prompts
of one length (a batch's prefill is eager); the general engine (:class:`~specdec_ext.engine.SpeculativeGenerator`:
ragged prompts, continuous batching, the batch budget) runs on the dynamic runners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops
from ..head.features import CONFIDENCE_FEATURES
from .fast_llama import FastLlamaRunner


@dataclass
class StaticCache:
    """A model's KV cache allocated once: ``k``, ``v`` lists (one per layer) of ``[B, kv_heads, max_len,
    head_dim]`` in the model's dtype, and ``lengths`` ``[B]`` int64, the columns each row holds."""

    k: list
    v: list
    lengths: torch.Tensor

    @classmethod
    def allocate(cls, runner: FastLlamaRunner, batch_size: int, max_len: int) -> "StaticCache":
        """Zeroed buffers for ``runner``'s model: ``batch_size`` rows of ``max_len`` columns each.

        Raises ValueError for a batch size below 1 or a ``max_len`` beyond the model's positions."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= runner.max_pos:
            raise ValueError(f"max_len must be in [1, {runner.max_pos}] (the model's positions), got {max_len}")
        shape = (batch_size, runner.n_kv, max_len, runner.head_dim)
        make = lambda: torch.zeros(shape, dtype=runner.dtype, device=runner.device)  # noqa: E731
        return cls([make() for _ in runner.layers], [make() for _ in runner.layers],
                   torch.zeros(batch_size, dtype=torch.int64, device=runner.device))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def rollback(self, n_remove: torch.Tensor) -> None:
        """Drop the last ``n_remove[b]`` columns of row b (``[B]`` int64), in place: they are overwritten later."""
        self.lengths.sub_(n_remove)


def forward_static(runner: FastLlamaRunner, cache: StaticCache, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``runner``'s model over ``tokens`` ``[B, n]`` int64, row b's at positions lengths[b] .. lengths[b] + n - 1.

    Writes their keys and values into ``cache`` and advances ``cache.lengths`` by n. Returns float32 logits
    ``[B, n, V]`` and the final norm's output ``[B, n, H]`` (the LM head's input). A row that would pass the
    buffer's end writes its last columns again (the caller bounds lengths; nothing here reads them back)."""
    B, n = tokens.shape
    M = cache.max_len
    pos = cache.lengths.unsqueeze(1) + torch.arange(n, device=tokens.device)  # [B, n]
    pos = pos.clamp_max(M - 1)
    cos, sin = runner.cos[pos].unsqueeze(1), runner.sin[pos].unsqueeze(1)  # [B, 1, n, d]
    cols = torch.arange(M, device=tokens.device)
    mask = (cols.view(1, 1, M) <= pos.unsqueeze(2)).unsqueeze(1)  # [B, 1, n, M]: causal, per row
    rows = torch.arange(B, device=tokens.device).unsqueeze(1).expand(B, n)
    x = F.embedding(tokens, runner.embed)
    for li, layer in enumerate(runner.layers):
        q, k, v = runner.qkv(layer, x, cos, sin)
        cache.k[li][rows, :, pos] = k.transpose(1, 2)  # [B, n, hk, d] into columns pos of each row
        cache.v[li][rows, :, pos] = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, cache.k[li], cache.v[li], attn_mask=mask,
                                           enable_gqa=runner.n_heads != runner.n_kv)
        x = runner.block_out(layer, x, o.transpose(1, 2))
    hn = runner._rms(x, runner.final_norm)
    cache.lengths.add_(n)
    return runner._linear(hn, runner.lm_head).float(), hn


def _processed(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, V]`` over the row's temperature ``[B]`` (0: greedy, the logits as they are)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t.unsqueeze(1)


def _pick(processed: torch.Tensor, temperature: torch.Tensor, philox_seed_offset: torch.Tensor) -> torch.Tensor:
    """A token per row ``[B]`` from ``processed`` logits (:func:`_processed`): the argmax where ``temperature`` is 0,
    else a draw from p = softmax(processed), from ``philox_seed_offset`` on the device (the residual op given p as
    both distributions: the residual max(0, p - p) is empty, and the op then draws from p itself, by inverse CDF)."""
    greedy = processed.argmax(-1)
    probs = processed.softmax(-1)
    drawn = ops.residual_sample(probs, probs, philox_seed_offset=philox_seed_offset)
    return torch.where(temperature > 0, drawn, greedy)


@dataclass
class HeadStep:
    """SpecDec++'s stop rule inside :func:`draft_steps`: the head's fused weights
    (:meth:`~specdec_ext.head.AcceptanceHead.fused_weights`), the feature columns it reads among
    ``CONFIDENCE_FEATURES``, the bounds [k_min, k_max] and the stop threshold h."""

    weights: tuple
    columns: Optional[list]
    k_min: int
    k_max: int
    threshold: float

    @classmethod
    def from_head(cls, head, k_min: int, k_max: int, threshold: float, device) -> "HeadStep":
        """Raises ValueError for a head these steps cannot score: one that reads the state at the candidate it
        scores (``input_position="candidate"``) or a feature outside ``CONFIDENCE_FEATURES``."""
        if head.input_position != "proposal":
            raise ValueError(f"head: the static steps score heads on the state that proposes a candidate "
                             f"(input_position='proposal'), this one reads {head.input_position!r}")
        feats = tuple(head.features)
        if any(f not in CONFIDENCE_FEATURES for f in feats):
            raise ValueError(f"head: features {feats} outside {CONFIDENCE_FEATURES} are not in the static steps")
        cols = [CONFIDENCE_FEATURES.index(f) for f in feats] if feats else None
        return cls(head.fused_weights(device), cols, int(k_min), int(k_max), float(threshold))


def draft_steps(draft: FastLlamaRunner, cache: StaticCache, last: torch.Tensor, k: int, temperature: torch.Tensor,
                philox_seed_offsets: torch.Tensor, head: Optional[HeadStep] = None, use_hidden: bool = True):
    """K candidates per row from ``last`` ``[B]`` (the last committed token), then one forward of the K-th.

    Args:
        temperature: ``[B]`` float32, 0 for greedy rows.
        philox_seed_offsets: ``[K, 2]`` int64, one (seed, offset) per step.
        head: SpecDec++'s stop rule, or None (fixed K).
    Returns:
        ``(candidates [B, K] int64, draft_logits [B, K, V] float32 (before temperature, as the verify op takes
        them), num_draft [B] int64)``:
        num_draft[b] is K, or under ``head`` the first step whose stop flag rose (at least ``k_min``).
    """
    B = last.shape[0]
    token = last.view(B, 1)
    cands, logits_all = [], []
    num = torch.full((B,), k, dtype=torch.int64, device=last.device)
    cum = torch.ones(B, dtype=torch.float32, device=last.device)
    for step in range(1, k + 1):
        logits, hidden = forward_static(draft, cache, token)
        logits = logits[:, -1]
        processed = _processed(logits, temperature)
        cand = _pick(processed, temperature, philox_seed_offsets[step - 1])
        if head is not None:
            feats = ops.confidence_features(processed, cand, logits=True)
            feats = feats[:, head.columns] if head.columns is not None else None
            h_in = hidden[:, -1] if use_hidden else None
            _, stop = ops.acceptance_head_step(h_in, feats, *head.weights, cum, step, head.k_min, head.k_max,
                                               head.threshold)
            first = stop & (num == k)  # rows whose flag rises for the first time: they verify `step` candidates
            num = torch.where(first, torch.full_like(num, step), num)
        cands.append(cand)
        logits_all.append(logits)
        token = cand.view(B, 1)
    forward_static(draft, cache, token)  # the K-th candidate's keys and values, kept if every candidate is accepted
    return torch.stack(cands, 1), torch.stack(logits_all, 1), num


def verify_step(target: FastLlamaRunner, target_cache: StaticCache, draft_cache: StaticCache, last: torch.Tensor,
                candidates: torch.Tensor, draft_logits: torch.Tensor, num_draft: torch.Tensor,
                temperature: torch.Tensor, philox_seed_offset: torch.Tensor):
    """The target scores ``[last, candidates]`` ``[B, K + 1]`` in one forward; ``chain_verify_logits`` accepts
    (min(1, p/q), the residual distribution at the first rejection, the bonus token after all ``num_draft[b]``);
    both caches roll back to the committed prefix (``last`` and the accepted candidates; the emitted token is the
    next round's ``last``). Returns ``(out_ids [B, K + 1], num_accepted [B])`` as the op does."""
    B, K = candidates.shape
    target_logits, _ = forward_static(target, target_cache, torch.cat([last.view(B, 1), candidates], 1))
    out, acc = ops.chain_verify_logits(candidates, draft_logits, target_logits, temperature, num_draft,
                                       philox_seed_offset=philox_seed_offset)
    keep = acc.clamp_min(0) + 1  # last and the accepted candidates (a negative code: a kernel error, raised later)
    target_cache.rollback(K + 1 - keep)
    draft_cache.rollback(K + 1 - keep)
    return out, acc


class StaticSpeculator:
    """Speculative decoding of a target/draft pair the lean runner serves, over static caches (module docstring).

    ``k``: the candidates drafted per round (SpecDec++: the cap K_max of the round); ``head``, ``threshold``,
    ``k_min``: SpecDec++'s stop rule (None: fixed K). ``packed``: the lean runners' oneDNN-packed weights on a CPU
    (None: their default; False for ``torch.compile``). ``max_len``: the caches' columns; None: what a call needs,
    rounded up to a multiple of 256, so that compiled or captured steps meet few shapes (a fixed ``max_len``: one).

    Raises ValueError for models the lean runner does not serve, k < 1, a head it cannot score, or a call that
    needs more than ``max_len`` columns."""

    def __init__(self, target, draft, k: int = 4, head=None, threshold: float = 0.7, k_min: int = 1,
                 packed: Optional[bool] = None, max_len: Optional[int] = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1 (candidates per round), got {k!r}")
        self.max_len = max_len
        self.target = FastLlamaRunner(target, "target", packed=packed)
        self.draft = FastLlamaRunner(draft, "draft", packed=packed)
        self.k = k
        self.head = None if head is None else HeadStep.from_head(head, k_min, k, threshold, self.draft.device)
        self.use_hidden = head is None or bool(head.use_hidden)
        self.draft_steps = draft_steps
        self.verify_step = verify_step
        self._kept: dict = {}  # (rows, max_len) -> the two caches, reused from call to call

    def _caches(self, batch_size: int, max_len: int) -> tuple[StaticCache, StaticCache]:
        """The target's and the draft's caches of this shape, emptied (lengths 0): allocated on the first call of a
        shape and reused after, so compiled or captured steps see the same tensors at every call."""
        key = (batch_size, max_len)
        if key not in self._kept:
            self._kept[key] = (StaticCache.allocate(self.target, batch_size, max_len),
                               StaticCache.allocate(self.draft, batch_size, max_len))
        for cache in self._kept[key]:
            cache.lengths.zero_()
        return self._kept[key]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
        """New tokens per row of ``input_ids`` ``[B, T]`` (one length for every row; T >= 1). Greedy at temperature
        0, else samples the target's distribution at that temperature, from ``seed``.

        Raises ValueError for an empty prompt, a negative ``max_new_tokens`` or a temperature below 0."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {list(input_ids.shape)}")
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError(f"max_new_tokens and temperature must be >= 0, got {max_new_tokens} and {temperature}")
        dev = self.target.device
        ids = input_ids.to(dev)
        B, T = ids.shape
        need = T + max_new_tokens + self.k + 2
        if self.max_len is not None and need > self.max_len:
            raise ValueError(f"max_len {self.max_len}: this call needs {need} cache columns (prompt, new tokens, k + 2)")
        max_len = self.max_len or min(-(-need // 256) * 256, self.target.max_pos, self.draft.max_pos)
        if need > max_len:
            raise ValueError(f"input_ids and max_new_tokens need {need} positions, beyond the models' {max_len}")
        tc, dc = self._caches(B, max_len)
        if T > 1:  # prefill (eager): the prompt but its last token, which is the first round's `last`
            forward_static(self.target, tc, ids[:, :-1])
            forward_static(self.draft, dc, ids[:, :-1])
        temp = torch.full((B,), float(temperature), dtype=torch.float32, device=dev)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        last = torch.empty(B, dtype=torch.int64, device=dev)  # one tensor for every round: steady shapes and strides
        last.copy_(ids[:, -1])
        out: list[list[int]] = [[] for _ in range(B)]
        while min(len(o) for o in out) < max_new_tokens:
            so = torch.randint(0, 2**62, (self.k + 1, 2), dtype=torch.int64, generator=gen).to(dev)
            cands, q_logits, num = self.draft_steps(self.draft, dc, last, self.k, temp, so[: self.k], self.head,
                                                    self.use_hidden)
            toks, acc = self.verify_step(self.target, tc, dc, last, cands, q_logits, num, temp, so[self.k])
            toks, acc = toks.cpu(), acc.cpu()  # the round's one read-back
            if int(acc.min()) < 0:
                raise ValueError("verification failed on the device (a NaN or +Inf logit, or a fully masked row)")
            for b in range(B):
                out[b].extend(toks[b, : int(acc[b]) + 1].tolist())
            last.copy_(toks.gather(1, acc.view(B, 1)).view(B))
        return [o[:max_new_tokens] for o in out]
