"""Speculative generation over a Hugging Face target/draft pair, with any candidate-length policy.

One round (Leviathan et al. 2023, Alg. 1; SpecDec++ Alg. 1):

1. the policy decides, candidate by candidate, how long each row drafts (``policies/``);
2. the draft proposes one token per forward pass, with its KV cache;
3. the target scores the last committed token and all candidates in one forward pass;
4. one fused op (``ops.chain_verify``; greedy: ``ops.chain_verify_greedy``) accepts a prefix and
   emits the residual or bonus token, per row, with ragged candidate lengths;
5. both caches roll back to the accepted prefix; the draft catches up on the tokens it has not
   seen at the start of the next round; statistics record the round.

Randomness is per row: row b draws from its own ``torch.Generator`` (seeded ``seed + b``), a fixed
number of uniforms per round whatever it uses, so a row's output in a batch equals its output alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from .. import ops
from ..head import AcceptanceHead
from ..policies import CandidateLengthPolicy, DraftStep, make_policy
from ..policies.goodput import CostModel
from . import fast_llama
from .admission import DEFAULT_ADMISSION, AdmissionRule, check_admission
from .kv_cache import compaction
from .models import context_length, fingerprint, hidden_size, param_count, vocab_size
from .packing import worth_packing
from .runner import TimedRunner, pad_front, sliding_layout
from .tensor_parallel import check_same_output, tp_size
from .sampling import SamplingConfig, process_logits, sample_with_uniforms
from .stats import GenerationStats, RoundStats


@dataclass
class ContinuousOutput:
    """What :meth:`SpeculativeGenerator.generate_continuous` returns. new_tokens: each request's generated
    token ids, in the order of the prompts; admitted_ms / finished_ms: per request, ms from the call's
    start to the start of its prefill and to the end of its last round; stats: :class:`GenerationStats` of
    the whole call (``RoundStats.rows`` hold request indices)."""

    new_tokens: list[list[int]]
    admitted_ms: list[float]
    finished_ms: list[float]
    stats: GenerationStats

    def tokens_per_s(self) -> list[float]:
        """Per request: its tokens over the time from its admission to its last round (tokens/s)."""
        return [len(t) / ((f - a) / 1e3) if f > a else 0.0
                for t, a, f in zip(self.new_tokens, self.admitted_ms, self.finished_ms)]


@dataclass
class GenerationOutput:
    """sequences: ``[B, T + L]`` int64, prompt then generated tokens, right-padded with ``pad_token_id``.
    new_tokens: the generated token ids of each row. stats: :class:`GenerationStats`."""

    sequences: torch.Tensor
    new_tokens: list[list[int]]
    stats: GenerationStats


_GENERATE_ARGS = ("input_ids", "attention_mask", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id",
                  "seed", "streamer", "pad_token_id", "policy", "logits_processor")


class SpeculativeGenerator:
    """Lossless speculative generation with a target and a draft model that share a vocabulary.

    Args:
        target: a ``transformers`` causal LM (any device / dtype; ``device_map="auto"`` works, and so does a
            tensor-parallel target under ``torchrun``, see ``engine/tensor_parallel.py``).
        draft: a causal LM with the same vocabulary (not needed for ``policy="autoregressive"``).
        policy: a :class:`~specdec_ext.policies.CandidateLengthPolicy` or a name: ``"autoregressive"``,
            ``"fixed"`` (``k=``), ``"heuristic"``, ``"confidence"``, ``"adaedl"``, ``"specdecpp"`` (needs ``head``).
        head: the :class:`~specdec_ext.head.AcceptanceHead` for ``specdecpp``.
        fast_draft: run a Llama, Qwen2 or Qwen3 draft with the lean runner of ``engine/fast_llama.py`` (same
            function, a fraction of ``transformers``' per-step overhead); other drafts, or ``False``, use
            ``transformers``' forward.
        fast_target: likewise for the target (Llama, Qwen2, Qwen3 on one device, in one process); ``False`` runs it
            through ``transformers``' forward (which can pack rows of different depths, ``engine/packing.py``).
        costs: the pair's :class:`~specdec_ext.policies.goodput.CostModel` for cost-aware policies
            (``threshold="auto"``); default: profiled on first use and cached (see :meth:`costs`).
        allow_other_draft: accept (with a warning) a head whose recorded draft fingerprint is not this draft's.
        batch_costs: the pair's :class:`~specdec_ext.policies.goodput.BatchCosts` for the batch verification
            budget of ``threshold="auto"`` at batch size > 1; default: profiled on first use and cached.
        draft_context: the most tokens of a request's context (prompt and tokens so far) the draft reads when it
            first drafts for the request: its last ``draft_context`` tokens (None: all). The draft's read is
            prefill work the target's rounds must repay; a draft that sees a recent window proposes a little
            worse on long prompts, and the output stays the target's (verification is exact). The truncated
            draft context of MagicDec and TriForce (a StreamingLLM cache), here without attention sinks.
        **policy_kwargs: passed to the named policy (e.g. ``k=4``, ``threshold=0.7`` or ``"auto"``, ``k_min=1``,
            ``k_max=20``).

    Raises:
        ValueError: vocabulary mismatch between draft and target, a head for another draft (hidden size, or
            fingerprint unless ``allow_other_draft``), models on the meta device, a speculative policy without a draft,
            a ``draft_context`` that is not None or an integer >= 1.
    """

    def __init__(self, target, draft=None, policy: Union[str, CandidateLengthPolicy] = "fixed",
                 head: Optional[AcceptanceHead] = None, fast_draft: bool = True, costs: Optional[CostModel] = None,
                 allow_other_draft: bool = False, batch_costs=None, draft_context: Optional[int] = None,
                 fast_target: bool = True, **policy_kwargs):
        if draft_context is not None and (isinstance(draft_context, bool) or not isinstance(draft_context, int)
                                          or draft_context < 1):
            raise ValueError(f"draft_context must be None or an integer >= 1 (tokens), got {draft_context!r}")
        self.draft_context = draft_context
        self.target = target
        self._batch_costs = self._given_batch_costs = batch_costs
        self.draft = draft
        self.head = head
        self._costs = costs
        self.allow_other_draft = allow_other_draft
        for m in (target, draft):  # attention that cannot be rolled back is refused here, naming the model
            if m is not None:
                sliding_layout(m)
        self.fast_draft = fast_draft and draft is not None and fast_llama.supports(draft)
        self.fast_target = bool(fast_target) and fast_llama.supports(target)
        self.catch_up_ms = 0.0  # the draft's reads of rows' contexts (_catch_up) over this generator's calls: ms,
        self.catch_up_rows = 0  # and rows read (_draft_overhead's measured mean ms per request)
        self.admission_points: list = []  # continuous batching's admissions (rows, prompt tokens, ms): AdmissionRule
        self._draft_share: Optional[float] = None  # the draft's parameters over the target's (_draft_overhead)
        self.policy = self._make_policy(policy, head, policy_kwargs)

    def _make_policy(self, policy, head, kwargs) -> CandidateLengthPolicy:
        pol = make_policy(policy, head=head, **kwargs) if isinstance(policy, str) else policy
        if not isinstance(pol, CandidateLengthPolicy):
            raise TypeError(f"policy must be a name or a CandidateLengthPolicy, got {type(pol).__name__}")
        if pol.speculative:
            if self.draft is None:
                raise ValueError(f"policy {pol.name!r} needs a draft model (draft=...)")
            vt, vd = vocab_size(self.target), vocab_size(self.draft)
            if vt != vd:
                raise ValueError(f"vocabulary mismatch: the target has V = {vt} but the draft has V = {vd}; "
                                 "speculative decoding needs a draft and target that share one tokenizer and vocabulary")
            heads = getattr(pol, "heads", {}).values()
            fp = fingerprint(self.draft) if any(h.draft_fingerprint for h in heads) else None
            for head_obj in heads:
                head_obj.check_draft(hidden_size(self.draft), fp, self.allow_other_draft)
        return pol

    def costs(self, policy: Optional[CandidateLengthPolicy] = None) -> CostModel:
        """The pair's :class:`~specdec_ext.policies.goodput.CostModel` (ms per draft step, per verification of
        n tokens, per round): the one given to the constructor, or measured once where the pair runs and
        cached on disk (``engine/profile.py``; a progress line on stderr while it runs)."""
        if self._costs is None:
            from .profile import cached_profile

            k_max = max(20, getattr(policy, "max_candidates", 20))
            self._costs = cached_profile(self.target, self.draft, self.fast_draft, k_max, generator_cls=type(self),
                                         fast_target=self.fast_target)
        return self._costs

    def batch_costs(self, batch_size: int = 64):
        """The pair's :class:`~specdec_ext.policies.goodput.BatchCosts` (whole-round ms by batch size and K, target
        forward ms by batch size and tokens) for the batch verification budget, covering calls of up to
        ``batch_size`` rows: the one given to the constructor, or measured where the pair runs at the batch sizes
        such a call needs (``engine/profile.sizes_for``) and cached on disk (``engine/profile.py``; a progress
        line on stderr while it runs). The same object is returned while it covers the calls."""
        if self._given_batch_costs is not None:
            return self._given_batch_costs
        from .profile import cached_batch_profile, sizes_for

        need = sizes_for(batch_size)
        if self._batch_costs is None or not set(need) <= set(self._batch_costs.sizes):
            self._batch_costs = cached_batch_profile(self.target, self.draft, self.fast_draft, generator_cls=type(self),
                                                     fast_target=self.fast_target, sizes=need)
        return self._batch_costs

    def prepare(self, batch_size: int = 1, policy: Optional[CandidateLengthPolicy] = None) -> float:
        """Measure, or read from the cache, the cost tables that ``policy`` (default: the generator's) needs for calls
        of up to ``batch_size`` rows, and warm the runners up (weights packed, kernels' first shapes met), so that the
        first call's speed is the decoding's own; returns the seconds it took.

        Raises ValueError for a ``batch_size`` below 1."""
        pol = self.policy if policy is None else policy
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1 (rows), got {batch_size!r}")
        t0 = time.perf_counter()
        if pol.needs_costs:
            self.costs(pol)
        if batch_size > 1 and getattr(pol, "needs_batch_costs", False):
            self.batch_costs(batch_size)
        # a short call of a throwaway generator: packs the lean runners' weights and meets the kernels' shapes once
        warm = type(self)(self.target, self.draft if pol.speculative else None,
                          policy="fixed" if pol.speculative else "autoregressive", fast_draft=self.fast_draft,
                          fast_target=self.fast_target, **({"k": 2} if pol.speculative else {}))
        ids = torch.randint(0, vocab_size(self.target), (batch_size, 16), generator=torch.Generator().manual_seed(0))
        warm.generate(ids, max_new_tokens=16, temperature=0)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------ checks
    def _check_inputs(self, input_ids, attention_mask, max_new_tokens, policy):
        if isinstance(input_ids, torch.Tensor) and input_ids.numel() == 0:
            raise ValueError(f"empty prompt: input_ids has shape {list(input_ids.shape)} (no token); give at least "
                             "one token (e.g. BOS)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError("input_ids must be an int64 (or int32) tensor of token ids [B, T]")
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {list(input_ids.shape)}")
        if input_ids.shape[0] == 0:
            raise ValueError("input_ids has batch size 0")
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens (T = 0); give at least one token (e.g. BOS)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, "
                             f"got {list(attention_mask.shape)}")
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError("attention_mask: pad prompts on the left (the last position of every row must be a real token)")
        if int(attention_mask.sum(-1).min()) == 0:
            raise ValueError("empty prompt: a row of attention_mask has no real token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        vt = vocab_size(self.target)
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vt:
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {vt})")
        models = [("target", self.target)] + ([("draft", self.draft)] if policy.speculative else [])
        T = int(attention_mask.sum(-1).max())
        for name, m in models:
            ctx = context_length(m)
            if ctx is not None and T >= ctx:
                raise ValueError(f"the prompt has {T} tokens, longer than the {name} model's context of {ctx} tokens")
            if ctx is not None and T + max_new_tokens > ctx:
                raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {name} model's "
                                 f"context of {ctx} tokens")
        return input_ids.long(), attention_mask.long()

    # ------------------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 64, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_token_id: Union[int, Sequence[int], None] = None,
                 seed: Union[int, Sequence[int]] = 0, streamer=None, pad_token_id: Optional[int] = None,
                 policy: Union[str, CandidateLengthPolicy, None] = None, logits_processor=None,
                 **policy_kwargs) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per row.

        Args:
            input_ids: ``[B, T]`` (or ``[T]``) int64 prompt ids, left-padded when rows differ in length.
            attention_mask: ``[B, T]``, 1 for real tokens (default: all ones).
            max_new_tokens: >= 1.
            temperature / top_k / top_p: applied identically to draft and target; temperature 0 is greedy.
            eos_token_id: an id or ids that end a row (emitted, then nothing after it).
            seed: row b uses ``seed + b`` (or ``seed[b]`` for a sequence).
            streamer: a ``transformers`` streamer (``put``/``end``), batch size 1 only.
            policy / **policy_kwargs: override the generator's policy for this call.
            logits_processor: a callable ``(input_ids [1, t] int64, scores [1, V] float32) -> scores``, e.g. a
                ``transformers`` ``LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])``, applied before
                temperature / top-k / top-p to the draft's and the target's logits alike, each verified position
                with its own prefix (the row's prompt as given, padding included as in ``transformers``,
                its generated tokens, the candidates before it), so the output follows the target's *processed* distribution exactly. Called once
                per row and position (correct, not fast).

        Returns: :class:`GenerationOutput`; ``stats`` holds per-round and per-call figures (ms, tokens/s).

        Raises: ValueError / TypeError for bad input (empty prompt, prompt beyond the context,
            max_new_tokens < 1, bad sampling settings, streamer with batch > 1, a keyword argument it does not
            know, e.g. ``do_sample`` or ``repetition_penalty``: it is refused, never silently ignored);
            RuntimeError when the ranks of a tensor-parallel target produced different outputs.
        """
        pol = self._policy_for_call(policy, policy_kwargs)
        cfg = SamplingConfig(temperature, top_k, top_p)
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask, max_new_tokens, pol)
        B, T = input_ids.shape
        if streamer is not None and B != 1:
            raise ValueError("streamer supports batch size 1 only")
        _check_processor(logits_processor)
        prompts = [input_ids[b].cpu() for b in range(B)] if logits_processor else None  # padded, as transformers
        call = _Call(cfg, max_new_tokens, _eos_set(eos_token_id), streamer, logits_processor, prompts,
                     [input_ids[b][attention_mask[b].bool()].cpu() for b in range(B)])
        rngs = _row_generators(seed, B)
        stats = GenerationStats(policy=pol.describe(), batch_size=B)
        self._configure(pol, cfg, B)  # costs profiled on first use: not part of this call's time
        t_start = time.perf_counter()
        target, draft = self._start_runners(pol, input_ids, attention_mask)
        stats.prefill_ms = (time.perf_counter() - t_start) * 1e3
        if streamer is not None:
            streamer.put(input_ids.cpu())
        last = input_ids[:, -1].clone()
        batch = _Batch.starting(list(range(B)), last, rngs, [[] for _ in range(B)])
        pol.reset(B, draft.device if draft is not None else target.device)  # head weights live beside the hidden states
        self._loop(pol, call, target, draft, batch, stats)
        if streamer is not None:
            streamer.end()
        stats.wall_ms = (time.perf_counter() - t_start) * 1e3
        out = _output(input_ids, batch.generated, call.eos, pad_token_id, stats)
        if tp_size(self.target) > 1:  # every rank decided for itself: prove they agree
            check_same_output(out.sequences)
        return out

    @torch.inference_mode()
    def generate_continuous(self, prompts, batch_size: int, max_new_tokens: Union[int, Sequence[int]] = 64,
                            temperature: float = 1.0,
                            top_k: Optional[int] = None, top_p: Optional[float] = None,
                            eos_token_id: Union[int, Sequence[int], None] = None, seed: Union[int, Sequence[int]] = 0,
                            policy: Union[str, CandidateLengthPolicy, None] = None, logits_processor=None,
                            admission: str = DEFAULT_ADMISSION, **policy_kwargs) -> "ContinuousOutput":
        """Continuous batching: generate for every prompt, with up to ``batch_size`` requests live at once.

        The first ``batch_size`` prompts start together; whenever requests finish, the next prompts of the queue
        take their places after that round: the target prefills them and their caches are written into the
        finished rows' places (:meth:`~specdec_ext.engine.runner.TimedRunner.replace_rows`), so the batch stays
        full until the queue runs dry, as in a server; the draft reads a request's context when it first drafts
        for it (a request served by plain steps alone never runs the draft). A request's output equals its
        output from :meth:`generate` alone (greedy; seeded sampling too, except under the batch verification
        budget of ``threshold="auto"``, whose decisions couple the rows: there its distribution, not its draws,
        is the same).

        Args:
            prompts: a sequence of prompts, each a 1-D int tensor or a list of token ids (at least one token).
            batch_size: the most requests live at once, >= 1.
            max_new_tokens: the most tokens a request generates, >= 1: one for every request, or one per prompt
                (a sequence as long as ``prompts``: requests of different lengths finish at different rounds, as a
                server's do).
            seed: request i draws from ``seed + i`` (or ``seed[i]`` for a sequence).
            admission: when queued requests join: ``"eager"``, after every round that freed a slot;
                ``"grouped"``, once the throughput the free slots lose reaches the measured fixed cost of an admission
                (:class:`~specdec_ext.engine.admission.AdmissionRule`: fewer, larger prefills, for devices where a
                forward's cost hardly grows with its rows); ``"ahead"``, as eager, but the target prefills the
                queue's next ``min(batch_size, AHEAD_ROWS)`` requests (16) in one go whenever it has none prefilled,
                and requests join from those rows (larger prefills than staggered rows would make, for up to 16
                more rows of KV cache; the default since 2026-11-25, :mod:`~specdec_ext.engine.admission`). Outputs do
                not depend on it (a request's tokens are its own); only when requests start does.
            temperature / top_k / top_p / eos_token_id / policy / logits_processor /
                **policy_kwargs: as :meth:`generate` (the processor sees each request's prompt unpadded).

        Returns: :class:`ContinuousOutput` (tokens, and per request the ms from the call's start to its
            admission, its prefill's start, and to its last round).

        Raises: ValueError / TypeError as :meth:`generate`, naming the prompt (``prompts[i]``); ValueError for
            no prompts, a batch_size that is not an integer >= 1, a sequence of max_new_tokens whose length is
            not the number of prompts, an unknown ``admission``, or ``"grouped"`` with a tensor-parallel target.
        """
        check_admission(admission)
        if admission == "grouped" and tp_size(self.target) > 1:
            raise ValueError("admission='grouped' decides from each process's own timings, and a tensor-parallel "
                             "target's ranks must decide alike: use admission='eager'")
        pol = self._policy_for_call(policy, policy_kwargs)
        cfg = SamplingConfig(temperature, top_k, top_p)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(prompts, torch.Tensor) or not len(prompts):
            raise ValueError("prompts: give a non-empty sequence of prompts (1-D tensors or lists of token ids)")
        per_request = not isinstance(max_new_tokens, int)
        if per_request and (isinstance(max_new_tokens, (str, bytes, torch.Tensor))
                            or not isinstance(max_new_tokens, Sequence) or len(max_new_tokens) != len(prompts)):
            raise ValueError(f"max_new_tokens must be an integer >= 1 or a sequence of them, one per prompt "
                             f"({len(prompts)}), got {max_new_tokens!r}")
        limits = list(max_new_tokens) if per_request else [max_new_tokens] * len(prompts)
        requests = []
        for i, p in enumerate(prompts):
            ids = p if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.int64)
            if ids.dim() != 1:
                raise ValueError(f"prompts[{i}]: a prompt is 1-D (token ids), got shape {list(ids.shape)}")
            try:
                requests.append(self._check_inputs(ids.view(1, -1), None, limits[i], pol)[0][0].cpu())
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        _check_processor(logits_processor)
        N = len(requests)
        call = _Call(cfg, max(limits), _eos_set(eos_token_id), None, logits_processor,
                     requests if logits_processor else None, requests, limits)
        rngs = _row_generators(seed, N)
        first = min(batch_size, N)
        stats = GenerationStats(policy=pol.describe(), batch_size=batch_size)
        self._configure(pol, cfg, first)
        queue = list(range(N))
        admitted_ms, finished_ms = [0.0] * N, [0.0] * N
        t_start = time.perf_counter()

        def prefill(ids, draft=True):  # runners that have read these requests' prompts (the draft's: empty)
            t0 = time.perf_counter()
            toks, mask = _right_aligned([requests[r] for r in ids])
            runners = self._start_runners(pol, toks, mask, lengths=[len(requests[r]) for r in ids], draft=draft)
            stats.prefill_ms += (time.perf_counter() - t0) * 1e3
            for r in ids:
                admitted_ms[r] = (t0 - t_start) * 1e3
            return runners

        def joining(ids):  # the starting state of these requests' rows
            last = torch.stack([requests[r][-1] for r in ids])
            return _Batch.starting(list(ids), last, [rngs[r] for r in ids], generated)

        def start(ids):  # runners that have read these requests' prompts, and their rows' starting state
            return (*prefill(ids), joining(ids))

        generated = [[] for _ in range(N)]
        rule = AdmissionRule(admission == "grouped", self.admission_points)
        # admission="ahead": prefilled rows not yet admitted (the target's runner, and the draft's where it read them)
        ahead = {"runner": None, "draft": None, "ids": [], "used": 0}

        def prefilled(ids, drafting):  # admission="ahead": [(runner, draft runner or None, their rows)] holding
            parts, need = [], list(ids)  # requests ``ids``; ``drafting``: whether the batch's last round drafted
            while need:
                if ahead["used"] == len(ahead["ids"]):  # prefill the next requests in one go
                    group = need + queue[: max(0, min(batch_size, AHEAD_ROWS) - len(need))]
                    t0 = time.perf_counter()
                    runner = prefill(group, draft=False)[0]
                    observe(group, t0)
                    ahead.update(runner=runner, ids=group, used=0,
                                 draft=self._read_ahead(pol, call, group, stats) if drafting else None)
                k = min(len(need), len(ahead["ids"]) - ahead["used"])
                parts.append((ahead["runner"], ahead["draft"], torch.arange(ahead["used"], ahead["used"] + k)))
                ahead["used"] += k
                need = need[k:]
            return parts

        def observe(ids, t0):  # an admission of requests ``ids`` that began at ``t0``, for the rule's fit
            rule.observe(len(ids), sum(len(requests[r]) for r in ids), (time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        target, draft, batch = start(queue[:first])
        observe(queue[:first], t0)
        del queue[:first]
        pol.reset(first, draft.device if draft is not None else target.device)

        def admit(batch, target, draft, done):  # queued requests take the places of finished ones
            now = (time.perf_counter() - t_start) * 1e3
            for i in done:
                finished_ms[batch.rows[i]] = now
            n = len(batch.rows)
            free = batch_size - (n - len(done))
            if not queue or free <= 0 or not rule.ready(batch_size - n, len(queue), n - len(done), batch_size,
                                                         stats.rounds[-1].total_ms):
                return done
            t0 = time.perf_counter()
            ids = queue[:free]
            del queue[: len(ids)]
            if admission == "ahead":
                parts = prefilled(ids, _drafting(stats.rounds))
                t_new = None
                d_new = self._start_runners(pol, None, None, target=False, rows=len(ids))[1]
                new = joining(ids)
            else:
                t_new, d_new, new = start(ids)
            grow = len(ids) - len(done)  # more requests than rows finished this round: the batch grows back
            if grow > 0:  # rows appended as copies of row 0, then overwritten like finished rows
                idx = torch.cat([torch.arange(n), torch.zeros(grow, dtype=torch.int64)])
                for r in (target, draft):
                    if r is not None:
                        r.select_rows(idx)
            slots = done[: len(ids)] + list(range(n, n + max(0, grow)))
            if t_new is not None:
                target.replace_rows(torch.tensor(slots), t_new)
            if draft is not None:  # d_new has read nothing: the slots become empty rows, read when they draft
                draft.replace_rows(torch.tensor(slots), d_new)

            def take(cache, runner, key, at, rows):  # a prefilled part's rows into their slots; close it once spent
                cache.replace_rows(torch.tensor(slots[at : at + len(rows)]), runner, rows=rows)
                if runner is not ahead[key] or ahead["used"] == len(ahead["ids"]):
                    runner.close()  # every row taken

            at = 0
            for runner, d_runner, rows in (parts if t_new is None else ()):  # the prefilled rows, part by part
                take(target, runner, "runner", at, rows)
                if draft is not None and d_runner is not None:  # rows the draft read ahead
                    take(draft, d_runner, "draft", at, rows)
                    new.unread -= set(ids[at : at + len(rows)])
                at += len(rows)
            order = list(range(n)) + [0] * max(0, grow)  # the new rows, appended, move into their slots
            for j, slot in enumerate(slots):
                order[slot] = n + j
            pol.add_rows(len(ids))
            pol.select_rows(torch.tensor(order))
            batch.extend(new)
            batch.select(order)
            stats.admissions += 1
            if admission != "ahead":  # ahead: the prefills were observed as they ran
                observe(ids, t0)
            return done[len(ids) :]

        self._loop(pol, call, target, draft, batch, stats, admit=admit, waiting=lambda: bool(queue))
        for r in (ahead["runner"], ahead["draft"]):
            if r is not None and r.mask is not None:
                r.close()
        stats.wall_ms = (time.perf_counter() - t_start) * 1e3
        stats.new_tokens = sum(len(g) for g in generated)
        if tp_size(self.target) > 1:  # every rank decided for itself: prove they agree
            check_same_output(torch.tensor([t for g in generated for t in g + [-1]], dtype=torch.int64))
        return ContinuousOutput(generated, admitted_ms, finished_ms, stats)

    def _configure(self, pol, cfg, batch_size: int) -> None:
        """Give the policy the call's decoding settings and, when it needs them, the pair's cost tables."""
        costs = self.costs(pol) if pol.needs_costs else None
        if getattr(pol, "needs_batch_costs", False):
            pol.configure(cfg, costs, batch_costs=self.batch_costs(batch_size) if batch_size > 1 else None)
        else:  # user policies written for the two-argument configure keep working
            pol.configure(cfg, costs)

    def _loop(self, pol, call: "_Call", target, draft, batch: "_Batch", stats, admit=None, waiting=None) -> None:
        """Rounds until no row is live; finished rows leave the batch. ``admit(batch, target, draft, done)``, when
        given, is called after each round with the positions of the rows that finished; it may give their places
        to new requests (continuous batching) and returns the positions left to remove; ``waiting()`` says whether
        requests are queued for them (:meth:`_draft_overhead`). Closes the runners."""
        tp = tp_size(self.target) > 1
        try:
            while batch.rows:
                remaining = torch.tensor([call.limit(r) - len(batch.generated[r]) for r in batch.rows])
                if pol.speculative:  # not measured for a tensor-parallel target's ranks, which must decide alike
                    pol.draft_overhead(0.0 if tp else self._draft_overhead(call, batch, waiting))
                    pol.draft_reads(0.0 if tp else self._draft_reads(batch))
                    if waiting is not None:  # continuous batching: rows in lockstep (rows_together)
                        pol.rows_together(len(remaining) > 1 and bool((remaining == remaining[0]).all()))
                if not pol.speculative:
                    emitted = self._plain_step(call, target, batch, stats)
                elif pol.draft_round(target.length):
                    self._catch_up(call, draft, batch, stats)
                    emitted = self._speculative_round(pol, call, target, draft, batch, remaining, stats)
                else:  # the policy skips drafting: a plain step, the draft falls one more token behind
                    emitted = self._plain_step(call, target, batch, stats)
                    batch.defer(batch.last)
                    none = torch.zeros(len(batch.rows), dtype=torch.int64)
                    pol.end_round(none, none)
                if pol.speculative and not tp:  # the ranks of a tensor-parallel target would measure differently
                    pol.round_time(stats.rounds[-1].total_ms)
                keep = self._commit(call, batch, emitted, remaining, stats)
                done = sorted(set(range(len(batch.rows))) - set(keep))
                if admit is not None:
                    done = admit(batch, target, draft, done)
                if done:  # the last rows take the finished rows' places: the runners move only those rows' caches
                    keep = compaction(len(batch.rows), done)
                    idx = torch.tensor(keep, dtype=torch.int64)
                    for r in (target, draft):
                        if r is not None:
                            r.select_rows(idx)
                    pol.select_rows(idx)
                    batch.select(keep)
        finally:
            stats.target_calls, stats.target_forward_ms = target.calls, target.seconds * 1e3
            stats.draft_calls = draft.calls if draft is not None else 0
            stats.draft_forward_ms = draft.seconds * 1e3 if draft is not None else 0.0
            for r in (target, draft):
                if r is not None:
                    r.close()

    def _policy_for_call(self, policy, policy_kwargs) -> CandidateLengthPolicy:
        if policy is None and policy_kwargs:
            raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(policy_kwargs)}: it accepts "
                            f"{', '.join(_GENERATE_ARGS)}, and policy keyword arguments (k, threshold, k_min, k_max, "
                            "...) only together with policy=")
        return self.policy if policy is None else self._make_policy(policy, self.head, policy_kwargs)

    def _start_runners(self, pol, input_ids, attention_mask, lengths: Optional[list] = None, target: bool = True,
                       draft: bool = True, rows: Optional[int] = None):
        """``(target, draft)``: the target's runner, with the prompt but its last token, and, when speculating,
        the draft's, started empty: the draft reads a row's context only when the row first drafts
        (:meth:`_catch_up`). Tells the policy whether the target verifies rows of different depths packed (before
        its ``reset``). ``target=False`` / ``draft=False``: that runner is None (``rows``: the draft's rows, where
        there are no ``input_ids``).

        ``lengths`` (continuous batching: each row's prompt length, the prompts right-aligned in ``input_ids``):
        rows of very different lengths are prefilled in groups of similar length (:func:`length_groups`)."""
        B = input_ids.shape[0] if rows is None else rows
        t = d = None
        if draft and pol.speculative:
            d = fast_llama.runner_for(self.draft, "draft", self.fast_draft)
            d.start(B)
        if target:
            t = fast_llama.runner_for(self.target, "target", self.fast_target)
            pol.packed_verification = t.packs
            t.start(B)
            _prefill(t, input_ids, attention_mask, lengths)
        return t, d

    def _draft_overhead(self, call: "_Call", batch: "_Batch", waiting=None) -> float:
        """ms per emitted token that drafting adds outside the rounds, for the policy's ``draft_overhead``: the
        draft's measured mean ms to read a request's context (:meth:`_catch_up`, over this generator's calls)
        over the tokens a request emits (``max_new_tokens``; their mean where requests have their own), while reads
        are still to come (a live row unread, or ``waiting()``: requests queued); else 0. Before any read was
        measured, the target's measured mean prefill ms per request (continuous batching's admissions) times the
        draft's share of the pair's parameters (draft over target; 0.126 on the bundled pair, whose target prefilled
        HumanEval prompts at about 35 ms each at B = 16, so 4.4 ms, where the draft's reads measured 3.5-5.4; a
        ``draft_context`` window is not counted in it), and 0 without either. On the bundled pair at B = 16
        (2-core AMD EPYC, 48-token HumanEval requests) a read took 5.4 ms per request with the bf16 target's draft
        (0.6 s for 112 requests) and 7.5-9 ms with the fp32 draft of an AVX2-only machine, 0.11-0.19 ms per emitted
        token, where decoding gains some 0.1 ms per token over plain steps."""
        if not (batch.unread or (waiting is not None and waiting())):
            return 0.0
        if self.catch_up_rows:
            return self.catch_up_ms / self.catch_up_rows / call.mean_limit
        # nothing read yet: the target's measured prefill ms per request, scaled by the draft's share of the pair's
        # parameters (a prefill's work grows with both), so that a batch's first decision to draft prices the reads
        points = self.admission_points
        if not points or self.draft is None:
            return 0.0
        if self._draft_share is None:  # counted once: a round reads it until the draft's first read
            self._draft_share = param_count(self.draft) / max(1, param_count(self.target))
        per_request = sum(ms for _, _, ms in points) / max(1, sum(rows for rows, _, _ in points))
        return per_request * self._draft_share / call.mean_limit

    def _read_ahead(self, pol, call: "_Call", ids: list, stats) -> Optional[TimedRunner]:
        """admission="ahead", while the batch drafts (:func:`_drafting`): a draft runner that has read requests
        ``ids``' prompts (their contexts: nothing is generated yet) in one prefill, as the target just did; None for
        plain decoding. A batch taking plain steps (the verification budget where speculation does not pay) leaves
        its new rows for the draft to read when they first draft (:meth:`_catch_up`), so rows that never draft cost
        no read. Read that way, requests joined a few at a time and the draft read them in groups of 1-4: 4.6 ms a
        HumanEval prompt alone against 2.8 ms in a group of 16 (bundled pair, bf16 draft, 2-core AMD EPYC with
        AVX512_BF16; the target's prefills take groups of 16 for the same reason). Its time counts as the draft's
        reads (``stats.draft_prefill_ms``, and the engine's mean ms per request read)."""
        if not pol.speculative:
            return None
        t0 = time.perf_counter()
        ctx = self._draft_window([call.inputs[r] for r in ids])
        d = self._start_runners(pol, None, None, target=False, rows=len(ids))[1]
        toks, mask = _right_aligned(ctx)
        _prefill(d, toks, mask, [len(c) for c in ctx])
        self._count_read(stats, t0, len(ids))
        return d

    def _draft_window(self, contexts: list) -> list:
        """The part of each context (1-D int64) the draft reads: all of it, or with ``draft_context`` its last
        ``draft_context`` tokens."""
        return contexts if self.draft_context is None else [c[-self.draft_context :] for c in contexts]

    def _count_read(self, stats, t0: float, requests: int) -> float:
        """Count a read by the draft that began at ``t0`` (``time.perf_counter()``) as prefill time and the draft's
        (``stats.prefill_ms``, ``stats.draft_prefill_ms``) and, where it read ``requests`` > 0 requests' contexts,
        in the engine's mean ms per request read (:meth:`_draft_reads`); returns its ms."""
        ms = (time.perf_counter() - t0) * 1e3
        stats.prefill_ms += ms
        stats.draft_prefill_ms += ms
        if requests:
            self.catch_up_ms += ms
            self.catch_up_rows += requests
        return ms

    def _draft_reads(self, batch: "_Batch") -> float:
        """ms the draft would spend reading the live rows it has not read (:meth:`_catch_up`) if this round drafted:
        the measured mean ms per request times those rows, for the policy's ``draft_reads``; 0 before any read was
        measured."""
        if not self.catch_up_rows or not batch.unread:
            return 0.0
        return self.catch_up_ms / self.catch_up_rows * sum(r in batch.unread for r in batch.rows)

    def _catch_up(self, call: "_Call", draft, batch: "_Batch", stats) -> None:
        """Before a round that drafts: the draft reads the context (prompt and generated tokens, but the last) of
        each live row it has not read yet, in groups of similar length, and the row's next pending token is its
        last one. A row's draft prefill is so paid only if the row ever drafts: a batch that takes plain steps
        (``draft_round`` False, e.g. the verification budget where speculation does not pay, as at B = 64 on a
        2-core CPU) never runs the draft's prefill, which cost about a sixth of the target's there. Its time is
        counted in ``stats.prefill_ms`` and ``stats.draft_prefill_ms``, not in the round's. With ``draft_context``
        the draft reads only the last ``draft_context`` tokens of each context."""
        pos = [i for i, r in enumerate(batch.rows) if r in batch.unread]
        if pos:
            self._read_rows(call, draft, batch, stats, pos)
        self._catch_up_deferred(draft, batch, stats)  # after the reads: an unread row's deferred tokens were read

    def _read_rows(self, call: "_Call", draft, batch: "_Batch", stats, pos: list) -> None:
        """The draft reads the contexts of the live rows at positions ``pos`` (:meth:`_catch_up`)."""
        t0 = time.perf_counter()
        ctx = self._draft_window([torch.cat([call.inputs[batch.rows[i]],
                                             torch.tensor(batch.generated[batch.rows[i]], dtype=torch.int64)])
                                  for i in pos])
        toks, mask = _right_aligned(ctx)
        _prefill(draft, toks, mask, [len(c) for c in ctx], slots=torch.tensor(pos))
        valid = batch.pending_valid.clone()
        valid[pos, :-1] = False  # the last pending token (the row's last token) is all the draft has not read
        batch.pending_valid = valid
        batch.unread -= {batch.rows[i] for i in pos}
        self._count_read(stats, t0, len(pos))

    def _catch_up_deferred(self, draft, batch: "_Batch", stats) -> None:
        """Before a round that drafts after plain steps: the draft reads the tokens those steps committed (deferred,
        ``_Batch.defer``) but the last in one forward of its own, so the round's first draft forward feeds what a
        round after a drafting round feeds. Its time counts as the draft's reads (``stats.draft_prefill_ms``, and
        apart in ``stats.draft_deferred_ms``), not the round's: a round's time is what a policy measures a depth's
        cost by, and one after 40 plain steps at B = 16 (bundled pair, bf16, 2-core AMD EPYC) carried 40 tokens a
        row into its first forward, which made the verification budget read a round of one candidate as 1.9x dearer
        against the table than a plain step, where rounds of fixed K = 1 measured 1.5x."""
        if batch.pending.shape[1] <= 2:  # after a drafting round: the last candidate (when unseen) and the next token
            return
        t0 = time.perf_counter()
        valid = batch.pending_valid[:, :-1]
        if bool(valid.any()):
            draft.forward(batch.pending[:, :-1], valid, keep=1)
        batch.pending, batch.pending_valid = batch.pending[:, -1:], batch.pending_valid[:, -1:]
        stats.draft_deferred_ms += self._count_read(stats, t0, 0)

    def _commit(self, call: "_Call", batch: "_Batch", emitted, remaining, stats) -> list[int]:
        """Append each live row's emitted tokens, cut at max_new_tokens and at EOS; stream them; return the
        positions (in the live batch) of the rows that go on."""
        keep = []
        for i, r in enumerate(batch.rows):
            toks = emitted[i][: int(remaining[i])]
            for j, t in enumerate(toks):
                if t in call.eos:
                    toks = toks[: j + 1]
                    break
            batch.generated[r].extend(toks)
            if call.streamer is not None and toks:
                call.streamer.put(torch.tensor(toks))
            stats.new_tokens += len(toks)
            if stats.rounds:
                stats.rounds[-1].emitted[i] = len(toks)
            done = len(batch.generated[r]) >= call.limit(r) or (toks and toks[-1] in call.eos)
            if not done:
                keep.append(i)
        return keep

    # ------------------------------------------------------------------------------ rounds
    def _plain_step(self, call: "_Call", target, batch: "_Batch", stats) -> list[list[int]]:
        cfg = call.cfg
        t0 = time.perf_counter()
        logits, _ = target.forward(batch.last.view(-1, 1), keep=1)
        logits = logits[:, -1].to(target.device)
        if call.processor is not None:
            logits = _processed(call.processor, _prefixes(call, batch), logits, None)
        if cfg.greedy:
            nxt = ops.argmax_tokens(logits)
        else:
            nxt = sample_with_uniforms(process_logits(logits, cfg), _uniforms(batch.rngs, 1)[:, 0])
        batch.last.copy_(nxt.to(batch.last.device))
        ms = (time.perf_counter() - t0) * 1e3
        n = batch.last.shape[0]
        stats.rounds.append(RoundStats([0] * n, [0] * n, [1] * n, 0.0, ms, ms, list(batch.rows)))
        return [[int(t)] for t in nxt.tolist()]

    def _speculative_round(self, pol, call: "_Call", target, draft, batch: "_Batch", remaining, stats) -> list[list[int]]:
        """Draft, verify, roll back; returns the tokens each live row emits (accepted prefix + one)."""
        cfg = call.cfg
        t0 = time.perf_counter()
        kcap = pol.max_candidates
        u = None if cfg.greedy else _uniforms(batch.rngs, 2 * kcap + 1)  # a fixed number per row and round
        drafted = self._draft(pol, call, draft, batch, remaining, u)
        n = pol.verify_depth(drafted.n)
        if not torch.equal(n, drafted.n):  # a verification budget keeps fewer slots than were drafted
            D = int(n.max())
            drafted = _Drafted(drafted.cands[:, :D], drafted.qs[:D], n, drafted.fed)
        t1 = time.perf_counter()
        out, acc = self._verify(call, target, batch, drafted, u, kcap)
        t2 = time.perf_counter()
        emitted = [out[b, : int(acc[b]) + 1].tolist() for b in range(out.shape[0])]
        self._roll_back(target, draft, batch, drafted, out, acc)
        pol.end_round(drafted.n, acc)
        t3 = time.perf_counter()
        stats.rounds.append(RoundStats(drafted.n.tolist(), acc.tolist(), [len(e) for e in emitted],
                                       (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3, list(batch.rows)))
        return emitted

    def _draft(self, pol, call: "_Call", draft, batch: "_Batch", remaining, u) -> "_Drafted":
        """Candidates one draft forward at a time, asking the policy after each whether each row stops.
        The first forward feeds the tokens the draft has not seen and proposes candidate 1; each later one
        feeds the candidate just drafted and proposes the next (K candidates: K draft forwards)."""
        cfg = call.cfg
        B = batch.last.shape[0]
        kcap = pol.max_candidates
        cap = (remaining - 1).clamp(min=0, max=kcap)  # per row: never draft past max_new_tokens or K_max
        n = torch.zeros(B, dtype=torch.int64)
        stopped = cap <= 0
        pol.begin_round()
        bases = _prefixes(call, batch) if call.processor is not None else None
        logits, hid = draft.forward(batch.pending, batch.pending_valid, keep=1, hidden=pol.needs_hidden)
        cands, qs = [], []
        step = 0
        fed = torch.zeros(B, dtype=torch.int64)  # candidates fed back to the draft, per row
        subset = isinstance(draft, fast_llama.FastLlamaRunner)  # can compute only the rows still drafting
        need_probs = not cfg.greedy or pol.needs_probs
        while True:
            step += 1
            last_logits = logits[:, -1]
            if call.processor is not None:
                last_logits = _processed(call.processor, bases, last_logits, torch.stack(cands, 1) if cands else None)
            if cfg.greedy:
                x = ops.argmax_tokens(last_logits)  # torch.argmax's tokens, vectorised on a CPU
                q = torch.softmax(last_logits, -1) if need_probs else None
            else:
                q = process_logits(last_logits, cfg)
                x = sample_with_uniforms(q, u[:, step - 1])
            cands.append(x)
            qs.append(q if not cfg.greedy else None)
            n = torch.where(stopped, n, torch.full_like(n, step))
            info = DraftStep(step, B, q.gather(-1, x.view(-1, 1)).squeeze(-1) if q is not None else None, q,
                             hidden=hid[:, -1] if hid is not None else None, tokens=x, logits=last_logits,
                             drafting=~stopped, room=~stopped & (step < cap))
            stopped = stopped | pol.should_stop(info).cpu() | (step >= cap)
            if bool(stopped.all()) or step >= kcap:
                break
            live = ~stopped
            if subset and not bool(live.all()):  # rows that stopped stop paying: only the live rows are computed
                idx = live.nonzero().view(-1)
                part, part_hid = draft.forward(x[idx.to(x.device)].view(-1, 1), keep=1, hidden=pol.needs_hidden, rows=idx)
                logits = logits.clone()
                logits[idx.to(logits.device)] = part  # stopped rows keep stale values that nothing reads
                if part_hid is not None:
                    hid = hid.clone()
                    hid[idx.to(hid.device)] = part_hid
            else:  # the others sit out as holes
                logits, hid = draft.forward(x.view(-1, 1), live.view(-1, 1), keep=1, hidden=pol.needs_hidden)
            fed += live.long()
        return _Drafted(torch.stack(cands, 1), qs, n, fed)

    def _verify(self, call: "_Call", target, batch: "_Batch", drafted: "_Drafted", u, kcap):
        """The target scores the last committed token and the K candidates in one forward; one fused op
        accepts a prefix per row and emits the residual or bonus token. Returns (out [B, K+1], num_accepted
        [B]) on the CPU."""
        cfg = call.cfg
        vdev = target.device
        B, K = drafted.cands.shape
        cand = drafted.cands.to(vdev)
        # a row verifies its own n_b candidates: the slots past them are holes, and where the target's runner can
        # pack rows and enough slots are holes to pay for it, a forward over the real tokens alone (a verification
        # budget's per-row depths cost no padding)
        valid = torch.arange(K + 1).unsqueeze(0) <= drafted.n.unsqueeze(1)
        pack = K > 0 and target.packs and worth_packing(B + int(drafted.n.sum()), B * (K + 1))
        t_logits, _ = target.forward(torch.cat([batch.last.view(-1, 1).to(vdev), cand], 1), valid, keep=K + 1,
                                     packed=pack)
        t_logits = t_logits.to(vdev)  # a target spread over devices returns logits on its last one
        if call.processor is not None:  # position i sees the candidates before it
            bases = _prefixes(call, batch)
            t_logits = torch.stack([_processed(call.processor, bases, t_logits[:, i], drafted.cands[:, :i] if i else None)
                                    for i in range(K + 1)], 1)
        n_dev = drafted.n.to(vdev)
        if K == 0:  # no slot kept: the target's next token, as plain decoding (the same uniform as a bonus token)
            nxt = ops.argmax_tokens(t_logits[:, 0]) if cfg.greedy else \
                sample_with_uniforms(process_logits(t_logits[:, 0], cfg), u[:, kcap].to(vdev))
            return nxt.view(-1, 1).cpu(), torch.zeros(B, dtype=torch.int64)
        if cfg.greedy:
            out, acc = ops.chain_verify_greedy(cand, t_logits, n_dev)
        else:
            p = process_logits(t_logits, cfg)
            q = torch.stack([qq.to(vdev) for qq in drafted.qs], 1)
            out, acc = ops.chain_verify(cand, q, p, n_dev, uniforms=u[:, kcap : kcap + K + 1].to(vdev))
        return out.cpu(), acc.cpu()

    def _roll_back(self, target, draft, batch: "_Batch", drafted: "_Drafted", out, acc) -> None:
        """Both caches back to the accepted prefix; the next round's pending tokens and last token."""
        B, K = drafted.cands.shape
        fed = drafted.fed
        target.rollback(drafted.n - acc)  # the target saw [last, x_1..x_n]; it keeps last, x_1..x_acc
        kept = torch.minimum(acc, fed)
        draft.rollback(fed - kept)  # row b's draft saw fed[b] candidates; it keeps the accepted ones it saw
        extra = out[torch.arange(B), acc]
        unseen = acc > fed  # its last accepted candidate never fed: the draft catches up on it next round
        # out and acc come back on the CPU (_verify); the candidates live on the draft's device
        lastcand = drafted.cands.cpu().gather(1, (acc - 1).clamp(min=0).view(-1, 1)).view(-1) if K else extra
        batch.pending = torch.stack([torch.where(unseen, lastcand, extra), extra], 1)
        batch.pending_valid = torch.stack([unseen, torch.ones_like(unseen)], 1)
        batch.last.copy_(extra.to(batch.last.device))


PREFILL_PADDING = 0.25  # length_groups: the padding a prefill group may compute, as a share of its real tokens
PREFILL_SLACK = 128     # ... or this many padding tokens (a forward of a few short prompts costs little more)
# The most tokens (rows x columns, padding included) one prefill forward computes; a longer prefill runs as forwards
# over consecutive column chunks, through the KV cache (None: one forward). On a 2-core AMD EPYC (fp32 bundled
# target) 16 prompts of 767 tokens took 6.9 s in one forward and 5.2 s in chunks of 128 columns (2,048 tokens):
# the activations of a 12k-token forward leave the caches. Chunks much smaller lose again (64 columns of 4 rows).
PREFILL_CHUNK_TOKENS: Optional[int] = 2048


def length_groups(lengths: Sequence[int], padding: float = PREFILL_PADDING,
                  slack: int = PREFILL_SLACK) -> list[list[int]]:
    """The rows ``0 .. len(lengths) - 1`` in groups to prefill together, the widest group first: rows sorted by
    length (longest first) and cut greedily so that a group, padded to its longest row, computes at most
    ``padding`` times its real tokens, or ``slack`` tokens, in padding. A padded prefill computes every row at
    the longest prompt's length: for the first 64 HumanEval prompts (39 to 365 tokens) 64% of it was padding,
    and the prefills were about 70% of a continuous-batching run's wall time at B = 64 on a 2-core CPU."""
    groups: list[list[int]] = []
    real = 0  # the real tokens of the last group
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups:
            width, total = lengths[groups[-1][0]], real + lengths[i]
            if (len(groups[-1]) + 1) * width - total <= max(padding * total, slack):
                groups[-1].append(i)
                real = total
                continue
        groups.append([i])
        real = lengths[i]
    return groups


def _drafting(rounds: list, recent: int = 4) -> bool:
    """Whether a batch is drafting, for reading new requests ahead (:meth:`SpeculativeGenerator._read_ahead`): at
    least three in four of its last ``recent`` rounds drafted (all of them while it has had fewer). One drafting
    round among plain steps is a verification budget's probe (``BatchBudget``), after which it mostly goes back to plain
    steps: reading ahead on the last round alone, the budget at B = 16 read 0.92 s of contexts where it read 0.30
    s lazily (bundled pair, 128 HumanEval requests, bf16 on a 2-core AMD EPYC)."""
    last = rounds[-recent:]
    return bool(last) and sum(any(r.candidates) for r in last) * 4 >= 3 * len(last)


def _right_aligned(seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences (1-D int64) as a batch ``[B, T]`` padded with zeros on the left, and its mask ``[B, T]``
    bool (True at real tokens), T the longest sequence's length."""
    lengths = torch.tensor([len(t) for t in seqs])
    width = int(lengths.max())
    toks = torch.stack([pad_front(t.view(1, -1), width)[0] for t in seqs])
    return toks, torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)


# admission="ahead": the most requests the target prefills together ahead of their admission. On the bundled pair
# in bf16 (2-core Intel Xeon with AMX, HumanEval prompts) a prefill's cost per prompt token was lowest in groups of
# 8-16 (100-130 us) and higher in groups of 1-2 (130-160 us) and 32-64 (130-180 us: the groups of similar length are
# written into the runner one by one); ahead of every one of 64 rows, the prefills cost 12% more than eager's.
AHEAD_ROWS = 16


def _prefill(runner, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Optional[list] = None,
             slots: Optional[torch.Tensor] = None) -> None:
    """Feed a started ``runner`` the prompts ``input_ids`` ``[B, T]`` but their last tokens (``attention_mask``
    ``[B, T]``, nonzero for real tokens), into its rows ``slots`` (``[B]`` int64; default: all its B rows, which
    have read nothing). With ``lengths`` (each row's length, the rows right-aligned), rows of very different
    lengths are prefilled in groups of similar length (:func:`length_groups`), each group's runner written into
    its rows (``replace_rows``), the widest first, so the prefill computes little padding."""
    B, T = input_ids.shape
    groups = (length_groups(lengths, PREFILL_PADDING, PREFILL_SLACK) if lengths is not None and T > 1
              else [list(range(B))])
    if slots is None and len(groups) == 1:  # straight into the runner
        if T > 1:
            _chunked_forward(runner, input_ids[:, :-1], attention_mask[:, :-1].bool())
        return
    for rows in groups:  # the widest group first: later ones never widen the cache
        w = max(lengths[i] for i in rows) if lengths is not None else T
        part = type(runner)(runner.model, runner.name)
        part.start(len(rows))
        if w > 1:
            _chunked_forward(part, input_ids[rows, T - w : -1], attention_mask[rows, T - w : -1].bool())
        runner.replace_rows(torch.tensor(rows) if slots is None else slots[rows], part)


def _chunked_forward(runner, tokens: torch.Tensor, valid: torch.Tensor) -> None:
    """Feed ``tokens`` ``[B, n]`` (``valid`` ``[B, n]`` bool) to ``runner`` in forwards of at most
    ``PREFILL_CHUNK_TOKENS`` tokens (B x columns; at least one column each), consecutive column chunks through the
    KV cache: each chunk's queries see the cache of the chunks before, so the cache and positions are what one
    forward over all n columns leaves (chunked prefill, as vLLM's ``max_num_batched_tokens``)."""
    B, n = tokens.shape
    step = n if PREFILL_CHUNK_TOKENS is None else max(1, PREFILL_CHUNK_TOKENS // max(B, 1))
    for c in range(0, n, step):
        runner.forward(tokens[:, c : c + step], valid[:, c : c + step], keep=1)


# ---------------------------------------------------------------------------------- call and round state
@dataclass
class _Call:
    """Settings of one generate() call."""

    cfg: SamplingConfig
    max_new_tokens: int
    eos: set
    streamer: object
    processor: Optional[Callable] = None  # logits_processor of the call
    prompts: Optional[list] = None        # each original row's prompt ids as given (for the processor)
    inputs: Optional[list] = None         # each original row's prompt ids without padding (the draft reads them)
    limits: Optional[list] = None         # each original row's own max_new_tokens (None: max_new_tokens for all)

    def limit(self, row: int) -> int:
        """The most tokens original row ``row`` generates."""
        return self.max_new_tokens if self.limits is None else self.limits[row]

    @property
    def mean_limit(self) -> float:
        """The rows' mean max_new_tokens."""
        return self.max_new_tokens if self.limits is None else sum(self.limits) / len(self.limits)


def _prefixes(call: "_Call", batch: "_Batch") -> list[torch.Tensor]:
    """Each live row's tokens so far, ``[t]`` int64: its prompt as given, then its generated tokens."""
    return [torch.cat([call.prompts[r], torch.tensor(batch.generated[r], dtype=torch.int64)]) for r in batch.rows]


def _processed(processor: Callable, bases: list[torch.Tensor], logits: torch.Tensor,
               cands: Optional[torch.Tensor]) -> torch.Tensor:
    """``logits`` ``[B, V]`` of the live rows through ``processor``, row by row, each with its prefix: the
    row's tokens so far (``bases``, :func:`_prefixes`), then ``cands[b]`` (``[B, j]``, the candidates before
    this position)."""
    rows = []
    for i, base in enumerate(bases):
        prefix = base if cands is None else torch.cat([base, cands[i].cpu().to(torch.int64)])
        rows.append(processor(prefix.view(1, -1).to(logits.device), logits[i : i + 1].float().clone())[0])
    return torch.stack(rows)


@dataclass
class _Batch:
    """The live rows of a generate() call and what their next round starts from."""

    rows: list[int]               # original row index of each live row
    last: torch.Tensor            # [B] last committed token of each live row (not yet in the target's cache)
    pending: torch.Tensor         # [B, P] tokens the draft has not seen yet (P = 1 or 2, more after plain steps)
    pending_valid: torch.Tensor   # [B, P] bool: which pending slots are real tokens
    rngs: list                    # [B] per-row torch.Generator
    generated: list[list[int]]    # every original row's emitted tokens
    unread: set = field(default_factory=set)  # original rows whose context the draft has not read (_catch_up)

    @classmethod
    def starting(cls, rows: list[int], last: torch.Tensor, rngs: list, generated: list[list[int]]) -> "_Batch":
        """Rows whose prompts the target has just read: ``last`` ``[B]`` (each prompt's last token) is what the
        target sees next; the draft has read nothing of them yet."""
        return cls(rows, last, last.view(-1, 1), torch.ones(len(rows), 1, dtype=torch.bool), rngs, generated,
                   set(rows))

    def defer(self, token: torch.Tensor) -> None:
        """The draft did not run this round: ``token`` ``[B]`` (the new last token) joins what it has not seen."""
        self.pending = torch.cat([self.pending, token.view(-1, 1).to(self.pending.device)], 1)
        self.pending_valid = torch.cat([self.pending_valid, torch.ones_like(self.pending_valid[:, :1])], 1)

    def extend(self, other: "_Batch") -> None:
        """Rows of ``other`` (new requests, sharing ``generated``) join after the live rows."""
        self.rows = self.rows + other.rows
        self.rngs = self.rngs + other.rngs
        self.unread = self.unread | other.unread
        self.last = torch.cat([self.last, other.last.to(self.last.device)])
        width = max(self.pending.shape[1], other.pending.shape[1])
        self.pending = torch.cat([pad_front(self.pending, width), pad_front(other.pending.to(self.pending.device), width)])
        self.pending_valid = torch.cat([pad_front(self.pending_valid, width),
                                        pad_front(other.pending_valid.to(self.pending_valid.device), width)])

    def select(self, keep: list[int]) -> None:
        """Keep live rows ``keep`` (positions in the live batch)."""
        idx = torch.tensor(keep, dtype=torch.int64)
        self.rows = [self.rows[i] for i in keep]
        self.rngs = [self.rngs[i] for i in keep]
        self.unread = self.unread & set(self.rows)
        self.last = self.last[idx.to(self.last.device)]
        self.pending = self.pending[idx.to(self.pending.device)]
        self.pending_valid = self.pending_valid[idx.to(self.pending_valid.device)]


@dataclass
class _Drafted:
    """A round's candidates: cands [B, K] (a row drafted n[b] <= K of them), the draft distributions q
    (sampling), and how many candidates were fed back to the draft, per row (``[B]`` int64: a row takes part
    in the draft forwards until it stops)."""

    cands: torch.Tensor
    qs: list
    n: torch.Tensor
    fed: torch.Tensor


def _check_processor(logits_processor) -> None:
    if logits_processor is not None and not callable(logits_processor):
        raise TypeError(f"logits_processor must be callable (input_ids, scores) -> scores, got "
                        f"{type(logits_processor).__name__}")


def _eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def _row_generators(seed, B: int) -> list:
    seeds = [seed + b for b in range(B)] if isinstance(seed, int) else list(seed)
    if len(seeds) != B:
        raise ValueError(f"seed: need one seed per row ({B}), got {len(seeds)}")
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def _uniforms(rngs, n: int) -> torch.Tensor:
    """``[B, n]`` uniforms in (0, 1]: each row draws exactly n from its own generator."""
    return torch.stack([1.0 - torch.rand(n, generator=g) for g in rngs])


def _output(input_ids, generated, eos, pad_token_id, stats) -> GenerationOutput:
    B, T = input_ids.shape
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    L = max(len(g) for g in generated)
    seq = torch.full((B, T + L), pad, dtype=torch.int64)
    seq[:, :T] = input_ids.cpu()
    for b, g in enumerate(generated):
        seq[b, T : T + len(g)] = torch.tensor(g, dtype=torch.int64)
    return GenerationOutput(seq, generated, stats)
