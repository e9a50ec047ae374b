"""Quantized weights (engine/weights.py; int8 panels in csrc/cpu/layer_cpu.cpp, 4-bit blocks in blocks_cpu.cpp): the
products against the pure-PyTorch reference and bitwise the same for a row whatever rows share the call; a quantized
target's lean forward against transformers' forward of the same (quantized) model; speculative decoding lossless for
the quantized target (greedy equal to its own decoding, chi-square per sampled position, with a negative control); the
loaders' errors."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator, ops, reference
from specdec_ext.engine import weights
from specdec_ext.engine.cache import StaticCache
from specdec_ext.engine.model import LeanModel
from specdec_ext.engine.packed import PackedEmbedding, PackedLinear
from specdec_ext.engine.models import fingerprint
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.zoo import load_models
from models import make_pair, make_target
from stats import assert_follows, chi_square
from support import exact_marginals, greedy_against_target

needs_kernel = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="the compiled extension's CPU kernels")


def test_quantize_rows_keeps_each_weight_within_half_a_step_and_is_idempotent():
    w = torch.randn(37, 50) * torch.logspace(-3, 1, 37).unsqueeze(1)
    w[5] = 0.0  # a row of zeros: scale 0, q 0
    q, scale = ops.quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and int(q.abs().max()) == 127
    back = q.float() * scale[:, None]
    assert bool(((back - w).abs() <= scale[:, None] / 2 + 1e-7).all())
    assert scale[5] == 0 and not bool(q[5].any())
    q2, scale2 = ops.quantize_rows(back)
    assert torch.equal(q2, q) and torch.equal(q2.float() * scale2[:, None], back)


def _products_match_the_reference_row_by_row(packed, N, K, dtype, g, row_counts):
    """packed_linear of 17 random rows against the reference, and the first r rows alone bitwise the same."""
    x = torch.randn(17, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    y = ops.packed_linear(x, packed, N, bias)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), reference.packed_linear(x, packed, bias, N).float(), rtol=tol,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
    for rows in row_counts:
        assert torch.equal(ops.packed_linear(x[:rows], packed, N, bias), y[:rows]), rows


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(48, 64), (40, 33), (96, 576)])
def test_int8_panels_match_the_reference_and_a_row_does_not_depend_on_its_neighbours(dtype, N, K, isa, monkeypatch):
    """The AVX-512 kernel (where the CPU has it) and the baseline one (ATEN_CPU_CAPABILITY=avx2, read at each call)."""
    if isa == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    packed = ops.pack_linear_weight(w, torch.int8)
    assert packed.dtype == torch.int8 and packed.shape == (-(-N // 16), K + 4, 16)
    q, scale = ops.quantize_rows(w)
    assert torch.equal(reference.unpack_linear_weight(packed, N), q.float() * scale[:, None])
    # the 16-row block, the grouped panels of 1-4 and 5-8 rows, two blocks of 17
    _products_match_the_reference_row_by_row(packed, N, K, dtype, g, (1, 4, 9, 16))


def test_quantize_blocks_is_q4_1_and_idempotent():
    """Each block of 32: q in [0, 15], the smallest weight at q = 0 and the largest at 15, every weight within half a
    step of d q + m (plus the float16 rounding of d and m); requantizing the values gives back q, d and m."""
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    w[3, :32] = 0.7  # a constant block: d = 0
    q, d, m = ops.quantize_blocks(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (24, 3) and d.dtype == torch.float16
    blocks = q.view(24, 3, 32)
    assert (blocks.amin(-1) == 0).all() and ((blocks.amax(-1) == 15) | (d == 0)).all()
    back = ops.dequantize_blocks(q, d, m)
    step, low = d.float().repeat_interleave(32, 1), m.float().abs().repeat_interleave(32, 1)
    assert ((back - w).abs() <= step * 0.5 + 2.0 ** -11 * (15 * step + low)).all()  # + float16 rounding of d, m
    assert torch.equal(back[3, :32], torch.full((32,), 0.7).half().float())
    q2, d2, m2 = ops.quantize_blocks(back)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
    with pytest.raises(ValueError, match=r"quantize_blocks: weight must be \[N, K\] with K a multiple of 32, got "
                                         r"\[4, 40\]"):
        ops.quantize_blocks(torch.randn(4, 40))


def test_quantize_blocks_8_bit_is_q8_0_and_idempotent():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    q, d, m = ops.quantize_blocks(w, 8)
    assert q.dtype == torch.int8 and m is None and (q.view(8, 2, 32).abs().amax(-1) == 127).all()
    back = ops.dequantize_blocks(q, d)
    assert ((back - w).abs() <= d.float().repeat_interleave(32, 1) * (0.5 + 2.0 ** -11 * 127)).all()
    assert all(torch.equal(a, b) for a, b in zip(ops.quantize_blocks(back, 8)[:2], (q, d)))
    with pytest.raises(ValueError, match="quantize_blocks: bits must be 4 or 8, got 2"):
        ops.quantize_blocks(w, 2)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(48, 64), (40, 96), (96, 576)])
@pytest.mark.parametrize("bits,a8", [(4, False), (8, False), (4, True), (8, True)])
def test_blocks_match_the_reference_and_a_row_does_not_depend_on_its_neighbours(bits, a8, dtype, N, K, isa,
                                                                                 monkeypatch):
    """4-bit (Q4_1) and 8-bit (Q8_0) blocks, with float or int8 activations (a8), on the AVX-512 kernel (where the
    CPU has it; VNNI for a8) and the baseline one (ATEN_CPU_CAPABILITY=avx2)."""
    if isa == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    packed = ops.pack_linear_weight(w, torch.uint8 if bits == 4 else torch.int8, blocks=True, int8_activations=a8)
    P = -(-N // 16)
    last = {(4, False): (320,), (8, False): (544,), (4, True): (5, 64), (8, True): (17, 32)}[bits, a8]
    assert packed.shape == (P, K // 32, *last)
    assert torch.equal(reference.unpack_linear_weight(packed, N),
                       ops.dequantize_blocks(*ops.quantize_blocks(w, bits)))
    # groups of 8, 4 and 2 panels, blocks of up to 8 rows, two blocks
    _products_match_the_reference_row_by_row(packed, N, K, dtype, g, (1, 2, 3, 4, 5, 8, 9, 16))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_round_half_to_even_per_block_and_every_kernel_agrees_bitwise(bits, monkeypatch):
    """Blocks for int8 activations: each row's block of 32 inputs becomes ``max |x| / 127`` times ``round(x * 127 /
    max |x|)`` (half to even), whatever the weights: identity weights give the rounded inputs back (0.5 -> 0, 1.5 ->
    2, 2.5 -> 2, -3.5 -> -4), a block of zeros gives zeros, and float activations would not round. The AVX-512 VNNI
    kernel and the baseline one give bitwise the same outputs (integer block sums, one float order)."""
    K = 64
    w = torch.eye(K)  # 4-bit: d = 1/15, q in {0, 15}, m = 0; 8-bit: d = 1/127 (float16), q = 127
    x = torch.zeros(2, K)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -3.5, 100.2])  # block 0: max 127, so r = round-half-even(x)
    x[1, 32:] = torch.linspace(-1, 1, 32)  # row 1: a block of zeros, then a scaled one
    packed = ops.pack_linear_weight(w, torch.uint8 if bits == 4 else torch.int8, blocks=True, int8_activations=True)
    native = ops.packed_linear(x, packed, K)
    scale = reference.block_parts(packed, K)[1][:, 0]  # each row's d: w = d q, q its largest value
    unit = scale * (15 if bits == 4 else 127)
    torch.testing.assert_close(native[0, :6] / unit[:6], torch.tensor([127.0, 0.0, 2.0, 2.0, -4.0, 100.0]))
    assert torch.equal(native[1, :32], torch.zeros(32))
    torch.testing.assert_close(native, reference.packed_linear(x, packed, None, K), rtol=1e-6, atol=1e-6)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert torch.equal(ops.packed_linear(x, packed, K), native)
    x2 = torch.randn(9, 576, generator=torch.Generator().manual_seed(bits))
    w2 = ops.pack_linear_weight(torch.randn(80, 576), torch.uint8 if bits == 4 else torch.int8, blocks=True,
                                int8_activations=True)
    baseline = ops.packed_linear(x2, w2, 80)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert torch.equal(ops.packed_linear(x2, w2, 80), baseline)


@needs_kernel
def test_blocks_are_refused_in_one_line_where_they_do_not_fit():
    w = ops.pack_linear_weight(torch.randn(32, 64), torch.uint8)
    with pytest.raises(ValueError, match=r"packed_linear: weight \(4-bit blocks\) must be \[2, 3, 320\] \(in features "
                                         r"a multiple of 32\), got \[2, 2, 320\]"):
        ops.packed_linear(torch.randn(3, 96), w, 32)
    w8 = ops.pack_linear_weight(torch.randn(32, 64), torch.int8, blocks=True)
    with pytest.raises(ValueError, match=r"packed_linear: weight \(8-bit blocks\) must be \[3, 2, 544\]"):
        ops.packed_linear(torch.randn(3, 64), w8, 48)
    a8 = ops.pack_linear_weight(torch.randn(32, 64), torch.uint8, int8_activations=True)
    for fn in (ops.packed_linear, reference.packed_linear):
        args = (torch.randn(3, 96), a8, 32) if fn is ops.packed_linear else (torch.randn(3, 96), a8, None, 32)
        with pytest.raises(ValueError, match=r"packed_linear: weight \(4-bit blocks for int8 activations\) must be "
                                             r"\[2, 3, 5, 64\] \(in features a multiple of 32\), got \[2, 2, 5, 64\]"):
            fn(*args)
    with pytest.raises(TypeError, match="pack_linear_weight: int8_activations=True needs blocks .* got dtype "
                                        "torch.float32"):
        ops.pack_linear_weight(torch.randn(16, 64), torch.float32, int8_activations=True)
    with pytest.raises(ValueError, match="pack_linear_weight: blocks need in_features a multiple of 32, got 40"):
        ops.pack_linear_weight(torch.randn(16, 40), torch.uint8)
    with pytest.raises(TypeError, match="pack_linear_weight: blocks=True needs dtype torch.int8 \\(Q8_0\\) or "
                                        "torch.uint8 \\(Q4_1\\), got torch.float32"):
        ops.pack_linear_weight(torch.randn(16, 64), torch.float32, blocks=True)


@needs_kernel
def test_int8_panels_are_refused_in_one_line_where_they_do_not_fit():
    w = ops.pack_linear_weight(torch.randn(32, 20), torch.int8)
    with pytest.raises(ValueError, match=r"packed_linear: weight \(int8 panels\) must be \[2, 25, 16\], got \[2, 24, 16\]"):
        ops.packed_linear(torch.randn(3, 21), w, 32)
    with pytest.raises(TypeError, match="pack_linear_weight: dtype must be torch.float32, torch.bfloat16, torch.int8 or "
                                        "torch.uint8"):
        ops.pack_linear_weight(torch.randn(4, 4), torch.float16)


def _layer_case(int8_down_only: bool = False, kind=torch.int8, a8: bool = False):
    """decoder_layer's arguments for a random layer (H 32, 4 query / 2 kv heads of 8, I 64) with int8 panels (or
    4-bit blocks: kind torch.uint8; a8: for int8 activations)."""
    g = torch.Generator().manual_seed(0)
    H, Hq, Hkv, D, inter, S, C = 32, 4, 2, 8, 64, 2, 12
    r = (lambda *s: torch.randn(*s, generator=g) * 0.3)
    pack = (lambda w, i8=True: ops.pack_linear_weight(w, kind, int8_activations=a8) if i8 else
            ops.pack_linear_weight(w, torch.float32))
    qkv, o, gu = pack(r((Hq + 2 * Hkv) * D, H), not int8_down_only), pack(r(H, Hq * D), not int8_down_only), \
        pack(r(2 * inter, H), not int8_down_only)
    down = pack(r(H, inter))
    cos, sin = torch.cos(torch.arange(C * D).view(C, D) * 0.1), torch.sin(torch.arange(C * D).view(C, D) * 0.1)
    cache = (lambda: torch.zeros(S, Hkv, C, D))
    return (r(S, 3, H), 1 + r(H), qkv, None, None, None, o, 1 + r(H), gu, down, cache(), cache(),
            torch.tensor([4, 6]), None, cos, sin, Hq, 1e-6)


@needs_kernel
@pytest.mark.parametrize("kind,a8", [(torch.int8, False), (torch.uint8, False), (torch.uint8, True)])
def test_a_decoder_layer_over_quantized_weights_matches_the_reference(kind, a8):
    args = _layer_case(kind=kind, a8=a8)
    out = ops.decoder_layer(*args)
    ref_args = list(args)
    ref_args[10], ref_args[11] = args[10].clone().zero_(), args[11].clone().zero_()
    ref = reference.decoder_layer(*ref_args)
    # int8 activations: an input the kernel and the reference round a float32 ulp apart can land on either side of
    # a half step of its block's int8 grid (max |x| / 127 ~ 0.02 here), moving an output by about one weight times
    # that step; products are checked to 1e-5 on their own (above)
    tol = dict(rtol=2e-2, atol=5e-2) if a8 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(args[10], ref_args[10], **tol)  # the keys written into the cache
    with pytest.raises(TypeError, match="qkv, o, gate_up and down must all be int8 panels, all blocks of one kind or "
                                        "all in x's dtype"):
        ops.decoder_layer(*_layer_case(int8_down_only=True, kind=kind, a8=a8))
    if a8:  # blocks for float activations beside blocks for int8 ones
        mixed = list(args)
        mixed[9] = ops.pack_linear_weight(torch.randn(32, 64), torch.uint8)
        with pytest.raises(TypeError, match="must all be int8 panels, all blocks of one kind"):
            ops.decoder_layer(*mixed)


@pytest.fixture(scope="module", params=["q8", "q4"])
def q8_pair(request):
    target, draft = make_pair("llama", noise=0.3, vocab=64)
    return weights.quantize(target, request.param), draft


@needs_kernel
def test_a_quantized_targets_lean_forward_reads_int8_and_equals_transformers_forward(q8_pair):
    target, _ = q8_pair
    lean = LeanModel(target, "target")
    layer_dtype = {"q8": torch.int8, "q4": torch.uint8}[weights.kind(target)]
    head_width = {"q8": 16, "q4": 544}[weights.kind(target)]  # int8 rows, or 8-bit blocks (Q8_0)
    assert lean.fused and lean.panels[0].qkv.dtype == layer_dtype and lean.head_panels.dtype == torch.int8
    assert lean.head_panels.shape[2] == head_width
    ids = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = lean.cache(2, 32)
    lean.forward(cache, ids[:, :5], width=5, start=0)  # prefill: oneDNN over the quantized float values
    steps = [lean.forward(cache, ids[:, i: i + 1])[0][:, -1] for i in range(5, 9)]  # fused steps: int8 panels
    with torch.no_grad():
        ref = target(ids).logits[:, 5:]
    torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=1e-4, atol=1e-4)
    assert isinstance(cache, StaticCache)


def test_quantizing_twice_changes_nothing_and_keeps_the_float_fingerprint():
    target = make_target("llama", vocab=64)
    before = fingerprint(target)
    tied = make_target("llama", vocab=64)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    embedding = tied.model.embed_tokens.weight.clone()
    weights.quantize(tied, "q8")  # a tied output layer whose values change: the embedding stays float, as it was
    assert isinstance(tied.lm_head, PackedLinear) and type(tied.model.embed_tokens) is torch.nn.Embedding
    assert torch.equal(tied.model.embed_tokens.weight, embedding) and not tied.config.tie_word_embeddings
    q = weights.quantize(target, "q8")
    state, held = {k: v.clone() for k, v in q.state_dict().items()}, weights.panels(q)
    weights.quantize(q, "q8")
    assert all(torch.equal(v, q.state_dict()[k]) for k, v in state.items()) and weights.panels(q) is held
    assert weights.kind(q) == "q8" and fingerprint(q) == before
    assert weights.weight_bytes(q) < weights.weight_bytes(make_target("llama", vocab=64)) / 3.5
    with pytest.raises(ValueError, match="the target model's weights are already 'q8', not 'q4'"):
        weights.quantize(q, "q4")
    with pytest.raises(ValueError, match=r"weights must be one of 'q8', 'q4', 'q4a8' \(or None for the model's "
                                         r"float weights\), got 'q2'"):
        weights.quantize(q, "q2")
    q4 = weights.quantize(make_target("llama", vocab=64), "q4")
    held = weights.panels(q4)
    weights.quantize(q4, "q4")
    assert weights.panels(q4) is held and fingerprint(q4) == before
    assert weights.weight_bytes(q4) < weights.weight_bytes(q)
    with pytest.raises(ValueError, match="weights='q4' needs every linear layer's in features a multiple of 32 .* one "
                                         "of 48"):
        weights.quantize(make_target("llama", vocab=64, hidden=48), "q4")
    odd = make_target("llama", vocab=64, hidden=48)
    assert weights.quantize(odd, "q4", exact=True) is None and weights.kind(odd) is None
    gguf_like = make_target("llama", vocab=64)  # a tied output layer already in Q8_0 values (a GGUF file's): the
    with torch.no_grad():  # embedding reads the output layer's blocks
        emb = gguf_like.model.embed_tokens.weight
        emb.copy_(ops.dequantize_blocks(*ops.quantize_blocks(emb, 8)))
    gguf_like.lm_head.weight = emb
    weights.quantize(gguf_like, "q4a8")
    embedding = gguf_like.model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and embedding.packed is gguf_like.lm_head.packed
    assert torch.equal(embedding(torch.arange(64)), emb) and weights.kind(gguf_like) == "q4a8"
    gguf_like.to(torch.bfloat16)  # rows in the model's dtype, as the float table cast would give them
    ids = torch.tensor([[5, 0], [63, 5]])
    assert torch.equal(embedding(ids), emb[ids].to(torch.bfloat16))


@needs_kernel
def test_a_cast_keeps_the_blocks_packed_from_float32_and_the_modules_read_the_fused_ops_tensors():
    """The blocks are packed from the float32 values when quantizing (bfloat16 cannot hold every d q + m); a cast to
    bfloat16 leaves them as they are, and each projection's module holds a view of the tensor the fused op reads."""
    target = make_target("llama", vocab=64, seed=5)
    w = target.model.layers[0].self_attn.k_proj.weight.detach().clone()
    weights.quantize(target, "q4")
    made = weights.panels(target)
    target.to(torch.bfloat16)
    assert target.dtype == torch.bfloat16 and weights.panels(target) is made
    assert LeanModel(target, "target").panels[0].qkv is made[0][0][0]
    attn = target.model.layers[0].self_attn
    qkv, q_rows = made[0][0][0], attn.q_proj.out_features // ops.PANEL
    assert attn.k_proj.packed.data_ptr() == qkv[q_rows:].data_ptr() and attn.k_proj.packed.dtype == torch.uint8
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())  # no float matrix kept
    assert torch.equal(reference.unpack_linear_weight(attn.k_proj.packed, w.shape[0]),
                       ops.dequantize_blocks(*ops.quantize_blocks(w, 4)))


