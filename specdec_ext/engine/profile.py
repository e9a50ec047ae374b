"""Profiling a target/draft pair where it runs, for the cost-aware stop rule (``threshold="auto"``).

Measures, with the engine's own runners at batch size 1 and a 128-token context: the target's forward
over n = 1 .. K_max + 1 tokens (what verifying K candidates costs), one draft forward, and the
engine's per-round and per-candidate work outside the forwards (from short fixed-K generations at two
K values). Each size is timed in a run of its own (two untimed forwards, then the timed repetitions; sizes in
increasing order), as a decode loop repeats it: timed round-robin among sizes, a one-token step came right after a
21-token forward, which runs oneDNN's matmuls over another copy of the weights (with AMX on an Intel Xeon), and took
8.0 ms against 5.5 ms in steady decoding (SmolLM2-135M with int8 weights, 2-core Xeon with AMX). The result is cached as JSON, keyed by the two models'
configurations, dtypes, device, thread count, torch version and processor, so the profile runs once
per pair and machine setting (about 10-30 s on a 2-core CPU for the bundled pair).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .._library import build_id
from ..policies.costs import CostModel, isotonic
from . import onednn_linear, weights
from .backends import backend_for, uses_lean
from .feature_draft import FeatureBackend, FeatureDraft
from .lookup import LookupBackend, PromptLookup
from .model import supports, uses_packed
from .tensor_parallel import from_rank0, is_main_process, tp_size


def cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR`` or ``~/.cache/specdec_ext``."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec_ext")


def processor_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_key(model) -> dict:
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    p = next(model.parameters())
    return {"config": cfg, "dtype": str(p.dtype), "device": str(p.device), "weights": weights.kind(model)}


def profile_key(target, draft, fast_draft: bool, k_max: int, fast_target: bool = True) -> str:
    if isinstance(draft, PromptLookup):  # a proposer: no weights
        lean, packed, draft_desc = False, False, repr(draft)
    else:
        p = next(draft.parameters())  # the lean runner's matmuls (packed oneDNN weights or F.linear) change its costs
        lean = bool(fast_draft) and supports(draft)
        packed = uses_packed(p.device, p.dtype) if lean else onednn_linear.wanted(draft, None)
        draft_desc = _model_key(draft)
        if isinstance(draft, FeatureDraft):  # its forward reads the target's features through its own backend
            draft_desc["kind"] = draft.kind
    desc = {"target": _model_key(target), "draft": draft_desc, "fast_draft": fast_draft, "k_max": k_max,
            "draft_linear": "onednn-packed" if packed else "torch",
            "target_linear": "onednn-packed" if onednn_linear.wanted(target, None) else "torch",
            "target_runner": "lean" if uses_lean(target, "target", fast_target) else "transformers",
            "target_attention": getattr(target.config, "_attn_implementation", None),
            "draft_attention": "decode_attention" if lean and next(draft.parameters()).device.type == "cpu" else "sdpa",
            "engine": "static", "kernels": build_id(), "timing": "runs",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "processor": processor_name(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "tp": tp_size(target)}
    return hashlib.sha1(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


# the verification sizes the single-row profile measures (ms between them are linear): a target's forward over n
# tokens moves little from n to n + 1 past a few tokens, and a first call waits for the profile
PAIR_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 21)


def _interpolate(measured: dict, n_max: int) -> list[float]:
    """ms for n = 1 .. n_max from ``measured`` {n: ms} (sorted keys, 1 among them), linear between measured n."""
    ns = sorted(measured)
    out = []
    for n in range(1, n_max + 1):
        hi = next((m for m in ns if m >= n), ns[-1])
        lo = max((m for m in ns if m <= n), default=ns[0])
        w = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append((1 - w) * measured[lo] + w * measured[hi])
    return out


@torch.inference_mode()
def profile_pair(target, draft, fast_draft: bool = True, k_max: int = 20, reps: int = 5, context: int = 128,
                 log=None, generator_cls=None, fast_target: bool = True) -> CostModel:
    """Measure a :class:`~specdec_ext.policies.costs.CostModel` for this pair (see the module docstring);
    ``generator_cls``: the engine's :class:`~specdec_ext.engine.generator.SpeculativeGenerator` (passed in by its
    caller, so that this module does not import the generator that imports it)."""
    from .models import vocab_size

    V = vocab_size(target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, context), generator=g)
    lookup = isinstance(draft, PromptLookup)
    use_fast = fast_draft and not lookup and supports(draft)
    t_run = backend_for(target, "target", fast_target)
    d_run = LookupBackend(draft, V, t_run.device) if lookup else FeatureBackend(draft, t_run, V) \
        if isinstance(draft, FeatureDraft) else backend_for(draft, "draft", use_fast, V)
    for r in (t_run, d_run):
        r.start(1, context + k_max + 8)
        r.append([0], [prompt[0].tolist()], [0])
    sizes = [n for n in PAIR_SIZES if n <= k_max + 1] + ([k_max + 1] if k_max + 1 not in PAIR_SIZES else [])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    dtimes: list[float] = []
    tokens = {n: torch.randint(0, V, (1, n), generator=g) for n in sizes}
    one = tokens[1]

    def tstep(n):
        t_run.forward(tokens[n].to(t_run.device), n, context + n)
        t_run.rollback(torch.tensor([n], device=t_run.device))

    def dstep():
        d_run.forward(one.to(d_run.device), 1, context + 1)
        d_run.rollback(torch.tensor([1], device=d_run.device))

    for i, n in enumerate(sizes):  # each size in a run of its own (module docstring)
        for _ in range(2):
            tstep(n)
        for _ in range(reps):
            times[n].append(_timed(lambda: tstep(n), t_run.device))
        if log is not None:
            log(f"\r[specdec] profiling the pair for threshold='auto': {i + 1}/{len(sizes)}")
    for _ in range(5):
        dstep()
    for _ in range(5 * reps):
        dtimes.append(_timed(dstep, d_run.device))
    for r in (t_run, d_run):
        r.close()
    verify = isotonic(_interpolate({n: statistics.median(times[n]) for n in sizes}, k_max + 1))
    draft_ms = statistics.median(dtimes)
    # per-round and per-candidate work outside the forwards, from short fixed-K generations at K = 1 and 4
    gen = generator_cls(target, draft, policy="fixed", k=1, fast_draft=fast_draft, fast_target=fast_target)
    outside = {}
    short = prompt[:, :16].repeat(1, 2) if lookup else prompt[:, :32]  # prompt lookup: a context it can copy from
    for k in (1, 4):
        per_round = []
        for _ in range(3):
            out = gen.generate(short, max_new_tokens=24, temperature=0, policy="fixed", k=k)
            st = out.stats
            rounds = len(st.rounds)
            in_rounds = st.decode_ms
            forwards = st.target_forward_ms + st.draft_forward_ms - st.prefill_ms  # prefill is outside the rounds
            per_round.append(max(0.0, in_rounds - forwards) / max(1, rounds))
        outside[k] = statistics.median(per_round)
    step_ms = max(0.0, (outside[4] - outside[1]) / 3.0)
    round_ms = max(0.0, outside[1] - step_ms)
    if log is not None:
        log("\n")
    meta = {"processor": processor_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "target_dtype": str(next(target.parameters()).dtype),
            "draft_dtype": draft.name if lookup else str(next(draft.parameters()).dtype),
            "device": str(t_run.device), "fast_draft": use_fast, "context": context, "reps": reps,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return CostModel(verify, draft_ms, step_ms, round_ms, meta)


def cached_profile(target, draft, fast_draft: bool = True, k_max: int = 20, refresh: bool = False,
                   progress: bool = True, directory: Optional[Path] = None, *, generator_cls,
                   fast_target: bool = True) -> CostModel:
    """The pair's :class:`CostModel`, measured once per pair and setting (:func:`profile_key`) and cached
    as JSON under ``directory`` (default :func:`cache_dir`)``/profiles``."""
    path = (directory or cache_dir()) / "profiles" / f"{profile_key(target, draft, fast_draft, k_max, fast_target)}.json"
    return _cached(path, CostModel, lambda log: profile_pair(target, draft, fast_draft, k_max, log=log,
                                                                  generator_cls=generator_cls, fast_target=fast_target),
                   "the pair for threshold='auto' (once per pair, dtype, device and thread count", refresh, progress)


def _cached(path: Path, cls, measure, what: str, refresh: bool, progress: bool):
    """``cls.from_json`` of the JSON at ``path``, or ``measure(log)`` saved there. A tensor-parallel target: the
    ranks measure together (its forwards are collective) and all use rank 0's measurement."""
    cached = from_rank0(_read(path, cls.from_json) if not refresh and is_main_process() else None)
    if cached is not None:
        return cls.from_json(cached)
    log = _progress_log(progress)
    if log is not None:
        log(f"[specdec] profiling {what}; cached in {path})\n")
    text = from_rank0(measure(log).to_json())
    _save(path, text)
    return cls.from_json(text)


