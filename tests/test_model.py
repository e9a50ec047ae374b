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
