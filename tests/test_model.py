"""The lean model over the static KV cache computes what transformers computes: prompts of every length in their
slots, steps, per-row roll-back, forwards of some slots (a range or an index), moves of slots, narrow widths."""

from __future__ import annotations

import pytest
import torch

from specdec_ext.engine.cache import StaticCache, columns_for
from specdec_ext.engine.model import LeanModel, packed_linear_available, supports
from models import make_target

PACKED = packed_linear_available(torch.device("cpu"), torch.float32)
needs_packed = pytest.mark.skipif(not PACKED, reason="this torch has no oneDNN (mkldnn) packed linear")


@torch.inference_mode(False)
def lean_model(arch: str, kv_heads: int):
    """A tiny Llama, Qwen2 (biases on q, k, v) or Qwen3 (per-head q / k norms) with random weights (norms and biases
    too, so that a forward that skipped one would differ)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, max_position_embeddings=512)
    if arch == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    else:
        m = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    return m.eval()


def reference_logits(model, seq: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(seq), V]`` of one sequence, float32."""
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_packed), False])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_the_static_forward_computes_what_transformers_computes(arch, kv_heads, packed):
    """Three prompts of different lengths prefilled into their slots, then steps of 3 tokens with per-row roll-back:
    each row's logits and hidden states equal transformers' over that row's own sequence."""
    m = lean_model(arch, kv_heads)
    assert supports(m)
    lean = LeanModel(m, packed=packed)
    assert lean.packed == packed
    cache = lean.cache(4, 64)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 4, 12)]
    for s, seq in enumerate(seqs):  # each prompt into its own slot: a slice of one row
        logits, hidden = lean.forward(cache, torch.tensor([seq]), rows=slice(s, s + 1), keep=len(seq))
        torch.testing.assert_close(logits[0], reference_logits(m, seq), rtol=1e-4, atol=1e-4)
        want_h = m(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(hidden[0], want_h, rtol=1e-4, atol=1e-4)
    assert cache.lengths.tolist() == [9, 4, 12, 0]
    for step in range(5):
        x = torch.randint(0, 300, (3, 3), generator=g)
        width = max(len(s) for s in seqs) + 3 if step % 2 else None  # a narrow width, or the whole cache
        logits, _ = lean.forward(cache, x, keep=3, width=width)
        for b in range(3):
            seqs[b] += x[b].tolist()
            torch.testing.assert_close(logits[b], reference_logits(m, seqs[b])[-3:], rtol=1e-4, atol=1e-4)
        drop = torch.randint(0, 4, (3,), generator=g)
        cache.rollback(drop, 3)
        for b in range(3):
            seqs[b] = seqs[b][: len(seqs[b]) - int(drop[b])]
        assert cache.lengths[:3].tolist() == [len(s) for s in seqs]


@torch.inference_mode()
def test_forwards_of_some_slots_and_moves_of_slots():
    """A forward over an index of slots computes their rows of a full forward and leaves the other slots as they
    were; a slot moved into another's place goes on as its own sequence; a cache taken into another keeps its rows."""
    m = lean_model("llama", 2)
    lean = LeanModel(m, packed=False)
    cache = lean.cache(3, 40)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 300, (6,), generator=g).tolist() for _ in range(3)]
    lean.forward(cache, torch.tensor(seqs))
    rows = torch.tensor([2, 0])
    x = torch.randint(0, 300, (2, 2), generator=g)
    logits, _ = lean.forward(cache, x, rows=rows, keep=2)
    for i, b in enumerate((2, 0)):
        seqs[b] += x[i].tolist()
        torch.testing.assert_close(logits[i], reference_logits(m, seqs[b])[-2:], rtol=1e-4, atol=1e-4)
    assert cache.lengths.tolist() == [8, 6, 8]
    cache.move([2], [1], [8])  # slot 1 finished: the last live row takes its place
    seqs[1] = seqs[2]
    y = torch.randint(0, 300, (2, 1), generator=g)
    logits, _ = lean.forward(cache, y, width=12)
    for b in range(2):
        seqs[b] += y[b].tolist()
        torch.testing.assert_close(logits[b, 0], reference_logits(m, seqs[b])[-1], rtol=1e-4, atol=1e-4)
    other = lean.cache(2, 40)
    other.take([0], cache, [1], [9])
    wide = other.resized(3, 64, keep=1)  # more slots and columns, the first slot kept
    assert wide.max_len == 64 and wide.lengths.tolist() == [9, 0, 0]
    z = torch.randint(0, 300, (1, 1), generator=g)
    torch.testing.assert_close(lean.forward(wide, z)[0][0, 0], reference_logits(m, seqs[1] + z[0].tolist())[-1],
                               rtol=1e-4, atol=1e-4)


