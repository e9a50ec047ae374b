"""End-to-end benchmark: candidate-length policies side by side with plain decoding and Hugging Face's
assisted generation, on the same models, prompts and seeds, in one process.

Methods run prompt by prompt, in an order that changes from prompt to prompt (:func:`balanced_order`), so that drift
on the machine and any carry-over from one method to the next hit all alike. For every run the figures come from
that run: wall time, tokens, forward passes of each model (counted with hooks, the same way for our loop and for
``transformers``), and for our engine its round statistics. Greedy runs of every method must produce the same text;
a difference is reported instead of a speed."""

from __future__ import annotations

import gzip
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from .engine import SpeculativeGenerator
from .policies import CandidateLengthPolicy, DraftStep, make_policy
from .policies.lookup import CopyOrDraft


def balanced_order(items, i: int) -> list:
    """The order in which ``items`` (n of them) run the i-th time (prompt, stream or pass i): row i of a Williams
    design (E. J. Williams, 1949), a Latin square balanced for first-order carry-over, repeated. Over a full cycle of
    n rows (2n for odd n) every item runs in every position equally often and directly after every other item equally
    often. A rotation of one order, which this replaces, keeps each item's predecessor in all but one row of n, so an
    item slowed by what ran just before it (caches, the allocator's state) would be slowed every time. Row 0 is
    ``items`` in the given order."""
    items, n = list(items), len(items)
    if n <= 1:
        return items
    base, low, high = [0], 1, n - 1  # 0, 1, n - 1, 2, n - 2, ...
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    label = [0] * n  # relabelled so that row 0 is the items' own order (a relabelling keeps the balance)
    for k, b in enumerate(base):
        label[b] = k
    r = i % (n if n % 2 == 0 else 2 * n)
    row = [label[(b + r) % n] for b in base]
    return [items[j] for j in (row[::-1] if r >= n else row)]


class CallCounter:
    """Counts forward calls of a module and the time spent inside them (hooks), for any generation
    loop, so that ours and ``transformers``' are measured the same way."""

    def __init__(self, module):
        self.n = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self._sync = next(module.parameters()).device.type == "cuda"
        self._h = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *a):
        if self._sync:
            torch.cuda.synchronize()
        self.n += 1
        self._t0 = time.perf_counter()

    def _post(self, *a):
        if self._sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._t0

    def close(self):
        for h in self._h:
            h.remove()


class Oracle(CandidateLengthPolicy):
    """Upper bound for candidate-length policies under greedy decoding: drafts exactly up to and
    including the first candidate the target rejects (known from a recorded target-only run)."""

    name = "oracle"

    def __init__(self, reference: list[list[int]], max_k: int = 64):
        self.reference = reference
        self.max_candidates = max_k

    def reset(self, batch_size, device):
        if batch_size != len(self.reference):
            raise ValueError("Oracle: one reference sequence per row is needed")
        self.pos = [0] * batch_size
        self.rows = list(range(batch_size))

    def should_stop(self, info: DraftStep):
        out = torch.zeros(info.batch_size, dtype=torch.bool)
        for i, r in enumerate(self.rows):
            ref = self.reference[r]
            j = self.pos[i] + info.step - 1
            out[i] = j >= len(ref) or int(info.tokens[i]) != ref[j]
        return out

    def end_round(self, num_drafted, num_accepted):
        for i in range(len(self.rows)):
            self.pos[i] += int(num_accepted[i]) + 1

    def select_rows(self, index):
        keep = index.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]


@dataclass
class Method:
    """A way to generate: our engine with a policy, or ``transformers``' generate (plain or assisted). Its policy
    is made once and serves every prompt of a run (:meth:`instance`), as one generator serves a user's calls: what a
    policy learns from the rounds it observes (``threshold="auto"``'s survivals' calibration) carries from prompt
    to prompt."""

    name: str
    kind: str                               # "ours" | "hf"
    policy: Optional[Callable[..., CandidateLengthPolicy]] = None
    hf_assistant: Optional[dict] = None     # assistant generation config for kind == "hf" (None: plain generate)
    hf_generate: Optional[dict] = None      # more keyword arguments of transformers' generate() (kind == "hf")
    family: str = ""                        # for tables and plots: plain, fixed, specdecpp, ...
    param: Optional[float] = None           # K or h (None: the auto rule)
    target: str = "default"                 # "float32": the fp32 copy of the target (a reference baseline)
    draft: str = "model"                    # "ngram": prompt lookup (engine/lookup.py) in place of the draft model;
    #                                         "both": prompt lookup beside it (lookup=True: a copy or a draft a round);
    #                                         "eagle": the pair's feature draft; "eagle+lookup": prompt lookup beside it
    _instance: Optional[CandidateLengthPolicy] = field(default=None, repr=False, compare=False)

    def instance(self) -> CandidateLengthPolicy:
        """The method's policy, made at the first call and the same object after."""
        if self._instance is None:
            self._instance = self.policy()
        return self._instance


DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7, 8)
LOOKUP_KS = (2, 4, 8)  # prompt lookup's fixed candidate lengths (arms "lookup K=k")
DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
PAPER_THRESHOLDS = (0.3, 0.7, 0.9)


def standard_methods(head=None, ks=DEFAULT_KS, thresholds=DEFAULT_THRESHOLDS, hf=True, hf_ks=None, k_bounds=(1, 20),
                     adaptive=True, oracle=True, auto=True, paper_head=None, paper_thresholds=PAPER_THRESHOLDS,
                     paper_bounds=(2, 20), fp32_plain=False, auto_uncalibrated=False,
                     hf_static=False, auto_copies=0, auto_rule_only=False, lookup_ks=LOOKUP_KS,
                     feature_ks=()) -> list[Method]:
    """The benchmark's methods: plain decoding (ours, ``transformers``', and with ``fp32_plain`` our plain
    decoding of a float32 copy of the target), fixed K for each of ``ks``, SpecDec++ with ``head`` for each
    stop threshold in ``thresholds`` and with ``threshold="auto"`` (bounds ``k_bounds``; with ``auto_uncalibrated``
    also ``"auto"`` with ``calibrate=False``; with ``auto_rule_only`` also ``"auto"`` with ``select=False``, the
    goodput rule alone; with ``auto_copies`` n more arms of ``"auto"`` exactly, each its own
    policy: how far identical arms fall apart in one run), SpecDec++ with the
    paper-recipe ``paper_head`` at ``paper_thresholds`` (bounds ``paper_bounds``, the paper's [2, 20]),
    the heuristic / confidence / AdaEDL policies, ``transformers``' assisted generation at ``hf_ks``
    (default: ``ks``) with its constant, heuristic and confidence schedules, with ``hf_static`` ``transformers``'
    plain ``generate(cache_implementation="static")`` (its forward compiled by transformers on a GPU), prompt lookup
    (no draft model: ``engine/lookup.py``) at each of ``lookup_ks``, under the heuristic and (with ``auto``) under
    SpecDec++'s stop rule with ``threshold="auto"`` (``policies/lookup.py``) and beside the draft model (``lookup=True``:
    a copy or a draft a round, the draft's rounds under SpecDec++ ``auto``), with ``hf``
    ``transformers``' own prompt lookup (``prompt_lookup_num_tokens=10``, its default size), and the greedy
    oracle."""
    hf_ks = ks if hf_ks is None else hf_ks
    m = [Method("plain", "ours", lambda **_: make_policy("autoregressive"), family="plain")]
    if fp32_plain:
        m.append(Method("plain fp32", "ours", lambda **_: make_policy("autoregressive"), family="plain-fp32",
                        target="float32"))
    if hf:
        m.append(Method("hf plain", "hf", None, None, family="hf-plain"))
        if hf_static:
            m.append(Method("hf static cache", "hf", None, None, family="hf-static",
                            hf_generate={"cache_implementation": "static"}))
    for k in ks:
        m.append(Method(f"fixed K={k}", "ours", (lambda k=k, **_: make_policy("fixed", k=k)), family="fixed", param=k))
    if head is not None:
        for h in list(thresholds) + (["auto"] if auto else []):
            m.append(Method(f"specdec++ {'auto' if h == 'auto' else f'h={h:g}'}", "ours",
                            (lambda h=h, **_: make_policy("specdecpp", head=head, threshold=h, k_min=k_bounds[0],
                                                          k_max=k_bounds[1])),
                            family="specdecpp" if h != "auto" else "specdecpp-auto", param=None if h == "auto" else h))
        if auto and auto_uncalibrated:
            m.append(Method("specdec++ auto uncalibrated", "ours",
                            lambda **_: make_policy("specdecpp", head=head, threshold="auto", k_min=k_bounds[0],
                                                    k_max=k_bounds[1], calibrate=False),
                            family="specdecpp-auto-uncalibrated"))
        if auto and auto_rule_only:
            m.append(Method("specdec++ auto goodput rule", "ours",
                            lambda **_: make_policy("specdecpp", head=head, threshold="auto", k_min=k_bounds[0],
                                                    k_max=k_bounds[1], select=False),
                            family="specdecpp-auto-rule"))
        for i in range(auto_copies if auto else 0):
            m.append(Method(f"specdec++ auto copy {i + 1}", "ours",
                            lambda **_: make_policy("specdecpp", head=head, threshold="auto", k_min=k_bounds[0],
                                                    k_max=k_bounds[1]), family="specdecpp-auto-copy"))
    if paper_head is not None:
        for h in paper_thresholds:
            m.append(Method(f"specdec++ paper head h={h:g}", "ours",
                            (lambda h=h, **_: make_policy("specdecpp", head=paper_head, threshold=h, k_min=paper_bounds[0],
                                                          k_max=paper_bounds[1])), family="specdecpp-paper", param=h))
    if adaptive:
        m.append(Method("heuristic", "ours", lambda **_: make_policy("heuristic"), family="heuristic"))
        m.append(Method("confidence 0.4", "ours", lambda **_: make_policy("confidence"), family="confidence"))
        m.append(Method("adaedl", "ours", lambda **_: make_policy("adaedl"), family="adaedl"))
    for k in lookup_ks:
        m.append(Method(f"lookup K={k}", "ours", (lambda k=k, **_: make_policy("fixed", k=k)), family="lookup-fixed",
                        param=k, draft="ngram"))
    if lookup_ks:
        m.append(Method("lookup heuristic", "ours", lambda **_: make_policy("heuristic"), family="lookup-heuristic",
                        draft="ngram"))
        if auto:
            m.append(Method("lookup auto", "ours", lambda **_: make_policy("lookup", threshold="auto"),
                            family="lookup-auto", draft="ngram"))
            if head is not None:
                m.append(Method("copy or draft, auto", "ours",
                                lambda **_: CopyOrDraft(make_policy("specdecpp", head=head, threshold="auto",
                                                                    k_min=k_bounds[0], k_max=k_bounds[1])),
                                family="copy-or-draft", draft="both"))
    for k in feature_ks:
        m.append(Method(f"eagle K={k}", "ours", (lambda k=k, **_: make_policy("fixed", k=k)), family="eagle-fixed",
                        param=k, draft="eagle"))
    if feature_ks:
        m.append(Method("eagle confidence", "ours", lambda **_: make_policy("confidence"), family="eagle-confidence",
                        draft="eagle"))
        m.append(Method("copy or eagle, confidence", "ours", lambda **_: CopyOrDraft(make_policy("confidence")),
                        family="copy-or-eagle", draft="eagle+lookup"))
    if hf:
        if lookup_ks:
            m.append(Method("hf prompt lookup", "hf", None, None, {"prompt_lookup_num_tokens": 10}, family="hf-lookup"))
        for k in hf_ks:
            m.append(Method(f"hf assisted K={k}", "hf", None, {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                                                                 "assistant_confidence_threshold": 0.0},
                            family="hf-fixed", param=k))
        m.append(Method("hf assisted heuristic", "hf", None, {"num_assistant_tokens": 5,
                                                               "num_assistant_tokens_schedule": "heuristic_transient",
                                                               "assistant_confidence_threshold": 0.0}, family="hf-heuristic"))
        m.append(Method("hf assisted confidence", "hf", None, {"num_assistant_tokens": 20,
                                                                "num_assistant_tokens_schedule": "constant",
                                                                "assistant_confidence_threshold": 0.4}, family="hf-confidence"))
    if oracle:
        m.append(Method("oracle", "ours", None, family="oracle"))
    return m


