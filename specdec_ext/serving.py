"""Serving latency: requests arriving over time, served by continuous batching, measured as serving benchmarks
report it (vLLM's ``benchmarks/benchmark_serving.py``): time to first token (TTFT), time per output token after the
first (TPOT), inter-token latency (ITL) and end-to-end latency, each as mean, median, p90 and p99.

Requests arrive by a gamma process at a request rate (``burstiness`` 1: Poisson arrivals), or all at once (rate
inf). :meth:`~specdec_ext.engine.generator.SpeculativeGenerator.generate_continuous` serves them with at most B live
(``arrival_ms``), and every time is read on the call's own clock (each token's emission is the end of the round that
emitted it; idle time before an arrival is skipped, never slept). Speculative decoding emits a round's tokens
together: the ITLs inside such a burst are 0 ms and the gap before it is one round, so its ITL distribution has
more zeros and a heavier tail than plain decoding's at the same mean.

``specdec bench --serve`` runs it for plain decoding, fixed K, SpecDec++ ``auto`` (each row's own goodput rule) and
the batch verification budget (``auto`` deciding for the batch), writes JSON, a Markdown table and plots.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Optional, Sequence

SUMMARY = ("mean", "median", "p90", "p99")


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times in ms of ``n`` requests at ``rate`` requests/s: gaps drawn from a gamma distribution of shape
    ``burstiness`` and mean 1 / rate (shape 1: exponential gaps, a Poisson process; below 1 burstier), the first
    request at 0. ``rate`` inf: every request at 0.

    Raises ValueError for a rate or burstiness that is not a positive number."""
    if not (isinstance(rate, (int, float)) and rate > 0) or math.isnan(rate):
        raise ValueError(f"rate must be a positive number of requests/s (inf: all at once), got {rate!r}")
    if not (isinstance(burstiness, (int, float)) and 0 < burstiness < math.inf):
        raise ValueError(f"burstiness must be a positive finite number (1: Poisson arrivals), got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) * 1e3
        out.append(t)
    return out


def summarize(values: Sequence[float]) -> dict:
    """Mean, median, p90 and p99 of ``values`` (linear interpolation between order statistics; None when empty)."""
    v = sorted(values)
    if not v:
        return {k: None for k in SUMMARY}

    def q(p):
        x = p * (len(v) - 1)
        lo = int(math.floor(x))
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"mean": sum(v) / len(v), "median": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def latencies(out) -> dict:
    """Per-request latencies in ms from a :class:`~specdec_ext.engine.scheduler.ContinuousOutput` of a call with
    arrivals: ``ttft`` (first token - arrival), ``tpot`` ((last - first token) / (tokens - 1), requests of two
    tokens or more), ``e2e`` (last token - arrival), and ``itl`` (every gap between a request's consecutive tokens,
    0 inside a round's burst), each a list."""
    ttft, tpot, e2e, itl = [], [], [], []
    for arrival, times in zip(out.arrival_ms, out.token_ms):
        if not times:
            continue
        ttft.append(times[0] - arrival)
        e2e.append(times[-1] - arrival)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl += [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": itl}


def acceptance_by_position(stats, depth: int = 8) -> list:
    """Per candidate position j = 1 .. ``depth``: the share of verified candidates at position j that were accepted
    (rows that verified at least j candidates), None where none was verified."""
    seen, taken = [0] * depth, [0] * depth
    for r in stats.rounds:
        for drafted, accepted in zip(r.candidates, r.accepted):
            for j in range(min(drafted, depth)):
                seen[j] += 1
                taken[j] += j < accepted
    return [t / s if s else None for t, s in zip(taken, seen)]


def serve(generate: Callable, prompts: list, rate: float, batch_size: int, max_new_tokens: int,
          burstiness: float = 1.0, seed: int = 0) -> dict:
    """One serving run: ``prompts`` (token id lists) arriving at ``rate`` requests/s, served by ``generate``
    (``generate_continuous`` of a generator, bound to its method), at most ``batch_size`` live, greedy. Returns
    each latency's summary in ms, per-position acceptance, the mean accepted length, tokens/s over the call's
    clock, the raw per-request values (``requests``) and every ITL (``itl_ms``)."""
    arrivals = arrival_times(len(prompts), rate, burstiness, seed)
    out = generate(prompts, batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=0,
                   arrival_ms=arrivals)
    lat = latencies(out)
    span = max(max(t) for t in out.token_ms if t) - min(out.arrival_ms)
    tokens = sum(len(t) for t in out.new_tokens)
    return {"rate": rate, **{k: summarize(v) for k, v in lat.items()},
            "acceptance_by_position": acceptance_by_position(out.stats),
            "mean_accepted_length": out.stats.mean_accepted_length, "tokens": tokens,
            "tokens_per_s": tokens / (span / 1e3) if span > 0 else None,
            "requests": {"ttft": lat["ttft"], "tpot": lat["tpot"], "e2e": lat["e2e"]}, "itl_ms": lat["itl"]}


def format_table(rows: list) -> str:
    """Markdown: per method and rate, TTFT / TPOT / ITL / end-to-end medians and p99s in ms, tokens/s."""
    lines = ["| method | rate (req/s) | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 | tokens/s |"
             " mean accepted length |", "|---|---|---|---|---|---|---|---|"]

    def two(d):
        return f"{d['median']:.1f} / {d['p99']:.1f}" if d["median"] is not None else "–"

    for r in rows:
        rate = "all at once" if math.isinf(r["rate"]) else f"{r['rate']:g}"
        lines.append(f"| {r['method']} | {rate} | {two(r['ttft'])} | {two(r['tpot'])} | {two(r['itl'])} | "
                     f"{two(r['e2e'])} | {r['tokens_per_s']:.1f} | {r['mean_accepted_length']:.2f} |")
    return "\n".join(lines)


def plot(rows: list, out_dir, prefix: str = "serve") -> list:
    """Two figures: TPOT and ITL p50 / p99 against request rate per method, and each method's ITL CDF at the highest
    finite rate; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    finite = sorted({r["rate"] for r in rows if not math.isinf(r["rate"])})
    made = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for i, m in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == m and not math.isinf(r["rate"])), key=lambda r: r["rate"])
        for ax, key in zip(axes, ("tpot", "itl")):
            ax.plot([r["rate"] for r in mine], [r[key]["median"] for r in mine], "o-", color=f"C{i}", label=f"{m} p50")
            ax.plot([r["rate"] for r in mine], [r[key]["p99"] for r in mine], "o--", color=f"C{i}", label=f"{m} p99")
    for ax, key in zip(axes, ("TPOT", "ITL")):
        ax.set_xscale("log")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(f"{key} (ms)")
        ax.legend(fontsize=6)
    made.append(_save(fig, out_dir / f"{prefix}-latency.png"))
    if finite:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
        for i, m in enumerate(methods):
            r = next(r for r in rows if r["method"] == m and r["rate"] == finite[-1])
            v = sorted(r["itl_ms"])
            ax.plot(v, [(j + 1) / len(v) for j in range(len(v))], color=f"C{i}", label=m)
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("share of token gaps")
        ax.set_title(f"ITL CDF at {finite[-1]:g} requests/s", fontsize=9)
        ax.legend(fontsize=7)
        made.append(_save(fig, out_dir / f"{prefix}-itl-cdf.png"))
    return made


def _save(fig, path) -> str:
    """Lay out, save and close ``fig``; returns the file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def serve_methods(pair, k: int) -> dict:
    """The methods ``specdec bench --serve`` compares, by name: keyword arguments of ``SpeculativeGenerator``."""
    return {"plain": dict(policy="autoregressive"), f"fixed K={k}": dict(policy="fixed", k=k),
            "specdec++ auto": dict(policy="specdecpp", head=pair.head, threshold="auto", batch_budget=False),
            "budget (auto)": dict(policy="specdecpp", head=pair.head, threshold="auto")}


def run(pair, prompts: list, rates: Sequence[float], batch_size: int, max_new_tokens: int, k: int = 2,
        burstiness: float = 1.0, seed: int = 0, log: Optional[Callable] = print, **engine) -> list:
    """Every method of :func:`serve_methods` at every rate (methods alternating within a rate), after one warm-up
    call per method at ``batch_size``; ``engine``: more keyword arguments of every ``SpeculativeGenerator`` (e.g.
    ``costs``). Returns rows: method, rate and :func:`serve`'s values."""
    from .engine.generator import SpeculativeGenerator

    gens = {}
    for name, kw in serve_methods(pair, k).items():
        g = SpeculativeGenerator(pair.target, pair.draft if kw["policy"] != "autoregressive" else None, **kw,
                                 **engine)
        g.generate_continuous(prompts[:batch_size], batch_size=batch_size, max_new_tokens=8, temperature=0)
        gens[name] = g
    rows = []
    for i, rate in enumerate(rates):
        names = list(gens) if i % 2 == 0 else list(reversed(gens))
        for name in names:
            row = {"method": name, **serve(gens[name].generate_continuous, prompts, rate, batch_size,
                                           max_new_tokens, burstiness, seed)}
            rows.append(row)
            if log is not None:
                log(f"{name} at {rate:g} req/s: TPOT p50 {row['tpot']['median']:.1f} ms, p99 "
                    f"{row['tpot']['p99']:.1f}; ITL p99 {row['itl']['p99']:.1f}; TTFT p50 {row['ttft']['median']:.1f}")
    return rows