def test_a_quantized_model_refuses_to_save_a_checkpoint_without_its_weights(tmp_path):
    """A quantized model holds its matrices as non-persistent packings, which save_pretrained would leave out: it
    raises, naming what to do, and writes nothing."""
    target = weights.quantize(make_target("llama", vocab=64), "q4")
    with pytest.raises(ValueError, match=r"save_pretrained: the target model's weights are held only packed "
                                         r"\(weights='q4'\), which a checkpoint does not store"):
        target.save_pretrained(tmp_path / "q4")
    assert not (tmp_path / "q4").exists()
    float_model = make_target("llama", vocab=64)
    float_model.save_pretrained(tmp_path / "float")  # a float model saves as before
    assert (tmp_path / "float" / "config.json").exists()


def test_the_loaders_refuse_quantized_weights_they_cannot_give(tmp_path):
    with pytest.raises(ValueError, match=r"weights must be None or 'float' \(the float weights\), 'auto' or one of "
                                         r"'q8', 'q4', 'q4a8', got 'int4'"):
        load_models(tmp_path, weights="int4")
    with pytest.raises(ValueError, match="weights='q8' is for a target on one CPU .* device='cuda'"):
        load_models(tmp_path, weights="q8", device="cuda")


@needs_kernel
@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 3}), ("heuristic", {}), ("autoregressive", {})])
def test_greedy_decoding_of_a_quantized_target_equals_its_own_decoding(q8_pair, policy, kw):
    target, draft = q8_pair
    gen = SpeculativeGenerator(target, draft if policy != "autoregressive" else None, policy=policy, **kw)
    if policy == "autoregressive":
        ids = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(0))
        ref = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=None)
        assert torch.equal(gen.generate(ids, max_new_tokens=24, temperature=0).sequences, ref)
    else:
        greedy_against_target(gen, target, prompt_ids=64)  # asserts candidates were accepted and rejected