def _progress_log(progress: bool):
    """Where progress lines go: stderr, on rank 0 only, or nowhere (None)."""
    return (lambda s: print(s, end="", file=sys.stderr, flush=True)) if progress and is_main_process() else None


def _save(path: Path, text: str) -> None:
    """Write a profile's JSON atomically (rank 0 only)."""
    if is_main_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _read(path: Path, parse=CostModel.from_json) -> Optional[str]:
    """The cached profile's JSON, or None when missing or damaged (then it is measured again)."""
    try:
        text = path.read_text()
        parse(text)
        return text
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None


BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
ROUND_KS = (0, 1, 2, 4)  # k >= 1 lie on a fitted line (_round_row), continued past 4 by its slope


@torch.inference_mode()
def profile_batches(target, draft, fast_draft: bool = True, sizes=BATCH_SIZES, ks=ROUND_KS, reps: int = 3,
                    context: int = 128, tokens: int = 8, wide_context: int = 512, log=None, generator_cls=None,
                    fast_target: bool = True):
    """Measure a :class:`~specdec_ext.policies.costs.BatchCosts` at each batch size B of ``sizes``:

    - whole rounds as the engine runs them: greedy generations of ``tokens`` tokens from B random
      ``context``-token prompts with fixed K = k for each k of ``ks`` (k = 0: plain decoding); the median
      ``total_ms`` of the rounds in which all B rows were live; k >= 1 are then put on a fitted line
      (``_round_row``; the raw medians are kept in ``meta["round_measured"]``);
    - the target's forward alone over ``[B, n]`` for n = 1 .. max(ks) + 1 (medians of ``reps``), with a cache of
      ``context`` columns and again of ``wide_context`` columns (attention over the cache grows with it),
      both capped by the target's context length.
    """
    from ..policies.costs import BatchCosts
    from .models import context_length, vocab_size

    V = vocab_size(target)
    g = torch.Generator().manual_seed(0)
    gens = {k: generator_cls(target, draft if k else None, policy="fixed" if k else "autoregressive",
                             fast_draft=fast_draft, fast_target=fast_target, **({"k": k} if k else {})) for k in ks}
    n_max = max(ks) + 1
    ctx = context_length(target)
    wide = min(wide_context, ctx - n_max - 1) if ctx is not None else wide_context
    rounds, verify, verify_wide, raw = [], [], [], {}
    for i, B in enumerate(sizes):
        prompt = torch.randint(0, V, (B, context), generator=g)
        measured = {}
        for k in ks:
            gens[k].generate(prompt[:, -8:], max_new_tokens=2, temperature=0)  # warm-up at this size
            st = gens[k].generate(prompt, max_new_tokens=tokens, temperature=0).stats
            full = [r.total_ms for r in st.rounds if len(r.rows) == B] or [r.total_ms for r in st.rounds]
            measured[k] = statistics.median(full)
        raw[B] = measured
        rounds.append(_round_row(measured, max(ks)))
        verify.append(forward_times(target, prompt, n_max, reps, g, fast_target))
        if wide > context:
            wide_prompt = torch.cat([torch.randint(0, V, (B, wide - context), generator=g), prompt], 1)
            verify_wide.append(forward_times(target, wide_prompt, n_max, reps, g, fast_target))
        if log is not None:
            log(f"\r[specdec] profiling batch sizes for the verification budget: {i + 1}/{len(sizes)}")
    if log is not None:
        log("\n")
    meta = {"processor": processor_name(), "threads": torch.get_num_threads(), "context": context, "reps": reps,
            "tokens": tokens, "ks": list(ks), "target_dtype": str(next(target.parameters()).dtype),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "round_measured": raw}
    if verify_wide:
        return BatchCosts(list(sizes), rounds, verify, meta, context, wide, verify_wide)
    return BatchCosts(list(sizes), rounds, verify, meta)


