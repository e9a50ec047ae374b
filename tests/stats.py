"""Chi-square goodness of fit used by every losslessness test.

Bins with expected count < 5 are merged into one bin; the test fails when the statistic exceeds
df + 10 * sqrt(2 * df) (about 7 standard deviations of the chi-square distribution: a correct
sampler essentially never fails, a biased one with enough samples always does). With one bin left
(df = 0), every sample must fall in it.
"""

from __future__ import annotations

import math

import torch


def _merged(values: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """``values`` of the bins ``big`` selects, then the sum of the rest as one bin."""
    return torch.cat([values[big], values[~big].sum().view(1)])


def threshold(df: int) -> float:
    """The statistic a correct sampler stays under: df + 10 * sqrt(2 * df) (module docstring)."""
    return df + 10 * math.sqrt(2 * df)


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
    obs, exp = _merged(observed, big), _merged(expected, big)
    keep = exp > 0
    # Any sample in a bin of zero probability is an outright failure.
    if bool((obs[~keep] > 0).any()):
        return math.inf, 0, 0.0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df == 0:
        return (0.0 if obs[0] == n else math.inf), 0, 0.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, df, threshold(df)


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
    p, q = _merged(probs, big), _merged(wrong, big)
    keep = p > 0
    df = int(keep.sum()) - 1
    lam = n * float(((q[keep] - p[keep]) ** 2 / p[keep]).sum())
    return df + lam, threshold(max(df, 1))