@dataclass
class RunRecord:
    method: str
    prompt: int
    new_tokens: int
    wall_s: float
    target_calls: int
    draft_calls: int
    tokens: list[int] = field(repr=False, default_factory=list)
    forward_s: float = 0.0                  # time inside target and draft forward calls
    engine: Optional[dict] = None           # our GenerationStats.summary()
    rounds: Optional[list] = field(default=None, repr=False)  # (candidates, accepted) per round, for replay

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _run(method: Method, pair, ids, max_new_tokens, temperature, seed, eos, reference, targets=None,
         costs=None) -> RunRecord:
    target, draft = (targets or {}).get(method.target, pair.target), pair.draft
    ct, cd = CallCounter(target), CallCounter(draft)
    try:
        t0 = time.perf_counter()
        if method.kind == "ours":
            if method.family == "oracle":
                policy = Oracle([reference])
            else:
                policy = method.instance()
            proposer = {"ngram": "ngram", "eagle": pair.feature, "eagle+lookup": pair.feature}.get(method.draft, draft)
            gen = SpeculativeGenerator(target, proposer if policy.speculative else None, policy=policy,
                                       costs=costs if method.draft in ("model", "both") else None,  # others: their own
                                       lookup=method.draft in ("both", "eagle+lookup") and policy.speculative)
            out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_token_id=eos)
            wall = time.perf_counter() - t0
            toks = out.new_tokens[0]
            st = out.stats  # the engine's own counts and timers: its lean draft runner bypasses module hooks
            rec = RunRecord(method.name, -1, len(toks), wall, st.target_calls, st.draft_calls, tokens=toks,
                            engine=st.summary(), rounds=[(r.candidates[0], r.accepted[0]) for r in st.rounds],
                            forward_s=(st.target_forward_ms + st.draft_forward_ms) / 1e3)
        else:
            kw = dict(max_new_tokens=max_new_tokens, pad_token_id=eos, eos_token_id=eos)
            if temperature == 0:
                kw["do_sample"] = False
            else:
                kw.update(do_sample=True, temperature=temperature, top_k=0)
                torch.manual_seed(seed)
            kw.update(method.hf_generate or {})
            if method.hf_assistant is not None:
                for k, v in method.hf_assistant.items():
                    setattr(draft.generation_config, k, v)
                kw["assistant_model"] = draft
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            wall = time.perf_counter() - t0
            toks = out[0, ids.shape[1]:].tolist()
            rec = RunRecord(method.name, -1, len(toks), wall, ct.n, cd.n, tokens=toks)
            rec.forward_s = ct.seconds + cd.seconds
    finally:
        ct.close()
        cd.close()
    return rec


