"""The batch benchmark (``specdec bench --batch-sizes 1,4,16,64``): speculative decoding as concurrent requests.

**Continuous batching** (the default, as a server runs): for each batch size B the prompts are cut, in
order, into streams of 4 B requests, and every method serves each stream in one
``SpeculativeGenerator.generate_continuous`` call: B requests live at once, and a request that finishes
hands its row to the next one in the queue after that round. The methods' order changes per stream
(``benchmark.balanced_order``), so machine drift, and what a method leaves behind for the next, falls on all
alike. Each stream ends with a tail in which the batch drains (B - 1 requests or fewer).

**Static batches** (``refill=False``, ``--static-batches``): the prompts are cut into groups of B (left-padded)
served by one ``generate()`` call each; a row that finishes leaves the batch but nothing takes its place, so
every group ends with a tail that runs at a smaller batch and waits for its slowest row. This setting
penalises speculation: rows advance at different speeds, and plain decoding's rows finish together.

Reported per (method, B):

- aggregate tokens/s: all tokens of all streams (groups) / the summed wall time of their calls;
- per-request tokens/s: median over requests of (the request's tokens / the time from its admission, prefill
  included, to the end of the round that finished it), i.e. the speed one user sees once served;
- mean accepted length (tokens emitted per row per round, minus one);
- decode tokens/s: all tokens / the summed time of the decoding rounds (prefills and admission left out), and the
  prefill share: the rest of the wall time. On a 2-core CPU at B = 64 the prompts' prefills (HumanEval, about 140
  tokens each, against 48 generated) take about 70% of the wall time whatever the method, so the aggregate figures
  differ by less than the decoding does;
- speedup: aggregate tokens/s over plain decoding's at the same B;
- with ``repeats`` > 1 (``--repeats``), the figures above pool every pass, and ``tokens_per_s_by_repeat`` gives each
  pass's aggregate tokens/s.

Results use the benchmark's JSON schema (``benchmark.save_json``): one summary row per (method, B) with a
``batch_size`` field; one run record per (method, stream or group) with its ``batch_size``.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from .benchmark import Method, RunRecord, balanced_order
from .engine import SpeculativeGenerator
from .engine.admission import DEFAULT_ADMISSION, check_admission


@dataclass
class BatchRecord(RunRecord):
    """A ``RunRecord`` of one group: ``prompt`` is the group's index, ``tokens`` its rows' tokens joined."""

    batch_size: int = 1
    repeat: int = 0                                    # which pass over the streams (``repeats``)
    row_tokens: list = field(default_factory=list)     # tokens of each request
    row_finish_s: list = field(default_factory=list)   # seconds from each request's admission to its last round
    decode_s: float = 0.0                              # seconds in decoding rounds (the rest: prefills, admission)


def _groups(encoded: list[list[int]], B: int, pad: int):
    for g in range(0, len(encoded), B):
        rows = encoded[g : g + B]
        T = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
        yield g // B, ids, mask


def finish_times_s(stats) -> list[float]:
    """Per row of a call: seconds from the call's start (prefill included) to the end of the row's last round."""
    t = stats.prefill_ms
    last = {}
    for r in stats.rounds:
        t += r.total_ms
        for row in r.rows:
            last[row] = t
    return [last.get(b, t) / 1e3 for b in range(stats.batch_size)]


STREAM_BATCHES = 4  # a stream of continuous batching holds this many batches' worth of requests


def request_lengths(n: int, max_new_tokens: int, spread: int = 0, seed: int = 0) -> list[int]:
    """Each of ``n`` requests' max_new_tokens: uniform integers in ``max_new_tokens`` +- ``spread`` (mean
    ``max_new_tokens``), from ``random.Random(seed)``; all ``max_new_tokens`` when ``spread`` is 0.

    Raises ValueError for a ``spread`` that is not an integer in 0 .. ``max_new_tokens`` - 1."""
    if isinstance(spread, bool) or not isinstance(spread, int) or not 0 <= spread < max_new_tokens:
        raise ValueError(f"length_spread must be an integer in 0 .. max_new_tokens - 1 = {max_new_tokens - 1} "
                         f"(tokens), got {spread!r}")
    rng = random.Random(seed)
    return [rng.randint(max_new_tokens - spread, max_new_tokens + spread) if spread else max_new_tokens
            for _ in range(n)]


def run_batch_benchmark(pair, prompts: list[str], methods: list[Method], batch_sizes, max_new_tokens: int = 64,
                        temperature: float = 0.0, seed: int = 0, costs=None, progress: bool = True,
                        refill: bool = True, repeats: int = 1, draft_context: Optional[int] = None,
                        length_spread: int = 0, admission: Optional[str] = None) -> list[BatchRecord]:
    """Every method on every stream (``refill``, continuous batching) or group (static batches) of every batch
    size (see the module docstring), ``repeats`` passes over them per batch size (the method order changing by
    stream and pass, ``benchmark.balanced_order``, so slow drift of the machine's speed falls on every method
    alike). ``methods``: ours only.
    ``draft_context``: the speculative methods' draft reads at most the last that many tokens of a request's
    context (``SpeculativeGenerator(draft_context=)``; None: all of it). ``length_spread`` S (continuous batching
    only): request i asks for its own number of tokens, drawn once (uniform, seeded by ``seed``) from
    ``max_new_tokens`` - S .. ``max_new_tokens`` + S, the same for every method, batch size and pass, as a
    server's requests differ (:func:`request_lengths`); 0: every request ``max_new_tokens``. With equal lengths
    plain decoding's requests finish in the same step and are refilled together, while a speculative method's
    finish at different rounds and are refilled a few at a time. ``admission`` (continuous batching only):
    ``generate_continuous``'s, ``"eager"``, ``"grouped"`` or ``"ahead"`` (:mod:`specdec_ext.engine.admission`;
    None: its default, ``DEFAULT_ADMISSION``).

    Raises: ValueError for methods that are not this engine's, batch sizes or ``repeats`` that are not integers
    >= 1, a ``draft_context`` that is not None or an integer >= 1, a ``length_spread`` that is not an integer in
    0 .. ``max_new_tokens`` - 1, or one > 0 with static batches, an unknown ``admission`` or any given with static
    batches."""
    if any(m.kind != "ours" or m.family == "oracle" for m in methods):
        raise ValueError("the batch benchmark runs this engine's policies only (no transformers or oracle methods)")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be integers >= 1, got {batch_sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    limits = request_lengths(len(prompts), max_new_tokens, length_spread, seed)
    if length_spread and not refill:
        raise ValueError("length_spread: requests of their own lengths need continuous batching (refill=True)")
    if admission is not None and check_admission(admission) and not refill:
        raise ValueError("admission: static batches admit no requests mid-generation (refill=True)")
    admission = DEFAULT_ADMISSION if admission is None else admission
    tok = pair.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or 0)
    encoded = [tok(p)["input_ids"] for p in prompts]
    if costs is None and any(m.policy().needs_costs for m in methods):
        costs = SpeculativeGenerator(pair.target, pair.draft).costs()
    gens = {}
    for m in methods:
        pol = m.policy()
        gens[m.name] = SpeculativeGenerator(pair.target, pair.draft if pol.speculative else None, policy=pol,
                                            costs=costs, draft_context=draft_context)
    first = torch.tensor([encoded[0][:16]] * min(4, max(batch_sizes)))
    for m in methods:  # warm-up: allocation and lazy initialisation
        gens[m.name].generate(first, max_new_tokens=8, temperature=temperature, seed=seed, eos_token_id=eos)
    size = (lambda B: STREAM_BATCHES * B) if refill else (lambda B: B)
    n_calls = repeats * sum(-(-len(encoded) // size(B)) for B in batch_sizes)
    bar = tqdm(total=n_calls * len(methods), desc="bench (batches)", unit="call", disable=not progress)
    records = []
    for B in batch_sizes:
        calls = ((r, x) for r in range(repeats) for x in _groups(encoded, size(B), pad))
        for call, (rep, (g, ids, mask)) in enumerate(calls):
            order = balanced_order(methods, call)  # one balanced sequence over the groups of every repeat
            for m in order:
                at = g * size(B)  # the group's first request
                kw = dict(max_new_tokens=limits[at : at + ids.shape[0]] if length_spread else max_new_tokens,
                          temperature=temperature, seed=seed + at, eos_token_id=eos)
                t0 = time.perf_counter()
                if refill:
                    out = gens[m.name].generate_continuous([row[mk.bool()] for row, mk in zip(ids, mask)], B,
                                                           admission=admission, **kw)
                else:
                    out = gens[m.name].generate(ids, attention_mask=mask, pad_token_id=pad, **kw)
                wall = time.perf_counter() - t0
                st = out.stats
                finish = [(f - a) / 1e3 for a, f in zip(out.admitted_ms, out.finished_ms)] if refill \
                    else finish_times_s(st)
                records.append(BatchRecord(
                    m.name, g, st.new_tokens, wall, st.target_calls, st.draft_calls,
                    tokens=[t for row in out.new_tokens for t in row], engine=st.summary(),
                    forward_s=(st.target_forward_ms + st.draft_forward_ms) / 1e3, batch_size=B, repeat=rep,
                    row_tokens=[len(r) for r in out.new_tokens], row_finish_s=finish,
                    decode_s=st.decode_ms / 1e3))
                bar.update(1)
    bar.close()
    return records


def summarize_batches(records: list[BatchRecord], methods: list[Method], baseline: str = "plain") -> list[dict]:
    """One row per (method, batch size): aggregate and per-request tokens/s, speedups over ``baseline`` at
    that batch size, mean accepted length and candidate length, and the texts' agreement with ``baseline``."""
    rows = []
    sizes = sorted({r.batch_size for r in records})
    for B in sizes:
        at = [r for r in records if r.batch_size == B]
        agg = {}
        for m in methods:
            runs = [r for r in at if r.method == m.name]
            if not runs:
                continue
            tokens, wall = sum(r.new_tokens for r in runs), sum(r.wall_s for r in runs)
            per_request = [n / s for r in runs for n, s in zip(r.row_tokens, r.row_finish_s) if s > 0]
            rounds = sum(r.engine["rounds"] for r in runs)
            agg[m.name] = row = {
                "method": m.name, "family": m.family, "param": m.param, "batch_size": B, "groups": len(runs),
                "requests": sum(len(r.row_tokens) for r in runs), "new_tokens": tokens,
                "tokens_per_s": tokens / wall if wall > 0 else 0.0,
                "per_request_tokens_per_s": statistics.median(per_request) if per_request else 0.0,
                "decode_tokens_per_s": tokens / decode if (decode := sum(r.decode_s for r in runs)) > 0 else 0.0,
                "prefill_share": 1.0 - decode / wall if wall > 0 else 0.0,
                "mean_accepted_length": sum(r.engine["mean_accepted_length"] * r.engine["rounds"] for r in runs)
                / max(1, rounds),
                "mean_candidate_length": sum(r.engine["mean_candidate_length"] * r.engine["rounds"] for r in runs)
                / max(1, rounds),
                "target_calls_per_token": sum(r.target_calls for r in runs) / max(1, tokens)}
            passes = sorted({r.repeat for r in runs})
            if len(passes) > 1:  # each pass's aggregate tokens/s, to show the machine's drift between passes
                row["tokens_per_s_by_repeat"] = [
                    sum(r.new_tokens for r in runs if r.repeat == p) / sum(r.wall_s for r in runs if r.repeat == p)
                    for p in passes]
            rows.append(row)
        base = agg.get(baseline)
        base_runs = {(r.prompt, r.repeat): r for r in at if r.method == baseline}
        for name, row in agg.items():
            if base is not None:
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["per_request_speedup"] = row["per_request_tokens_per_s"] / base["per_request_tokens_per_s"]
                if base["decode_tokens_per_s"] > 0:
                    row["decode_speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            runs = [r for r in at if r.method == name]
            same = [r.tokens == base_runs[r.prompt, r.repeat].tokens for r in runs if (r.prompt, r.repeat) in base_runs]
            row["same_text_share"] = sum(same) / len(same) if same else None
    return rows


def format_batch_table(rows: list[dict]) -> str:
    lines = ["| B | method | aggregate tokens/s | × plain | per-request tokens/s | × plain | decode tokens/s | × plain | "
             "prefill share | mean accepted length | mean candidate length | groups with plain's text |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = f"{r['same_text_share']:.0%}" if r.get("same_text_share") is not None else "–"
        decode = (f"{r['decode_tokens_per_s']:.1f} | {r.get('decode_speedup', 1.0):.2f}× | {r['prefill_share']:.0%}"
                  if "decode_tokens_per_s" in r else "– | – | –")  # results saved before these were measured
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f}× | "
                     f"{r['per_request_tokens_per_s']:.1f} | {r.get('per_request_speedup', 1.0):.2f}× | {decode} | "
                     f"{r['mean_accepted_length']:.2f} | {r['mean_candidate_length']:.2f} | {same} |")
    return "\n".join(lines)


def batch_plot(rows: list[dict], path: Path) -> str:
    """Aggregate throughput against per-request speed: one line per method, one point per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
    names = list(dict.fromkeys(r["method"] for r in rows))
    for i, name in enumerate(names):
        rs = sorted((r for r in rows if r["method"] == name), key=lambda r: r["batch_size"])
        style = "k-" if name == "plain" else ("-" if "specdec" in name else "--")
        ax.plot([r["per_request_tokens_per_s"] for r in rs], [r["tokens_per_s"] for r in rs], style, marker="o",
                ms=4, label=name, lw=2 if name == "plain" or "specdec" in name else 1)
        for r in rs:
            ax.annotate(f"B={r['batch_size']}", (r["per_request_tokens_per_s"], r["tokens_per_s"]), fontsize=5,
                        xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-request speed (tokens/s, median request)")
    ax.set_ylabel("aggregate throughput (tokens/s)")
    ax.set_title("Throughput vs per-request speed by batch size", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name

