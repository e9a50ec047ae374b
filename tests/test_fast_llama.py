"""The lean Llama draft runner computes what transformers computes, through holes, rollback and row selection."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_ext.engine.fast_llama import FastLlamaRunner, supports
from specdec_ext.engine.runner import CausalLMRunner
from models import make_target


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fast_runner_matches_transformers(kv_heads):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).eval()
    a, b = CausalLMRunner(m, "hf"), FastLlamaRunner(m)
    B = 3
    a.start(B)
    b.start(B, capacity=8)  # small capacity: exercises growth
    ids = torch.randint(0, 300, (B, 12))
    valid = torch.ones(B, 12, dtype=torch.bool)
    valid[1, :5] = False
    la, ha = a.forward(ids, valid, keep=4, hidden=True)
    lb, hb = b.forward(ids, valid, keep=4, hidden=True)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randint(0, 300, (B, 3), generator=g)
        v = torch.ones(B, 3, dtype=torch.bool)
        v[step % B, 0] = False
        torch.testing.assert_close(b.forward(x, v, keep=3)[0], a.forward(x, v, keep=3)[0], rtol=1e-5, atol=1e-5)
        r = torch.randint(0, 3, (B,), generator=g)
        a.rollback(r)
        b.rollback(r)
        assert torch.equal(a.next_pos, b.next_pos)
    keep = torch.tensor([2, 0])
    a.select_rows(keep)
    b.select_rows(keep)
    x = torch.randint(0, 300, (2, 1))
    torch.testing.assert_close(b.forward(x)[0], a.forward(x)[0], rtol=1e-5, atol=1e-5)


def test_supports():
    assert supports(make_target("llama"))
    assert not supports(make_target("gpt2"))
    with pytest.raises(ValueError, match="not a supported Llama"):
        FastLlamaRunner(make_target("gpt2"))
