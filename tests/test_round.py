"""The round as fixed-shape steps (``engine/round.py``): one read-back to the host per round through the public
API, batch buckets, and a negative control of the losslessness checks at the engine level."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from models import make_pair, noisy_copy
from stats import assert_follows
from support import PIDS, POLICIES, exact_marginals, make_gen, target_only
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine import round as round_module
from specdec_ext.engine import steps as steps_module
from specdec_ext.engine.round import BUCKETS, StepRunner
from specdec_ext.engine.sampling import SamplingConfig

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}


class CountReads(TorchFunctionMode):
    """Counts the tensor methods that read a value back to the host (item, tolist, bool, int, float, index, cpu,
    numpy)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def reads_per_round(gen, call) -> tuple:
    """Runs ``call()`` (a public generate call of ``gen``) and returns the host reads and draft steps of each of
    its rounds (``StepRunner.launch``, from its first step, to ``StepRunner.read``, its read-back), and what the call
    returned."""
    counts = []
    launch, read = gen.steps.launch, gen.steps.read

    def launched(*a, **k):
        with CountReads() as mode:
            out = launch(*a, **k)
        out.reads = mode.reads
        return out

    def counted(launched):
        with CountReads() as mode:
            out = read(launched)
        counts.append((launched.reads + mode.reads, out.steps))
        return out

    gen.steps.launch, gen.steps.read = launched, counted
    try:
        out = call()
    finally:
        del gen.steps.launch, gen.steps.read
    return counts, out


@pytest.mark.parametrize("name,kw", POLICIES, ids=PIDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_round_reads_back_once(name, kw, temperature):
    """Without early exit every policy's round reads back once (its tokens and counts); with it, policies whose
    rounds are planned whole still do, and those that stop rows within a round read one flag after each draft step
    short of the cap (and the verification budget its depth)."""
    target, draft = make_pair("llama")
    ids = torch.randint(2, 48, (3, 6), generator=torch.Generator().manual_seed(0))
    for early_exit in (False, True):
        gen = make_gen(target, draft, name, kw, early_exit=early_exit)
        counts, out = reads_per_round(gen, lambda: gen.generate(ids, max_new_tokens=20, temperature=temperature))
        assert counts and len(counts) == len(out.stats.rounds)
        planned = name in ("autoregressive", "fixed", "heuristic")
        for reads, steps in counts:
            if not early_exit or planned:
                assert reads == 1, (early_exit, reads, steps)
            else:
                budget = kw.get("threshold") == "auto"
                assert 1 <= reads <= steps + 1 + budget, (reads, steps)
        if not early_exit and name != "autoregressive":
            assert any(steps >= 1 for _, steps in counts)  # the rounds drafted


@pytest.mark.parametrize("name,kw", [(n, kw) for n, kw in POLICIES if n == "specdecpp"],
                         ids=[i for (n, _), i in zip(POLICIES, PIDS) if n == "specdecpp"])
def test_exit_tiers_read_only_after_their_steps(name, kw):
    """early_exit=(1, 3): a round reads whether a row still drafts only after draft steps 1 and 3 (and the budget its
    depth), so its drafting ends there or at the round's cap, never in between; it drafts no fewer steps than a read
    after every step, and its greedy tokens are target-only decoding's (fp32)."""
    target, draft = make_pair("llama")
    ids = torch.randint(2, 48, (1, 6), generator=torch.Generator().manual_seed(3))
    tiers = make_gen(target, draft, name, kw, early_exit=(1, 3))
    every = make_gen(target, draft, name, kw, early_exit=True)
    caps = []
    launch = tiers.steps.launch

    def capped(draft_, target_, inp, plan, early_exit, **kw):
        caps.append(plan.cap)
        return launch(draft_, target_, inp, plan, early_exit, **kw)

    tiers.steps.launch = capped
    counts, out = reads_per_round(tiers, lambda: tiers.generate(ids, max_new_tokens=24, temperature=0))
    budget = kw.get("threshold") == "auto"
    assert len(caps) == len(counts) and any(steps > 1 for _, steps in counts)
    for (reads, steps), cap in zip(counts, caps):
        assert steps in (0, 1, 3) or steps == cap, (steps, cap)
        assert reads <= 1 + sum(k <= steps and k < cap for k in (1, 3)) + budget, (reads, steps, cap)
    assert out.new_tokens[0] == target_only(target, ids[0], 24)
    counted, base = reads_per_round(every, lambda: every.generate(ids, max_new_tokens=24, temperature=0))
    assert base.new_tokens == out.new_tokens
    assert sum(s for _, s in counts) / len(counts) >= sum(s for _, s in counted) / len(counted)


@pytest.mark.parametrize("bad", [(), (3, 1), (0, 2), (1.5,), "1,3", (True, 2)])
def test_exit_tiers_refuse_what_is_not_increasing_steps(bad):
    target, draft = make_pair("llama")
    with pytest.raises(ValueError, match=r"early_exit: expected True, False, 'device' or increasing draft steps >= 1"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, early_exit=bad)


def test_the_count_sees_a_read():
    """Negative control: a round that reads one more value back is counted."""
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    step = round_module.verify_step

    def reading(*a, **k):
        out, acc = step(*a, **k)
        int(acc.sum())
        return out, acc

    with pytest.MonkeyPatch.context() as m:
        m.setattr(round_module, "verify_step", reading)
        counts, _ = reads_per_round(gen, lambda: gen.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=8,
                                                              temperature=0))
    assert counts and all(reads == 2 for reads, _ in counts)