@pytest.fixture(scope="module")
def a8_pair():
    target, draft = make_pair("llama", noise=0.3, vocab=64)
    return weights.quantize(target, "q4a8"), draft


class _EngineLogits:
    """A model's logits as the lean engine computes them (a ``"q4a8"`` model's function is the fused op's, not
    transformers' forward): ``self(ids).logits`` ``[b, 1, V]`` at each row's last position, as ``exact_marginals``
    reads a model."""

    def __init__(self, model):
        self.lean, self.config = LeanModel(model, "target"), model.config

    def __call__(self, ids):
        cache = self.lean.cache(ids.shape[0], ids.shape[1] + 1)
        return type("Out", (), {"logits": self.lean.forward(cache, ids, keep=1, start=0)[0]})


@needs_kernel
@torch.inference_mode()
def test_a_q4a8_target_runs_every_forward_fused_and_a_prefill_is_bitwise_its_steps(a8_pair):
    """Int8 activations are a function only the fused op and the packed modules compute: a prefill of 2 x 20 tokens
    (past FUSED_MAX_ROWS) runs the fused op too and gives bitwise the logits of one-token steps; transformers'
    forward of the same model (its projections engine.packed.PackedLinear) is near; the lean model refuses to run
    unfused."""
    target, _ = a8_pair
    lean = LeanModel(target, "target")
    assert lean.fused_only and lean.panels[0].qkv.shape[-2:] == (5, 64) and lean.head_panels.dim() == 4
    assert lean.lm_head is lean.head_panels and all(  # no float copy: the model's packed tensors, no other
        a is b for layer, panel in zip(lean.layers, lean.panels)
        for a, b in zip((layer.qkv, layer.o, layer.gate_up, layer.down), panel))
    ids = torch.randint(2, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = lean.cache(2, 24)
    whole = lean.forward(cache, ids, keep=20, start=0)[0]
    cache = lean.cache(2, 24)
    steps = torch.cat([lean.forward(cache, ids[:, i: i + 1], start=i)[0] for i in range(20)], dim=1)
    assert torch.equal(whole, steps)
    with torch.no_grad():
        hf = target(ids).logits
    torch.testing.assert_close(whole, hf, rtol=2e-2, atol=2e-2 * float(hf.abs().max()))
    with pytest.raises(ValueError, match="weights are 'q4a8' \\(int8 activations\\), which only the fused CPU op "
                                         "computes"):
        LeanModel(target, "target", fused=False)


@needs_kernel
@pytest.mark.parametrize("policy,kw", [("fixed", {"k": 6}), ("heuristic", {})])
def test_greedy_decoding_of_a_q4a8_target_equals_its_own_plain_decoding(a8_pair, policy, kw):
    """3 left-padded rows: K = 6 verifies 21 tokens a round (past FUSED_MAX_ROWS, fused all the same); the tokens
    equal the engine's plain decoding of the same target token for token."""
    target, draft = a8_pair
    ids = torch.randint(2, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2], mask[2, :4] = 0, 0
    run = dict(attention_mask=mask, max_new_tokens=32, temperature=0, pad_token_id=1)
    plain = SpeculativeGenerator(target, None, policy="autoregressive").generate(ids, **run)
    out = SpeculativeGenerator(target, draft, policy=policy, **kw).generate(ids, **run)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.stats.accepted > 0 and out.stats.discarded > 0


N_ROWS, N_POS = 3000, 3


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q8", "q4", "q4a8"])
def test_sampling_follows_the_quantized_target_and_the_test_tells_another_target_apart(kind):
    target, draft = make_pair("llama", noise=0.5, vocab=12, ctx=48)
    float_target = make_target("llama", vocab=12, ctx=48, seed=3)  # the negative control's other model
    weights.quantize(target, kind)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    source = _EngineLogits(target) if kind in weights.INT8_ACTIVATIONS else target  # the function decoding samples
    with torch.inference_mode():
        marginals = exact_marginals(source, prompt, SamplingConfig(1.0), N_POS)
    out = SpeculativeGenerator(target, draft, policy="fixed", k=3).generate(
        prompt.expand(N_ROWS, -1), max_new_tokens=N_POS, temperature=1.0, seed=11)
    toks = torch.tensor(out.new_tokens)
    for i in range(N_POS):
        assert_follows(toks[:, i], marginals[i], f"{kind} target, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0
    other = exact_marginals(float_target, prompt, SamplingConfig(1.0), N_POS)
    caught = [chi_square(toks[:, i], other[i]) for i in range(N_POS)]
    assert any(stat > thr for stat, _, thr in caught), "the chi-square test cannot tell another target's samples"


@needs_kernel
@pytest.mark.parametrize("kind", ["q8", "q4", "q4a8"])
def test_the_bundled_pair_loads_quantized_and_its_greedy_text_equals_its_own_plain_decoding(kind):
    """load_pair(weights=kind) quantizes both models; the heads still check against the draft (the float
    fingerprint kept); SpecDec++ with them gives the quantized target's own greedy tokens."""
    from specdec_ext.zoo import load_pair

    pair = load_pair(target_dtype=torch.float32, draft_dtype=torch.float32, weights=kind)
    assert weights.kind(pair.target) == weights.kind(pair.draft) == kind
    ids = torch.tensor([pair.tokenizer.encode("def fibonacci(n):\n    ")])
    plain = SpeculativeGenerator(pair.target, None, policy="autoregressive").generate(ids, max_new_tokens=40,
                                                                                      temperature=0)
    out = SpeculativeGenerator(pair.target, pair.draft, policy="specdecpp", head=pair.head, threshold=0.5).generate(
        ids, max_new_tokens=40, temperature=0)
    assert out.new_tokens == plain.new_tokens and out.stats.accepted > 0


@needs_kernel
def test_a_quantized_feature_draft_over_a_quantized_target_keeps_greedy_decoding_exact():
    """A feature draft (EAGLE) quantizes its decoder (fc stays float) and still reads the quantized target's
    features: greedy output equals the target's own."""
    from specdec_ext.training import feature_train
    from support import perturbed

    target = make_target("llama", vocab=64)
    ids = sorted(set(range(20)) | set(range(20, 64, 3)))
    draft = feature_train.new_feature_draft(target, torch.as_tensor(ids), 0)
    draft = perturbed(draft, feature_train.trainable(draft), 0.3, 1)
    weights.quantize(target, "q8")
    weights.quantize(draft, "q8", "draft")
    assert weights.kind(draft) == weights.kind(draft.model) == "q8" and draft.fc.weight.dtype == torch.float32
    greedy_against_target(SpeculativeGenerator(target, draft, policy="fixed", k=3), target, prompt_ids=64)
