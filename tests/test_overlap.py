"""Overlapped rounds (``engine/scheduler.py``, ``Scheduler._launch_ahead``; ``StepRunner.advance``): round r + 1 is
launched, its inputs written on the device, before round r is read; rows that finish in round r are seen a round late
and their tokens of round r + 1 dropped. Off CUDA the graphs are recorded (``cuda_graphs="emulate"``) and the rounds
run as they are launched, so these tests check what the overlap changes in what the rounds compute: the inputs
advanced on the device, the plans made a round early, the dropped tokens. The CUDA tests run it on a GPU."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from stats import assert_follows
from support import PIDS, POLICIES, exact_marginals, graphed, keeping, make_gen, sampled_rows, target_only
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.round import StepRunner
from specdec_ext.engine.sampling import SamplingConfig
from specdec_ext.transfer import PinnedRing

AUTO = ("specdecpp", {"threshold": "auto", "k_max": 8, "_head": "confidence"})  # as the bundled heads: it overlaps


def recorded(gen: SpeculativeGenerator, overlap: bool) -> tuple:
    """``gen`` over recorded graphs, its rounds overlapped or one at a time, and a list that counts the rounds
    launched ahead (``StepRunner.advance`` calls)."""
    graphed(gen, overlap)
    ahead = []
    advance = gen.steps.advance

    def counted(*a, **k):
        ahead.append(1)
        return advance(*a, **k)

    gen.steps.advance = counted
    return gen, ahead


# every policy drafting to its cap (rounds read once: the form that overlaps on a GPU), but a head that reads the
# acceptance history (its rounds go one at a time); SpecDec++ also deciding its steps on the device, and reading
# after every step
OWN = [(name, kw) for name, kw in POLICIES if kw.get("_head") != "proposal"] + [AUTO]
CASES = [(name, kw, False) for name, kw in OWN] + [(name, kw, "device") for name, kw in OWN if name == "specdecpp"] + \
    [(*POLICIES[6], True)]
CIDS = [f"{(PIDS + ['specdecpp-auto-confidence'])[(POLICIES + [AUTO]).index((name, kw))]}-{early_exit}"
        for name, kw, early_exit in CASES]


@pytest.mark.parametrize("name,kw,early_exit", CASES, ids=CIDS)
def test_overlapped_rounds_emit_the_tokens_of_rounds_one_at_a_time(name, kw, early_exit):
    """Every policy, a batch padded to its bucket and one row, EOS on (rows end at different rounds) and limits that
    end rows mid-round: overlapped rounds emit exactly the tokens of rounds one at a time, greedy (fp32, and equal to
    target-only decoding for the single row) and seeded sampling (greedy only for ``threshold="auto"``, which plans
    from measured times); rounds were launched ahead by the policies that plan ahead (``threshold="auto"`` in its
    single-row call: its batches run the verification budget, whose rounds go one at a time)."""
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(11)
    over, ahead = recorded(make_gen(target, draft, name, kw, early_exit=early_exit), True)
    one, _ = recorded(make_gen(target, draft, name, kw, early_exit=early_exit), False)
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)  # auto plans from measured times
    for ids in (torch.randint(2, 48, (3, 6), generator=g), torch.randint(2, 48, (1, 9), generator=g)):
        for t in temperatures:
            for eos in (None, 7) if ids.shape[0] > 1 else (None,):
                kwargs = dict(max_new_tokens=16, temperature=t, seed=3, eos_token_id=eos)
                want = one.generate(ids, **kwargs).new_tokens
                assert over.generate(ids, **kwargs).new_tokens == want, (t, eos)
        if ids.shape[0] == 1:
            assert over.generate(ids, max_new_tokens=16, temperature=0.0).new_tokens[0] == \
                target_only(target, ids[0], 16)
    if over.policy.plans_ahead:  # not the heuristic (its caps follow the last round's result), nor a head that
        assert ahead, "no round was launched ahead"  # reads the acceptance history


def test_continuous_batching_overlaps_while_the_batch_is_full():
    """A continuous batch with a queue (EOS on, per-request limits, greedy and seeded sampling, requests arriving
    mid-call): rounds overlap while no queued request could join, and each request's tokens equal its tokens
    through rounds one at a time."""
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 48, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (7,), generator=g)]
    limits = [3, 17, 9, 12, 1, 20, 6]
    over, ahead = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=3), True)
    one, _ = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=3), False)
    for t, arrivals in ((0.0, None), (1.0, None), (0.0, [0, 0, 3, 3, 20, 20, 45])):  # requests arriving mid-call
        kwargs = dict(batch_size=2, max_new_tokens=limits, temperature=t, seed=9, eos_token_id=5, arrival_ms=arrivals)
        assert over.generate_continuous(prompts, **kwargs).new_tokens == \
            one.generate_continuous(prompts, **kwargs).new_tokens
    assert ahead


@pytest.mark.parametrize("name,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.3, "k_max": 4})],
                         ids=["fixed-3", "specdecpp-0.3"])
def test_overlapped_rounds_sample_the_targets_distribution(name, kw):
    """Seeded sampling through overlapped rounds (each row its own seed; the second round of every call launched
    before the first is read; a SpecDec++ round planned before the last one's result): each of the first four
    positions follows the target's exact marginal (chi-square), and rounds were launched ahead. (The negative controls
    are exact: a broken advance changes greedy tokens, below; this tiny model's next token depends too little on
    the last one for a stale token to fail a chi-square of 3,008 rows.)"""
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marg = exact_marginals(target, prompt, SamplingConfig(1.0), 4)
    gen, ahead = recorded(make_gen(target, draft, name, kw, early_exit=False), True)
    toks, accepted, discarded = sampled_rows(gen, prompt, 4, 7000)
    for i in range(4):
        assert_follows(toks[:, i], marg[i], f"{name} overlapped, position {i + 1}")
    assert accepted > 0 and discarded > 0, "speculation was not exercised"
    assert len(ahead) >= 47


def round_inputs(gen, ids, broken=None) -> list:
    """The per-row inputs (last and previous tokens, room, Philox seeds and round counts) of each round of a seeded
    call, as its launch received them; ``broken``: an advance that replaces ``StepRunner.advance``."""
    seen = []
    launch = gen.steps.launch

    def recorded_launch(draft_, target_, inp, plan, early_exit, **kw):
        B = inp.last.shape[0]
        seen.append([None if t is None else t[:B].tolist() for t in (inp.last, inp.prev, inp.room, inp.seeds)])
        return launch(draft_, target_, inp, plan, early_exit, **kw)

    gen.steps.launch = recorded_launch
    if broken is not None:
        gen.steps.advance = broken
    gen.generate(ids, max_new_tokens=24, temperature=1.0, seed=4)
    return seen


def test_advanced_inputs_are_what_the_host_writes():
    """``StepRunner.advance`` writes on the device, round after round, the inputs the host writes from the tokens it
    read (last and previous tokens, each row's room, its Philox seed and round count; a batch padded to its
    bucket); a control that skips the room's update is caught by the same comparison."""
    target, draft = make_pair("llama")
    ids = torch.randint(2, 48, (3, 7), generator=torch.Generator().manual_seed(2))
    one, _ = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=3), False)
    want = round_inputs(one, ids)
    over, ahead = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=3), True)
    got = round_inputs(over, ids)
    same = next(i for i, r in enumerate(want) if len(r[0]) < 3)  # the rounds before a row finished (the overlapped
    assert same >= 3 and len(ahead) >= 2  # call runs one more round with it, and drops its tokens)
    assert got[:same] == want[:same]

    bad, _ = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=3), True)
    assert round_inputs(bad, ids, keeping(bad, "room"))[:same] != want[:same]