def test_batches_run_in_the_smallest_bucket_that_holds_them():
    """A bucketed runner pads B rows to the smallest batch bucket that holds them; beyond the largest it refuses (without
    CUDA graphs, which run such a batch eagerly), naming the batch size; compile needs the graphs it compiles for."""
    runner = StepRunner(BUCKETS)
    assert [runner.bucket(b) for b in (1, 3, 4, 5, 64)] == [1, 4, 4, 8, 64]
    with pytest.raises(ValueError, match="batch_size: 65 rows are more than the largest batch bucket 64"):
        runner.bucket(65)
    assert StepRunner(BUCKETS, cuda_graphs="emulate").bucket(65) == 65
    with pytest.raises(ValueError, match="compile: the forwards are compiled for the CUDA graphs"):
        StepRunner(BUCKETS, compile=True)


@pytest.mark.slow
def test_a_verifier_that_ignores_rejections_fails_the_engines_check(monkeypatch):
    """Negative control: an engine whose verification accepts every candidate (the draft's distribution, not the
    target's) fails the chi-square check of test_lossless_engine against the target's exact marginals; the same
    engine with the real verification passes it."""
    target, draft = make_pair("llama", vocab=12, noise=0.3, ctx=48)
    draft = noisy_copy(target, 3.0)  # far from the target, so accepting blindly shows
    prompt = torch.tensor([[3, 7, 5]])
    marg = exact_marginals(target, prompt, SamplingConfig(temperature=1.0), 1)[0]
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    real = gen.generate(prompt.expand(3000, -1), max_new_tokens=1, temperature=1.0, seed=5).new_tokens
    assert_follows(torch.tensor(real)[:, 0], marg, "the real verification")
    ops = steps_module.ops

    def accept_all(cands, draft_logits, target_logits, temperature, n, uniforms=None, check=True):
        B, K = cands.shape
        return torch.cat([cands, cands[:, -1:]], 1), n.clone()

    monkeypatch.setattr(ops, "chain_verify_logits", accept_all)
    blind = gen.generate(prompt.expand(3000, -1), max_new_tokens=2, temperature=1.0, seed=5).new_tokens
    with pytest.raises(AssertionError):
        assert_follows(torch.tensor(blind)[:, 0], marg, "blind acceptance")


def test_a_request_longer_than_the_models_positions_is_refused_up_front():
    target, draft = make_pair("llama", ctx=40)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_new_tokens \(11\) exceeds the target model's "
                                         r"context of 40 tokens"):
        gen.generate(torch.randint(2, 48, (1, 30)), max_new_tokens=11)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt \(30 tokens\)"):
        gen.generate_continuous([[3, 4], list(range(2, 32))], batch_size=2, max_new_tokens=11)
    # a request that fills the context exactly: the round's candidates past it go to the scratch column
    ids = torch.randint(2, 48, (2, 30), generator=torch.Generator().manual_seed(1))
    out = gen.generate(ids, max_new_tokens=10, temperature=0)
    assert out.new_tokens == [target_only(target, ids[b], 10) for b in range(2)]
