"""Statistics of a generation call: per round and aggregated."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundStats:
    """One draft-verify round. Lists have one entry per live row."""

    candidates: list[int]          # candidate length n_b drafted for each row
    accepted: list[int]            # accepted candidates per row
    emitted: list[int]             # tokens emitted per row (accepted + 1, or fewer at EOS / max_new_tokens)
    draft_ms: float
    verify_ms: float
    total_ms: float
    rows: list[int] = field(default_factory=list)  # the call's row index of each entry (rows retire as they finish)


@dataclass
class GenerationStats:
    """Per-call statistics (times in ms, throughput in tokens/s)."""

    policy: str
    batch_size: int
    new_tokens: int = 0            # tokens emitted, all rows
    target_calls: int = 0          # target forward passes (prefill included)
    draft_calls: int = 0           # draft forward passes (prefill included)
    prefill_ms: float = 0.0
    draft_prefill_ms: float = 0.0   # the draft reading rows' contexts when they first draft (in prefill_ms)
    draft_deferred_ms: float = 0.0  # the draft reading the tokens plain steps committed (in draft_prefill_ms)
    admissions: int = 0            # continuous batching: times queued requests joined the batch (the first fill not counted)
    wall_ms: float = 0.0
    target_forward_ms: float = 0.0  # inside target forward calls (prefill included)
    draft_forward_ms: float = 0.0   # inside draft forward calls (prefill included)
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def draft_ms(self) -> float:
        return sum(r.draft_ms for r in self.rounds)

    @property
    def decode_ms(self) -> float:
        """The time of the decoding rounds, whole (prefills and continuous batching's admissions left out)."""
        return sum(r.total_ms for r in self.rounds)

    @property
    def verify_ms(self) -> float:
        return sum(r.verify_ms for r in self.rounds)

    @property
    def overhead_ms(self) -> float:
        """Round time outside the draft and verify phases: policy, rollback, bookkeeping."""
        return sum(r.total_ms - r.draft_ms - r.verify_ms for r in self.rounds)

    @property
    def overhead_ms_per_round(self) -> float:
        return self.overhead_ms / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.wall_ms / 1e3) if self.wall_ms > 0 else 0.0

    @property
    def drafted(self) -> int:
        return sum(sum(r.candidates) for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(sum(r.accepted) for r in self.rounds)

    @property
    def verifications(self) -> int:
        """Row-verifications: one per live row per round."""
        return sum(len(r.candidates) for r in self.rounds)

    @property
    def mean_accepted_length(self) -> float:
        """Mean accepted candidates per row-verification (tokens per target call minus the extra token)."""
        return self.accepted / max(1, self.verifications)

    @property
    def mean_candidate_length(self) -> float:
        return self.drafted / max(1, self.verifications)

    @property
    def discarded(self) -> int:
        """Drafted candidates that were not accepted."""
        return self.drafted - self.accepted

    @property
    def discard_rate(self) -> float:
        """Discarded draft tokens per emitted token (SpecDec++ Sec. 4's Pareto axis)."""
        return self.discarded / max(1, self.new_tokens)

    @property
    def verification_rate(self) -> float:
        """Target verification calls per emitted token (SpecDec++ Sec. 4's other axis)."""
        return self.verifications / max(1, self.new_tokens)

    def row_accepted_lengths(self, row: int) -> list[int]:
        """Accepted candidates of row ``row`` (of the call's batch) in each round it took part in."""
        return [r.accepted[r.rows.index(row)] for r in self.rounds if row in r.rows]

    def acceptance_rate_per_position(self) -> list[float]:
        """alpha_i: P(candidate i accepted | candidate i drafted and candidates < i accepted), i = 1..max."""
        reached: dict[int, int] = {}
        passed: dict[int, int] = {}
        for r in self.rounds:
            for n, a in zip(r.candidates, r.accepted):
                for i in range(1, min(n, a + 1) + 1):
                    reached[i] = reached.get(i, 0) + 1
                    passed[i] = passed.get(i, 0) + (1 if i <= a else 0)
        return [passed[i] / reached[i] for i in sorted(reached)]

    @property
    def acceptance_rate(self) -> float:
        """alpha over all candidates that were tested (accepted / (accepted + first rejections))."""
        tested = sum(min(n, a + 1) for r in self.rounds for n, a in zip(r.candidates, r.accepted))
        return self.accepted / max(1, tested)

    def summary(self) -> dict:
        return {
            "policy": self.policy, "batch_size": self.batch_size, "new_tokens": self.new_tokens,
            "rounds": len(self.rounds), "target_calls": self.target_calls, "draft_calls": self.draft_calls,
            "tokens_per_s": round(self.tokens_per_s, 2), "wall_ms": round(self.wall_ms, 2),
            "draft_ms": round(self.draft_ms, 2), "verify_ms": round(self.verify_ms, 2),
            "overhead_ms": round(self.overhead_ms, 2), "prefill_ms": round(self.prefill_ms, 2),
            "admissions": self.admissions,
            "target_forward_ms": round(self.target_forward_ms, 2), "draft_forward_ms": round(self.draft_forward_ms, 2),
            "overhead_ms_per_round": round(self.overhead_ms_per_round, 3),
            "mean_candidate_length": round(self.mean_candidate_length, 3),
            "mean_accepted_length": round(self.mean_accepted_length, 3),
            "acceptance_rate": round(self.acceptance_rate, 4), "discarded": self.discarded,
            "discard_rate": round(self.discard_rate, 4), "verification_rate": round(self.verification_rate, 4),
        }
