"""engine/packed.py: the modules a quantized model holds in place of its float matrices. ops.packed_rows gives back any
packing's rows as its unpacking does, PackedLinear multiplies as ops.packed_linear, and a quantized model's own
(transformers') forward through them computes the lean model's function."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import ops, reference
from specdec_ext.engine import weights
from specdec_ext.engine.model import LeanModel
from specdec_ext.engine.packed import PackedLinear
from models import make_target

needs_kernel = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="needs the compiled extension")

LAYOUTS = {  # name -> pack_linear_weight arguments
    "float32": dict(dtype=torch.float32), "bfloat16": dict(dtype=torch.bfloat16), "int8 rows": dict(dtype=torch.int8),
    "Q4_1": dict(dtype=torch.uint8), "Q8_0": dict(dtype=torch.int8, blocks=True),
    "Q4_1 a8": dict(dtype=torch.uint8, int8_activations=True),
    "Q8_0 a8": dict(dtype=torch.int8, blocks=True, int8_activations=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_are_the_unpacked_weights_rows_in_every_layout(layout, dtype):
    """ops.packed_rows (the kernel: each id's panel unpacked alone) and its reference give bitwise the rows of the
    whole unpacking, in ``dtype``, for ids in a full panel and in the half-padding last one, repeated ids included."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))  # 40 rows: the last panel half padding
    packed = ops.pack_linear_weight(w, **LAYOUTS[layout])
    whole = reference.unpack_linear_weight(packed, 40).float().to(dtype)
    ids = torch.tensor([[39, 0, 17], [16, 16, 5]])
    for fn in (ops.packed_rows, reference.packed_rows):
        got = fn(packed, ids, 40, dtype)
        assert got.dtype == dtype and got.shape == (2, 3, 64) and torch.equal(got, whole[ids])
        assert fn(packed, ids[:, :0], 40, dtype).shape == (2, 0, 64)
        with pytest.raises(ValueError, match=r"packed_rows: ids must be in \[0, 40\) \(the weight's rows\), got 40"):
            fn(packed, torch.tensor([0, 40]), 40)
        with pytest.raises(ValueError, match=r"ids must be in \[0, 40\) \(the weight's rows\), got -1"):
            fn(packed, torch.tensor([-1]), 40)
        with pytest.raises(TypeError, match="packed_rows: ids must be int64, got "):
            fn(packed, ids.int(), 40)
        with pytest.raises(TypeError, match="packed_rows: dtype must be float32 or bfloat16, got "):
            fn(packed, ids, 40, torch.float16)


@needs_kernel
def test_packed_rows_kernel_opcheck_and_errors():
    packed = ops.pack_linear_weight(torch.randn(40, 64), torch.int8, blocks=True, int8_activations=True)
    torch.library.opcheck(torch.ops.specdec_ext.packed_rows.default, (packed, torch.tensor([3, 39]), 40,
                                                                       torch.bfloat16))
    with pytest.raises(ValueError, match=r"packed_rows: weight \(.*\) must be \[4, "):
        ops.packed_rows(packed, torch.tensor([1]), 60)
    with pytest.raises(TypeError, match="packed_rows: weight must be a quantized packing"):
        torch.ops.specdec_ext.packed_rows(torch.zeros(3, 64, 16), torch.tensor([1]), 40, torch.float32)


@needs_kernel
@pytest.mark.parametrize("layout", ["int8 rows", "Q4_1", "Q4_1 a8"])
def test_a_packed_linear_multiplies_as_the_packed_op_and_keeps_its_bytes_through_a_cast(layout):
    gen = torch.Generator().manual_seed(2)
    w, bias, x = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), torch.randn(3, 5, 64, generator=gen)
    packed = ops.pack_linear_weight(w, **LAYOUTS[layout])
    module = PackedLinear(packed, 64, 48, bias)
    assert torch.equal(module(x), ops.packed_linear(x, packed, 48, bias))
    torch.testing.assert_close(module(x), reference.packed_linear(x, packed, bias, 48), rtol=1e-5, atol=1e-4)
    module.to(torch.bfloat16)
    assert module.packed is packed and module.bias.dtype == torch.bfloat16 and module(x.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(module.rows(torch.tensor([3])), reference.unpack_linear_weight(packed, 48)[3:4].float())


@needs_kernel
@pytest.mark.parametrize("kind", ["q8", "q4", "q4a8"])
def test_a_quantized_models_own_forward_computes_the_lean_models_function(kind):
    """transformers' forward of a quantized model runs its PackedLinear modules: the logits of the lean model's
    fused forward (another order of the same operations, float32; with int8 activations an input near a rounding
    boundary of its block may round the other way, so within 2% of the largest logit)."""
    target = weights.quantize(make_target("llama", vocab=64, seed=3), kind)
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())
    ids = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    lean = LeanModel(target, "target")
    fused = lean.forward(lean.cache(2, 12), ids, keep=9, start=0)[0]
    with torch.no_grad():
        own = target(ids).logits
    tol = 2e-2 if kind == "q4a8" else 1e-4
    torch.testing.assert_close(own, fused, rtol=tol, atol=tol * float(own.abs().max()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacking_gives_back_the_weights_a_packing_stands_for(layout, dtype, monkeypatch):
    """ops.unpack_linear_weight against the reference unpacking: bitwise (the values computed in float32, exactly,
    then rounded to dtype), 40 rows (two full panels, where the CPU has AVX-512 its kernel's, and a panel's padding
    dropped), as a transposed view of a [K, N] tensor; the baseline kernel (ATEN_CPU_CAPABILITY=avx2) the same bits."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    packed = ops.pack_linear_weight(w, **LAYOUTS[layout])
    got = ops.unpack_linear_weight(packed, 40, dtype)
    assert got.shape == (40, 96) and got.dtype == dtype
    assert torch.equal(got, reference.unpack_linear_weight(packed, 40).to(dtype))
    out = torch.empty(96, 40, dtype=dtype)  # into a buffer: the same values, in it
    assert torch.equal(ops.unpack_linear_weight(packed, 40, dtype, out=out), got) and torch.equal(out.t(), got)
    if packed.dtype in (torch.int8, torch.uint8) and ops.HAS_EXTENSION:
        assert got.t().is_contiguous()
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert torch.equal(ops.unpack_linear_weight(packed, 40, dtype).contiguous().view(torch.uint8),
                           got.contiguous().view(torch.uint8))


@needs_kernel
def test_unpacking_refuses_what_is_not_a_packing_with_one_line_errors():
    packed = ops.pack_linear_weight(torch.randn(32, 64), torch.uint8)
    with pytest.raises(TypeError, match="unpack_linear_weight: dtype must be float32 or bfloat16, got torch.float16"):
        ops.unpack_linear_weight(packed, 32, torch.float16)
    floats = ops.pack_linear_weight(torch.randn(32, 64), torch.float32)
    with pytest.raises(ValueError, match=r"unpack_linear_weight: weight must be \[3, 64, 16\]"):
        ops.unpack_linear_weight(floats, 40)  # float panels checked too
    with pytest.raises(TypeError, match="unpack_linear_weight: dtype must be float32 or bfloat16"):
        ops.unpack_linear_weight(floats, 32, torch.int8)
    with pytest.raises(ValueError, match=r"unpack_linear_weight: out must be \[64, 32\] \(W\^T\), contiguous, got "
                                         r"\[32, 64\]"):
        ops.unpack_linear_weight(packed, 32, out=torch.empty(32, 64))
    with pytest.raises(ValueError, match=r"unpack_linear_weight: weight \(4-bit blocks\) must be \[3, 2, 320\]"):
        ops.unpack_linear_weight(packed, 40, torch.float32)
    with pytest.raises(TypeError, match="unpack_linear_weight: weight must be a quantized packing"):
        torch.ops.specdec_ext.unpack_linear_weight(torch.zeros(2, 64, 16, dtype=torch.int32), 32, torch.empty(64, 32))
    with pytest.raises(ValueError, match=r"unpack_linear_weight: out must be \[64, 32\] \(W\^T\), contiguous"):
        torch.ops.specdec_ext.unpack_linear_weight(packed, 32, torch.empty(32, 64).t())  # the kernel's own check
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    assert ops.unpack_linear_weight(packed, 32, torch.bfloat16, out=out).data_ptr() == out.data_ptr()
    fake = torch.library.opcheck(torch.ops.specdec_ext.unpack_linear_weight, (packed, 32, out))
    assert all(v == "SUCCESS" for v in fake.values())


@needs_kernel
def test_a_quantized_prefill_over_unpacked_weights_is_near_its_fused_forward():
    """A forward of more than UNPACK_ABOVE tokens multiplies each layer's unpacked weights (a library matmul);
    fewer run the fused op: the same function in another order of operations (float32)."""
    from specdec_ext.engine import model as lean_model

    target = weights.quantize(make_target("llama", vocab=64, seed=6), "q4")
    lean = LeanModel(target, "target")
    n = lean_model.UNPACK_ABOVE + 6
    ids = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        unpacked = lean.forward(lean.cache(1, n + 2), ids, keep=n, start=0)[0]
        fused = lean._fused_forward(lean.cache(1, n + 2), ids, None, n)[0]
    assert not torch.equal(unpacked, fused)  # the two paths did run
    torch.testing.assert_close(unpacked, fused, rtol=1e-4, atol=1e-4 * float(fused.abs().max()))


@needs_kernel
def test_an_embedding_read_from_the_output_layers_blocks_replays_in_recorded_steps():
    """A GGUF-like target (its tied output layer already Q8_0 values) reads its embedding from those blocks, reading
    nothing on the host inside a step: steps recorded as graphs replay it and emit the eager steps' greedy tokens,
    which equal the target's own plain decoding."""
    from models import make_pair
    from support import graphed, make_gen

    from specdec_ext import SpeculativeGenerator
    from specdec_ext.engine.packed import PackedEmbedding

    target, draft = make_pair("llama", vocab=64)
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        emb.copy_(ops.dequantize_blocks(*ops.quantize_blocks(emb, 8)))
    target.lm_head.weight = emb
    weights.quantize(target, "q4")
    assert isinstance(target.model.embed_tokens, PackedEmbedding)
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(8))
    gen = graphed(make_gen(target, draft, "fixed", {"k": 3}))
    eager = make_gen(target, draft, "fixed", {"k": 3}).generate(ids, max_new_tokens=12, temperature=0).new_tokens
    assert gen.generate(ids, max_new_tokens=12, temperature=0).new_tokens == eager
    assert gen.steps.graphs.captures > 0
    plain = SpeculativeGenerator(target, None, policy="autoregressive")
    assert eager == plain.generate(ids, max_new_tokens=12, temperature=0).new_tokens


def test_a_cast_keeps_the_rotary_frequencies_in_float32():
    """engine.models.to_dtype: bfloat16 weights, the RoPE inverse frequencies as they were (Module.to would round them
    to bfloat16, moving the positions' angles), so the lean model's cos / sin tables are the float32 model's rounded
    once."""
    from specdec_ext.engine.models import to_dtype

    target = make_target("llama", vocab=64, seed=9)
    rope = target.model.rotary_emb.inv_freq.clone()
    tables = LeanModel(target, "target").cos
    to_dtype(target, torch.bfloat16)
    assert target.dtype == torch.bfloat16 and target.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert target.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(target.model.rotary_emb.inv_freq, rope)
    assert torch.equal(LeanModel(target, "target").cos, tables.to(torch.bfloat16))
    assert not torch.equal(rope.to(torch.bfloat16).float(), rope)  # what Module.to would have kept


@needs_kernel
def test_a_quantized_model_runs_unfused_over_unpacked_weights():
    """attention="sdpa" (no fused op): every forward, a step too, multiplies the unpacked weights, and the LM head
    the packed one; the logits of the fused forward within float32 rounding."""
    target = weights.quantize(make_target("llama", vocab=64, seed=10), "q8")
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(11))
    fused, sdpa = LeanModel(target, "target"), LeanModel(target, "target", attention="sdpa")
    assert fused.fused and not sdpa.fused and sdpa.fused_only
    with torch.no_grad():
        want = fused.forward(fused.cache(2, 8), ids, keep=5, start=0)[0]
        got = sdpa.forward(sdpa.cache(2, 8), ids, keep=5, start=0)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