def run_benchmark(pair, prompts: list[str], methods: list[Method], max_new_tokens: int = 128, temperature: float = 0.0,
                  seed: int = 0, progress: bool = True, warmup: bool = True, costs=None) -> list[RunRecord]:
    """Every method on every prompt, the order changing per prompt (:func:`balanced_order`). The first method must be
    plain decoding.
    ``costs``: the pair's cost model for cost-aware policies (default: profiled once, cached)."""
    import copy

    tok = pair.tokenizer
    eos = tok.eos_token_id
    dev = next(pair.target.parameters()).device  # transformers' generate() wants the ids on the model's (first) device
    encoded = [torch.tensor([tok(p)["input_ids"]], device=dev) for p in prompts]
    targets = {"default": pair.target}
    if any(m.target == "float32" for m in methods):
        targets["float32"] = copy.deepcopy(pair.target).float().eval()
    if costs is None and any(m.policy is not None and m.policy().needs_costs for m in methods
                             if m.kind == "ours" and m.draft in ("model", "both")):  # others profile their own pair
        costs = SpeculativeGenerator(pair.target, pair.draft).costs()
    if warmup:  # first calls pay for allocation and lazy initialisation
        longest = max(encoded, key=lambda ids: ids.shape[1])
        for m in methods:
            if m.family == "hf-static":  # its static cache sized (and its forward compiled) for the longest request
                _run(m, pair, longest, max_new_tokens, temperature, seed, eos, None, targets, costs)
            elif m.family != "oracle":
                _run(m, pair, encoded[0][:, :16], 8, temperature, seed, eos, None, targets, costs)
    records: list[RunRecord] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", disable=not progress, unit="run")
    for i, ids in enumerate(encoded):
        reference = None
        order = balanced_order(methods, i)
        # the oracle needs plain decoding's tokens of this prompt: run it after plain
        order = [m for m in order if m.family != "oracle"] + [m for m in order if m.family == "oracle"]
        for m in order:
            if m.family == "oracle":
                if temperature != 0:
                    bar.update(1)
                    continue
                reference = next(r.tokens for r in records if r.prompt == i and r.method == methods[0].name)
            rec = _run(m, pair, ids, max_new_tokens, temperature, seed + i, eos, reference, targets, costs)
            rec.prompt = i
            records.append(rec)
            bar.update(1)
    bar.close()
    return records


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first token where two texts differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(records: list[RunRecord], methods: list[Method], baseline: str = "plain", greedy: bool = True,
              exact: bool = True, reference: Optional[str] = None) -> list[dict]:
    """Per method: median tokens/s and speedup over ``baseline`` (per-prompt ratios, median and IQR; also over
    ``reference``, e.g. fp32 plain decoding, when given), calls per token, accepted length, discard and
    verification rates, per-round overhead; and, for greedy runs, the share of prompts whose text equals the
    baseline's and the mean position of the first difference. With ``exact`` (a float32 target) a greedy
    text difference is a defect: such a method gets no speed in the table. In bf16, verifying K + 1 tokens
    rounds differently from single-token steps, so near-tie argmaxes may flip: the share is reported and
    the speed kept."""
    by = {}
    for r in records:
        by.setdefault(r.method, {})[r.prompt] = r
    base = by[baseline]
    ref = by.get(reference) if reference else None
    rows = []
    for m in methods:
        runs = by.get(m.name, {})
        if not runs:
            continue
        prompts = sorted(runs)
        ratios = [runs[p].tokens_per_s / base[p].tokens_per_s for p in prompts if p in base]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        tokens = sum(runs[p].new_tokens for p in prompts)
        compared = greedy and m.target == "default"
        diffs = {p: first_difference(runs[p].tokens, base[p].tokens) for p in prompts if compared and p in base}
        mism = [p for p, d in diffs.items() if d is not None]
        row = {"method": m.name, "family": m.family, "param": m.param, "prompts": len(prompts),
               "tokens_per_s": statistics.median(r.tokens_per_s for r in runs.values()),
               "speedup": statistics.median(ratios), "speedup_q1": q[0], "speedup_q3": q[2],
               "target_calls_per_token": sum(runs[p].target_calls for p in prompts) / tokens,
               "draft_calls_per_token": sum(runs[p].draft_calls for p in prompts) / tokens,
               "greedy_mismatches": mism, "greedy_checked": compared, "exact": exact,
               "same_text_share": (1 - len(mism) / len(diffs)) if diffs else None,
               "first_difference_mean": statistics.mean(diffs[p] for p in mism) if mism else None,
               # wall time outside model forwards, per target call (= per round), same hooks for every loop
               "loop_overhead_ms_per_round": statistics.median(
                   1e3 * (runs[p].wall_s - runs[p].forward_s) / max(1, runs[p].target_calls) for p in prompts)}
        if ref is not None:
            row["speedup_vs_reference"] = statistics.median(runs[p].tokens_per_s / ref[p].tokens_per_s
                                                            for p in prompts if p in ref)
        eng = [runs[p].engine for p in prompts if runs[p].engine and "rounds" in runs[p].engine]  # our engine's
        if eng:
            ver = sum(e["rounds"] for e in eng)
            row.update({
                "mean_accepted_length": sum(e["mean_accepted_length"] * e["rounds"] for e in eng) / max(1, ver),
                "mean_candidate_length": sum(e["mean_candidate_length"] * e["rounds"] for e in eng) / max(1, ver),
                "discard_rate": sum(e["discarded"] for e in eng) / tokens,
                "verification_rate": sum(e["rounds"] for e in eng) / tokens,
                "overhead_ms_per_round": statistics.median(e["overhead_ms_per_round"] for e in eng),
            })
        rows.append(row)
    return rows