def test_supports_and_bad_sizes():
    assert supports(make_target("llama"))
    assert not supports(make_target("gpt2"))
    assert not supports(make_target("mistral"))  # sliding-window layers: transformers' runner
    assert not supports(make_target("qwen2"))  # use_sliding_window: likewise
    with pytest.raises(ValueError, match="not a Llama, Qwen2 or Qwen3 model"):
        LeanModel(make_target("gpt2"))
    lean = LeanModel(make_target("llama", ctx=300))
    with pytest.raises(ValueError, match="at most the draft model's 300 positions"):
        lean.cache(1, 512)
    with pytest.raises(ValueError, match="slots >= 1"):
        StaticCache(2, 0, 2, 8, 16, torch.float32, torch.device("cpu"))
    assert columns_for(1, 4096) == 256 and columns_for(257, 4096) == 512 and columns_for(300, 300) == 300
    with pytest.raises(ValueError, match="needs 301 cache columns"):
        columns_for(301, 300)


def _logits(model, ids, packed=None, fused=None):
    """The lean model's logits over ``ids`` ``[B, T]`` (a fresh cache)."""
    lean = LeanModel(model, packed=packed, fused=fused)
    return lean.forward(lean.cache(ids.shape[0], 64), ids, keep=ids.shape[1])[0]


