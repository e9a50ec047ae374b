"""``ops.decode_attention`` (the CPU decode-attention kernel) against its pure-PyTorch reference and torch's SDPA;
its errors, fake kernel and opcheck; and ``attn_implementation="specdec_decode"`` in transformers models and in
the engine (same logits as SDPA, greedy speculative output equal to target-only decoding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models import make_pair, make_target
from support import cache_case
from specdec_ext import SpeculativeGenerator, make_policy, ops, reference
from specdec_ext.engine import attention
from specdec_ext.engine.model import LeanModel
from specdec_ext.engine.runner import CausalLMRunner

needs_ext = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def case(B=3, Hq=4, Hkv=2, n=2, C=11, D=16, dtype=torch.float32, spare=5, per_head=False, seed=0, p_seen=0.7):
    """query [B, Hq, n, D] (a transposed view, as attention layers pass it), key and value views of a cache with
    ``spare`` columns on each side, and a mask with holes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, C + 2 * spare, D, generator=g).to(dtype)[:, :, spare:spare + C]
    v = torch.randn(B, Hkv, C + 2 * spare, D, generator=g).to(dtype)[:, :, spare:spare + C]
    mask = torch.rand(B, Hq if per_head else 1, n, C, generator=g) < p_seen
    return q, k, v, mask


def test_reference_is_sdpa():
    """The oracle itself: torch's SDPA (with the key/value heads repeated) where every query sees a column."""
    q, k, v, mask = case(p_seen=0.6)
    mask[..., 0] = True
    group = q.shape[1] // k.shape[1]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(reference.decode_attention(q, k, v, mask, 0.3), want, atol=1e-6, rtol=1e-5)