def resident_mib() -> Optional[float]:
    """This process's resident memory (MiB, /proc/self/statm), or None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def pair_memory(pair, resident_before: Optional[float] = None, resident_loaded: Optional[float] = None) -> dict:
    """What the loaded pair holds (MiB): its tensors (parameters and buffers, each storage once: a draft sharing the
    target's embedding counts it once) per model and in all, and, given the process's resident memory before and
    after loading it, their difference and the growth from before loading to now (after the runs: KV caches,
    prepared weights, the runtime's buffers)."""
    seen: dict = {}
    per = {}
    for name in ("target", "draft", "feature"):
        model = getattr(pair, name, None)
        if model is None:
            continue
        start = sum(seen.values())
        for t in (*model.parameters(), *model.buffers()):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        per[name] = (sum(seen.values()) - start) / 2**20
    out = {"tensors_MiB": {**per, "total": sum(seen.values()) / 2**20}}
    now = resident_mib()
    if resident_before is not None and resident_loaded is not None and now is not None:
        out["resident_growth_after_load_MiB"] = resident_loaded - resident_before
        out["resident_growth_at_end_MiB"] = now - resident_before
    return out


def machine_description(pair) -> dict:
    from .engine.models import param_count as params
    from .engine.profile import processor_name
    from .engine.weights import kind
    from .zoo import cpu_bf16_flags

    gpu = {}
    if pair.target.device.type == "cuda":  # the GPU the pair runs on, named in every result measured there
        gpu = {"gpu": torch.cuda.get_device_name(pair.target.device), "cuda": torch.version.cuda}
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": processor_name(), **cpu_bf16_flags(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), **gpu,
            "target": {"params": params(pair.target), "dtype": str(pair.target.dtype), "weights": kind(pair.target),
                       "layers": pair.target.config.num_hidden_layers, "hidden": pair.target.config.hidden_size},
            "draft": {"params": params(pair.draft), "dtype": str(pair.draft.dtype), "weights": kind(pair.draft),
                      "layers": pair.draft.config.num_hidden_layers, "hidden": pair.draft.config.hidden_size}}


def alternate_streams(generate: Callable, arms: tuple, prompts: list, batch_size: int, rows_per_stream: int,
                      max_new_tokens: int, first_stream: int = 0) -> dict:
    """Two or more arms (e.g. two drafts) over the same requests, greedy, continuous batching: ``prompts`` split
    into streams of ``rows_per_stream * batch_size``, the arms' order changing from stream to stream
    (:func:`balanced_order`; stream i runs in order ``first_stream + i``, so that several calls continue one
    sequence), after one short warm-up call of each at this batch size. ``generate(arm, stream, max_new_tokens)``
    runs one stream and returns a ``GenerationOutput``.

    Returns: ``tokens_per_s`` (aggregate, wall time of the arm's calls), with the ``tokens`` and ``seconds`` behind it
    (to pool several calls), ``decode_seconds`` (the time of the calls' decoding rounds, prefills and admission left
    out), ``draft_prefill_seconds`` (the draft's reads of the requests' contexts), ``prefill_seconds`` (all reads of
    the requests' prompts and contexts, the draft's included), ``admissions`` (times queued requests joined),
    ``accepted`` (accepted candidates), ``drafted`` (candidates) and ``verifications`` (rounds times their live rows)
    per arm (the calls'
    :class:`~specdec_ext.engine.stats.GenerationStats` summed), ``by_stream``: each stream's tokens/s per arm (in
    stream order; their spread is the machine's noise over one stream), with the tokens and seconds behind them
    (``by_stream_tokens``, ``by_stream_seconds``: to resample streams), and ``same_tokens``: the share of requests
    whose tokens are the same under every arm."""
    seconds = dict.fromkeys(arms, 0.0)
    decode = dict.fromkeys(arms, 0.0)
    tokens = dict.fromkeys(arms, 0)
    accepted = dict.fromkeys(arms, 0)
    drafted, verifications, reads = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
    prefill, admissions = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0)
    texts: dict = {a: [] for a in arms}
    by_stream_tokens, by_stream_seconds = [], []
    for a in arms:
        generate(a, prompts[:batch_size], 8)
    step = rows_per_stream * batch_size
    for i, start in enumerate(range(0, len(prompts), step)):
        stream = prompts[start:start + step]
        by_stream_tokens.append({})
        by_stream_seconds.append({})
        for a in balanced_order(arms, first_stream + i):
            t0 = time.perf_counter()
            out = generate(a, stream, max_new_tokens)
            dt = time.perf_counter() - t0
            seconds[a] += dt
            by_stream_tokens[-1][a], by_stream_seconds[-1][a] = out.stats.new_tokens, dt
            tokens[a] += out.stats.new_tokens
            decode[a] += out.stats.decode_ms / 1e3
            accepted[a] += out.stats.accepted
            drafted[a] += out.stats.drafted
            verifications[a] += out.stats.verifications
            reads[a] += out.stats.draft_prefill_ms / 1e3
            prefill[a] += out.stats.prefill_ms / 1e3
            admissions[a] += out.stats.admissions
            texts[a].extend(out.new_tokens)
    same = sum(all(t == row[0] for t in row) for row in zip(*(texts[a] for a in arms)))
    by_stream = [{a: n[a] / s[a] for a in n} for n, s in zip(by_stream_tokens, by_stream_seconds)]
    return {"tokens_per_s": {a: tokens[a] / seconds[a] for a in arms}, "tokens": tokens, "seconds": seconds,
            "decode_seconds": decode, "draft_prefill_seconds": reads, "prefill_seconds": prefill,
            "admissions": admissions, "accepted": accepted, "drafted": drafted,
            "verifications": verifications, "by_stream": by_stream, "by_stream_tokens": by_stream_tokens,
            "by_stream_seconds": by_stream_seconds, "same_tokens": same / len(prompts)}


