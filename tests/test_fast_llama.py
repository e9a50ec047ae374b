"""The lean Llama draft runner computes what transformers computes, through holes, rollback and row selection."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_ext.engine.fast_llama import FastLlamaRunner, packed_linear_available, supports
from specdec_ext.engine.runner import CausalLMRunner
from models import make_target


PACKED = packed_linear_available(torch.device("cpu"), torch.float32)
needs_packed = pytest.mark.skipif(not PACKED, reason="this torch has no oneDNN (mkldnn) packed linear")


def lean_model(arch: str, kv_heads: int):
    """A tiny Llama, Qwen2 (biases on q, k, v) or Qwen3 (per-head q / k norms) with random weights (norms and biases
    too, so that a runner that skipped one would differ)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

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


@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_packed), False])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_runner_matches_transformers(arch, kv_heads, packed):
    m = lean_model(arch, kv_heads)
    assert supports(m)
    a, b = CausalLMRunner(m, "hf"), FastLlamaRunner(m, packed=packed)
    assert b.packed == packed
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
    for keep in ([0, 2], [1]):  # rows leave in place (row 2 takes row 1's place), then a reordering copy
        a.select_rows(torch.tensor(keep))
        b.select_rows(torch.tensor(keep))
        x = torch.randint(0, 300, (len(keep), 1))
        torch.testing.assert_close(b.forward(x)[0], a.forward(x)[0], rtol=1e-5, atol=1e-5)


def test_supports():
    assert supports(make_target("llama"))
    assert not supports(make_target("gpt2"))
    assert not supports(make_target("mistral"))  # sliding-window layers: transformers' runner
    assert not supports(make_target("qwen2"))  # use_sliding_window: likewise
    with pytest.raises(ValueError, match="not a supported Llama"):
        FastLlamaRunner(make_target("gpt2"))


def test_forward_of_some_rows_equals_their_rows_of_a_full_forward():
    """Rows that stopped drafting sit out: a forward over rows [0, 2] of 3 computes what a forward of all three
    computes for those rows, leaves a hole for row 1, and row 1 goes on as if that column never existed."""
    from specdec_ext.engine.fast_llama import FastLlamaRunner
    from models import make_target

    model = make_target("llama", vocab=48)
    ids = torch.randint(2, 48, (3, 7), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5], [6], [7]])
    full, part = FastLlamaRunner(model), FastLlamaRunner(model)
    for r in (full, part):
        r.start(3)
        r.forward(ids)
    want, want_h = full.forward(nxt, keep=1, hidden=True)
    rows = torch.tensor([0, 2])
    got, got_h = part.forward(nxt[rows], keep=1, hidden=True, rows=rows)
    torch.testing.assert_close(got, want[rows])
    torch.testing.assert_close(got_h, want_h[rows])
    assert part.mask[:, -1].tolist() == [True, False, True] and part.next_pos.tolist() == [8, 7, 8]
    alone = FastLlamaRunner(model)
    alone.start(1)
    alone.forward(ids[1:2])
    torch.testing.assert_close(part.forward(nxt[1:2] + 1, rows=torch.tensor([1]))[0],
                               alone.forward(nxt[1:2] + 1)[0])
    # rollback removes a row's own last valid positions, not the column it sat out
    part.rollback(torch.tensor([1, 1, 1]))
    assert part.next_pos.tolist() == [7, 7, 7] and part.length == 7  # both new columns are holes in every row


def test_rows_that_stop_are_not_computed():
    """With per-row stops, later draft forwards compute only the rows still drafting."""
    from specdec_ext import SpeculativeGenerator
    from specdec_ext.engine import fast_llama
    from models import make_pair
    from support import make_gen

    target, draft = make_pair("llama", noise=0.3)
    gen = make_gen(target, draft, "specdecpp", {"threshold": 0.5, "_head": "proposal"})
    sizes = []
    real = fast_llama.FastLlamaRunner._forward

    def spy(self, tokens, *a, **kw):
        if kw.get("rows") is not None:
            sizes.append((tokens.shape[0], self.next_pos.shape[0]))
        return real(self, tokens, *a, **kw)

    fast_llama.FastLlamaRunner._forward = spy
    try:
        ids = torch.randint(2, 48, (6, 5), generator=torch.Generator().manual_seed(1))
        out = gen.generate(ids, max_new_tokens=20, temperature=0)
    finally:
        fast_llama.FastLlamaRunner._forward = real
    plain = SpeculativeGenerator(target, policy="autoregressive").generate(ids, max_new_tokens=20, temperature=0)
    assert out.new_tokens == plain.new_tokens
    assert sizes and all(0 < b < live for b, live in sizes)  # some forwards ran on a subset of the live rows


