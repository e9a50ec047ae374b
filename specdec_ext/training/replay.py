"""Offline replay of speculative rounds over recorded acceptance outcomes, under a cost model.

Each response of a head data set (recipe "deployment") holds, per position, whether the draft's
candidate there is accepted (greedy: exactly; sampling: one draw of the soft label). A round starting
at response position ``pos`` drafts K candidates at positions pos .. pos + K - 1, emits its accepted
prefix plus one token, and costs ``CostModel.round_time(K)``. Under greedy decoding this is exact: a
candidate's acceptance is tested only when its context is a prefix of the target's output, which is
what the data set records. The candidate-length rule sees predicted acceptances p_hat from a head
(with the acceptance-history feature evaluated on the outcomes observed so far, as at run time).

Used to choose the head's rejection weight w on a validation split by the end-to-end objective, and
to report what a head would gain over fixed K before any benchmark runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..head.features import HISTORY_PRIOR, history_after_accepts, history_update
from ..head.module import AcceptanceHead
from ..policies.costs import CostModel
from ..policies.goodput import GoodputRule
from .head_features import select_features


@dataclass
class ReplayResult:
    median_speedup: float     # median over responses of (tokens/ms) / (tokens/ms of plain decoding)
    aggregate_speedup: float  # sum of plain-decoding time / sum of modelled time
    mean_candidates: float    # mean K per round
    mean_accepted: float      # mean accepted candidates per round


def flat_costs(draft_ratio: float = 0.1, k_max: int = 20) -> CostModel:
    """A GPU-like cost model in units of one target forward: verification of any number of tokens costs 1,
    a draft step ``draft_ratio`` (the paper's 7B/70B regime is about 0.1). Machine-independent, so head
    training does not depend on the timing noise of the machine that runs it."""
    return CostModel([1.0] * (k_max + 2), draft_ratio, 0.0, 0.0, {"kind": "flat", "draft_ratio": draft_ratio})


def _responses(feats: dict) -> list[torch.Tensor]:
    """Row indices of each response, in response-position order (positions must be contiguous from 0)."""
    ex, idx = feats["example"], feats["index"]
    out = []
    for e in torch.unique(ex).tolist():
        rows = (ex == e).nonzero().squeeze(-1)
        rows = rows[torch.argsort(idx[rows])]
        if not torch.equal(idx[rows], torch.arange(rows.numel())):
            raise ValueError("replay needs every response position (a 'proposal'-position data set)")
        out.append(rows)
    return out


@torch.no_grad()
def head_scorer(head: AcceptanceHead, feats: dict) -> Callable:
    """A scorer for :func:`replay`: p_hat of candidates at given rows, with the acceptance-history feature
    (if the head reads it) set from the replay's observed outcomes."""
    hidden = feats["hidden"] if head.use_hidden else None
    X = select_features(feats["features"], head.features) if head.features else None
    hist_col = head.features.index("recent_accept") if "recent_accept" in head.features else None
    static = None
    if hist_col is None:
        static = head.predict(hidden, X)

    def score(rows: torch.Tensor, history: torch.Tensor) -> torch.Tensor:  # rows [B, k] -> [B, k]
        if static is not None:
            return static[rows]
        B, k = rows.shape
        f = X[rows].clone()
        for j in range(k):
            f[:, j, hist_col] = history_after_accepts(history, j)
        return head.predict(hidden[rows] if hidden is not None else None, f)

    return score


def soft_label_scorer(feats: dict) -> Callable:
    """A scorer for :func:`replay` that knows each candidate's recorded label: under sampling the soft label
    min(1, p(y) / q(y)) (the candidate's acceptance probability given the target's p, which no draft-side head
    sees), under greedy decoding the outcome itself. A candidate-length rule fed these labels bounds what any
    acceptance head can reach under the same rule on these responses: a head sees only the draft's side, whose
    best prediction of acceptance is the expectation of this label given that side. At temperature 1 it is
    the figure that says whether a sampling head can beat the best fixed K at all (README, "Sampling at
    temperature 1")."""
    labels = feats["labels"].float()

    def score(rows: torch.Tensor, history: torch.Tensor) -> torch.Tensor:  # rows [B, k] -> [B, k]
        return labels[rows]

    return score


def replay(feats: dict, score: Callable, costs: CostModel, rule: str = "auto", k_min: int = 1, k_max: int = 20,
           mean_accept: Optional[float] = None, outcomes: Optional[torch.Tensor] = None) -> ReplayResult:
    """Replay every response of ``feats`` (``training.head_features.draft_features`` output) with a
    candidate-length ``rule``: ``"auto"`` (:class:`GoodputRule`), ``"h=0.7"`` (SpecDec++'s threshold),
    ``"K=4"`` (fixed), or ``"oracle"`` (draft exactly to the first rejection). ``score(rows, history)``
    gives p_hat ``[B, k]`` for candidate rows ``[B, k]`` (see :func:`head_scorer`)."""
    outcomes = feats["accept"] if outcomes is None else outcomes
    resp = _responses(feats)
    B = len(resp)
    n = torch.tensor([r.numel() for r in resp])
    start = torch.tensor([int(r[0]) for r in resp])  # rows of one response are contiguous in draft_features order
    if any(not torch.equal(r, torch.arange(int(r[0]), int(r[0]) + r.numel())) for r in resp):
        raise ValueError("replay: a response's rows must be contiguous")
    pos = torch.zeros(B, dtype=torch.int64)
    t = torch.zeros(B, dtype=torch.float64)
    rounds = drafted = accepted = 0
    history = torch.full((B,), HISTORY_PRIOR)
    g = GoodputRule(costs, mean_accept, k_max) if rule == "auto" else None
    if g is not None:
        g.reset(B)
    live = torch.arange(B)
    steps = torch.arange(k_max)
    acc_all = outcomes.bool()
    while live.numel():
        p0, nl = pos[live], n[live]
        offs = (p0.unsqueeze(1) + steps).clamp_max(nl.unsqueeze(1) - 1)          # [L, k_max], clamped inside
        rows = start[live].unsqueeze(1) + offs
        inside = (p0.unsqueeze(1) + steps) < nl.unsqueeze(1)
        acc = acc_all[rows] & inside
        if rule == "oracle":
            first_rej = (~acc).int().argmax(1)
            K = torch.where((~acc).any(1), first_rej + 1, torch.full_like(first_rej, k_max))
        else:
            ph = score(rows, history[live]).float() if not rule.startswith("K=") else None
            if rule.startswith("K="):
                K = torch.full((live.numel(),), int(rule[2:]))
            else:
                S = torch.cumprod(ph * inside, 1)
                if rule == "auto":
                    thr = g.thresholds(k_max, 1, k_max + 1).t()[live]
                    stop = S < thr
                else:
                    stop = (1 - S) > float(rule.split("=")[1])
                stop[:, : k_min - 1] = False
                stop[:, -1] = True
                K = stop.int().argmax(1) + 1
        K = torch.minimum(K, (nl - p0 - 1).clamp_min(0))  # as the engine: never draft past the response's end
        lead = torch.cumprod(acc.int(), 1)
        a = (lead * (steps.unsqueeze(0) < K.unsqueeze(1))).sum(1)                 # accepted prefix within K
        emit = torch.minimum(a + 1, nl - p0)
        t[live] += torch.tensor([costs.round_time(int(k)) for k in K.tolist()], dtype=torch.float64)
        pos[live] += emit
        history[live] = history_update(history[live], K, a)
        if g is not None:
            full = torch.zeros(B, dtype=torch.int64)
            full_a = torch.zeros(B, dtype=torch.int64)
            full[live], full_a[live] = K, a
            # rows that are not live keep their state: update only the live ones
            tok, tim = list(g.tokens), list(g.time)
            g.update(full, full_a)
            for i in set(range(B)) - set(live.tolist()):
                g.tokens[i], g.time[i] = tok[i], tim[i]
        rounds += live.numel()
        drafted += int(K.sum())
        accepted += int(a.sum())
        live = live[pos[live] < n[live]]
    plain = costs.plain_ms()
    speed = (n.double() / t) * plain
    return ReplayResult(statistics.median(speed.tolist()), float(n.sum() * plain / t.sum()), drafted / rounds,
                        accepted / rounds)


def best_fixed(feats: dict, costs: CostModel, ks=range(1, 11)) -> tuple[int, ReplayResult]:
    """The fixed K with the highest median speedup, and its result."""
    results = {k: replay(feats, None, costs, f"K={k}") for k in ks}
    k = max(results, key=lambda k: results[k].median_speedup)
    return k, results[k]
