"""CUDA kernels against the CPU kernels and the reference; chi-square on CUDA; CUDA-graph capture.
Skipped without a CUDA device (and without a CUDA build of the extension)."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import ops, reference
from stats import assert_follows
from support import advance_case, cache_case, case, check_positions, head_args, logits_case, make_case

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,K,V", [(1, 1, 1), (7, 3, 37), (33, 8, 1000), (4, 4, 32000), (2, 2, 128256)])
def test_chain_verify_cuda_equals_cpu(dtype, B, K, V):
    ids, q, p, n, u = make_case(B, K, V, dtype, seed=B + K)
    want = ops.chain_verify(ids, q, p, n, uniforms=u)
    got = ops.chain_verify(*cuda(ids, q, p, n), uniforms=u.cuda())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    so = torch.tensor([5, 6])
    want = ops.chain_verify(ids, q, p, n, philox_seed_offset=so)
    got = ops.chain_verify(*cuda(ids, q, p, n), philox_seed_offset=so.cuda())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_verify_logits_cuda_matches_reference(dtype):
    ids, dl, tl, temp, n, u = logits_case(16, 6, 5000, dtype, seed=1)
    got = ops.chain_verify_logits(*cuda(ids, dl, tl, temp, n), uniforms=u.cuda())
    want = reference.chain_verify_logits(ids, dl, tl, temp, n, u)
    greedy = temp == 0
    assert torch.equal(got[0].cpu()[greedy], want[0][greedy])
    assert int((got[0].cpu() != want[0]).any(-1).sum()) <= 1  # rounding-level ties only


def test_residual_and_head_cuda():
    _, q, p, _, u = make_case(40, 1, 3001, seed=2)
    assert torch.equal(ops.residual_sample(*cuda(p[:, 0], q[:, 0]), uniforms=u[:, 0].cuda()).cpu(),
                       ops.residual_sample(p[:, 0], q[:, 0], uniforms=u[:, 0]))
    for F in (0, 3):
        head = head_args(B=9, H=256, F=F)
        c1 = torch.rand(9)
        c2 = c1.clone().cuda()
        p1, s1 = ops.acceptance_head_step(*head, c1, 2, 2, 20, 0.4)
        p2, s2 = ops.acceptance_head_step(*[t.cuda() if t is not None else None for t in head], c2, 2, 2, 20, 0.4)
        torch.testing.assert_close(p2.cpu(), p1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c2.cpu(), c1, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["fused", "split"])
def test_cuda_head_kernels_equal_the_cpu_kernel(kernel, monkeypatch):
    """Both CUDA head kernels (forced by SPECDEC_HEAD_KERNEL) against the CPU kernel: widths that are and are not
    multiples of a warp or a block, batches that are not multiples of the split kernel's rows per warp, no residual
    block (L = 0), hidden in every dtype, with and without features; p_hat, the running product and the stops."""
    monkeypatch.setenv("SPECDEC_HEAD_KERNEL", kernel)
    for B, H, L, F, dtype in [(1, 256, 3, 3, torch.float32), (9, 200, 2, 0, torch.bfloat16),
                              (5, 1030, 1, 3, torch.float16), (70, 128, 3, 3, torch.float32),
                              (3, 64, 0, 3, torch.float32), (6, 33, 2, 0, torch.float32)]:
        head = head_args(B=B, H=H, L=L, dtype=dtype, F=F, seed=H)
        head = (head[0], *head[1:4], head[4] / H**0.5, *head[5:])  # x stays of order 1 through the blocks
        c1 = torch.rand(B)
        c2 = c1.clone().cuda()
        p1, s1 = ops.acceptance_head_step(*head, c1, 2, 1, 20, 0.4)
        p2, s2 = ops.acceptance_head_step(*[t.cuda() if t is not None else None for t in head], c2, 2, 1, 20, 0.4)
        what = f"{kernel} kernel, B={B} H={H} L={L} F={F} {dtype}"
        torch.testing.assert_close(p2.cpu(), p1, rtol=1e-4, atol=1e-5, msg=what)
        torch.testing.assert_close(c2.cpu(), c1, rtol=1e-4, atol=1e-5, msg=what)
        close = ((1 - c1) - 0.4).abs() < 1e-4  # a running product at the threshold may round either way
        assert torch.equal(s2.cpu()[~close], s1[~close]), what
        below = torch.rand(B) * 0.5  # threshold="auto"'s per-row survivals (h = 1: only they stop a row)
        c1 = torch.rand(B)
        c2 = c1.clone().cuda()
        _, s1 = ops.acceptance_head_step(*head, c1, 2, 1, 20, 1.0, below)
        _, s2 = ops.acceptance_head_step(*[t.cuda() if t is not None else None for t in head], c2, 2, 1, 20, 1.0,
                                         below.cuda())
        close = (c1 - below).abs() < 1e-4
        assert torch.equal(s2.cpu()[~close], s1[~close]) and torch.equal(s1, c1 < below), what


def test_cuda_head_kernel_variable_other_than_fused_or_split_is_refused(monkeypatch):
    """SPECDEC_HEAD_KERNEL set to a misspelling is an error naming the variable, not the default rule in silence;
    set empty, it is as if unset."""
    head = [t.cuda() if t is not None else None for t in head_args(B=2, H=256, F=3)]
    monkeypatch.setenv("SPECDEC_HEAD_KERNEL", "splt")
    with pytest.raises(ValueError, match="SPECDEC_HEAD_KERNEL must be unset, 'fused' or 'split', got 'splt'"):
        ops.acceptance_head_step(*head, torch.ones(2, device="cuda"), 2, 1, 20, 0.5)
    monkeypatch.setenv("SPECDEC_HEAD_KERNEL", "")
    p, _ = ops.acceptance_head_step(*head, torch.ones(2, device="cuda"), 2, 1, 20, 0.5)
    monkeypatch.delenv("SPECDEC_HEAD_KERNEL")
    want, _ = ops.acceptance_head_step(*head, torch.ones(2, device="cuda"), 2, 1, 20, 0.5)
    torch.testing.assert_close(p, want)


@pytest.mark.parametrize("kernel", ["fused", "split"])
def test_cuda_head_step_captured_in_cuda_graph_equals_eager(kernel, monkeypatch):
    """The head step (its workspace allocated from the graph's pool in the split kernels) replays as it runs."""
    monkeypatch.setenv("SPECDEC_HEAD_KERNEL", kernel)
    head = [t.cuda() if t is not None else None for t in head_args(B=5, H=256, F=3)]
    head[4] /= 16
    cum = torch.ones(5, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        torch.ops.specdec_ext.acceptance_head_step(*head, cum, 2, 1, 20, 0.5)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    cum.fill_(1.0)
    with torch.cuda.graph(g):
        p, stop = torch.ops.specdec_ext.acceptance_head_step(*head, cum, 2, 1, 20, 0.5)
    for scale in (1.0, 0.5, 2.0):
        head[0].mul_(scale)
        cum.fill_(1.0)
        g.replay()
        got = p.clone(), stop.clone(), cum.clone()
        cum.fill_(1.0)
        want = torch.ops.specdec_ext.acceptance_head_step(*head, cum, 2, 1, 20, 0.5)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], cum)


