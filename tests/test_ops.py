"""The fused ops against the pure-PyTorch reference: exact parity, opcheck, errors, fuzzing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_ext import ops, reference
from support import advance_case, head_args, logits_case, make_case

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,K,V", [(1, 1, 1), (7, 3, 37), (33, 8, 1000), (4, 4, 32000)])
@pytest.mark.parametrize("ragged", [False, True])
def test_chain_verify_matches_reference(dtype, B, K, V, ragged):
    ids, q, p, n, u = make_case(B, K, V, dtype, seed=B * 131 + K, ragged=ragged)
    got = ops.chain_verify(ids, q, p, n, uniforms=u)
    want = reference.chain_verify(ids, q, p, n, u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # layout: accepted prefix equals the candidates, one extra token, then -1 padding
    out, num = got
    for b in range(B):
        a = int(num[b])
        assert torch.equal(out[b, :a], ids[b, :a].long())
        assert 0 <= int(out[b, a]) < V
        assert bool((out[b, a + 1 :] == -1).all())
        assert a <= (int(n[b]) if n is not None else K)


@pytest.mark.parametrize("B,K,V", [(5, 3, 50), (16, 8, 4099)])
def test_philox_paths_match_reference(B, K, V):
    ids, q, p, n, _ = make_case(B, K, V, seed=7)
    so = torch.tensor([2024, 11], dtype=torch.int64)
    got = ops.chain_verify(ids, q, p, n, philox_seed_offset=so)
    want = reference.chain_verify(ids, q, p, n, None, so)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    r = ops.residual_sample(p[:, 0], q[:, 0], philox_seed_offset=so)
    assert torch.equal(r, reference.residual_sample(p[:, 0], q[:, 0], None, so))


def test_generator_is_reproducible_and_advances():
    ids, q, p, n, _ = make_case(64, 4, 100, seed=3)
    a = ops.chain_verify(ids, q, p, n, generator=torch.Generator().manual_seed(5))
    b = ops.chain_verify(ids, q, p, n, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])
    g = torch.Generator().manual_seed(5)
    c1 = ops.chain_verify(ids, q, p, n, generator=g)
    c2 = ops.chain_verify(ids, q, p, n, generator=g)
    assert not torch.equal(c1[0], c2[0])


def test_philox_reference_known_properties():
    u = reference.philox_uniforms(1, 2, 4, 1000)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u <= 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(reference.philox_uniforms(1, 2, 1, 8), reference.philox_uniforms(1, 3, 1, 8))


def test_philox_row_streams_match_the_reference_and_do_not_depend_on_the_batch():
    """Per-row streams: each row's uniforms equal the reference's, and a row's draws are the same alone, at another
    place in a batch, or beside other rows; the kernels' one-(seed, offset) draws are that stream's counter (slot,
    row), so row 0 of a call drawing from (seed, offset) matches slot for slot."""
    so = torch.tensor([[7, 0], [7, 1], [2**63 + 5 - 2**64, 2**40 + 3], [11, 4]], dtype=torch.int64)
    got = ops.philox_uniforms(so, 9, first_slot=5)
    assert got.shape == (4, 9) and got.dtype == torch.float32
    assert torch.equal(got, reference.philox_row_uniforms(so, 9, 5))
    assert bool((got > 0).all()) and bool((got <= 1).all())
    for b in range(4):
        assert torch.equal(ops.philox_uniforms(so[b : b + 1], 9, 5)[0], got[b])
        assert torch.equal(ops.philox_uniforms(so.flip(0), 9, 5)[3 - b], got[b])
    assert torch.equal(ops.philox_uniforms(so, 14)[:, 5:], got)  # slots are counters: a wider draw extends it
    assert torch.equal(got[0], reference.philox_uniforms(7, 0, 1, 14)[0, 5:])
    assert not torch.equal(got[0], got[1]) and abs(float(ops.philox_uniforms(so, 4000).mean()) - 0.5) < 0.02
    assert ops.philox_uniforms(so, 0).shape == (4, 0)


@pytest.mark.parametrize("bad,err,match", [
    (torch.zeros(3, dtype=torch.int64), ValueError, r"seed_offsets must be \[B, 2\]"),
    (torch.zeros(3, 2, dtype=torch.int32), TypeError, "seed_offsets must be int64"),
])
def test_philox_uniforms_refuses_bad_seed_offsets(bad, err, match):
    for fn in (ops.philox_uniforms, reference.philox_row_uniforms):
        with pytest.raises(err, match=match):
            fn(bad, 4)
    with pytest.raises(ValueError, match="first_slot"):
        ops.philox_uniforms(torch.zeros(2, 2, dtype=torch.int64), 4, first_slot=2**32 - 2)
    with pytest.raises(ValueError, match="first_slot"):
        torch.ops.specdec_ext.philox_uniforms(torch.zeros(2, 2, dtype=torch.int64), -1, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,K,V", [(8, 1, 5), (12, 4, 257), (16, 8, 32000)])
def test_chain_verify_logits_matches_reference(dtype, B, K, V):
    ids, dl, tl, temp, n, u = logits_case(B, K, V, dtype, seed=V + K)
    got = ops.chain_verify_logits(ids, dl, tl, temp, n, uniforms=u)
    want = reference.chain_verify_logits(ids, dl, tl, temp, n, u)
    # The kernel's exp differs from torch.exp by about 1 ulp, so an acceptance test within rounding
    # of its boundary may go either way. Any disagreement must be such a tie.
    for b in torch.nonzero((got[0] != want[0]).any(-1) | (got[1] != want[1])).flatten().tolist():
        i = min(int(got[1][b]), int(want[1][b]))
        assert float(temp[b]) > 0, f"greedy row {b} differs"
        p = torch.softmax(tl[b, i].double() / float(temp[b]), -1)
        q = torch.softmax(dl[b, i].double() / float(temp[b]), -1)
        tok = int(ids[b, i])
        margin = abs(float(u[b, i]) * float(q[tok]) - float(p[tok]))
        assert margin < 1e-5 * max(float(p[tok]), 1e-30) + 1e-9, f"row {b} differs away from a tie ({margin})"
    assert int(((got[0] != want[0]).any(-1)).sum()) <= 1


def test_greedy_rows_are_argmax_chains():
    ids, dl, tl, temp, n, u = logits_case(32, 6, 300, torch.float32, seed=9)
    temp = torch.zeros(32)
    out, num = ops.chain_verify_logits(ids, dl, tl, temp, n, uniforms=u)
    for b in range(32):
        a = int(num[b])
        am = tl[b].argmax(-1)
        assert torch.equal(out[b, : a + 1], am[: a + 1])
        if a < int(n[b]):
            assert int(ids[b, a]) != int(am[a])


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_sample_matches_reference(dtype):
    _, q, p, _, u = make_case(50, 1, 3001, dtype, seed=11)
    got = ops.residual_sample(p[:, 0], q[:, 0], uniforms=u[:, 0])
    assert torch.equal(got, reference.residual_sample(p[:, 0], q[:, 0], u[:, 0]))


def test_residual_falls_back_to_target_when_p_equals_q():
    p = torch.softmax(torch.randn(20, 40), -1)
    got = ops.residual_sample(p, p.clone(), uniforms=torch.rand(20).clamp_min(1e-6))
    assert bool((p[torch.arange(20), got] > 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [0, 1, 3])
@pytest.mark.parametrize("inputs", ["hidden", "hidden+features", "features"])
def test_acceptance_head_step_matches_reference(dtype, L, inputs):
    args = list(head_args(L=L, dtype=dtype, F=0 if inputs == "hidden" else 3))
    if inputs == "features":
        args[0] = None
    c1 = torch.rand(6)
    c2 = c1.clone()
    p1, s1 = ops.acceptance_head_step(*args, c1, 3, 2, 20, 0.5)
    p2, s2 = reference.acceptance_head_step(*args, c2, 3, 2, 20, 0.5)
    torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c1, c2, rtol=1e-5, atol=1e-6)
    near = ((1 - c2) - 0.5).abs() < 1e-5
    assert torch.equal(s1[~near], s2[~near])


@pytest.mark.parametrize("B", [1, 5, 13, 64])
def test_acceptance_head_step_rows_are_batch_and_thread_invariant(B):
    # the CPU op runs the batch in tiles of rows, padded, with the threads splitting each weight matrix:
    # a row's p_hat must be bit-identical alone, at any place in a batch, and with any thread count
    args = list(head_args(B=B, H=96, L=3, F=3, seed=B))
    p_batch, _ = ops.acceptance_head_step(*args, torch.ones(B), 1, 1, 20, 0.5)
    for b in {0, B // 2, B - 1}:
        alone = [args[0][b : b + 1], args[1][b : b + 1]] + args[2:]
        p_alone, _ = ops.acceptance_head_step(*alone, torch.ones(1), 1, 1, 20, 0.5)
        assert torch.equal(p_alone[0], p_batch[b]), f"row {b} of {B}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        p_one, _ = ops.acceptance_head_step(*args, torch.ones(B), 1, 1, 20, 0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(p_one, p_batch)


def test_acceptance_head_features_change_the_prediction():
    # a control for the test above: the features are really read (p differs when they change)
    args = list(head_args(F=3))
    p1, _ = ops.acceptance_head_step(*args, torch.ones(6), 1, 1, 20, 0.5)
    args[1] = args[1] + 1.0
    p2, _ = ops.acceptance_head_step(*args, torch.ones(6), 1, 1, 20, 0.5)
    assert (p1 - p2).abs().min() > 1e-4


def test_stop_rule_bounds():
    head = head_args()
    B = head[0].shape[0]
    # below k_min never stops, at k_max always stops, between follows 1 - prod > h
    _, stop = ops.acceptance_head_step(*head, torch.zeros(B), 1, 2, 5, 0.0)
    assert not bool(stop.any())
    _, stop = ops.acceptance_head_step(*head, torch.ones(B), 5, 2, 5, 1.0)
    assert bool(stop.all())
    cum = torch.ones(B)
    p, stop = ops.acceptance_head_step(*head, cum, 2, 2, 5, 0.3)
    assert torch.equal(stop, (1 - p) > 0.3)


@pytest.mark.parametrize("fn", [ops.acceptance_head_step, reference.acceptance_head_step], ids=["op", "reference"])
def test_stop_below_stops_rows_whose_survival_falls_under_it(fn):
    # threshold="auto"'s per-row goodput rule: stop where prod p_hat < stop_below[b], within [k_min, k_max) only
    head = head_args(B=6, F=3)
    cum0 = torch.rand(6) * 0.5 + 0.5
    p, _ = fn(*head, cum0.clone(), 2, 1, 20, 1.0)
    S = cum0 * p  # the survivals after this step
    below = torch.tensor([-math.inf, 0.0, 1.0, float(S[3]) * 1.01, float(S[4]) * 0.99, 0.3], dtype=torch.float32)
    cum = cum0.clone()
    _, stop = fn(*head, cum, 2, 1, 20, 1.0, below)  # h = 1: only stop_below can stop a row
    assert stop.tolist() == (S < below).tolist()
    assert stop.tolist()[:5] == [False, False, True, True, False]
    _, stop = fn(*head, cum0.clone(), 1, 2, 20, 1.0, torch.ones(6))  # below k_min: no stop whatever it says
    assert not bool(stop.any())
    _, stop = fn(*head, cum0.clone(), 20, 2, 20, 1.0, torch.full((6,), -math.inf))  # at k_max: stop
    assert bool(stop.all())
    _, stop = fn(*head, cum0.clone(), 2, 1, 20, 0.0, torch.full((6,), -math.inf))  # h still applies beside it
    assert torch.equal(stop, (1 - S) > 0.0)


@pytest.mark.parametrize("fn", [ops.acceptance_head_step, reference.acceptance_head_step], ids=["op", "reference"])
@pytest.mark.parametrize("bad, match", [(torch.zeros(5), r"stop_below must be \[B\] = \[6\]"),
                                        (torch.zeros(6, dtype=torch.float64), "stop_below must be float32")])
def test_stop_below_bad_input_is_named(fn, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*head_args(B=6, F=3), torch.ones(6), 2, 1, 20, 0.5, bad)


@pytest.mark.parametrize("fn", [ops.acceptance_head_step, reference.acceptance_head_step], ids=["op", "reference"])
@pytest.mark.parametrize("where", ["hidden", "features", "cum_accept"])
def test_acceptance_head_nan_input_raises(fn, where):
    # a NaN p_hat compares false in the stop rule and would silently keep drafting to K_max
    args = list(head_args(B=3, F=3))
    cum = torch.ones(3)
    if where == "hidden":
        args[0] = args[0].clone()
        args[0][1, 4] = float("nan")
    elif where == "features":
        args[1] = args[1].clone()
        args[1][2, 0] = float("inf")
    else:
        cum[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fn(*args, cum, 2, 1, 20, 0.5)


# ----------------------------------------------------------------------------------- opcheck
def test_opcheck_every_op():
    ids, q, p, n, u = make_case(3, 2, 17)
    so = torch.tensor([1, 2])
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify.default, (ids, q, p, n, u, None))
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify.default, (ids, q, p, None, None, so))
    temp = torch.tensor([0.0, 0.7, 1.0])
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify_logits.default, (ids, q.log(), p.log(), temp, n, u, None))
    torch.library.opcheck(torch.ops.specdec_ext.residual_sample.default, (p[:, 0], q[:, 0], u[:, 0], None))
    for F in (0, 3):
        torch.library.opcheck(torch.ops.specdec_ext.acceptance_head_step.default,
                              (*head_args(B=3, F=F), torch.ones(3), 2, 2, 20, 0.5))
    features_only = (None, *head_args(B=3, F=3)[1:])
    torch.library.opcheck(torch.ops.specdec_ext.acceptance_head_step.default, (*features_only, torch.ones(3), 2, 2, 20, 0.5))
    torch.library.opcheck(torch.ops.specdec_ext.philox_uniforms.default, (torch.tensor([[1, 2], [3, 4]]), 5, 7))


def test_ops_under_torch_compile():
    ids, q, p, n, u = make_case(4, 3, 64)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(ids, q, p, n, u):
        return torch.ops.specdec_ext.chain_verify(ids, q, p, n, u, None)

    out, num = f(ids, q, p, n, u)
    want = reference.chain_verify(ids, q, p, n, u)
    assert torch.equal(out, want[0]) and torch.equal(num, want[1])
    so = torch.tensor([[3, 1], [3, 2]])
    drawn = torch.compile(lambda t: ops.philox_uniforms(t, 6, 2), fullgraph=True, backend="aot_eager")(so)
    assert torch.equal(drawn, reference.philox_row_uniforms(so, 6, 2))


# ------------------------------------------------------------------------------- bad input
def _bad_cases():
    ids, q, p, n, u = make_case(2, 3, 10, ragged=False)
    nanp = p.clone()
    nanp[:, :, :] = float("nan")
    negq = q.clone()
    negq[:, :, :] = -0.1
    yield "K = 0", lambda: ops.chain_verify(ids[:, :0], q[:, :0], p[:, :1], uniforms=u[:, :1]), ValueError, "K"
    yield "target K", lambda: ops.chain_verify(ids, q, p[:, :3], uniforms=u), ValueError, "target_probs must be [B, K+1, V]"
    yield "draft shape", lambda: ops.chain_verify(ids, q[:1], p, uniforms=u), ValueError, "draft_probs must be [B, K, V]"
    yield "vocab", lambda: ops.chain_verify(ids, q, p[..., :9], uniforms=u), ValueError, "vocabulary mismatch"
    yield "dtype", lambda: ops.chain_verify(ids, q.double(), p.double(), uniforms=u), TypeError, "draft_probs must be float32"
    yield "mixed dtype", lambda: ops.chain_verify(ids, q, p.half(), uniforms=u), TypeError, "target_probs has dtype"
    yield "ids dtype", lambda: ops.chain_verify(ids.float(), q, p, uniforms=u), TypeError, "draft_token_ids must be int32"
    yield "n > K", lambda: ops.chain_verify(ids, q, p, torch.tensor([4, 1]), uniforms=u), ValueError, "num_draft_tokens"
    yield "n shape", lambda: ops.chain_verify(ids, q, p, torch.tensor([1]), uniforms=u), ValueError, "num_draft_tokens"
    yield "nan target", lambda: ops.chain_verify(ids, q, nanp, uniforms=u), ValueError, "target_probs has a NaN"
    yield "neg draft", lambda: ops.chain_verify(ids, negq, p, uniforms=u), ValueError, "draft_probs has a NaN"
    yield "bad id", lambda: ops.chain_verify(ids + 100, q, p, uniforms=u), ValueError, "draft_token_ids has an id"
    yield "u = 0", lambda: ops.chain_verify(ids, q, p, uniforms=torch.zeros_like(u)), ValueError, "uniforms must lie"
    yield "u shape", lambda: ops.chain_verify(ids, q, p, uniforms=u[:, :2]), ValueError, "uniforms must have shape"
    yield "both rng", lambda: ops.chain_verify(ids, q, p, uniforms=u, philox_seed_offset=torch.tensor([1, 2])), ValueError, "at most one"
    yield "seed shape", lambda: ops.chain_verify(ids, q, p, philox_seed_offset=torch.tensor([1])), ValueError, "philox_seed_offset must have shape"
    yield "meta device", lambda: ops.chain_verify(ids, q, p.to("meta"), uniforms=u), ValueError, "is on"
    yield "temp missing", lambda: torch.ops.specdec_ext.chain_verify_logits(ids, q, p, torch.ones(3), None, u, None), ValueError, "temperature must be [B]"
    yield "temp neg", lambda: ops.chain_verify_logits(ids, q, p, torch.tensor([-1.0, 1.0]), uniforms=u), ValueError, "temperature must be finite"
    yield "inf logits", lambda: ops.chain_verify_logits(ids, q, p * float("inf"), torch.ones(2), uniforms=u), ValueError, "target_logits has a NaN"
    yield "residual vocab", lambda: ops.residual_sample(p[:, 0, :5], q[:, 0], uniforms=u[:, 0]), ValueError, "vocabulary mismatch"
    yield "target zero", lambda: ops.chain_verify(ids, q, torch.zeros_like(p), uniforms=u), ValueError, "sums to 0"
    yield "residual zero", lambda: ops.residual_sample(torch.zeros(2, 4), torch.zeros(2, 4), uniforms=u[:, 0]), ValueError, "sums to 0"
    head = head_args(B=2, H=8)
    hid, _, _, _, w, b, ow, ob = head
    fhead = head_args(B=2, H=8, F=3)
    yield "head hidden size", lambda: ops.acceptance_head_step(torch.randn(2, 16), *head[1:], torch.ones(2), 1, 2, 20, 0.3), ValueError, "H = 8"
    yield "head bounds", lambda: ops.acceptance_head_step(*head, torch.ones(2), 1, 5, 2, 0.3), ValueError, "k_min <= k_max"
    yield "head candidate_length", lambda: ops.acceptance_head_step(*head, torch.ones(2), 0, 2, 5, 0.3), ValueError, "candidate_length"
    yield "head threshold", lambda: ops.acceptance_head_step(*head, torch.ones(2), 1, 2, 5, 1.5), ValueError, "threshold"
    yield "head dtype", lambda: ops.acceptance_head_step(hid, None, None, None, w.double(), b, ow, ob, torch.ones(2), 1, 2, 5, 0.3), TypeError, "float32"
    yield "head no input", lambda: ops.acceptance_head_step(None, None, None, None, w, b, ow, ob, torch.ones(2), 1, 2, 5, 0.3), ValueError, "pass hidden [B, H], features [B, F]"
    yield "head features F", lambda: ops.acceptance_head_step(fhead[0], fhead[1][:, :2], *fhead[2:], torch.ones(2), 1, 2, 5, 0.3), ValueError, "feature_weight must be"
    yield "head features dtype", lambda: ops.acceptance_head_step(fhead[0], fhead[1].double(), *fhead[2:], torch.ones(2), 1, 2, 5, 0.3), TypeError, "features must be float32"
    yield "head features no weight", lambda: ops.acceptance_head_step(fhead[0], fhead[1], None, None, *fhead[4:], torch.ones(2), 1, 2, 5, 0.3), ValueError, "need feature_weight"
    yield "head weight no features", lambda: ops.acceptance_head_step(fhead[0], None, *fhead[2:], torch.ones(2), 1, 2, 5, 0.3), ValueError, "without features"


@pytest.mark.parametrize("name,call,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_clear_error(name, call, exc, msg):
    with pytest.raises(exc, match=msg.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        call()


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")
def test_compiled_messages_print_shapes_numbers_dtypes_and_devices():
    """The compiled checks format their messages without std::ostream (csrc/check_msg.h): the shapes, integers,
    floats, dtypes and devices read as torch would print them."""
    ids, q, p, n, u = make_case(2, 3, 10, ragged=False)
    cases = [(lambda: ops.chain_verify(ids, q[:1], p, uniforms=u), ValueError,
              "chain_verify: draft_probs must be [B, K, V] = [2, 3, V], got [1, 3, 10]"),
             (lambda: ops.chain_verify(ids, q, p, torch.tensor([4, 1]), uniforms=u), ValueError,
              "chain_verify: num_draft_tokens must lie in [0, K] = [0, 3], got 4 in row 0"),
             (lambda: ops.chain_verify_logits(ids, q, p, torch.tensor([1.0, -0.25]), uniforms=u), ValueError,
              "chain_verify_logits: temperature must be finite and >= 0 (0 means greedy), got -0.25 in row 1"),
             (lambda: ops.acceptance_head_step(*head_args(B=2, H=8), torch.ones(2), 1, 2, 5, 1.5), ValueError,
              "acceptance_head_step: stop threshold must lie in [0, 1], got 1.5"),
             (lambda: ops.chain_verify(ids, q, p.to("meta"), uniforms=u), ValueError,
              "chain_verify: draft_token_ids is on cpu but target_probs is on meta"),
             (lambda: ops.chain_verify(ids, q, p.half(), uniforms=u), TypeError,
              "chain_verify: target_probs has dtype Half but draft_probs has Float")]
    for call, exc, msg in cases:
        with pytest.raises(exc) as err:
            call()
        assert str(err.value).splitlines()[0] == msg


@pytest.mark.parametrize("name,call,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_reference_raises_the_same_errors(name, call, exc, msg, monkeypatch):
    if name in ("temp missing", "meta device"):
        pytest.skip("direct torch.ops call / meta tensors have no reference analogue")
    monkeypatch.setattr(ops, "HAS_EXTENSION", False)
    with pytest.raises(exc, match=msg.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        call()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(0, 4), K=st.integers(1, 4), V=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
    poison=st.sampled_from([None, "nan", "inf", "neg", "zero", "id"]),
    ragged=st.booleans(), logits=st.booleans(),
)
def test_fuzz_never_crashes(B, K, V, dtype, seed, poison, ragged, logits):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, K, V, generator=g)
    p = torch.rand(B, K + 1, V, generator=g)
    if poison == "nan" and p.numel():
        p.view(-1)[torch.randint(0, p.numel(), (1,), generator=g)] = float("nan")
    elif poison == "inf" and q.numel():
        q.view(-1)[torch.randint(0, q.numel(), (1,), generator=g)] = float("inf")
    elif poison == "neg":
        p.neg_()
    elif poison == "zero":
        p.zero_()
    ids = torch.randint(0, V + (3 if poison == "id" else 0), (B, K), generator=g)
    n = torch.randint(0, K + 1, (B,), generator=g) if ragged else None
    u = torch.rand(B, K + 1, generator=g).clamp_min(2**-24)
    q, p = q.to(dtype), p.to(dtype)
    try:
        if logits:
            out, num = ops.chain_verify_logits(ids, q, p, torch.rand(B, generator=g), n, uniforms=u)
        else:
            out, num = ops.chain_verify(ids, q, p, n, uniforms=u)
    except (ValueError, TypeError):
        return
    assert out.shape == (B, K + 1) and num.shape == (B,)
    assert bool(((num >= 0) & (num <= K)).all())
    for b in range(B):
        assert 0 <= int(out[b, int(num[b])]) < V


# ------------------------------------------------------------------ checks of the rows the ops read
BOTH = [ops.chain_verify, reference.chain_verify]
BOTH_IDS = ["op", "reference"]


@pytest.mark.parametrize("fn", BOTH, ids=BOTH_IDS)
@pytest.mark.parametrize("which,scale", [("target", 2.0), ("draft", 0.5)])
def test_unnormalised_rows_are_refused(fn, which, scale):
    """Rows read in full (residual / bonus) must sum to 1 within the dtype's tolerance: scaled rows would
    change the acceptance probability min(1, p/q) and so the output distribution."""
    ids, q, p, _, u = make_case(4, 3, 50, ragged=False)
    if which == "target":
        p = p * scale
    else:
        q = q * scale
    with pytest.raises(ValueError, match=f"a {which}_probs row it reads does not sum to 1"):
        fn(ids, q, p, uniforms=torch.full_like(u, 0.999))  # every candidate rejected: both rows read in full


@pytest.mark.parametrize("fn", BOTH, ids=BOTH_IDS)
def test_validate_checks_rows_read_only_at_a_token(fn):
    """By default an accepted candidate's rows are read at its token only; validate=True reads them all."""
    ids, q, p, _, u = make_case(3, 3, 40, ragged=False)
    p = p.clone()
    accepted_row = p[:, 0].clone()
    for b in range(3):  # a NaN in target row 0 away from the candidate, which is accepted (u tiny)
        j = (int(ids[b, 0]) + 1) % 40
        accepted_row[b, j] = float("nan")
    p[:, 0] = accepted_row
    tiny = torch.full_like(u, 1e-7)
    out, n = fn(ids, q, p, uniforms=tiny)
    assert bool((n >= 1).all())
    with pytest.raises(ValueError, match="target_probs has a NaN"):
        fn(ids, q, p, uniforms=tiny, validate=True)