@needs_packed
def test_packed_weights_are_kept_per_model_and_follow_a_change_of_the_weights():
    """The packed weights are prepared once per model (a lean model is made per backend) and prepared again when a
    weight changes in place or is replaced, so the forward always computes the model's current function."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))

    def hf():
        with torch.no_grad():
            return m(ids).logits.float()

    first, second = LeanModel(m), LeanModel(m)
    assert first.packed and second.layers is first.layers and second.lm_head is first.lm_head  # reused, not repacked
    with torch.inference_mode():
        torch.testing.assert_close(_logits(m, ids), hf(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # in place: the tensor's version moves
    assert LeanModel(m).layers is not first.layers
    with torch.inference_mode():
        torch.testing.assert_close(_logits(m, ids), hf(), rtol=1e-5, atol=1e-5)
    m.lm_head.weight = torch.nn.Parameter(torch.randn(64, 32))  # replaced
    with torch.inference_mode():
        torch.testing.assert_close(_logits(m, ids), hf(), rtol=1e-5, atol=1e-5)
    assert not LeanModel(m, packed=False).packed


def test_packed_linear_needs_a_cpu_model_of_float32_or_bfloat16():
    m = make_target("llama").to(torch.float16)
    assert not packed_linear_available(torch.device("cpu"), torch.float16)
    assert not LeanModel(m).packed  # None: packed where available, F.linear elsewhere
    with pytest.raises(ValueError, match="packed=True needs a CPU float32/bfloat16 model"):
        LeanModel(m, packed=True)


@torch.inference_mode()
def test_a_bfloat16_model_packs_only_where_onednn_has_a_bf16_path():
    """On a CPU without oneDNN's bf16 path (AVX2 only, e.g. AMD Zen 3), packing a bf16 weight raises inside oneDNN:
    the default lean model then uses F.linear, and its torch-op path (the fused layer's float32 arithmetic rounds
    otherwise) computes what transformers' forward computes."""
    with torch.inference_mode(False):
        m = make_target("llama").to(torch.bfloat16)
    assert LeanModel(m).packed == (PACKED and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    ids = torch.randint(2, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    got, want = _logits(m, ids, fused=False), m(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)  # bf16 rounding in different operation orders
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_target_runs_as_the_lean_model_where_it_is_supported():
    """SpeculativeGenerator(fast_target=True), the default, runs a Llama target on one device as the lean model
    over a static cache, other architectures and fast_target=False through transformers' forward; the profile keys
    differ."""
    from specdec_ext import SpeculativeGenerator
    from specdec_ext.engine.backends import HFBackend, LeanBackend, backend_for
    from specdec_ext.engine.profile import profile_key

    llama, gpt2 = make_target("llama"), make_target("gpt2")
    assert SpeculativeGenerator(llama, policy="autoregressive").fast_target
    assert not SpeculativeGenerator(llama, policy="autoregressive", fast_target=False).fast_target
    assert not SpeculativeGenerator(gpt2, policy="autoregressive").fast_target
    assert type(backend_for(llama, "target")) is LeanBackend
    assert type(backend_for(llama, "target", lean=False)) is HFBackend
    assert type(backend_for(gpt2, "target")) is HFBackend
    draft = make_target("llama", seed=1)
    assert profile_key(llama, draft, True, 8, fast_target=True) != profile_key(llama, draft, True, 8, fast_target=False)


@pytest.mark.parametrize("arch,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 2)])
def test_lean_target_greedy_decoding_equals_transformers_generate(arch, kv_heads):
    """fp32: plain decoding and speculative decoding with the target as the lean model give exactly the tokens of
    transformers' own greedy generate() (batch of 3 with left padding), and transformers' forward agrees."""
    from specdec_ext import SpeculativeGenerator
    from models import noisy_copy

    target = lean_model(arch, kv_heads)
    assert SpeculativeGenerator(target, policy="autoregressive").fast_target  # the lean model serves it
    target.config.pad_token_id, target.config.eos_token_id = 1, None
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharper outputs: greedy margins well above float32 rounding
    draft = noisy_copy(target, 0.3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 1, 0  # left padding
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1,
                          eos_token_id=None)[:, ids.shape[1]:].tolist()
    for kw in ({"policy": "autoregressive"}, {"draft": draft, "policy": "fixed", "k": 3},
               {"draft": draft, "policy": "fixed", "k": 3, "fast_target": False}):
        out = SpeculativeGenerator(target, **kw).generate(ids, attention_mask=mask, max_new_tokens=20, temperature=0)
        assert out.new_tokens == ref, kw


@torch.inference_mode()
def test_rows_of_one_length_take_the_slice_path_to_the_same_result():
    """``start`` (every row's length, known on the host) gives the logits, hidden states and cache of the per-row
    path; past the cache's end it falls back to the per-row path (the scratch column)."""
    m = lean_model("qwen2", 2)
    lean = LeanModel(m, packed=False)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (3, 6), generator=g)
    caches = [lean.cache(3, 16), lean.cache(3, 16)]
    for step in (ids, torch.randint(0, 300, (3, 2), generator=g), torch.randint(0, 300, (3, 9), generator=g)):
        length = int(caches[0].lengths[0])
        got = [lean.forward(c, step, keep=step.shape[1], width=length + step.shape[1], start=s)
               for c, s in zip(caches, (None, length))]
        torch.testing.assert_close(got[0][0], got[1][0])
        torch.testing.assert_close(got[0][1], got[1][1])
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            torch.testing.assert_close(a[:, :, :16], b[:, :, :16])


def test_bucketed_rows_are_few_and_cover_every_count():
    from specdec_ext.engine.model import bucketed_rows

    sizes = [bucketed_rows(m) for m in range(1, 4097)]
    assert all(m <= b <= max(m, 1.125 * m) for m, b in zip(range(1, 4097), sizes))
    assert sizes == sorted(sizes) and sizes[:16] == list(range(1, 17))
    assert len(set(sizes)) == 16 + 8 * 8  # up to 16 exact, then eight per octave from 16 to 4096


@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_packed), False])
@torch.inference_mode()
def test_prefills_multiply_bucketed_rows_and_compute_the_same(packed, monkeypatch):
    """A prefill of more than BUCKET_ABOVE tokens per row runs its projections over a bucketed token count (the
    matmul shapes oneDNN compiles stay few); logits and cache equal the unpadded forward's; steps are not padded."""
    import specdec_ext.engine.model as model_module

    m = lean_model("qwen2", 2)
    lean = LeanModel(m, packed=packed)
    seen = []
    linear = lean._linear
    lean._linear = lambda x, w: seen.append(x.reshape(-1, x.shape[-1]).shape[0]) or linear(x, w)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 300, (3, 23), generator=g)  # 69 tokens: 72 rows through each projection
    cache = lean.cache(3, 64)
    got, hidden = lean.forward(cache, x, keep=23)
    assert set(seen[:-1]) == {72} and seen[-1] == 69  # the LM head reads the kept positions alone
    seen.clear()
    n = model_module.FUSED_MAX_ROWS[torch.float32] // 3 + 1  # a step past the fused layer's tokens: rows as they are
    lean.forward(cache, x[:, :n], keep=n)
    assert set(seen) == {3 * n}
    monkeypatch.setattr(model_module, "BUCKET_ABOVE", 10 ** 9)
    plain = lean.cache(3, 64)
    want, want_hidden = lean.forward(plain, x, keep=23)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache.k + cache.v, plain.k + plain.v):
        torch.testing.assert_close(a[:, :, :23], b[:, :, :23], rtol=1e-5, atol=1e-5)