def test_cuda_head_nan_raises_and_stops():
    head = [t.cuda() if t is not None else None for t in head_args(B=3, H=64, F=3)]
    head[0][1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.acceptance_head_step(*head, torch.ones(3, device="cuda"), 2, 1, 20, 0.5)
    # the raw op (no Python check) marks the row: p = NaN and stop = True
    p, stop = torch.ops.specdec_ext.acceptance_head_step(*head, torch.ones(3, device="cuda"), 2, 1, 20, 0.5)
    assert bool(torch.isnan(p[1]).item()) and bool(stop[1].item())


def test_cuda_invalid_input_raises():
    ids, q, p, n, u = make_case(2, 3, 10, ragged=False)
    with pytest.raises(ValueError, match="target_probs has a NaN"):
        ops.chain_verify(*cuda(ids, q, p * float("nan")), uniforms=u.cuda())


@pytest.mark.parametrize("name", ["random", "adversarial", "one-hot target"])
def test_chain_verify_cuda_is_lossless(name):
    K, V, N = 3, 37, 12000
    q, p = case(name, K, V, seed=1)
    ids = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=torch.Generator().manual_seed(i))
                       for i in range(K)], 1)
    out, num = ops.chain_verify(ids.cuda(), q.float().cuda().expand(N, K, V), p.float().cuda().expand(N, K + 1, V),
                                philox_seed_offset=torch.tensor([3, 4], device="cuda"))
    check_positions(out.cpu(), num.cpu(), p, f"cuda {name}")


def test_residual_cuda_follows_residual():
    V, N = 40, 20000
    q, p = case("adversarial", 1, V, seed=2)
    got = ops.residual_sample(p[0].float().cuda().expand(N, V).contiguous(), q[0].float().cuda().expand(N, V).contiguous(),
                              philox_seed_offset=torch.tensor([9, 0], device="cuda"))
    assert_follows(got.cpu(), (p[0] - q[0]).clamp_min(0), "cuda residual")


def test_verify_captured_in_cuda_graph_equals_eager():
    ids, q, p, n, _ = make_case(8, 4, 2048, seed=4)
    ids, q, p, n = cuda(ids, q, p, n)
    so = torch.tensor([1, 0], device="cuda")
    static = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        torch.ops.specdec_ext.chain_verify(ids, q, p, n, None, so)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static["out"], static["num"] = torch.ops.specdec_ext.chain_verify(ids, q, p, n, None, so)
    for offset in range(3):
        so.copy_(torch.tensor([1, offset], device="cuda"))
        g.replay()
        eager = torch.ops.specdec_ext.chain_verify(ids, q, p, n, None, so.clone())
        assert torch.equal(static["out"], eager[0]) and torch.equal(static["num"], eager[1])


