"""The bundled pair: loads in one call, its tokenizer round-trips real prompts, SpecDec++ is exact."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.prompts import humaneval_prompts, load_prompts
from specdec_ext.zoo import PAIR_DIR, load_pair, pair_available

pytestmark = pytest.mark.skipif(not pair_available(), reason=f"no bundled pair in {PAIR_DIR} (specdec zoo train)")


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def pair32():
    """The pair with an fp32 target: exact greedy equality is an fp32 promise. ``load_pair()`` gives a bf16 target on
    CPUs with native bf16, where near-tie logits round to exact ties (prompt 1 of HumanEval, token 32: two logits
    both 5.4062) that transformers' generate and our decoding may break differently."""
    return load_pair(target_dtype=torch.float32)


def test_pair_loads_with_head(pair):
    assert set(pair.head) == {"greedy", "sample"} and {"greedy", "sample", "paper"} <= set(pair.heads)
    for name, head in pair.heads.items():
        head.check_draft(pair.draft.config.hidden_size)
        assert head.hidden_size == pair.draft.config.hidden_size, name
    assert pair.target.config.vocab_size == pair.draft.config.vocab_size == len(pair.tokenizer)


def test_the_pairs_draft_takes_the_targets_default_dtype(pair, pair32, monkeypatch):
    """load_pair's draft follows default_draft_dtype (bf16 where the CPU has bf16 matrix instructions), whatever the
    target's dtype; an explicit draft_dtype wins, and the heads read either draft."""
    import specdec_ext.zoo as zoo

    assert pair.draft.dtype == pair32.draft.dtype == zoo.default_draft_dtype("cpu") == zoo.default_target_dtype("cpu")
    monkeypatch.setattr(zoo, "cpu_has_native_bf16", lambda: False)
    assert zoo.default_draft_dtype("cpu") == torch.float32 and zoo.default_draft_dtype("cuda") == torch.bfloat16
    monkeypatch.undo()
    other = torch.float32 if pair.draft.dtype == torch.bfloat16 else torch.bfloat16
    explicit = load_pair(target_dtype=torch.float32, draft_dtype=other)
    assert explicit.draft.dtype == other


def test_tokenizer_round_trips_humaneval(pair):
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    for p in prompts:
        ids = pair.tokenizer(p, add_special_tokens=False)["input_ids"]
        assert pair.tokenizer.decode(ids) == p


def test_stdlib_prompts_are_held_out_function_headers():
    prompts = load_prompts("stdlib", limit=5)
    assert len(prompts) == 5 and all(p.lstrip().startswith(("def ", "async def ", "@")) for p in prompts)


def test_prompt_files_jsonl_and_blank_line_separated(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f():"}\n\n{"prompt": "x = 1"}\n')
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["def f():", "x = 1"]
    (tmp_path / "p.txt").write_text("def f():\n    return 1\n\n\nclass A:\n    pass\n")
    assert load_prompts(str(tmp_path / "p.txt"), limit=5) == ["def f():\n    return 1", "\nclass A:\n    pass\n"]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="no 'prompt' key"):
        load_prompts(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="unknown data set 'nope'"):
        load_prompts("nope")


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2])
def test_specdecpp_greedy_equals_target_only_on_humaneval(pair32, index):
    pair = pair32
    assert pair.target.dtype == torch.float32
    text = humaneval_prompts()[index]
    ids = torch.tensor([pair.tokenizer(text, add_special_tokens=False)["input_ids"]])
    plain = SpeculativeGenerator(pair.target, policy="autoregressive").generate(ids, max_new_tokens=48, temperature=0)
    spec = SpeculativeGenerator(pair.target, pair.draft, policy="specdecpp", head=pair.head, threshold=0.3)
    out = spec.generate(ids, max_new_tokens=48, temperature=0)
    assert out.new_tokens == plain.new_tokens
    assert out.stats.accepted > 0
    ref = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                               eos_token_id=None, pad_token_id=pair.tokenizer.eos_token_id)
    assert out.new_tokens[0] == ref[0, ids.shape[1]:].tolist()


def test_the_pairs_own_generator_copies_or_drafts_and_equals_plain_decoding(pair32):
    """``pair.generator()``: a copy or a draft each round under SpecDec++ auto with the pair's heads; greedy, the
    tokens of plain decoding; keyword arguments override its choices."""
    from specdec_ext.policies import CopyOrDraft

    gen = pair32.generator()
    assert isinstance(gen.policy, CopyOrDraft) and gen.policy.draft.name.startswith("specdec++")
    text = humaneval_prompts()[3]
    ids = torch.tensor([pair32.tokenizer(text, add_special_tokens=False)["input_ids"]])
    plain = SpeculativeGenerator(pair32.target, policy="autoregressive").generate(ids, max_new_tokens=32, temperature=0)
    out = gen.generate(ids, max_new_tokens=32, temperature=0)
    assert out.new_tokens == plain.new_tokens and out.stats.accepted > 0
    assert not isinstance(pair32.generator(lookup=False, policy="fixed", k=2).policy, CopyOrDraft)


def test_lr_schedule_with_warm_restart_and_stage_extension(tmp_path):
    from specdec_ext.zoo.train import StageConfig, _stage_due, lr_at

    one = StageConfig(2, 8, 16, 2, steps=300, batch_size=1, seq_len=8, lr=1e-3, min_lr=1e-5, warmup=10)
    two = StageConfig(2, 8, 16, 2, steps=300, batch_size=1, seq_len=8, lr=1e-3, min_lr=1e-5, warmup=10,
                      restart_at=100, restart_lr=5e-4)
    assert lr_at(9, one) == lr_at(9, two) == 1e-3                       # same warm-up
    assert abs(lr_at(99, two) - 1e-5) < 1e-6 < lr_at(99, one) - 1e-5   # first phase ends at restart_at
    assert lr_at(100, two) == 5e-4 / 10 and lr_at(109, two) == 5e-4     # second warm-up to restart_lr
    assert abs(lr_at(299, two) - 1e-5) < 1e-6 and abs(lr_at(299, one) - 1e-5) < 1e-6
    (tmp_path / "draft").mkdir()
    assert _stage_due(tmp_path, {}, "draft", two)                        # no saved model
    (tmp_path / "draft" / "config.json").write_text("{}")
    assert _stage_due(tmp_path, {"draft": {"steps": 100}}, "draft", two)  # saved after fewer steps
    assert not _stage_due(tmp_path, {"draft": {"steps": 300}}, "draft", two)
