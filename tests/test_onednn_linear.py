"""The models' linear layers through oneDNN with packed weights (engine/onednn_linear.py): same function, the model
untouched outside a forward, repacked when its weights change, and the runner's choice of when to pack."""

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine import onednn_linear
from specdec_ext.engine.onednn_linear import PackedLinears
from specdec_ext.engine.runner import CausalLMRunner

from models import make_pair, make_target

needs_onednn = pytest.mark.skipif(not onednn_linear.available(torch.device("cpu"), torch.float32),
                                  reason="this torch has no oneDNN linear with packed weights")
IDS = torch.randint(2, 48, (3, 7), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(input_ids=ids).logits


def instance_forwards(model) -> int:
    return sum("forward" in m.__dict__ for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # qwen2: q/k/v biases; gpt2: Conv1D, not nn.Linear
def test_packed_layers_compute_the_same_function_and_leave_the_model_as_it_was(arch):
    model = make_target(arch)
    want = logits(model)
    packed = PackedLinears(model)
    assert packed.forwards or arch == "gpt2"  # gpt2's only nn.Linear is its LM head
    with packed.applied():
        assert instance_forwards(model) == len(packed.forwards)
        got = logits(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert instance_forwards(model) == 0
    assert torch.equal(logits(model), want)  # the model's own forward again, bit for bit


@pytest.mark.skipif(not onednn_linear.available(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU's oneDNN has no bf16 path (AVX2 only)")
def test_packed_bfloat16_layers_compute_the_same_function_up_to_bf16_rounding():
    """A bf16 model, packed by default where oneDNN has a bf16 path: logits as transformers' own forward's, up to bf16
    rounding in another order of operations, and the same greedy token at every position."""
    model = make_target("llama").to(torch.bfloat16)
    want = logits(model).float()
    with PackedLinears(model).applied():
        got = logits(model).float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert instance_forwards(model) == 0


@needs_onednn
def test_the_packed_path_is_taken_and_undone_even_when_the_forward_raises():
    model = make_target("llama")
    packed = PackedLinears(model)
    head = model.get_output_embeddings()
    calls = []
    real = onednn_linear.linear

    def counting(x, w, b=None):
        calls.append(x.shape)
        return real(x, w, b)

    onednn_linear.linear, saved = counting, onednn_linear.linear
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with packed.applied():
                logits(model)
                raise RuntimeError("boom")
    finally:
        onednn_linear.linear = saved
    assert len(calls) == len(packed.forwards) and head in packed.forwards  # every layer once, the LM head included
    assert instance_forwards(model) == 0


@needs_onednn
def test_a_layer_with_its_own_instance_forward_is_left_alone():
    """accelerate's offloading hooks set an instance forward: such a layer keeps it."""
    model = make_target("llama")
    head = model.get_output_embeddings()
    own = head.forward
    hook = head.forward = lambda x: own(x) * 0.0
    packed = PackedLinears(model)
    assert head not in packed.forwards and len(packed.forwards) == 14  # 2 layers x 7 projections
    with packed.applied():
        assert torch.count_nonzero(logits(model)) == 0
    assert head.__dict__["forward"] is hook and torch.count_nonzero(logits(model)) == 0


@needs_onednn
def test_weights_changed_in_place_are_packed_again():
    model = make_target("llama")
    first = PackedLinears(model).forwards
    assert PackedLinears(model).forwards is first  # kept per model while the weights stay the same
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(-1.0)
    again = PackedLinears(model)
    assert again.forwards is not first
    with again.applied():
        got = logits(model)
    torch.testing.assert_close(got, logits(model), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_when_a_runner_packs(monkeypatch):
    model = make_target("llama")
    assert CausalLMRunner(model, "target").packed  # CPU float32, small: packed by default
    assert not CausalLMRunner(model, "target", packed=False).packed
    bf16 = make_target("llama").to(torch.bfloat16)  # packed by default exactly where oneDNN has a bf16 path
    assert CausalLMRunner(bf16, "target").packed == onednn_linear.available(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(onednn_linear, "AUTO_MAX_BYTES", 1000)  # packing copies the weights: not for large models
    assert not CausalLMRunner(model, "target").packed and CausalLMRunner(model, "target", packed=True).packed
    half = make_target("llama").to(torch.float16)
    assert not CausalLMRunner(half, "target").packed
    with pytest.raises(ValueError, match="packed linear layers need a CPU float32/bfloat16 model.*float16"):
        CausalLMRunner(half, "target", packed=True)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_do_not_depend_on_packing(arch, monkeypatch):
    """Greedy decoding, plain and speculative, with the runners' layers packed and not: the same tokens."""
    target, draft = make_pair(arch)
    prompts = [IDS[i, : 3 + 2 * i] for i in range(3)]
    out = {}
    for packed in (None, False):
        if packed is False:  # every runner the generators make: F.linear
            monkeypatch.setattr(onednn_linear, "wanted", lambda model, packed: False)
        for name, d, kw in (("plain", None, {"policy": "autoregressive"}), ("fixed", draft, {"policy": "fixed", "k": 3})):
            gen = SpeculativeGenerator(target, d, fast_draft=False, **kw)
            out[packed, name] = gen.generate_continuous(prompts, 2, max_new_tokens=12, temperature=0).new_tokens
    assert out[None, "plain"] == out[False, "plain"] == out[None, "fixed"] == out[False, "fixed"]
    assert all(len(t) == 12 for t in out[None, "plain"])
