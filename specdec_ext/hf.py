"""This engine inside ``transformers``' own ``generate()``: a decoding loop for its ``custom_generate`` hook.

    from specdec_ext.hf import speculative_generate
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                          custom_generate=speculative_generate, draft_model=draft, head=head,
                          threshold="auto")

``generate()`` prepares the inputs and the generation config as usual, then hands the loop to
:func:`speculative_generate` (transformers 5.x: a callable ``custom_generate`` receives the model, the
prompt ids, the processors, the stopping criteria, the config, the arguments its signature adds, and the
model kwargs). Greedy decoding and sampling with temperature / top-k / top-p run as the engine's own
settings; the other logits processors generate() builds (repetition penalty, no-repeat n-grams, bad words,
min new tokens, ...) are applied to the draft's and the target's logits alike, position by position, so the
output follows the target's processed distribution (batch size 1: they keep per-batch state); other warpers (min-p, typical, ...), stopping criteria
other than max length and EOS (stop strings, max time), beams and several sequences are refused by name.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from transformers import LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .engine import SpeculativeGenerator
from .policies import CandidateLengthPolicy

# the processors generate() builds from do_sample / temperature / top_k / top_p, which the engine applies itself
_SAMPLING_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_STOPPING = {"MaxLengthCriteria", "EosTokenCriteria"}


def speculative_generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                         generation_config=None, draft_model=None, head=None,
                         policy: Union[str, CandidateLengthPolicy] = "specdecpp", threshold: Union[float, str] = "auto",
                         k: Optional[int] = None, k_min: Optional[int] = None, k_max: Optional[int] = None,
                         seed: int = 0, **model_kwargs):
    """Speculative decoding (SpecDec++ by default) as ``transformers``' ``custom_generate`` callable.

    Args (besides what ``generate()`` passes):
        draft_model: the draft causal LM (same vocabulary as ``model``); required unless ``policy="autoregressive"``.
        head: an :class:`~specdec_ext.head.AcceptanceHead` or ``{"greedy": ..., "sample": ...}`` (needed by
            ``policy="specdecpp"``).
        policy: a policy name or object (see :class:`~specdec_ext.SpeculativeGenerator`).
        threshold: SpecDec++ stop threshold h in [0, 1] or ``"auto"``; k: K for ``policy="fixed"``;
            k_min / k_max: SpecDec++ bounds on the candidate length K.
        seed: sampling seed of row 0 (row b uses ``seed + b``).

    Returns: ``[B, T + L]`` int64 sequences (prompt, then generated tokens right-padded with the pad id), or a
    ``GenerateDecoderOnlyOutput`` with ``sequences`` when ``return_dict_in_generate=True``.

    Raises: ValueError for a generation setting the engine does not reproduce (named), or the engine's own
    input errors (no draft, vocabulary mismatch, a head for another draft, ...).
    """
    cfg = generation_config
    if draft_model is None and policy != "autoregressive":
        raise ValueError("speculative_generate: pass draft_model=... (the draft causal LM), or policy='autoregressive'")
    if getattr(cfg, "num_beams", 1) not in (None, 1) or getattr(cfg, "num_return_sequences", 1) not in (None, 1):
        raise ValueError("speculative_generate: num_beams and num_return_sequences must be 1")
    processors, seen_warper = [], None
    for proc in logits_processor or []:
        name = type(proc).__name__
        if name in _SAMPLING_PROCESSORS:
            seen_warper = name
        elif name.endswith("Warper"):
            raise ValueError(f"speculative_generate: the sampling setting behind {name} is not supported "
                             f"(temperature, top_k and top_p are)")
        elif seen_warper is not None:
            raise ValueError(f"speculative_generate: {name} comes after {seen_warper} in generate()'s processors; "
                             f"the engine applies processors before temperature / top-k / top-p")
        else:
            processors.append(proc)
    for crit in stopping_criteria or []:
        if type(crit).__name__ not in _STOPPING:
            raise ValueError(f"speculative_generate: the stopping criterion {type(crit).__name__} is not supported "
                             f"(max_new_tokens / max_length and eos_token_id are)")
    if processors and input_ids.shape[0] > 1:
        raise ValueError(f"speculative_generate: {', '.join(type(p).__name__ for p in processors)} with a batch of "
                         f"{input_ids.shape[0]} rows: transformers' processors keep per-batch state while this engine's "
                         f"rows advance and retire on their own; run such settings one prompt at a time")
    greedy = not cfg.do_sample
    temperature = 0.0 if greedy else float(cfg.temperature if cfg.temperature is not None else 1.0)
    top_k = None if greedy or not cfg.top_k else int(cfg.top_k)
    top_p = None if greedy or cfg.top_p is None or cfg.top_p >= 1.0 else float(cfg.top_p)
    max_new_tokens = int(cfg.max_length) - input_ids.shape[1]
    eos = cfg.eos_token_id
    eos = eos.tolist() if isinstance(eos, torch.Tensor) else eos
    pad = cfg.pad_token_id
    pad = int(pad.reshape(-1)[0]) if isinstance(pad, torch.Tensor) else pad

    policy_kwargs = {}
    if policy == "specdecpp":
        policy_kwargs["threshold"] = threshold
        policy_kwargs.update({n: v for n, v in (("k_min", k_min), ("k_max", k_max)) if v is not None})
    elif policy == "fixed":
        policy_kwargs["k"] = 4 if k is None else k
    # cheap to build: the auto rule's cost profile is cached on disk per pair, dtype, device and thread count
    gen = SpeculativeGenerator(model, draft_model, policy=policy, head=head, **policy_kwargs)
    out = gen.generate(input_ids, attention_mask=model_kwargs.get("attention_mask"), max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos, seed=seed,
                       pad_token_id=pad, logits_processor=LogitsProcessorList(processors) if processors else None)
    if getattr(cfg, "return_dict_in_generate", False):
        return GenerateDecoderOnlyOutput(sequences=out.sequences)
    return out.sequences