def _round_row(measured: dict, k_max: int) -> list[float]:
    """Round ms for k = 0 .. k_max from the measured rounds: k = 0 (plain decoding) as measured; k >= 1 on the
    least-squares line through the measured k >= 1 (slope >= 0). A round's cost grows by about a draft step and
    a verified token per candidate, and single short measurements on a loaded machine are noisy: a fit keeps a
    noisy point from making one step look free (or dear) to the budget's marginal decisions."""
    pts = [(k, m) for k, m in measured.items() if k >= 1]
    if len(pts) < 2:
        return [measured.get(0, pts[0][1] if pts else 0.0)] + [pts[0][1] if pts else 0.0] * k_max
    mk = sum(k for k, _ in pts) / len(pts)
    mm = sum(m for _, m in pts) / len(pts)
    var = sum((k - mk) ** 2 for k, _ in pts)
    slope = max(0.0, sum((k - mk) * (m - mm) for k, m in pts) / var)
    return [measured[0]] + [mm + slope * (k - mk) for k in range(1, k_max + 1)]


def forward_times(target, prompt: torch.Tensor, n_max: int, reps: int, g, fast_target: bool = True) -> list[float]:
    """Median ms of the target's forward over ``[B, n]`` new tokens, n = 1 .. n_max, after reading ``prompt``
    (each forward rolled back), through the backend :func:`~specdec_ext.engine.backends.backend_for` gives it."""
    from .models import vocab_size

    B, C = prompt.shape
    t_run = backend_for(target, "target", fast_target)
    t_run.start(B, C + n_max + 1)
    t_run.append(list(range(B)), prompt.tolist(), [0] * B)
    times: dict[int, list[float]] = {n: [] for n in range(1, n_max + 1)}
    toks = {n: torch.randint(0, vocab_size(target), (B, n), generator=g).to(t_run.device) for n in times}

    def tstep(n):
        t_run.forward(toks[n], n, C + n)
        t_run.rollback(torch.full((B,), n, device=t_run.device))

    for n in times:  # each size in a run of its own, as profile_pair times them
        for _ in range(2):
            tstep(n)
        for _ in range(reps):
            times[n].append(_timed(lambda: tstep(n), t_run.device))
    t_run.close()
    return [statistics.median(times[n]) for n in times]


