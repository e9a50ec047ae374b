"""``ops.packed_linear``, ``ops.decoder_layer`` and ``ops.decoder_layers`` (the CPU kernels of a decode step's layers) against their
pure-PyTorch references; a row's result independent of the rows beside it; errors, fake kernels and opcheck; and
the lean model's fused path against its torch-op path."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from specdec_ext import ops, reference
from specdec_ext.engine.model import FUSED_MAX_ROWS, LeanModel

needs_ext = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built")


def rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("N,K,M", [(16, 8, 1), (33, 20, 3), (100, 64, 13), (48, 7, 7), (960, 96, 5)])
def test_packed_linear_is_x_times_w_transposed(N, K, M):
    g = torch.Generator().manual_seed(N + K + M)
    w, x, b = rand(g, N, K), rand(g, 2, M, K), rand(g, N)
    packed = ops.pack_linear_weight(w)
    assert packed.shape == (-(-N // 16), K, 16)
    assert torch.equal(reference.unpack_linear_weight(packed, N), w)
    want = x.double() @ w.double().T + b.double()
    for got in (ops.packed_linear(x, packed, N, b), reference.packed_linear(x, packed, b, N)):
        assert got.shape == (2, M, N)
        torch.testing.assert_close(got.double(), want, atol=1e-5 * K ** 0.5, rtol=1e-5)
    assert torch.equal(ops.packed_linear(x, packed, N) + b, ops.packed_linear(x, packed, N, b))


@needs_ext
def test_packed_linear_bfloat16_accumulates_in_float32():
    """bfloat16 weights and rows: the products of the bfloat16 values summed in float32, rounded once at the end."""
    g = torch.Generator().manual_seed(7)
    w, x, b = rand(g, 40, 96).bfloat16(), rand(g, 5, 96).bfloat16(), rand(g, 40).bfloat16()
    packed = ops.pack_linear_weight(w)
    assert packed.dtype == torch.bfloat16 and ops.pack_linear_weight(w.float()).dtype == torch.float32
    want = (x.double() @ w.double().T + b.double()).bfloat16()
    for got in (ops.packed_linear(x, packed, 40, b), reference.packed_linear(x, packed, b, 40)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)  # one bfloat16 ulp


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_row_does_not_depend_on_its_neighbours(isa, dtype, monkeypatch):
    """Each output sums in one chain in k order whatever the row count: a decode step's row and the same row inside a
    verification of K + 1 rows are bitwise equal (row blocks of 1 to 6 and their remainders, a partial last panel). ``isa="avx2"``: the baseline kernel a CPU without AVX-512 runs
    (ATEN_CPU_CAPABILITY, read by the op at each call); its results checked against float64 too."""
    if isa == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    g = torch.Generator().manual_seed(0)
    w, x = rand(g, 85, 576).to(dtype), rand(g, 13, 576).to(dtype)
    packed = ops.pack_linear_weight(w)
    alone = torch.cat([ops.packed_linear(x[i: i + 1], packed, 85) for i in range(13)])
    for m in range(1, 14):
        assert torch.equal(ops.packed_linear(x[:m], packed, 85), alone[:m]), m
    want = x.double() @ w.double().T
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(alone.double(), want.to(dtype).double(), **tol)


def layer_case(seed=0, H=64, hq=4, hk=2, D=16, inter=48, S=3, C=10, T=12, bias=False, qk_norm=False,
               dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hk) * D
    weights = dict(
        input_norm=1 + rand(g, H, scale=0.3), qkv=ops.pack_linear_weight(rand(g, width, H, scale=0.3)),
        qkv_bias=rand(g, width, scale=0.3) if bias else None,
        q_norm=1 + rand(g, D, scale=0.3) if qk_norm else None, k_norm=1 + rand(g, D, scale=0.3) if qk_norm else None,
        o=ops.pack_linear_weight(rand(g, H, hq * D, scale=0.3)), post_norm=1 + rand(g, H, scale=0.3),
        gate_up=ops.pack_linear_weight(rand(g, 2 * inter, H, scale=0.3)),
        down=ops.pack_linear_weight(rand(g, H, inter, scale=0.3)))
    cache = rand(g, S, hk, C, D), rand(g, S, hk, C, D)
    weights = {k: None if v is None else v.to(dtype) for k, v in weights.items()}
    return weights, tuple(c.to(dtype) for c in cache), rand(g, T, D).to(dtype), rand(g, T, D).to(dtype), hq


def call(fn, x, weights, caches, lengths, slots, cos, sin, heads, eps=1e-5):
    w = weights
    return fn(x, w["input_norm"], w["qkv"], w["qkv_bias"], w["q_norm"], w["k_norm"], w["o"], w["post_norm"],
              w["gate_up"], w["down"], caches[0], caches[1], lengths, slots, cos, sin, heads, eps)


@needs_ext
@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "qwen3-qk-norm", "multi-head", "llama-bf16", "qwen3-bf16"])
def test_decoder_layer_matches_reference(kind):
    """Output and the cache's keys and values against the torch-op reference, for rows in their own slots or
    others' (``slots``), rows of different lengths, a position past the last regular column (the scratch column)
    and past the RoPE table (its last row)."""
    bf16 = kind.endswith("bf16")
    dtype = torch.bfloat16 if bf16 else torch.float32
    weights, caches, cos, sin, heads = layer_case(bias=kind == "qwen2-bias", qk_norm=kind.startswith("qwen3"),
                                                  hk=4 if kind == "multi-head" else 2, dtype=dtype)
    tol = dict(atol=5e-2, rtol=2e-2) if bf16 else dict(atol=1e-4, rtol=1e-4)  # bf16: a rounding or two apart
    g = torch.Generator().manual_seed(1)
    for B, n, lengths, slots in [(1, 1, [3, 0, 0], None), (2, 4, [5, 2, 9], torch.tensor([2, 0])),
                                 (3, 2, [0, 8, 1], None), (1, 3, [0, 11, 0], torch.tensor([1]))]:
        x = rand(g, B, n, 64).to(dtype)
        mine = [c.clone() for c in caches]
        theirs = [c.clone() for c in caches]
        got = call(ops.decoder_layer, x, weights, mine, torch.tensor(lengths), slots, cos, sin, heads)
        want = call(reference.decoder_layer, x, weights, theirs, torch.tensor(lengths), slots, cos, sin, heads)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tol)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a.float(), b.float(), **tol)
        written = [s for s in range(3) if not torch.equal(mine[0][s], caches[0][s])]
        assert written == sorted(slots.tolist() if slots is not None else range(B))


@needs_ext
def test_decoder_layer_errors_name_the_argument():
    weights, caches, cos, sin, heads = layer_case()
    x, lengths = torch.zeros(1, 1, 64), torch.zeros(3, dtype=torch.int64)
    bad = {
        "x must be float32": dict(x=x.double()),
        r"x must be \[B, n, H\]": dict(x=x[0]),
        "heads must be a multiple": dict(heads=3),
        r"lengths must be \[S\] = \[3\]": dict(lengths=lengths[:2]),
        "lengths must be int64": dict(lengths=lengths.int()),
        r"slots\[0\] = 3 is not a slot": dict(slots=torch.tensor([3])),
        r"lengths\[0\] = -1 is negative": dict(lengths=torch.tensor([-1, 0, 0])),
        r"qkv must be \[8, 64, 16\]": dict(qkv=weights["qkv"][:, :32]),
        "pass both q_norm and k_norm": dict(q_norm=torch.ones(16)),
        "cos must be": dict(cos=cos[:, :8]),
        "multiple of 16": dict(down=torch.zeros(4, 36, 16), gate_up=torch.zeros(5, 64, 16)),
    }
    for message, change in bad.items():
        args = dict(x=x, lengths=lengths, slots=None, heads=heads, cos=cos, sin=sin)
        w = dict(weights)
        for key, value in change.items():
            (w if key in w else args)[key] = value
        for fn in (ops.decoder_layer, reference.decoder_layer):
            with pytest.raises((ValueError, TypeError), match=message):
                call(fn, args["x"], w, caches, args["lengths"], args["slots"], args["cos"], args["sin"],
                     args["heads"])
    with pytest.raises(ValueError, match=r"weight must be \[2, 8, 16\]"):
        ops.packed_linear(torch.zeros(2, 8), torch.zeros(1, 8, 16), 20)
    with pytest.raises(ValueError, match="out_features must be >= 1"):
        ops.packed_linear(torch.zeros(2, 8), torch.zeros(1, 8, 16), 0)
    with pytest.raises(TypeError, match="x must be float32 or bfloat16"):
        ops.packed_linear(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(1, 8, 16), 16)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        ops.packed_linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 16), 16)
    with pytest.raises(TypeError, match="dtype must be torch.float32, torch.bfloat16, torch.int8 or torch.uint8"):
        ops.pack_linear_weight(torch.zeros(4, 4), torch.float16)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\]"):
        ops.pack_linear_weight(torch.zeros(4))


def stack_case(kind, layers=3):
    """decoder_layers' per-layer lists (checks.LAYER_LISTS' order, caches last) for ``layers`` random layers of
    :func:`layer_case` (``kind`` as in test_decoder_layer_matches_reference; ``"q4a8"``: float32 rows over 4-bit
    blocks for int8 activations), and the shared cos, sin and heads."""
    dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float32
    cases = [layer_case(seed=s, bias=kind == "qwen2-bias", qk_norm=kind.startswith("qwen3"), dtype=dtype)
             for s in range(layers)]
    if kind == "q4a8":
        g = torch.Generator().manual_seed(5)
        for w, _, _, _, _ in cases:
            for name, (N, K) in dict(qkv=(128, 64), o=(64, 64), gate_up=(128, 64), down=(64, 64)).items():
                w[name] = ops.pack_linear_weight(rand(g, N, K, scale=0.3), torch.uint8, int8_activations=True)
    names = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")
    lists = [[w[name] for w, *_ in cases] for name in names]
    lists += [[c[1][0] for c in cases], [c[1][1] for c in cases]]
    _, _, cos, sin, heads = cases[0]
    return lists, cos, sin, heads, dtype


@needs_ext
@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "qwen3-bf16", "llama-bf16", "q4a8"])
def test_decoder_layers_is_bitwise_its_layers_one_call_each(kind):
    """A stack of 3 layers in one call gives bitwise the output and caches of 3 ``decoder_layer`` calls (rows in
    their own slots or others', one token or several), and the reference's values."""
    lists, cos, sin, heads, dtype = stack_case(kind)
    g = torch.Generator().manual_seed(2)
    for B, n, lengths, slots in [(1, 1, [3, 0, 0], None), (2, 4, [5, 2, 9], torch.tensor([2, 0]))]:
        x, lengths = rand(g, B, n, 64).to(dtype), torch.tensor(lengths)
        mine, theirs, ref = ([[c.clone() for c in lists[i]] for i in (9, 10)] for _ in range(3))
        got = ops.decoder_layers(x, *lists[:9], *mine, lengths, slots, cos, sin, heads, 1e-5)
        want = x
        for layer in range(3):
            want = ops.decoder_layer(want, *(t[layer] for t in lists[:9]), theirs[0][layer], theirs[1][layer],
                                     lengths, slots, cos, sin, heads, 1e-5)
        assert got.dtype == dtype and torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(mine[0] + mine[1], theirs[0] + theirs[1]))
        expected = reference.decoder_layers(x, *lists[:9], *ref, lengths, slots, cos, sin, heads, 1e-5)
        # int8 activations: an input rounded to either side of a half step of its block's grid moves an output by
        # about a weight times that step, and 3 layers carry it on (test_weights checks one layer tighter)
        tol = (dict(atol=5e-2 * float(expected.abs().max()), rtol=0) if kind == "q4a8" else
               dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4))
        torch.testing.assert_close(got.float(), expected.float(), **tol)


@needs_ext
@pytest.mark.parametrize("kind", ["llama", "qwen3-bf16", "q4a8"])
def test_decoder_layers_threads_share_the_work_not_the_bits(kind):
    """The layers' threads (one parallel region, each thread's share of every product, attention and RoPE, a barrier
    between steps) give bitwise one thread's output and caches: 2 threads, 3 (shares of unequal size), and 5 (more
    threads than some products have panels: threads with nothing to do still meet at every barrier). The second case's
    first row runs past the cache's last column: its last 3 tokens write the scratch column, the last one's values
    kept, whichever thread writes them."""
    lists, cos, sin, heads, dtype = stack_case(kind)
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    for B, n, lengths, slots in [(1, 1, [3, 0, 0], None), (2, 4, [5, 2, 9], torch.tensor([2, 0]))]:
        x, lengths = rand(g, B, n, 64).to(dtype), torch.tensor(lengths)
        outs = {}
        try:
            for count in (1, 2, 3, 5):
                torch.set_num_threads(count)
                caches = [[c.clone() for c in lists[i]] for i in (9, 10)]
                outs[count] = (ops.decoder_layers(x, *lists[:9], *caches, lengths, slots, cos, sin, heads, 1e-5),
                               caches)
        finally:
            torch.set_num_threads(threads)
        want, want_caches = outs[1]
        assert want.abs().sum() > 0
        for count, (got, caches) in outs.items():
            assert torch.equal(got, want), count
            assert all(torch.equal(a, b) for a, b in zip(caches[0] + caches[1], want_caches[0] + want_caches[1]))


@needs_ext
def test_decoder_layers_errors_name_the_list():
    lists, cos, sin, heads, _ = stack_case("llama")
    x, lengths = torch.zeros(1, 1, 64), torch.zeros(3, dtype=torch.int64)
    short = [list(t) for t in lists]
    short[7] = short[7][:2]
    extra = [list(t) for t in lists]
    extra[10] = extra[10] + extra[10][:1]
    bad_layer = [list(t) for t in lists]
    bad_layer[1][2] = bad_layer[1][2][:, :32]
    cases = {r"gate_up must hold 3 entries \(one per layer, as input_norm\), got 2": (short, ValueError),
             r"value_cache must hold 3 entries \(one per layer, as input_norm\), got 4": (extra, ValueError),
             "input_norm must hold a tensor per layer": ([[] for _ in lists], ValueError),
             r"qkv must be \[8, 64, 16\]": (bad_layer, ValueError)}
    for message, (args, error) in cases.items():
        for fn in (ops.decoder_layers, reference.decoder_layers, torch.ops.specdec_ext.decoder_layers):
            with pytest.raises(error, match=message):
                fn(x, *args, lengths, None, cos, sin, heads, 1e-5)
    with pytest.raises(TypeError, match="down must be a list with an entry per layer, got Tensor"):
        ops.decoder_layers(x, *lists[:8], lists[8][0], *lists[9:], lengths, None, cos, sin, heads, 1e-5)


@needs_ext
def test_layer_ops_fake_kernels_and_opcheck():
    weights, caches, cos, sin, heads = layer_case(bias=True)
    x, lengths = torch.randn(2, 3, 64), torch.tensor([1, 4, 0])
    w = weights
    args = (x, w["input_norm"], w["qkv"], w["qkv_bias"], w["q_norm"], w["k_norm"], w["o"], w["post_norm"],
            w["gate_up"], w["down"], caches[0].clone(), caches[1].clone(), lengths, None, cos, sin, heads, 1e-5)
    torch.library.opcheck(torch.ops.specdec_ext.decoder_layer.default, args)
    lists, cos, sin, heads, _ = stack_case("qwen2-bias", layers=2)
    torch.library.opcheck(torch.ops.specdec_ext.decoder_layers.default,
                          (x, *lists, lengths, None, cos, sin, heads, 1e-5))
    torch.library.opcheck(torch.ops.specdec_ext.packed_linear.default, (x, w["gate_up"], None, 96))
    fn = torch.compile(lambda a: ops.packed_linear(a, w["gate_up"], 96) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x), ops.packed_linear(x, w["gate_up"], 96) * 2)


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_fused_verification_is_bitwise_its_one_token_steps(dtype, isa, monkeypatch):
    """Through ``ops.decoder_layer`` a verification of n tokens gives bitwise the logits of n one-token steps over the
    same cache (every product, attention score, softmax sum and norm of a row rounds the same way whatever the other
    rows of its call): greedy speculative decoding on the fused path equals target-only decoding by construction,
    not only where no near-tie occurs. ``isa="avx2"``: the baseline kernels (ATEN_CPU_CAPABILITY)."""
    if isa == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with torch.inference_mode(False):
        target, _ = make_pair("llama")
        target = target.to(dtype)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 48, (2, 11), generator=g)
    tokens = torch.randint(2, 48, (2, FUSED_MAX_ROWS[dtype] // 2), generator=g)
    lean = LeanModel(target, "target", fused=True)
    logits = []
    for n in (tokens.shape[1], 1):  # one verification; then one token at a time
        cache = lean.cache(2, 40)
        lean.forward(cache, prompt, keep=1)
        logits.append(torch.cat([lean.forward(cache, tokens[:, i: i + n], keep=n, start=int(cache.lengths[0]))[0]
                                 for i in range(0, tokens.shape[1], n)], dim=1))
    assert logits[0].shape == (2, tokens.shape[1], target.config.vocab_size)
    assert torch.equal(logits[0], logits[1])


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_lean_model_fused_path_matches_torch_ops(dtype):
    """The lean model's decode steps and verifications through ``ops.decoder_layer`` give the logits of its torch-op
    path (rows in slots 0.., a slice of slots, an index of slots; a prefill beyond FUSED_MAX_ROWS takes the torch-op
    path in both; bfloat16: within a few roundings, the fused layer keeping float32 between its ops), and the fused
    path is refused where it cannot run."""
    with torch.inference_mode(False):
        target, _ = make_pair("llama")
        target = target.to(dtype)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 48, (2, FUSED_MAX_ROWS[dtype] + 3), generator=g)
    steps = [torch.randint(2, 48, (2, n), generator=g) for n in (1, 4, 2)]
    out = {}
    for fused in (True, False):
        lean = LeanModel(target, "target", fused=fused)
        assert lean.fused == fused
        cache = lean.cache(3, 32)
        got = [lean.forward(cache, prompt, keep=2)[0]]
        got += [lean.forward(cache, t, keep=t.shape[1], start=int(cache.lengths[0]))[0] for t in steps]
        got.append(lean.forward(cache, steps[0][:1], rows=slice(1, 2))[0])
        got.append(lean.forward(cache, steps[1], rows=torch.tensor([1, 0]), keep=4)[0])
        out[fused] = got + [cache.k[1].clone(), cache.lengths.clone()]
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=0.05)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    with pytest.raises(ValueError, match="fused=True needs a float32 or bfloat16 model on a CPU"):
        LeanModel(target, "target", fused=True, attention="sdpa")
