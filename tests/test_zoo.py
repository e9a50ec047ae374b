"""The bundled pair: loads in one call, its tokenizer round-trips real prompts, SpecDec++ is exact."""

from __future__ import annotations

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.data import humaneval_prompts, load_prompts
from specdec_ext.zoo import PAIR_DIR, load_pair, pair_available

pytestmark = pytest.mark.skipif(not pair_available(), reason=f"no bundled pair in {PAIR_DIR} (specdec zoo train)")


@pytest.fixture(scope="module")
def pair():
    return load_pair()


def test_pair_loads_with_head(pair):
    assert pair.head is not None
    pair.head.check_draft(pair.draft.config.hidden_size)
    assert pair.target.config.vocab_size == pair.draft.config.vocab_size == len(pair.tokenizer)


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
def test_specdecpp_greedy_equals_target_only_on_humaneval(pair, index):
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