def add_stream_arguments(ap, k_help: str = "fixed candidate length K") -> None:
    """The options of a script built on :func:`alternate_streams`: --k, --prompts, --max-new-tokens,
    --rows-per-stream, --out."""
    ap.add_argument("--k", type=int, default=2, help=k_help)
    ap.add_argument("--prompts", type=int, default=128, help="HumanEval prompts per batch size")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rows-per-stream", type=int, default=4, help="prompts per stream and batch slot")
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write")


def format_table(rows: list[dict]) -> str:
    ref = any("speedup_vs_reference" in r for r in rows)
    head = ("| method | tokens/s | speedup (IQR) |" + (" vs fp32 plain |" if ref else "")
            + " mean accepted length | target calls / token | draft calls / token | loop overhead (ms / round) | greedy text |")
    lines = [head, "|---|---|---|" + ("---|" if ref else "") + "---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "–"
        vs = (f" {r['speedup_vs_reference']:.2f}× |" if "speedup_vs_reference" in r else " – |") if ref else ""
        if r["greedy_mismatches"] and r.get("exact", True):  # fp32: a method that changed the text gets no speed
            speed = f"– | text differs from plain decoding on prompts {r['greedy_mismatches']}"
            same = "DIFFERS"
            vs = " – |" if ref else ""
        else:
            speed = f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}× ({r['speedup_q1']:.2f}–{r['speedup_q3']:.2f})"
            if not r.get("greedy_checked", True):
                same = {"plain-fp32": "– (fp32 reference)", "llama.cpp": "– (its own arithmetic)"}.get(r["family"],
                                                                                                   "– (sampling)")
            elif not r["greedy_mismatches"]:
                same = "same"
            else:
                n = r["prompts"]
                same = (f"same on {round(r['same_text_share'] * n)}/{n} (first difference at token "
                        f"{r['first_difference_mean']:.0f} on average)")
        lines.append(f"| {r['method']} | {speed} |{vs} {acc} | {r['target_calls_per_token']:.3f} | "
                     f"{r['draft_calls_per_token']:.3f} | {r['loop_overhead_ms_per_round']:.2f} | {same} |")
    return "\n".join(lines)


def save_json(path, records: list[RunRecord], rows: list[dict], meta: dict) -> None:
    raw = [{"method": r.method, "prompt": r.prompt, "new_tokens": r.new_tokens, "wall_s": r.wall_s,
            "target_calls": r.target_calls, "draft_calls": r.draft_calls, "forward_s": r.forward_s,
            "engine": r.engine, "rounds": r.rounds, "tokens": r.tokens,
            **{k: getattr(r, k) for k in ("batch_size", "row_tokens", "row_finish_s") if hasattr(r, k)}}
           for r in records]
    data = {"meta": meta, "summary": rows, "runs": raw}
    if str(path).endswith(".gz"):  # a full run's per-round traces are tens of MB as text
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(data, f)
    else:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def load_results(path) -> dict:
    """A file written by :func:`save_json` (``.json`` or ``.json.gz``): ``{"meta", "summary", "runs"}``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)