@pytest.mark.parametrize("fn", BOTH, ids=BOTH_IDS)
def test_candidate_with_zero_target_mass_is_never_emitted(fn):
    """p(x) = q(x) = 0 at the candidate: u * 0 <= 0 would accept it; the target gives it no mass."""
    V = 6
    q = torch.full((1, 1, V), 1.0 / (V - 1))
    q[0, 0, 2] = 0.0
    p = torch.softmax(torch.randn(1, 2, V), -1)
    p[0, 0, 2] = 0.0
    p[0, 0] /= p[0, 0].sum()
    ids = torch.tensor([[2]])
    for uu in (1e-7, 0.5, 1.0):
        out, n = fn(ids, q, p, uniforms=torch.full((1, 2), uu))
        assert int(n[0]) == 0 and int(out[0, 0]) != 2


@pytest.mark.parametrize("fn", BOTH, ids=BOTH_IDS)
def test_nan_or_inf_at_an_accepted_candidate_raises(fn):
    ids, q, p, _, u = make_case(2, 2, 30, ragged=False)
    p = p.clone()
    p[0, 0, int(ids[0, 0])] = float("inf")
    with pytest.raises(ValueError, match="target_probs has a NaN, Inf or negative"):
        fn(ids, q, p, uniforms=torch.full_like(u, 1e-7))