@needs_packed
def test_packed_weights_are_kept_per_model_and_follow_a_change_of_the_weights():
    """The packed weights are prepared once per model (a runner is made per generation call) and prepared again
    when a weight changes in place or is replaced, so the runner always computes the model's current function."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))

    def logits(runner):
        runner.start(2)
        return runner.forward(ids, keep=5)[0]

    first, second = FastLlamaRunner(m), FastLlamaRunner(m)
    assert first.packed and second.layers is first.layers and second.lm_head is first.lm_head  # reused, not repacked
    hf = CausalLMRunner(m, "hf", packed=False)  # transformers' forward through F.linear
    torch.testing.assert_close(logits(second), logits(hf), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # in place: the tensor's version moves
    changed = FastLlamaRunner(m)
    assert changed.layers is not first.layers
    torch.testing.assert_close(logits(changed), logits(CausalLMRunner(m, "hf")), rtol=1e-5, atol=1e-5)
    m.lm_head.weight = torch.nn.Parameter(torch.randn(64, 32))  # replaced
    torch.testing.assert_close(logits(FastLlamaRunner(m)), logits(CausalLMRunner(m, "hf")), rtol=1e-5, atol=1e-5)
    assert not FastLlamaRunner(m, packed=False).packed


def test_packed_linear_needs_a_cpu_model_of_float32_or_bfloat16():
    m = make_target("llama").to(torch.float16)
    assert not packed_linear_available(torch.device("cpu"), torch.float16)
    assert not FastLlamaRunner(m).packed  # None: packed where available, F.linear elsewhere
    with pytest.raises(ValueError, match="packed=True needs a CPU float32/bfloat16 model"):
        FastLlamaRunner(m, packed=True)


def test_a_bfloat16_model_packs_only_where_onednn_has_a_bf16_path():
    """On a CPU without oneDNN's bf16 path (AVX2 only, e.g. AMD Zen 3), packing a bf16 weight raises inside oneDNN:
    the default runner then uses F.linear, and computes what transformers' forward computes."""
    m = make_target("llama").to(torch.bfloat16)
    runner = FastLlamaRunner(m)
    assert runner.packed == (PACKED and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    ids = torch.randint(2, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    hf = CausalLMRunner(m, "hf", packed=False)  # transformers' forward through F.linear
    got, want = [(r.start(2), r.forward(ids, keep=6)[0].float())[1] for r in (runner, hf)]
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)  # bf16 rounding in different operation orders
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_packed
def test_profile_key_tells_the_packed_runner_from_f_linear():
    """The two runners cost differently, so a cost profile cached for one is not read for the other."""
    from specdec_ext.engine.profile import profile_key

    target, draft = make_target("llama"), make_target("llama")
    packed = profile_key(target, draft, True, 8)
    try:
        FastLlamaRunner.packed_default = False
        linear = profile_key(target, draft, True, 8)
    finally:
        FastLlamaRunner.packed_default = None
    assert packed != linear and profile_key(target, draft, True, 8) == packed
    assert profile_key(target, draft, False, 8) != packed  # the transformers runner, whose packing is its own


def test_the_target_runs_on_the_lean_runner_where_it_is_supported():
    """SpeculativeGenerator(fast_target=True), the default, runs a Llama target on one device through the lean
    runner, other architectures and fast_target=False through transformers' forward; the profile keys differ."""
    from specdec_ext import SpeculativeGenerator
    from specdec_ext.engine.fast_llama import runner_for
    from specdec_ext.engine.profile import profile_key

    llama, gpt2 = make_target("llama"), make_target("gpt2")
    assert SpeculativeGenerator(llama, policy="autoregressive").fast_target
    assert not SpeculativeGenerator(llama, policy="autoregressive", fast_target=False).fast_target
    assert not SpeculativeGenerator(gpt2, policy="autoregressive").fast_target
    assert type(runner_for(llama, "target")) is FastLlamaRunner
    assert type(runner_for(llama, "target", lean=False)) is CausalLMRunner
    assert type(runner_for(gpt2, "target")) is CausalLMRunner
    draft = make_target("llama", seed=1)
    assert profile_key(llama, draft, True, 8, fast_target=True) != profile_key(llama, draft, True, 8, fast_target=False)
    with pytest.raises(ValueError, match="cannot pack"):
        r = FastLlamaRunner(llama, "target")
        r.start(1)
        r.forward(torch.tensor([[3, 4]]), packed=True)


@pytest.mark.parametrize("arch,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 2)])
def test_lean_target_greedy_decoding_equals_transformers_generate(arch, kv_heads):
    """fp32: plain decoding and speculative decoding with the target on the lean runner give exactly the tokens of
    transformers' own greedy generate() (batch of 3 with left padding), and the transformers runner agrees."""
    from specdec_ext import SpeculativeGenerator
    from models import noisy_copy

    target = lean_model(arch, kv_heads)
    assert SpeculativeGenerator(target, policy="autoregressive").fast_target  # the lean runner serves it
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
