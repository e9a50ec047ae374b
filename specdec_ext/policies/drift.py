"""The batch verification budget's filter of the rounds' measured costs against the profiled table
(``BatchBudget(cost_drift=True)``, ``policies/budget.py``)."""

from __future__ import annotations

class DriftFilter:
    """A Kalman filter of the rounds' measured costs against the table, with ``BatchBudget(cost_drift=True)``:
    log(measured / table ms) of a round of depth k is d + o_k + noise, d a drift common to every depth (o_0 = 0,
    so d is that of a plain step) and o_k how much dearer than the table, relative to a plain step, a round of k
    candidates is. d follows a random walk of ``drift_sd`` per round (the machine's load, the contexts' width, the
    text: on the bundled pair at B = 4 on a 2-core CPU, every depth's rounds ran some 25% over the table in one
    stretch of prompts and not in the next); o_k starts at 0 with sd ``offset_sd`` (the table's relative costs,
    trusted to within about a third) and moves by ``offset_step`` sd per round; a round's own noise has sd
    ``round_sd``. A round's innovation is clipped to within ``clip`` (a round that stalls moves the state by a
    bounded step); a depth's first rounds instead set its estimate (:meth:`anchor`). With per-depth running means
    (``cost_drift=False``), a depth not played for a while keeps the cost it
    had when last played, so a drift that raised the played depth's cost made the unplayed ones look cheaper: at
    B = 4 the budget went to plain decoding for some thirty rounds, where rounds of two candidates had given 1.5x its
    tokens per ms. Here a round of any depth moves d, so every depth's cost follows the drift, and the offsets,
    identified only by comparing depths, move only as far as the rounds at several depths show them to differ.
    Standard Kalman predict / update (e.g. Sarkka, Bayesian Filtering and Smoothing, 2013, Sec. 4.3); the state has
    ``depth_max + 1`` entries, so a round's update is a few hundred floating-point operations."""

    def __init__(self, depth_max: int, round_sd: float = 0.12, drift_sd: float = 0.03, offset_sd: float = 0.3,
                 offset_step: float = 0.005):
        n = depth_max + 1
        self.round_var, self.drift_var, self.step_var = round_sd ** 2, drift_sd ** 2, offset_step ** 2
        self.x = [0.0] * n  # d, o_1 .. o_depth_max
        self.P = [[(1.0 if i == 0 else offset_sd ** 2) if i == j else 0.0 for j in range(n)] for i in range(n)]

    def log_ratio(self, k: int) -> float:
        """The estimate of log(measured / table ms) of a round of depth k now: d + o_k."""
        return self.x[0] + (self.x[k] if k else 0.0)

    def anchor(self, k: int, log_ratio: float, var: float) -> None:
        """Set depth k's estimate d + o_k to ``log_ratio`` (with variance ``var``), every other depth's d + o_j left
        as it was (k = 0 moves d, and every o_j by the opposite amount): a depth's first rounds measure how far the
        table misjudges that depth, not a drift of every depth (:meth:`BatchBudget.observe`)."""
        x, P, n = self.x, self.P, len(self.x)
        if k:
            x[k] = log_ratio - x[0]
        else:
            shift, x[0] = log_ratio - x[0], log_ratio
            for j in range(1, n):
                x[j] -= shift
        for j in range(n):
            P[k][j] = P[j][k] = 0.0
        P[k][k] = var

    def observe(self, k: int, log_ratio: float, clip: float) -> None:
        """One round of depth k whose log(measured / table ms) was ``log_ratio``."""
        x, P, n = self.x, self.P, len(self.x)
        for i in range(n):  # predict: d and every o_k walk
            P[i][i] += self.drift_var if i == 0 else self.step_var
        idx = (0, k) if k else (0,)  # the observation reads d + o_k
        Ph = [sum(P[i][j] for j in idx) for i in range(n)]
        S = sum(Ph[i] for i in idx) + self.round_var
        innovation = min(max(log_ratio - sum(x[i] for i in idx), -clip), clip)
        gain = [v / S for v in Ph]
        for i in range(n):
            x[i] += gain[i] * innovation
            row = P[i]
            for j in range(n):
                row[j] -= gain[i] * Ph[j]