@pytest.mark.parametrize("logits", [True, False])
def test_confidence_features_cuda(logits):
    x = torch.randn(9, 5000) * 3
    dist = x if logits else torch.softmax(x, -1)
    t = torch.randint(0, 5000, (9,))
    torch.testing.assert_close(ops.confidence_features(dist.cuda(), t.cuda(), logits).cpu(),
                               ops.confidence_features(dist, t, logits), rtol=1e-4, atol=1e-6)


def test_chain_verify_greedy_cuda():
    ids, _, tl, _, n, _ = logits_case(16, 6, 5000, torch.float32, seed=9)
    got = ops.chain_verify_greedy(ids.cuda(), tl.cuda(), n.cuda())
    want = ops.chain_verify_greedy(ids, tl, n)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_tokens_cuda_equals_the_cpu_kernel(dtype):
    # on a GPU the wrapper is torch.argmax (the op has a CPU kernel only): same tokens, on the input's device
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 3, (2, 5, 3000), generator=g).float().to(dtype)  # ties in every row
    got = ops.argmax_tokens(x.cuda())
    assert got.device.type == "cuda" and torch.equal(got.cpu(), ops.argmax_tokens(x))
    with pytest.raises(ValueError, match="V >= 1"):
        ops.argmax_tokens(torch.zeros(3, 0, device="cuda"))


def test_advance_rows_cuda_equals_the_cpu_kernel_and_replays_in_a_graph():
    """``advance_rows`` on CUDA writes what the CPU kernel writes; captured in a CUDA graph, each replay advances
    the rows from what the emitted and accepted tensors hold then."""
    for accepted in (True, False):
        cpu = advance_case(accepted=accepted)
        gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in cpu]
        ops.advance_rows(*cpu)
        ops.advance_rows(*gpu)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu[:4], cpu[:4]))
    cpu = advance_case(seed=3)
    gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in cpu]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.advance_rows(*gpu)
    for step in range(3):  # each replay: new tokens and counts, the rows advanced again
        new = advance_case(seed=10 + step)
        gpu[4].copy_(new[4])
        gpu[5].copy_(new[5])
        cpu[4], cpu[5] = new[4], new[5]
        graph.replay()
        ops.advance_rows(*cpu)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu[:4], cpu[:4])), step


def test_philox_uniforms_cuda_equals_the_cpu_kernel():
    so = torch.tensor([[5, 0], [5, 1], [2**62, 2**33 + 7]], dtype=torch.int64)
    got = ops.philox_uniforms(so.cuda(), 300, first_slot=4096)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), ops.philox_uniforms(so, 300, first_slot=4096))
    graph, buf = torch.cuda.CUDAGraph(), so.cuda()
    with torch.cuda.graph(graph):  # the streams are read from device memory: a replay follows the buffer
        out = ops.philox_uniforms(buf, 8)
    buf[:, 1] += 1
    graph.replay()
    assert torch.equal(out.cpu(), ops.philox_uniforms(buf.cpu(), 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,n,C,D,starts", [(1, 4, 4, 1, 17, 64, (16,)), (3, 8, 2, 5, 33, 128, (0, 11, 28)),
                                                   (2, 8, 1, 3, 129, 64, (127, -1)),
                                                   (3, 32, 8, 1, 1030, 64, (1029, 600, 3))])
def test_cache_attention_cuda_matches_the_reference(dtype, B, Hq, Hkv, n, C, D, starts):
    """The flash-decoding kernel against the CPU reference: one to five queries, grouped-query ratios 1/4/8, head
    dims 64 and 128, rows whose live columns end in any chunk of 128 (chunks past a row's length write nothing that
    counts), a row that sees nothing (zeros), a Llama-3.2-1B-shaped layer over 1,030 columns."""
    q, k, v, s = cache_case(B, Hq, Hkv, n, C, D, dtype, starts)
    want = reference.cache_attention(q.float(), k.float(), v.float(), s, D ** -0.5)
    got = ops.cache_attention(q.cuda(), k.cuda(), v.cuda(), s.cuda(), D ** -0.5)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_cache_attention_cuda_captured_in_a_graph_reads_the_lengths_at_each_replay():
    """Captured once, replayed with the rows' positions changed in place: each replay reads them on the device."""
    q, k, v, s = [t.cuda() for t in cache_case(3, 8, 2, 2, 300, 64, torch.bfloat16, (10, 200, 299))]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.cache_attention(q, k, v, s, 0.125)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.cache_attention(q, k, v, s, 0.125)
    for starts in ((10, 200, 299), (0, 5, 130), (299, -1, 64)):
        s.copy_(torch.tensor(starts))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.cache_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), s.cpu(), 0.125)
        torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
