"""Losslessness of the fused verify ops: the emitted tokens follow the target distribution.

For a chain with fixed target rows p_0..p_K and draft rows q_0..q_{K-1}, the token the op emits at
position i, among the rows that reached position i (num_accepted >= i), must follow p_i exactly
(Leviathan et al. 2023, Thm. 1). Each case draws N chains, each with candidates sampled from q,
and runs a chi-square test per position (see tests/stats.py for the fixed threshold).
"""

from __future__ import annotations

import pytest
import torch

from specdec_ext import ops
from stats import assert_follows, chi_square
from support import case, check_positions

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")


def run_chains(q, p, n_samples, seed, *, logits=False, temperature=1.0, dtype=torch.float32, chunk=4096,
               verify=None):
    """Run ``n_samples`` chains of candidates x_i ~ q_i through the op; return (out [N, K+1], num [N])."""
    K, V = q.shape
    g = torch.Generator().manual_seed(seed)
    outs, nums = [], []
    done = 0
    while done < n_samples:
        B = min(chunk, n_samples - done)
        if logits:
            qp = torch.softmax(q.double() / temperature, -1)
        else:
            qp = q.double()
        ids = torch.stack([torch.multinomial(qp[i], B, replacement=True, generator=g) for i in range(K)], 1)
        so = torch.tensor([seed, done], dtype=torch.int64)
        d = q.to(dtype).unsqueeze(0).expand(B, K, V)
        t = p.to(dtype).unsqueeze(0).expand(B, K + 1, V)
        if verify is not None:
            out, num = verify(ids, d, t, so)
        elif logits:
            out, num = ops.chain_verify_logits(ids, d, t, torch.full((B,), temperature), philox_seed_offset=so)
        else:
            out, num = ops.chain_verify(ids, d, t, philox_seed_offset=so)
        outs.append(out)
        nums.append(num)
        done += B
    return torch.cat(outs), torch.cat(nums)


CASES = ["random", "q zeros where p > 0", "p = q", "one-hot target", "adversarial"]


FOCI = ["first", "last", "bonus"]


def focus_of(where, K):
    return {"first": 0, "last": K - 1, "bonus": K}[where]


@pytest.mark.parametrize("where", FOCI)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("K", [1, 3, 8])
def test_chain_verify_is_lossless(name, K, where):
    V = 37  # not a multiple of any vector width
    f = focus_of(where, K)
    q, p = case(name, K, V, seed=K, focus=f)
    out, num = run_chains(q.float(), p.float(), 12000, seed=K * 17 + f)
    check_positions(out, num, p, f"{name}, K={K}", focus=f)


@pytest.mark.parametrize("V", [1, 2, 1000])
def test_chain_verify_is_lossless_vocab_sizes(V):
    q, p = case("random", 3, V, seed=V)
    out, num = run_chains(q.float(), p.float(), 8000, seed=V)
    check_positions(out, num, p, f"V={V}")


@pytest.mark.slow
def test_chain_verify_is_lossless_llama3_vocab():
    V, K = 128256, 1
    q, p = case("adversarial", K, V, seed=3)
    # a peaked target so that the chi-square bins are informative at this vocabulary size
    p = torch.softmax(torch.log(p) * 4, -1)
    q = torch.softmax(-torch.log(p[:K]), -1) * 0.5 + 0.5 * p[:K]
    out, num = run_chains(q.float(), p.float(), 6000, seed=5, chunk=256)
    check_positions(out, num, p, "V=128256")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chain_verify_is_lossless_half_dtypes(dtype):
    q, p = case("adversarial", 3, 50, seed=4)
    q, p = q.to(dtype).double(), p.to(dtype).double()  # the distribution the op actually sees
    out, num = run_chains(q.float(), p.float(), 10000, seed=8, dtype=dtype)
    check_positions(out, num, p, f"{dtype}")


@pytest.mark.parametrize("where", FOCI)
@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("K", [1, 3, 8])
def test_chain_verify_logits_is_lossless(temperature, K, where):
    V = 53
    f = focus_of(where, K)
    g = torch.Generator().manual_seed(K)
    tl = torch.randn(K + 1, V, generator=g) * 2
    dl = -tl[:K] * 0.5 + torch.randn(K, V, generator=g)  # partly adversarial
    dl[:f] = tl[:f]
    out, num = run_chains(dl, tl, 12000, seed=K + 100 + f, logits=True, temperature=temperature)
    target = torch.softmax(tl.double() / temperature, -1)
    check_positions(out, num, target, f"logits T={temperature} K={K}", focus=f)


def test_residual_sample_follows_residual():
    V = 40
    q, p = case("adversarial", 1, V, seed=2)
    p0, q0 = p[0].float(), q[0].float()
    N = 20000
    got = ops.residual_sample(p0.expand(N, V), q0.expand(N, V), philox_seed_offset=torch.tensor([9, 0]))
    residual = (p0.double() - q0.double()).clamp_min(0)
    assert_follows(got, residual, "residual distribution")


def test_chi_square_catches_a_biased_sampler():
    """Negative control: a verifier that skips the residual (emits p's argmax on rejection) must fail."""
    K, V = 1, 37
    q, p = case("adversarial", K, V, seed=1)

    def biased(ids, d, t, so):
        out, num = ops.chain_verify(ids, d, t, philox_seed_offset=so)
        rejected = num < K
        out[rejected, 0] = t[rejected, 0].argmax(-1)
        return out, num

    out, num = run_chains(q.float(), p.float(), 12000, seed=1, verify=biased)
    stat, df, thr = chi_square(out[:, 0], p[0])
    assert stat > thr, "the chi-square test failed to detect a biased sampler"
    # and the same run through the real op passes
    out, num = run_chains(q.float(), p.float(), 12000, seed=1)
    check_positions(out, num, p, "control")
