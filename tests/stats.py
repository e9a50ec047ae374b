"""Chi-square goodness of fit used by every losslessness test.

Bins with expected count < 5 are merged into one bin; the test fails when the statistic exceeds
df + 10 * sqrt(2 * df) (about 7 standard deviations of the chi-square distribution: a correct
sampler essentially never fails, a biased one with enough samples always does). With one bin left
(df = 0), every sample must fall in it.
"""

from __future__ import annotations

import math

import torch


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Return (statistic, df, threshold) for integer ``samples`` against distribution ``probs`` [V]."""
    samples = samples.reshape(-1).long().cpu()
    probs = probs.double().cpu()
    probs = probs / probs.sum()
    n = samples.numel()
    assert n > 0, "no samples reached this position"
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    assert observed.numel() == probs.numel(), "a sample lies outside the vocabulary"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    # Any sample in a bin of zero probability is an outright failure.
    if bool((obs[~keep] > 0).any()):
        return math.inf, 0, 0.0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df == 0:
        return (0.0 if obs[0] == n else math.inf), 0, 0.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, df, df + 10 * math.sqrt(2 * df)


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    stat, df, thr = chi_square(samples, probs)
    assert stat <= thr, f"{what}: chi-square {stat:.1f} > threshold {thr:.1f} (df = {df}, n = {samples.numel()})"


def caught_at(n: int, probs: torch.Tensor, wrong: torch.Tensor) -> tuple[float, float]:
    """A negative control without sampling: ``(expected statistic, threshold)`` of :func:`chi_square` for ``n`` samples
    drawn from ``wrong`` instead of ``probs`` (df plus the noncentrality n * sum (wrong - probs)^2 / probs over the
    same bins). A test that draws ``n`` samples would catch a sampler that returned ``wrong`` when the first clears
    the second by a wide margin."""
    probs = probs.double().cpu() / probs.double().sum()
    wrong = wrong.double().cpu() / wrong.double().sum()
    big = probs * n >= 5
    p = torch.cat([probs[big], probs[~big].sum().view(1)])
    q = torch.cat([wrong[big], wrong[~big].sum().view(1)])
    df = int((p > 0).sum()) - 1
    lam = n * float(((q[p > 0] - p[p > 0]) ** 2 / p[p > 0]).sum())
    return df + lam, df + 10 * math.sqrt(2 * max(df, 1))