@needs_ext
@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), Hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), n=st.integers(1, 6),
       C=st.integers(1, 40), D=st.sampled_from([1, 5, 8, 16, 24, 64, 72]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), per_head=st.booleans(),
       p_seen=st.sampled_from([0.0, 0.3, 0.8, 1.0]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(B, Hkv, group, n, C, D, dtype, per_head, p_seen, seed):
    q, k, v, mask = case(B, Hkv * group, Hkv, n, C, D, dtype, per_head=per_head, seed=seed, p_seen=p_seen)
    out = ops.decode_attention(q, k, v, mask, D ** -0.5)
    want = reference.decode_attention(q, k, v, mask, D ** -0.5)
    assert out.shape == (B, n, Hkv * group, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    unseen = ~mask.expand(B, Hkv * group, n, C).any(-1)  # [B, Hq, n]: queries that see nothing get zeros
    assert (out.transpose(1, 2)[unseen] == 0).all()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_does_not_depend_on_the_others_of_its_call(dtype):
    """A decode step's query and the same query inside a verification of up to 8 (causal masks one column apart)
    give bitwise the same output: its scores, softmax sum and weighted values round the same way whatever the number
    of query rows beside it (blocks of 1 to 4 rows, a split of the rows between threads, more columns seen by
    later queries). SmolLM2-135M's heads: 9 query heads on 3 key/value heads of 64."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 8, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 3, 300, 64, generator=g).to(dtype) for _ in range(2))
    starts = torch.tensor([250, 37])

    def run(n):
        mask = torch.arange(300)[None, None, None, :] <= (starts[:, None, None, None] + torch.arange(n)[:, None])
        return ops.decode_attention(q[:, :, :n], k, v, mask, 64 ** -0.5)

    alone = run(1)[:, 0]
    for n in range(2, 9):
        assert torch.equal(run(n)[:, 0], alone), n


@needs_ext
def test_kernel_reads_only_seen_columns():
    """Columns no query may see are never read: NaN there changes nothing, NaN in a seen column propagates."""
    q, k, v, mask = case(B=2, n=3, C=9, p_seen=1.0)
    mask[:, :, :, :4] = False  # left padding
    k, v = k.clone(), v.clone()
    k[:, :, :4] = float("nan")
    v[:, :, :4] = float("nan")
    out = ops.decode_attention(q, k, v, mask, 0.25)
    assert torch.isfinite(out).all()
    want = reference.decode_attention(q, k.nan_to_num(0), v.nan_to_num(0), mask, 0.25)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    k[0, 0, 6] = float("nan")
    out = ops.decode_attention(q, k, v, mask, 0.25)
    assert torch.isnan(out[0, :, :2]).all() and torch.isfinite(out[1]).all()


@needs_ext
def test_errors_name_the_argument():
    q, k, v, mask = case()
    with pytest.raises(TypeError, match="key and value must have query's dtype"):
        ops.decode_attention(q, k.double(), v, mask, 1.0)
    with pytest.raises(TypeError, match="query must be float32, bfloat16 or float16"):
        ops.decode_attention(q.long(), k.long(), v.long(), mask, 1.0)
    with pytest.raises(TypeError, match="mask must be bool"):
        ops.decode_attention(q, k, v, mask.float(), 1.0)
    with pytest.raises(ValueError, match=r"query must be \[B, Hq, n, D\]"):
        ops.decode_attention(q[0], k, v, mask, 1.0)
    with pytest.raises(ValueError, match=r"key must be \[B, Hkv, C, D\]"):
        ops.decode_attention(q, k[:, :, :, :3], v, mask, 1.0)
    with pytest.raises(ValueError, match=r"key must be .* with Hkv, C >= 1"):
        ops.decode_attention(q, k[:, :, :0], v[:, :, :0], mask[..., :0], 1.0)
    with pytest.raises(ValueError, match="value must have key's shape"):
        ops.decode_attention(q, k, v[:, :, :5], mask, 1.0)
    with pytest.raises(ValueError, match=r"must be a multiple of key/value heads \(3\)"):
        q3, k3, v3, m3 = case(Hq=4, Hkv=3)
        ops.decode_attention(q3, k3, v3, m3, 1.0)
    with pytest.raises(ValueError, match=r"mask must be \[B or 1, Hq or 1, n, C\]"):
        ops.decode_attention(q, k, v, mask[:, :, :1], 1.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        ops.decode_attention(q, k, v, mask, float("inf"))
    with pytest.raises(ValueError, match="scale must be finite"):
        reference.decode_attention(q, k, v, mask, float("nan"))


@needs_ext
def test_opcheck_and_compile():
    q, k, v, mask = case()
    torch.library.opcheck(torch.ops.specdec_ext.decode_attention.default, (q, k, v, mask, 0.5))
    torch.library.opcheck(torch.ops.specdec_ext.decode_attention.default, (q, k, v, mask[:1], 0.5))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, mask):
        return torch.ops.specdec_ext.decode_attention(q, k, v, mask, 0.5) * 2

    torch.testing.assert_close(f(q, k, v, mask), 2 * reference.decode_attention(q, k, v, mask, 0.5), atol=1e-5,
                               rtol=1e-5)


# ----------------------------------------------------------------------------------- in transformers models
def pieces(rows: int, lengths: tuple, seed: int) -> list:
    """Forwards of ``rows`` rows: (tokens, valid) per length, with holes (each piece's last token real)."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randint(2, 48, (rows, n), generator=g), torch.rand(rows, n, generator=g) < 0.75) for n in lengths]
    for _, valid in out:
        valid[:, -1] = True
    return out


def assert_same_logits(model, other: str, forwards: list) -> None:
    """The runner's logits at every fed position under ``specdec_decode`` and under ``other``."""
    logits = {}
    for impl in (other, "specdec_decode"):
        model.set_attn_implementation(impl)
        runner = CausalLMRunner(model, "target")
        runner.start(forwards[0][0].shape[0])
        logits[impl] = [runner.forward(t, valid, keep=t.shape[1])[0] for t, valid in forwards]
    for a, b in zip(logits[other], logits["specdec_decode"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_kernel_serves_only_what_it_supports():
    q = torch.zeros(2, 4, 3, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    assert attention.kernel_serves(q, mask, 0.0, False, {}) == ops.HAS_EXTENSION
    assert not attention.kernel_serves(q, None, 0.0, False, {})
    assert not attention.kernel_serves(q, mask.float(), 0.0, False, {})
    assert not attention.kernel_serves(q, mask, 0.1, True, {})
    assert not attention.kernel_serves(q, mask, 0.0, False, {"softcap": 50.0})
    assert not attention.kernel_serves(q, mask, 0.0, False, {"s_aux": torch.zeros(4)})
    assert not attention.kernel_serves(torch.zeros(2, 4, attention.MAX_QUERIES + 1, 8), mask, 0.0, False, {})


@needs_ext
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_model_logits_match_sdpa(arch):
    """A padded batch fed in pieces (a prefill longer than MAX_QUERIES, then verification-sized forwards with
    holes) gives SDPA's logits through the runner."""
    assert_same_logits(make_target(arch, layers=2), "sdpa", pieces(3, (20, 1, 4, 2), seed=3))


def test_softcapped_model_matches_eager():
    """Gemma-2 caps its attention logits, which neither the kernel nor SDPA does: the registered function computes
    it in torch ops and gives eager attention's logits."""
    model = make_target("gemma2", layers=2)
    assert model.config.attn_logit_softcapping
    assert_same_logits(model, "eager", pieces(2, (9, 1, 3), seed=4))


@needs_ext
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_speculative_equals_target_only(arch):
    target, draft = make_pair(arch, noise=0.3)
    target.set_attn_implementation("specdec_decode")
    prompts = [torch.randint(2, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5, 14, 7)]
    plain = SpeculativeGenerator(target, None, policy=make_policy("autoregressive"))
    want = plain.generate_continuous(prompts, 3, max_new_tokens=24, temperature=0).new_tokens
    for k in (1, 3):
        spec = SpeculativeGenerator(target, draft, policy=make_policy("fixed", k=k))
        assert spec.generate_continuous(prompts, 3, max_new_tokens=24, temperature=0).new_tokens == want


@needs_ext
@torch.inference_mode()
def test_lean_model_kernel_matches_sdpa():
    """The lean model's attention through the decode-attention kernel (``"auto"`` on a CPU) and through
    ``cache_attention`` (each row's first position as ``starts``) gives the logits of its SDPA path, over ragged
    rows of a static cache, the whole cache's width as well as a narrow one, and rows of one length given by the
    host (``start``: slices)."""
    with torch.inference_mode(False):
        _, draft = make_pair("llama")
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(2, 48, (2, n), generator=g) for n in (9, 1, 3, 2)]
    out = {}
    for kind in ("auto", "cache", "sdpa"):
        lean = LeanModel(draft, "draft", attention=kind)
        cache = lean.cache(2, 32)
        got = [lean.forward(cache, tokens[0], keep=9)[0]]
        same = [lean.forward(cache, tokens[3], keep=2, start=9)[0]]  # both rows at 9: slices
        cache.rollback(torch.tensor([0, 3]), 2)  # rows of different lengths
        # width 12: row 0's length after its forward (the narrowest a caller may pass)
        got += [lean.forward(cache, t, keep=t.shape[1], width=w)[0] for t, w in zip(tokens[1:3], (12, None))]
        out[kind] = got + same
    for kind in ("auto", "cache"):
        for a, b in zip(out[kind], out["sdpa"]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="attention must be one of 'auto', 'cache', 'sdpa'"):
        LeanModel(draft, "draft", attention="flash")
    assert attention.kernel_takes(torch.device("cpu"), attention.MAX_QUERIES) == ops.HAS_EXTENSION
    assert not attention.kernel_takes(torch.device("cpu"), attention.MAX_QUERIES + 1)


def test_default_attn_implementation():
    from specdec_ext.zoo import default_attn_implementation

    assert default_attn_implementation("cpu") == ("specdec_decode" if ops.HAS_EXTENSION else None)
    assert default_attn_implementation("cuda") is None
    assert default_attn_implementation("cpu", device_map="auto") is None


# ------------------------------------------------------------------------------------------- cache_attention
def live_sdpa(q, k, v, starts, scale):
    """The oracle from torch's SDPA alone: each query over its row's columns 0 .. starts[b] + i (clamped to the
    cache), the key/value heads repeated; zeros where it sees none."""
    B, Hq, n, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, n, Hq, D)
    for b in range(B):
        for i in range(n):
            last = min(int(starts[b]) + i, k.shape[2] - 1)
            if last < 0:
                continue
            kk = k[b, :, : last + 1].float().repeat_interleave(group, 0)
            vv = v[b, :, : last + 1].float().repeat_interleave(group, 0)
            out[b, i] = F.scaled_dot_product_attention(q[b, :, i: i + 1].float(), kk, vv, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,n,C,D,starts", [
    (1, 4, 4, 1, 17, 64, (16,)),               # one token, no GQA, the cache's last column
    (3, 8, 2, 5, 33, 128, (0, 11, 28)),        # K + 1 = 5 queries, group 4, a row at the start
    (2, 8, 1, 3, 129, 64, (127, -1)),          # group 8, queries past the cache (clamped), a row that sees nothing
    (3, 2, 2, 2, 300, 64, (299, 150, 3)),      # more than two chunks of 128 columns on a GPU
])
def test_cache_attention_sees_each_rows_live_columns(dtype, B, Hq, Hkv, n, C, D, starts):
    """cache_attention (the op, its reference, and SDPA over each row's live prefix alone) for one to five queries per
    row, grouped-query ratios 1, 4 and 8, head dims 64 and 128, positions at 0, odd, at and past the cache's end, and
    below 0 (zeros)."""
    q, k, v, s = cache_case(B, Hq, Hkv, n, C, D, dtype, starts)
    want = live_sdpa(q, k, v, s, D ** -0.5)
    got = ops.cache_attention(q, k, v, s, D ** -0.5)
    ref = reference.cache_attention(q, k, v, s, D ** -0.5)
    assert got.shape == (B, n, Hq, D) and got.dtype == dtype
    torch.testing.assert_close(ref.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    if min(starts) < 0:
        assert not got[1, 0].any()  # position -1: no column


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 80])
def test_causal_attention_is_bitwise_the_masked_one_and_each_query_its_own(isa, dtype, D, monkeypatch):
    """cache_attention's causal path (on AVX-512 CPUs, values summed in registers, each query row over its own
    columns; the baseline kernel under ATEN_CPU_CAPABILITY=avx2) gives bitwise decode_attention's output under the
    equivalent mask, and a query's output inside a verification of up to 9 tokens is bitwise its one-token output.
    Columns past every seen one hold NaN: never read."""
    if isa == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    g = torch.Generator().manual_seed(D)
    q = torch.randn(3, 9, 9, D, generator=g).to(dtype)
    k, v = (torch.randn(3, 3, 320, D, generator=g).to(dtype) for _ in range(2))
    starts = torch.tensor([250, 37, -1])  # the last row's first query sees nothing
    k[:, :, 300:] = float("nan")
    v[:, :, 300:] = float("nan")
    alone = ops.cache_attention(q[:, :, :1], k, v, starts, D ** -0.5)
    for n in (1, 2, 4, 5, 9):
        mask = torch.arange(320)[None, None, None, :] <= (starts[:, None, None, None] + torch.arange(n)[:, None])
        got = ops.cache_attention(q[:, :, :n], k, v, starts, D ** -0.5)
        assert torch.isfinite(got).all()
        assert torch.equal(got, ops.decode_attention(q[:, :, :n], k, v, mask, D ** -0.5)), n
        assert torch.equal(got[:, :1], alone), n
    assert not alone[2].any()


def test_cache_attention_checks_and_fake_kernel():
    q, k, v, s = cache_case()
    for fn in (ops.cache_attention, reference.cache_attention):
        with pytest.raises(ValueError, match="cache_attention: starts must be \\[B\\] = \\[3\\]"):
            fn(q, k, v, s[:2], 0.1)
        with pytest.raises(TypeError, match="cache_attention: starts must be int64"):
            fn(q, k, v, s.int(), 0.1)
        with pytest.raises(ValueError, match="cache_attention: query must be \\[B, Hq, n, D\\]"):
            fn(torch.randn(3, 8, 1, 300), torch.randn(3, 2, 4, 300), torch.randn(3, 2, 4, 300), s, 0.1)
        with pytest.raises(ValueError, match="cache_attention: query heads \\(8\\) must be a multiple"):
            fn(q, k[:, :1].expand(3, 3, 40, 64), v[:, :1].expand(3, 3, 40, 64), s, 0.1)
    if ops.HAS_EXTENSION:
        torch.library.opcheck(torch.ops.specdec_ext.cache_attention.default, (q, k, v, s, 0.125))
        out = torch.compile(lambda *a: torch.ops.specdec_ext.cache_attention(*a, 0.125), fullgraph=True,
                            backend="aot_eager")(q, k, v, s)
        torch.testing.assert_close(out, reference.cache_attention(q, k, v, s, 0.125))


def test_importing_the_package_registers_the_attention_name():
    """engine/attention.py's contract: ``import specdec_ext`` alone (nothing else of it) lets transformers load a model
    with ``attn_implementation="specdec_decode"``."""
    import subprocess
    import sys

    code = ("import specdec_ext\nfrom transformers import AttentionInterface\n"
            "print('specdec_decode' in AttentionInterface().valid_keys())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "True", "import specdec_ext did not register attn_implementation='specdec_decode'"
