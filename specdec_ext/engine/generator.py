"""Speculative generation over a Hugging Face target/draft pair, with any candidate-length policy: the public API.

A call's requests are served by the scheduler (``engine/scheduler.py``: a slot per request in each model's KV cache,
admission, prefills, the draft's reads), in rounds of fixed-shape steps with one read-back each
(``engine/steps.py``: draft steps, the verify step with the fused verification op, roll-back by subtraction), over
the lean model and its static cache where the model is a Llama, Qwen2 or Qwen3 on one device, and over
``transformers``' forward otherwise (``engine/backends.py``). The policy plans each round
(``policies/base.py``). Randomness is per request: request i draws from its own Philox stream (seed ``seed + i``),
so its output does not depend on the requests beside it.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Optional, Sequence, Union

import torch

from ..head import AcceptanceHead
from ..policies import CandidateLengthPolicy, LookupStop, make_policy
from ..policies.lookup import CopyOrDraft
from ..policies.costs import CostModel
from .admission import DEFAULT_ADMISSION, check_admission
from .backends import backend_for
from .graphs import chain_nodes
from .feature_draft import FeatureBackend, FeatureDraft
from .lookup import LookupBackend, PromptLookup
from .model import supports
from .models import check_vocabularies, context_length, fingerprint, hidden_size, param_count, vocab_size
from .round import BUCKETS, StepRunner
from .steps import exit_steps
from .runner import sliding_layout, usable_device
from .sampling import SamplingConfig
from .scheduler import ContinuousOutput, Measured, Request, Scheduler, Settings
from .call_args import (GenerationOutput, arrivals, check_processor, eos_set, make_output, per_request,
                        seeds_for)
from .tensor_parallel import check_same_output, tp_size


_GENERATE_ARGS = ("input_ids", "attention_mask", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id",
                  "seed", "streamer", "pad_token_id", "policy", "logits_processor")


def _one_call_at_a_time(method):
    """Serialise ``method`` on the generator's lock: its backends, KV caches, step buffers and policy are one
    call's state at a time, so calls from several threads queue instead of sharing them."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class SpeculativeGenerator:
    """Lossless speculative generation with a target and a draft model that share a tokenizer.

    Args:
        target: a ``transformers`` causal LM (any device / dtype; ``device_map="auto"`` works, and so does a
            tensor-parallel target under ``torchrun``, see ``engine/tensor_parallel.py``).
        draft: a causal LM with the target's tokenizer (not needed for ``policy="autoregressive"``). Its embedding
            rows may differ from the target's by padding rows (e.g. Qwen2.5 0.5B's 151,936 against 7B's 152,064):
            the draft's probability of an id beyond its rows is 0, and it reads a stand-in for such an id
            (``engine/backends.py``, ``VocabMap``); a one-line warning names the extra rows unless ``tokenizers``
            shows the pair shares one tokenizer. Or ``"ngram"`` (a :class:`~specdec_ext.engine.lookup.PromptLookup`
            with its defaults) or a ``PromptLookup``: prompt lookup, candidates copied from each request's own
            context after the longest earlier match of its last tokens, no draft model (``engine/lookup.py``); any
            policy whose stop rule does not read a draft model's hidden state (plain, fixed K, heuristic,
            confidence, AdaEDL; ``"specdecpp"`` without a head: SpecDec++'s stop rule over the copy), each row
            drafting at most its match's continuation.
        policy: a :class:`~specdec_ext.policies.CandidateLengthPolicy` or a name: ``"autoregressive"``,
            ``"fixed"`` (``k=``), ``"heuristic"``, ``"confidence"``, ``"adaedl"``, ``"specdecpp"`` (needs ``head``).
        head: the :class:`~specdec_ext.head.AcceptanceHead` for ``specdecpp``.
        fast_draft: run a Llama, Qwen2 or Qwen3 draft as the lean model over a static KV cache
            (``engine/model.py``: the same function, a fraction of ``transformers``' per-step overhead, steps a
            CUDA graph can capture); other drafts, or ``False``, use ``transformers``' forward.
        fast_target: likewise for the target (Llama, Qwen2, Qwen3 on one device, in one process); ``False`` runs it
            through ``transformers``' forward.
        costs: the pair's :class:`~specdec_ext.policies.costs.CostModel` for cost-aware policies
            (``threshold="auto"``); default: profiled on first use and cached (see :meth:`costs`).
        allow_other_draft: accept (with a warning) a head whose recorded draft fingerprint is not this draft's.
        batch_costs: the pair's :class:`~specdec_ext.policies.costs.BatchCosts` for the batch verification
            budget of ``threshold="auto"`` at batch size > 1; default: profiled on first use and cached.
        draft_context: the most tokens of a request's context the draft reads when it first drafts for it: its last
            ``draft_context`` (at least the two each round feeds; None: all), a read the rounds must repay; the
            output stays the target's. MagicDec's and TriForce's truncated draft context, without attention sinks.
        early_exit: read, between draft steps, whether any row still drafts, and end a round's drafting when none
            does (and read the verification budget's depth to verify fewer slots); False: the draft runs to the
            round's cap and a round reads back once, the form a CUDA graph replays (``engine/round.py``); a tuple of
            increasing steps, e.g. ``(1, 3, 7)``: read only after those steps (tiers, as SGLang's adaptive speculation
            keeps graphs of 1, 3 and 7 steps), the steps between enqueued without a wait, rows that stopped drafting
            on masked to the next read; ``"device"``: in a captured round (CUDA graphs, a stop rule that can be captured:
            SpecDec++ at B = 1 or with a fixed h) the GPU reads the stop flags itself, each draft step after the first
            a conditional node that runs while some row drafts, so the round reads back once and the steps after every
            row stopped cost nothing (the verification spans the cap); rounds that are not captured read after
            every step. Policies whose rounds are planned whole (plain decoding, fixed K, the heuristic) read back once
            either way. Raises ValueError for steps that are not increasing integers >= 1, and for ``"device"`` with
            CUDA graphs where the extension was not built for CUDA 12.4+ (it composes the conditional nodes itself,
            ``engine/graphs.py``, so any torch with ``CUDAGraph(keep_graph=True)`` serves).
        tokenizers: ``(target's, draft's)`` tokenizers: checked to have the same vocabulary and special tokens, and
            ids that both models embed (``engine/models.py``, ``check_vocabularies``).
        cuda_graphs: replay the round's steps from CUDA graphs (``engine/graphs.py``): rows padded to batch buckets
            (1, 2, 4, .. 64), each step's graph captured at its shape's first round. None (default): on where the
            target is on a CUDA device and both models run lean (``fast_draft``, ``fast_target``); True requires
            that; False: eager steps on the live rows.
        compile: with CUDA graphs, compile the models' forwards (``torch.compile``, inductor) before they are
            captured, so each graph replays fused kernels instead of one per elementwise op; compilation takes
            seconds to a minute per model at the first rounds of new shapes (one batch bucket, then many; one
            token, then many), and is kept for the generator's life.
        overlap: launch each round before the one before it is read (SGLang's overlap scheduler, vLLM's
            asynchronous scheduling), its inputs written on the device, so the host's work between rounds (reading,
            planning, launching) runs while the GPU computes; rows that reach EOS or their limit are seen a round
            late and their tokens of that round dropped; the tokens are those of rounds run one at a time (greedy
            exactly; sampling exactly under a fixed K, and in distribution where an adaptive policy plans a round
            without the last one's result). Rounds overlap where they replay CUDA graphs, the policy plans ahead
            (``CandidateLengthPolicy.plans_ahead``: plain decoding, fixed K, confidence, AdaEDL and SpecDec++, but
            not under its batch verification budget or with a head that reads the acceptance history), no logits
            processor is given and no queued request could join (``engine/scheduler.py``).
            None (default): on where the rounds replay CUDA graphs; True requires them; False: rounds one at a time.
        lookup: with a draft model, also prompt lookup (True, or a ``PromptLookup``): each round runs as a round of
            copies or as the policy's draft round, whichever promises more tokens per ms
            (:class:`~specdec_ext.policies.lookup.CopyOrDraft` wraps the policy; it profiles the pair's costs).
        **policy_kwargs: passed to the named policy (e.g. ``k=4``, ``threshold=0.7`` or ``"auto"``, ``k_min=1``,
            ``k_max=20``).

    Calls from several threads on one generator run one at a time (a lock), each as it would alone.

    Raises:
        ValueError: a draft and target that cannot share a tokenizer ("vocabulary mismatch", naming both sizes),
            a head for another draft (hidden size, or fingerprint unless ``allow_other_draft``), models on the meta
            device, a speculative policy without a draft, a ``draft_context`` that is not None or an integer >= 1,
            ``cuda_graphs=True`` for models that are not lean on a CUDA device, ``compile=True`` without CUDA
            graphs, ``overlap`` that is not None or a bool, ``overlap=True`` without CUDA graphs, a ``draft`` string
            other than ``"ngram"``, a prompt-lookup draft with a policy that reads a draft model's hidden state,
            ``lookup`` without a draft model or with CUDA graphs asked for.
    """

    def __init__(self, target, draft=None, policy: Union[str, CandidateLengthPolicy] = "fixed",
                 head: Optional[AcceptanceHead] = None, fast_draft: bool = True, costs: Optional[CostModel] = None,
                 allow_other_draft: bool = False, batch_costs=None, draft_context: Optional[int] = None,
                 fast_target: bool = True, early_exit=True, tokenizers: Optional[tuple] = None,
                 cuda_graphs: Optional[bool] = None, compile: bool = False, overlap: Optional[bool] = None,
                 lookup: Union[bool, PromptLookup] = False, **policy_kwargs):
        if draft_context is not None and (isinstance(draft_context, bool) or not isinstance(draft_context, int)
                                          or draft_context < 1):
            raise ValueError(f"draft_context must be None or an integer >= 1 (tokens), got {draft_context!r}")
        self._lock = threading.RLock()  # one call at a time (_one_call_at_a_time)
        self.draft_context = draft_context
        self.tokenizers = tokenizers
        self.target = target
        self._batch_costs = self._given_batch_costs = batch_costs
        if isinstance(draft, str):
            if draft != PromptLookup.name:
                raise ValueError(f"draft: expected a causal LM, {PromptLookup.name!r} (prompt lookup) or a "
                                 f"PromptLookup, got {draft!r}")
            draft = PromptLookup()
        self.lookup = isinstance(draft, PromptLookup)  # a proposer, not a model: no weights, no cache
        self.feature = isinstance(draft, FeatureDraft)  # a draft that reads the target's hidden states (EAGLE)
        if self.feature and not (fast_target and supports(target)):
            raise ValueError("draft: a FeatureDraft reads the target's hidden states through the lean forward: the "
                             "target must be a Llama, Qwen2 or Qwen3 model on one device, with fast_target=True")
        if self.feature and draft_context is not None:
            raise ValueError("draft_context: a FeatureDraft reads the whole context with the target's features "
                             f"at the same positions; pass draft_context=None, got {draft_context}")
        if lookup is not False and not isinstance(lookup, PromptLookup) and lookup is not True:
            raise ValueError(f"lookup: expected True, False or a PromptLookup, got {lookup!r}")
        if lookup is not False and (draft is None or self.lookup):
            raise ValueError("lookup: prompt lookup beside a draft model needs the draft model (draft=...); for "
                             "prompt lookup alone pass draft='ngram'")
        # prompt lookup beside the draft model: each round copies or drafts (policies/lookup.py, CopyOrDraft)
        self.hybrid = (PromptLookup() if lookup is True else lookup) if lookup is not False else None
        self.draft = draft
        self.head = head
        self._costs = costs
        self.allow_other_draft = allow_other_draft
        for m in (target, None if self.lookup or self.feature else draft):  # attention that cannot be rolled back
            if m is not None:
                sliding_layout(m)
        self.fast_draft = bool(fast_draft) and draft is not None and not self.lookup and supports(draft)
        self.fast_target = bool(fast_target) and supports(target)
        self.early_exit = exit_steps(early_exit)
        self.vocab = vocab_size(target)
        self._backends: dict = {}  # (model role, staging) -> its backend, kept from call to call (caches, weights)
        self.cuda_graphs = self._wants_graphs(cuda_graphs)
        # eager on the live rows, or captured steps over batch buckets (their forwards compiled with compile=True)
        if compile not in (True, False) or (compile and not self.cuda_graphs):
            raise ValueError(f"compile: True compiles the forwards that CUDA graphs capture (cuda_graphs on: a lean "
                             f"pair on a CUDA device), got compile={compile!r} with CUDA graphs "
                             f"{'on' if self.cuda_graphs else 'off'}")
        if self.early_exit == "device" and self.cuda_graphs and not chain_nodes():
            raise ValueError("early_exit: 'device' needs conditional nodes in CUDA graphs, which this build of "
                             "specdec_ext composes only when compiled for CUDA (12.4 or later); it was built without: "
                             "use True or a tuple of steps")
        self.steps = StepRunner(BUCKETS, cuda_graphs=True, compile=compile) if self.cuda_graphs else StepRunner()
        if overlap not in (None, True, False) or (overlap and not self.cuda_graphs):
            raise ValueError(f"overlap: rounds overlap the host where they replay CUDA graphs (None: there; True: "
                             f"requires them; False: never), got overlap={overlap!r} with CUDA graphs "
                             f"{'on' if self.cuda_graphs else 'off'}")
        self.overlap = overlap is not False  # where the step runner's rounds allow it (Scheduler._overlaps)
        self.measured = Measured()  # the draft's reads and the admissions over this generator's calls (the scheduler's)
        self._draft_share: Optional[float] = None  # the draft's parameters over the target's (Settings.draft_share)
        self.policy = self._make_policy(policy, head, policy_kwargs)

    def _wants_graphs(self, asked: Optional[bool]) -> bool:
        """Whether the rounds replay CUDA graphs (``cuda_graphs``, class docstring)."""
        if asked is not None and not isinstance(asked, bool):
            raise ValueError(f"cuda_graphs must be None, True or False, got {asked!r}")
        if asked is False:
            return False
        if self.hybrid is not None or self.feature:  # rounds of copies, a feature draft's steps: the host's state
            if asked:
                raise ValueError("cuda_graphs=True: rounds with prompt lookup beside the draft (lookup=...) or with a "
                                 "FeatureDraft run eagerly; use cuda_graphs=None or False")
            return False
        lean = self.fast_target and (self.draft is None or self.fast_draft)
        on_cuda = usable_device(self.target, "target").type == "cuda"
        if asked and not (lean and on_cuda):
            raise ValueError("cuda_graphs=True needs a target on a CUDA device and models the lean forward runs "
                             f"(Llama, Qwen2, Qwen3; fast_draft and fast_target), got a target on "
                             f"{usable_device(self.target, 'target')}, lean target {self.fast_target}, lean draft "
                             f"{self.draft is None or self.fast_draft}")
        return lean and on_cuda

    def _make_policy(self, policy, head, kwargs) -> CandidateLengthPolicy:
        if (self.lookup and head is None and isinstance(policy, str)
                and policy.lower().replace("+", "p").replace("-", "").replace("_", "") == "specdecpp"):
            policy = "lookup"  # SpecDec++ over prompt lookup: its stop rule on the copy's own features
        pol = make_policy(policy, head=head, **kwargs) if isinstance(policy, str) else policy
        if not isinstance(pol, CandidateLengthPolicy):
            raise TypeError(f"policy must be a name or a CandidateLengthPolicy, got {type(pol).__name__}")
        if self.hybrid is not None and pol.speculative and not isinstance(pol, (CopyOrDraft, LookupStop)):
            pol = CopyOrDraft(pol)  # its draft rounds checked below as the policy's own
        if isinstance(pol, LookupStop) and not self.lookup:
            raise ValueError(f"policy {pol.name!r} decides how much of a prompt-lookup copy to verify: it needs "
                             f"draft='ngram', got a draft model")
        if pol.speculative:
            if self.draft is None:
                raise ValueError(f"policy {pol.name!r} needs a draft model (draft=...)")
            heads = getattr(pol.draft if isinstance(pol, CopyOrDraft) else pol, "heads", {}).values()
            if self.lookup:
                if heads or pol.needs_hidden or (pol.needs_costs and not isinstance(pol, LookupStop)):
                    raise ValueError(f"policy: {pol.name!r} reads a draft model's hidden state or profiles its steps; "
                                     f"draft='ngram' (prompt lookup) has neither: use 'specdecpp' (its stop rule "
                                     f"over the copy, without a head), 'fixed', 'heuristic', 'confidence' or 'adaedl'")
                return pol
            check_vocabularies(self.target, self.draft.model if self.feature else self.draft, self.tokenizers)
            fp = fingerprint(self.draft) if any(h.draft_fingerprint for h in heads) else None
            for head_obj in heads:
                head_obj.check_draft(hidden_size(self.draft), fp, self.allow_other_draft)
        return pol

    @_one_call_at_a_time
    def costs(self, policy: Optional[CandidateLengthPolicy] = None) -> CostModel:
        """The pair's :class:`~specdec_ext.policies.costs.CostModel` (ms per draft step, per verification of
        n tokens, per round): the one given to the constructor, or measured once where the pair runs and
        cached on disk (``engine/profile.py``; a progress line on stderr while it runs)."""
        if self._costs is None:
            from .profile import cached_profile

            k_max = max(20, getattr(policy, "max_candidates", 20))
            self._costs = cached_profile(self.target, self.draft, self.fast_draft, k_max, generator_cls=type(self),
                                         fast_target=self.fast_target)
        return self._costs

    @_one_call_at_a_time
    def batch_costs(self, batch_size: int = 64):
        """The pair's :class:`~specdec_ext.policies.costs.BatchCosts` (whole-round ms by batch size and K, target
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
        if batch_size > 1 and pol.needs_batch_costs:
            self.batch_costs(batch_size)
        # a short call with a policy of its own: this generator's backends made (weights packed, caches allocated),
        # the kernels' first shapes met, and the generator's policy untouched
        ids = torch.randint(0, vocab_size(self.target), (batch_size, 16), generator=torch.Generator().manual_seed(0))
        self.generate(ids, max_new_tokens=16, temperature=0,
                      **({"policy": "fixed", "k": 2} if pol.speculative else {"policy": "autoregressive"}))
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
        models = [("target", self.target)] + ([("draft", self.draft)] if policy.speculative and not self.lookup else [])
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

        Each row is a request of its own (its prompt without padding in its own cache slot, its own Philox stream
        ``seed + b``): row b produces exactly what it would alone, greedy or seeded (except under the batch
        verification budget of ``threshold="auto"``, whose decisions couple the rows: their distribution, not their
        draws, is the same). A ``logits_processor`` is a host callable: it reads each round's candidates back and
        cannot be captured in a CUDA graph.

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
        check_processor(logits_processor)
        seeds = seeds_for(seed, B)
        rows = [input_ids[b][attention_mask[b].bool()].tolist() for b in range(B)]
        padded = input_ids.tolist() if logits_processor is not None else None  # the processor sees the padding
        requests = [Request(rows[b], max_new_tokens, seeds[b], cfg, padded[b] if padded else None) for b in range(B)]
        if streamer is not None:
            streamer.put(input_ids.cpu())
        served = self._serve(pol, cfg, requests, B, eos_set(eos_token_id), streamer, logits_processor, "eager",
                             continuous=False)
        if streamer is not None:
            streamer.end()
        out = make_output(input_ids, served.new_tokens, eos_set(eos_token_id), pad_token_id, served.stats)
        if tp_size(self.target) > 1:  # every rank decided for itself: prove they agree
            check_same_output(out.sequences)
        return out

    @torch.inference_mode()
    def generate_continuous(self, prompts, batch_size: int, max_new_tokens: Union[int, Sequence[int]] = 64,
                            temperature: Union[float, Sequence[float]] = 1.0,
                            top_k: Union[int, None, Sequence[Optional[int]]] = None,
                            top_p: Union[float, None, Sequence[Optional[float]]] = None,
                            eos_token_id: Union[int, Sequence[int], None] = None, seed: Union[int, Sequence[int]] = 0,
                            policy: Union[str, CandidateLengthPolicy, None] = None, logits_processor=None,
                            admission: str = DEFAULT_ADMISSION, arrival_ms: Optional[Sequence[float]] = None,
                            **policy_kwargs) -> "ContinuousOutput":
        """Continuous batching: generate for every prompt, with up to ``batch_size`` requests live at once.

        The first ``batch_size`` prompts start together; whenever requests finish, the next prompts of the queue
        take their slots after that round, prefilled by the target, so the batch stays full until the queue runs
        dry, as in a server (``engine/scheduler.py``); the draft reads a request's context when it first drafts
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
            arrival_ms: when each request arrives, in ms from the call's start, non-decreasing (None: all at
                once). A request joins only once it has arrived; while none is live and the next has not arrived,
                the call's clock jumps to its arrival (nothing sleeps). The output's ``token_ms`` gives each
                token's emission on that clock: the serving latencies (``specdec_ext.serving``).
            temperature / top_k / top_p: as :meth:`generate`, one for every request or each a sequence of one per
                prompt (a server's requests sample differently; every row is verified against its own processed
                distributions, and the policy configures itself, e.g. SpecDec++'s choice of head, for the first
                sampling request's settings, else greedy).
            eos_token_id / policy / logits_processor / **policy_kwargs: as :meth:`generate` (the processor sees
                each request's prompt unpadded).

        Returns: :class:`ContinuousOutput` (tokens, and per request the ms from the call's start to its
            admission, its prefill's start, and to its last round).

        Raises: ValueError / TypeError as :meth:`generate`, naming the prompt (``prompts[i]``); ValueError for
            no prompts, a batch_size that is not an integer >= 1, a sequence of max_new_tokens (or temperature,
            top_k, top_p) whose length is not the number of prompts, an unknown ``admission``, ``"grouped"`` with a
            tensor-parallel target, or an ``arrival_ms`` that is not one finite time >= 0 per prompt in
            non-decreasing order.
        """
        check_admission(admission)
        if admission == "grouped" and tp_size(self.target) > 1:
            raise ValueError("admission='grouped' decides from each process's own timings, and a tensor-parallel "
                             "target's ranks must decide alike: use admission='eager'")
        pol = self._policy_for_call(policy, policy_kwargs)
        if isinstance(prompts, torch.Tensor) or not len(prompts):
            raise ValueError("prompts: give a non-empty sequence of prompts (1-D tensors or lists of token ids)")
        settings = [per_request(name, v, len(prompts)) for name, v in
                    (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))]
        cfgs = []
        for i, (t, k, p) in enumerate(zip(*settings)):
            try:
                cfgs.append(SamplingConfig(t, k, p))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        cfg = next((c for c in cfgs if not c.greedy), cfgs[0])  # what the policy configures itself for
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        listed = not isinstance(max_new_tokens, int)
        if listed and (isinstance(max_new_tokens, (str, bytes, torch.Tensor))
                            or not isinstance(max_new_tokens, Sequence) or len(max_new_tokens) != len(prompts)):
            raise ValueError(f"max_new_tokens must be an integer >= 1 or a sequence of them, one per prompt "
                             f"({len(prompts)}), got {max_new_tokens!r}")
        limits = list(max_new_tokens) if listed else [max_new_tokens] * len(prompts)
        ids = []
        for i, p in enumerate(prompts):
            x = p if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.int64)
            if x.dim() != 1:
                raise ValueError(f"prompts[{i}]: a prompt is 1-D (token ids), got shape {list(x.shape)}")
            try:
                ids.append(self._check_inputs(x.view(1, -1), None, limits[i], pol)[0][0].tolist())
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        check_processor(logits_processor)
        seeds = seeds_for(seed, len(ids))
        arrived = arrivals(arrival_ms, len(ids))
        requests = [Request(x, lim, s, c, list(x) if logits_processor is not None else None, at)
                    for x, lim, s, c, at in zip(ids, limits, seeds, cfgs, arrived)]
        served = self._serve(pol, cfg, requests, batch_size, eos_set(eos_token_id), None, logits_processor,
                             admission, continuous=True)
        if tp_size(self.target) > 1:  # every rank decided for itself: prove they agree
            check_same_output(torch.tensor([t for g in served.new_tokens for t in g + [-1]], dtype=torch.int64))
        return served

    @_one_call_at_a_time
    def _serve(self, pol, cfg, requests: list, batch_size: int, eos: set, streamer, processor, admission: str,
               continuous: bool):
        """Serve ``requests`` through the scheduler with at most ``batch_size`` live (``engine/scheduler.py``)."""
        self.steps.bucket(batch_size)  # refused up front when larger than the largest batch bucket
        first = min(batch_size, len(requests))
        self._configure(pol, cfg, first)  # costs profiled on first use: not part of this call's time
        target = self._backend("target")
        draft = self._backend("draft") if pol.speculative else None
        staging = None
        if admission == "ahead" and continuous and len(requests) > batch_size and not self.feature:
            staging = (self._backend("target", True), self._backend("draft", True) if pol.speculative else None)
        if self._draft_share is None and self.draft is not None:
            self._draft_share = 0.0 if self.lookup else param_count(self.draft) / max(1, param_count(self.target))
        settings = Settings(eos, streamer, processor, admission, self.early_exit, self.draft_context, continuous,
                            timed=tp_size(self.target) == 1, draft_share=self._draft_share, overlap=self.overlap)
        before = {k: (b.calls, b.seconds) for k, b in self._backends.items()}
        proposer = self._backend("proposer") if self.hybrid is not None and isinstance(pol, CopyOrDraft) else None
        served = Scheduler(self.steps, pol, target, draft, requests, batch_size, settings, self.vocab, self.measured,
                           staging, proposer).run()
        self.measured = served.measured
        stats = served.stats
        for key, b in self._backends.items():  # forward calls and time of this call
            calls, secs = b.calls - before.get(key, (0, 0.0))[0], b.seconds - before.get(key, (0, 0.0))[1]
            if key[0] == "target":
                stats.target_calls += calls
                stats.target_forward_ms += secs * 1e3
            else:
                stats.draft_calls += calls
                stats.draft_forward_ms += secs * 1e3
        return served

    def _backend(self, role: str, staging: bool = False):
        """The backend of the target or the draft (``engine/backends.py``), kept from call to call."""
        key = (role, staging)
        if key not in self._backends:
            model = self.target if role == "target" else self.draft
            if (self.lookup and role == "draft") or role == "proposer":
                proposer = self.draft if role == "draft" else self.hybrid
                self._backends[key] = LookupBackend(proposer, self.vocab, usable_device(self.target, "target"))
                return self._backends[key]
            if self.feature and role == "draft":  # reads the target's features: the target's backend, not a staging one
                self._backends[key] = FeatureBackend(self.draft, self._backend("target"), self.vocab)
                return self._backends[key]
            self._backends[key] = backend_for(model, role, self.fast_target if role == "target" else self.fast_draft,
                                              self.vocab)
        return self._backends[key]

    def _configure(self, pol, cfg, batch_size: int) -> None:
        """Give the policy the call's decoding settings and, when it needs them, the pair's cost tables."""
        costs = self.costs(pol) if pol.needs_costs else None
        if pol.needs_batch_costs:
            pol.configure(cfg, costs, batch_costs=self.batch_costs(batch_size) if batch_size > 1 else None)
        else:  # user policies written for the two-argument configure keep working
            pol.configure(cfg, costs)

    def _policy_for_call(self, policy, policy_kwargs) -> CandidateLengthPolicy:
        if policy is None and policy_kwargs:
            raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(policy_kwargs)}: it accepts "
                            f"{', '.join(_GENERATE_ARGS)}, and policy keyword arguments (k, threshold, k_min, k_max, "
                            "...) only together with policy=")
        return self.policy if policy is None else self._make_policy(policy, self.head, policy_kwargs)