def test_a_stale_last_token_is_caught():
    """Negative control: an advance that leaves each row's last token as it was (the next round verifies the wrong
    context) changes the greedy tokens, so the comparison with target-only decoding fails."""
    target, draft = make_pair("llama")
    ids = torch.randint(2, 48, (1, 8), generator=torch.Generator().manual_seed(8))
    want = target_only(target, ids[0], 16)
    assert len(set(want)) > 4  # a varied continuation: a stale token is not the right one by chance
    gen, ahead = recorded(SpeculativeGenerator(target, draft, policy="fixed", k=2), True)
    gen.steps.advance = keeping(gen, "last")
    assert gen.generate(ids, max_new_tokens=16, temperature=0.0).new_tokens[0] != want
    assert ahead


def test_overlap_argument_is_checked():
    target, draft = make_pair("llama")
    with pytest.raises(ValueError, match="overlap"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, overlap=True)  # no CUDA graphs on a CPU
    with pytest.raises(ValueError, match="overlap"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, overlap="yes")


def test_pinned_ring_rotates_and_checks_its_size():
    ring = PinnedRing((2, 3), torch.int64, torch.device("cpu"), size=2, fill=7)
    a, b, c = ring.take(), ring.take(), ring.take()
    assert a is c and a is not b and a.tolist() == [[7] * 3] * 2
    assert ring.used() is None  # nothing to wait for off CUDA
    with pytest.raises(ValueError, match="size"):
        PinnedRing((1,), torch.int64, torch.device("cpu"), size=0)


def test_advance_refuses_what_the_device_cannot_write():
    """``StepRunner.advance`` needs a bucket's persistent inputs, and a drafting round's ``prev`` and ``room`` come
    from the host after a plain step: each a one-line ValueError."""
    target, draft = make_pair("llama")
    gen, _ = recorded(SpeculativeGenerator(target, None, policy="autoregressive"), False)
    launched = []
    launch = gen.steps.launch
    gen.steps.launch = lambda *a, **k: launched.append(launch(*a, **k)) or launched[-1]
    gen.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="drafting round after a plain step"):
        gen.steps.advance(launched[-1], True, True)
    with pytest.raises(ValueError, match="bucket's persistent tensors"):
        StepRunner().advance(launched[-1], False, False)