def sizes_for(batch_size: int) -> list[int]:
    """The batch sizes of :data:`BATCH_SIZES` a call of ``batch_size`` rows needs in its cost table: those below it
    and the first at or above it (rows only leave a call, so its live rows stay within that range; the table is
    linear between measured sizes)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1 (rows), got {batch_size!r}")
    below = [s for s in BATCH_SIZES if s < batch_size]
    above = [s for s in BATCH_SIZES if s >= batch_size]
    return below + [above[0] if above else batch_size]


def merge_batch_costs(old, new):
    """One :class:`~specdec_ext.policies.costs.BatchCosts` with the sizes of both (``new``'s rows where both have
    a size); ``old`` None, or measured at other cache widths: ``new``."""
    from ..policies.costs import BatchCosts

    if old is None or (old.context, old.wide_context) != (new.context, new.wide_context) \
            or bool(old.verify_wide_ms) != bool(new.verify_wide_ms):
        return new
    rows = {}
    for t in (old, new):
        for i, B in enumerate(t.sizes):
            rows[B] = (t.round_ms[i], t.verify_ms[i], t.verify_wide_ms[i] if t.verify_wide_ms else None)
    sizes = sorted(rows)
    meta = dict(new.meta)
    meta["round_measured"] = {**old.meta.get("round_measured", {}), **new.meta.get("round_measured", {})}
    return BatchCosts(sizes, [rows[B][0] for B in sizes], [rows[B][1] for B in sizes], meta, new.context,
                      new.wide_context, [rows[B][2] for B in sizes] if new.verify_wide_ms else ())


def cached_batch_profile(target, draft, fast_draft: bool = True, refresh: bool = False, progress: bool = True,
                         directory: Optional[Path] = None, *, generator_cls, fast_target: bool = True,
                         sizes=BATCH_SIZES):
    """The pair's :class:`~specdec_ext.policies.costs.BatchCosts` at (at least) the batch sizes ``sizes``, cached
    as JSON beside the single-row profile (the key of :func:`profile_key`): sizes the cache lacks are measured and
    added, so a first call measures only the sizes it can use (:func:`sizes_for`; about 1-2 s a size for the
    bundled pair on a 2-core CPU) and a later, larger call adds its own. A tensor-parallel target: the ranks
    measure together and all use rank 0's table."""
    from ..policies.costs import BatchCosts

    key = profile_key(target, draft, fast_draft, max(ROUND_KS), fast_target)
    path = (directory or cache_dir()) / "profiles" / f"{key}-batch4.json"  # 4: sizes measured on demand
    text = _read(path, BatchCosts.from_json) if not refresh and is_main_process() else None
    stored = BatchCosts.from_json(text) if text is not None else None
    missing = from_rank0([B for B in sizes if stored is None or B not in stored.sizes])  # rank 0 read the cache
    if not missing:
        return BatchCosts.from_json(from_rank0(text))
    log = _progress_log(progress)
    if log is not None:
        log(f"[specdec] profiling batch sizes {missing} for the verification budget (once per pair and setting; "
            f"cached in {path})\n")
    measured = profile_batches(target, draft, fast_draft, sizes=missing, log=log, generator_cls=generator_cls,
                               fast_target=fast_target)
    merged = from_rank0(merge_batch_costs(stored, measured).to_json())
    _save(path, merged)
    return BatchCosts.from_json(merged)