LOGITS = [ops.chain_verify_logits, reference.chain_verify_logits]


@pytest.mark.parametrize("T", [1e-3, 1e-6, 1e-9, 1e-12])
def test_tiny_temperatures_agree_with_the_reference_and_act_greedy(T):
    """The softmax is exp((x - max) / T): stable down to the floor; at T far below the logits' gaps the
    draw is the target's argmax (the greedy answer), on the op and the reference alike."""
    ids, dl, tl, _, _, u = logits_case(6, 3, 40, torch.float32, seed=2)
    temp = torch.full((6,), T)
    if T < 1e-6:
        for fn in LOGITS:
            with pytest.raises(ValueError, match="temperature must be 0 .greedy decoding. or at least 1e-06"):
                fn(ids, dl, tl, temp, uniforms=u)
        return
    got = ops.chain_verify_logits(ids, dl, tl, temp, uniforms=u)
    want = reference.chain_verify_logits(ids, dl, tl, temp, uniforms=u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if T <= 1e-6:
        greedy = ops.chain_verify_logits(ids, dl, tl, torch.zeros(6), uniforms=u)
        assert torch.equal(got[0], greedy[0])


def test_engine_refuses_tiny_temperatures_with_the_same_message():
    from specdec_ext.engine.sampling import SamplingConfig

    with pytest.raises(ValueError, match="temperature must be 0 .greedy decoding. or at least 1e-06"):
        SamplingConfig(1e-40)
    SamplingConfig(1e-6)


@pytest.mark.parametrize("fn", LOGITS, ids=BOTH_IDS)
def test_masked_logits_work_and_fully_masked_rows_are_refused(fn):
    """-inf is the masking value of top-k / top-p / grammars: masked tokens are never emitted."""
    ids, dl, tl, temp, n, u = logits_case(8, 3, 30, torch.float32, seed=4)
    temp = torch.ones(8)
    mask = torch.zeros(30, dtype=torch.bool)
    mask[10:] = True  # only tokens 0..9 allowed
    dl, tl = dl.masked_fill(mask, float("-inf")), tl.masked_fill(mask, float("-inf"))
    ids = ids % 10
    out, num = fn(ids, dl, tl, temp, uniforms=u)
    emitted = out[out >= 0]
    assert bool((emitted < 10).all())
    if fn is ops.chain_verify_logits:
        want = reference.chain_verify_logits(ids, dl, tl, temp, uniforms=u)
        assert torch.equal(out, want[0])
    tl2 = tl.clone()
    tl2[3, 0] = float("-inf")
    with pytest.raises(ValueError, match="a target_logits row it reads is -inf everywhere"):
        fn(ids, dl, tl2, temp, uniforms=torch.full_like(u, 0.999), validate=True)
    with pytest.raises(ValueError, match="target_logits has a NaN or \\+Inf"):
        fn(ids, dl, tl.masked_fill(mask, float("inf")), temp, uniforms=u)


def test_error_messages_come_from_one_table():
    """csrc/kernels/errors.h is generated from specdec_ext/errors.py; the committed header must match."""
    from pathlib import Path

    from specdec_ext import errors

    header = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "errors.h"
    assert header.read_text() == errors.header(), "regenerate: python -m specdec_ext.errors > csrc/kernels/errors.h"


# ------------------------------------------------------------------ confidence_features
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logits", [True, False], ids=["logits", "probs"])
@pytest.mark.parametrize("V", [1, 2, 37, 8192])
def test_confidence_features_match_reference(dtype, logits, V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g) * 3
    if logits and V > 4:
        x[2, V // 2 :] = float("-inf")  # masked tokens
    dist = (x if logits else torch.softmax(x, -1)).to(dtype)
    tokens = torch.randint(0, max(1, V // 2), (6,), generator=g)
    got = ops.confidence_features(dist, tokens, logits)
    want = reference.confidence_features(dist, tokens, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    q = torch.softmax(dist.double(), -1) if logits else dist.double()
    assert bool((got[:, 1] >= -1e-6).all()) and bool((got[:, 2] >= -1e-6).all())
    torch.testing.assert_close(got[:, 0].double(), q.gather(-1, tokens.view(-1, 1)).squeeze(-1), rtol=1e-4, atol=1e-6)


def test_confidence_features_errors_and_opcheck():
    x = torch.randn(3, 10)
    t = torch.tensor([1, 2, 3])
    for fn in (ops.confidence_features, reference.confidence_features):
        with pytest.raises(ValueError, match="draft_token_ids has an id outside"):
            fn(x, torch.tensor([1, 2, 10]), True)
        with pytest.raises(ValueError, match="draft_logits has a NaN"):
            fn(x.index_fill(1, torch.tensor([4]), float("nan")), t, True)
        with pytest.raises(ValueError, match="-inf everywhere"):
            fn(x.index_fill(0, torch.tensor([1]), float("-inf")), t, True)
        with pytest.raises(ValueError, match="draft_probs has a NaN, Inf or negative"):
            fn(-torch.softmax(x, -1), t, False)
        with pytest.raises(ValueError, match="tokens must be"):
            fn(x, t[:2], True)
    torch.library.opcheck(torch.ops.specdec_ext.confidence_features.default, (x, t, True))
    torch.library.opcheck(torch.ops.specdec_ext.confidence_features.default, (torch.softmax(x, -1), t, False))


# ------------------------------------------------- argmax_tokens (and chain_verify_greedy's argmax)
def _argmax_rows(V: int, dtype, seed: int) -> torch.Tensor:
    """[9, V] rows that test the first-index convention: Gaussian, small integers (many ties), -inf in most places,
    a NaN or two, +inf, -inf everywhere, signed zeros, the maximum in the last place, and in the first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, V, generator=g)
    x[1] = torch.randint(-2, 2, (V,), generator=g).float()
    x[2] = torch.where(torch.rand(V, generator=g) < 0.9, float("-inf"), x[2])
    x[3, torch.randint(0, V, (2,), generator=g)] = float("nan")
    x[4, torch.randint(0, V, (2,), generator=g)] = float("inf")
    x[5] = float("-inf")
    x[6] = torch.where(torch.arange(V) % 3 == 0, -0.0, 0.0)
    x[7, -1] = 100.0
    x[8, 0] = 100.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 2, 63, 64, 65, 200, 8192, 32001])
def test_argmax_tokens_equals_torch_argmax(dtype, V):
    x = _argmax_rows(V, dtype, seed=V)
    got = ops.argmax_tokens(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(x, -1))
    assert torch.equal(got, reference.argmax_tokens(x))
    wide = torch.cat([x, x], -1)[..., ::2]  # any strides
    assert torch.equal(ops.argmax_tokens(wide), torch.argmax(wide, -1))
    batched = x.view(3, 3, V)  # any leading dimensions, and none
    assert torch.equal(ops.argmax_tokens(batched), torch.argmax(batched, -1))
    assert ops.argmax_tokens(x[7]).shape == () and int(ops.argmax_tokens(x[7])) == V - 1
    assert ops.argmax_tokens(x[:0]).shape == (0,)


@given(rows=st.integers(1, 70), V=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(DTYPES), ties=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_argmax_tokens_fuzzed_against_torch(rows, V, seed, dtype, ties):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, V), generator=g).float() if ties else torch.randn(rows, V, generator=g)
    x = x.to(dtype)
    assert torch.equal(ops.argmax_tokens(x), torch.argmax(x, -1))


def test_argmax_tokens_errors_opcheck_and_compile():
    for fn in (ops.argmax_tokens, reference.argmax_tokens):
        with pytest.raises(ValueError, match="logits must be \\[..., V\\] with V >= 1"):
            fn(torch.tensor(1.0))
        with pytest.raises(ValueError, match="got shape \\[3, 0\\]"):
            fn(torch.zeros(3, 0))
        with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16"):
            fn(torch.zeros(3, 4, dtype=torch.int64))
    x = _argmax_rows(37, torch.bfloat16, seed=1)
    torch.library.opcheck(torch.ops.specdec_ext.argmax_tokens.default, (x,))
    torch.library.opcheck(torch.ops.specdec_ext.argmax_tokens.default, (x.float().view(3, 3, 37),))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def greedy(logits):
        return ops.argmax_tokens(logits[:, -1])

    y = torch.randn(4, 2, 37)
    assert torch.equal(greedy(y), torch.argmax(y[:, -1], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_verify_greedy_takes_the_first_of_tied_maxima(dtype):
    # logits of small integers: every row has ties; the op accepts and emits the first index, as torch.argmax
    g = torch.Generator().manual_seed(11)
    B, K, V = 64, 3, 130
    tl = torch.randint(-3, 3, (B, K + 1, V), generator=g).float().to(dtype)
    ids = torch.argmax(tl[:, :K], -1)
    ids[::3, 1] = (ids[::3, 1] + 1) % V  # a mismatch at slot 1 in every third row
    out, num = ops.chain_verify_greedy(ids, tl)
    want = reference.chain_verify_greedy(ids, tl)
    assert torch.equal(out, want[0]) and torch.equal(num, want[1])
    assert torch.equal(out[torch.arange(B), num], torch.argmax(tl, -1)[torch.arange(B), num])


# ------------------------------------------------------------------ chain_verify_greedy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,K,V", [(8, 1, 5), (12, 4, 257), (16, 8, 32000)])
def test_chain_verify_greedy_equals_greedy_rows_of_the_logits_op(dtype, B, K, V):
    ids, dl, tl, _, n, u = logits_case(B, K, V, dtype, seed=3)
    for b in range(0, B, 2):  # half the rows propose the target's argmax chain, with one mismatch in some
        ids[b] = tl[b, :K].float().argmax(-1)
    got = ops.chain_verify_greedy(ids, tl, n)
    want = ops.chain_verify_logits(ids, dl, tl, torch.zeros(B), n, uniforms=u)
    ref = reference.chain_verify_greedy(ids, tl, n)
    for a, b in ((got, want), (got, ref)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert int(got[1].max()) >= 1


def test_chain_verify_greedy_masked_errors_and_opcheck():
    ids, _, tl, _, n, _ = logits_case(4, 3, 20, torch.float32, seed=5)
    masked = tl.clone()
    masked[..., 10:] = float("-inf")
    out, num = ops.chain_verify_greedy(ids % 10, masked, n)
    assert bool((out[out >= 0] < 10).all())
    for fn in (ops.chain_verify_greedy, reference.chain_verify_greedy):
        with pytest.raises(ValueError, match="num_draft_tokens must lie in"):
            fn(ids, tl, torch.tensor([0, 1, 4, 2]))
        with pytest.raises(ValueError, match="-inf everywhere"):
            fn(ids, tl.index_fill(0, torch.tensor([2]), float("-inf")), torch.zeros(4, dtype=torch.long))
        with pytest.raises(ValueError, match="target_logits must be"):
            fn(ids, tl[:, :3], n)
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify_greedy.default, (ids, tl, n))
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify_greedy.default, (ids, tl, None))


@pytest.mark.parametrize("accepted", [True, False], ids=["drafted", "plain"])
@pytest.mark.parametrize("optional", [(True, True, True), (False, False, True), (True, True, False)],
                         ids=["all", "no-prev-room", "no-seeds"])
def test_advance_rows_matches_the_reference(accepted, optional):
    """The next round's inputs from a round's outputs: the kernel writes what the reference writes, rows past
    ``rows`` untouched, optional tensors left out; error codes count as no candidate accepted."""
    for rows in (0, 1, 6, 8):
        args = advance_case(rows=rows, accepted=accepted)
        for i, keep in zip((1, 2, 3), optional):
            args[i] = args[i] if keep else None
        want = [None if t is None else t.clone() for t in args[:4]]
        reference.advance_rows(*want, *args[4:])
        before = [None if t is None else t.clone() for t in args[:4]]
        ops.advance_rows(*args)
        for got, w, b in zip(args[:4], want, before):
            assert (got is None) == (w is None)
            if got is not None:
                assert torch.equal(got, w) and torch.equal(got[rows:], b[rows:])
    last, prev, room, seeds, emitted, acc, _ = advance_case()
    a = acc[0].clamp(0, 4)
    want_last, want_prev = emitted[0, a].item(), emitted[0, a - 1].item() if a > 0 else last[0].item()
    room0, count0 = room[0].item(), seeds[0, 1].item()
    ops.advance_rows(last, prev, room, seeds, emitted, acc, 1)
    assert (last[0], prev[0], room[0], seeds[0, 1]) == (want_last, want_prev, room0 - a - 1, count0 + 1)


@pytest.mark.parametrize("bad,err,match", [
    (lambda a: a.__setitem__(4, a[4].int()), TypeError, "emitted must be int64"),
    (lambda a: a.__setitem__(4, a[4][:, :0]), ValueError, "emitted must be \\[B, W\\] with W >= 1"),
    (lambda a: a.__setitem__(6, 9), ValueError, "rows must be in 0 .. 8"),
    (lambda a: a.__setitem__(0, a[0][:3]), ValueError, "last must be \\[B\\] with B >= rows"),
    (lambda a: a.__setitem__(3, a[3][:, :1]), ValueError, "seed_offsets must be \\[B, 2\\]"),
    (lambda a: a.__setitem__(2, a[2].float()), TypeError, "room must be int64"),
    (lambda a: a.__setitem__(1, torch.zeros(16, dtype=torch.int64)[::2]), ValueError, "prev must be contiguous"),
    (lambda a: a.__setitem__(5, a[5][:2]), ValueError, "accepted must be \\[B\\] with B >= rows")])
def test_advance_rows_refuses_bad_input(bad, err, match):
    """One line naming the argument and what was expected, from the wrapper, the compiled op and the reference."""
    for fn in (ops.advance_rows, torch.ops.specdec_ext.advance_rows, reference.advance_rows):
        args = advance_case()
        bad(args)
        with pytest.raises(err, match=match):
            fn(*args)


def test_advance_rows_opcheck_and_compile():
    """The op's schema, fake kernel and in-place writes pass torch's opcheck, and it runs under torch.compile."""
    torch.library.opcheck(torch.ops.specdec_ext.advance_rows.default, tuple(advance_case()))
    torch.library.opcheck(torch.ops.specdec_ext.advance_rows.default, tuple(advance_case(accepted=False)))
    args, want = advance_case(), advance_case()
    reference.advance_rows(*want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def advance(last, prev, room, seeds, emitted, acc):
        ops.advance_rows(last, prev, room, seeds, emitted, acc, 6)

    advance(*args[:6])
    assert all(torch.equal(a, w) for a, w in zip(args[:4], want[:4]))

