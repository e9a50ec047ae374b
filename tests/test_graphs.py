"""CUDA graphs of the round's steps (``engine/graphs.py``). Off CUDA the graphs are recorded, not captured
(``StepRunner(cuda_graphs="emulate")``): the ops a step dispatched at capture are replayed on the same tensors, the
Python around them not run again, so these tests check what a captured graph depends on (inputs copied in, outputs
read before the next replay overwrites them, caches' lengths unchanged by capture, graphs dropped with a replaced
cache, no host state read or written inside a step). The CUDA tests (``tests/test_cuda_engine.py``) run the
captured graphs themselves."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from stats import assert_follows
from support import (CHAIN_CASES, EACH_WAY, PIDS, POLICIES, chain_pieces, exact_marginals, graphed, head_for, make_gen,
                     sampled_rows, target_only)
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.round import BUCKETS, StepRunner
from specdec_ext.engine.sampling import SamplingConfig


# every policy drafting to the cap, and every stop rule with the stop decided inside the round ("device"); plain
# decoding and fixed K have no stop rule, so ``early_exit`` changes nothing in their rounds (engine/round.py reads
# nothing without a rule). Reading the rule's flag after each step or after some steps reads it the same way whichever
# rule set it: those run with the stop rules of support.EACH_WAY
EXITS = {"early-exit": True, "to-cap": False, "tiers": (1, 3), "device": "device"}
REPLAYED = [(name, kw, mode, f"{mode}-{pid}") for mode in EXITS for (name, kw), pid in zip(POLICIES, PIDS)
            if mode == "to-cap" or (name not in ("autoregressive", "fixed") and (mode == "device" or pid in EACH_WAY))]


@pytest.mark.parametrize("name,kw,mode", [c[:3] for c in REPLAYED], ids=[c[3] for c in REPLAYED])
def test_replayed_steps_give_the_eager_steps_tokens(name, kw, mode):
    """Every policy, greedy and seeded sampling, a batch padded to its bucket and one row: the replayed steps emit
    exactly the eager steps' tokens (fp32), and a second round of the calls captures nothing new. ``threshold="auto"`` plans
    its rounds from measured times, so its seeded samples differ from run to run (the candidates drawn differ; the
    distribution does not): greedy only there."""
    early_exit = EXITS[mode]
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(1)
    gen = graphed(make_gen(target, draft, name, kw, early_exit=early_exit))
    eager = make_gen(target, draft, name, kw, early_exit=early_exit)
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)
    calls = [(torch.randint(2, 48, (3, 6), generator=g), t) for t in temperatures]
    calls += [(torch.randint(2, 48, (1, 9), generator=g), t) for t in temperatures]
    wants = [eager.generate(ids, max_new_tokens=20, temperature=t, seed=5).new_tokens for ids, t in calls]
    for (ids, temperature), want in zip(calls, wants):
        assert gen.generate(ids, max_new_tokens=20, temperature=temperature, seed=5).new_tokens == want
    captured = gen.steps.graphs.captures
    assert captured > 0
    for (ids, temperature), want in zip(calls, wants):  # the eager steps' tokens are fixed by the seed
        assert gen.generate(ids, max_new_tokens=20, temperature=temperature, seed=5).new_tokens == want
    if kw.get("threshold") != "auto":  # auto's depths follow measured times: a second call may meet a new one
        assert gen.steps.graphs.captures == captured, "a second call captured again"


def test_continuous_batching_through_replayed_steps_gives_each_request_its_solo_tokens():
    """Requests joining and leaving a continuous batch (EOS on, per-request limits; greedy and seeded sampling):
    each request's tokens through replayed steps equal its tokens alone through eager steps."""
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 48, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (7,), generator=g)]
    limits = [3, 17, 9, 12, 1, 20, 6]
    gen = graphed(SpeculativeGenerator(target, draft, policy="fixed", k=3))
    eager = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    for temperature in (0.0, 1.0):
        out = gen.generate_continuous(prompts, max_new_tokens=limits, batch_size=3, temperature=temperature, seed=11,
                                      eos_token_id=7)
        for i, p in enumerate(prompts):
            alone = eager.generate(torch.tensor([p]), max_new_tokens=limits[i], temperature=temperature, seed=11 + i,
                                   eos_token_id=7)
            assert out.new_tokens[i] == alone.new_tokens[0], (temperature, i)


def test_a_replaced_cache_drops_the_graphs():
    """A longer request grows the caches: the graphs read the old ones, so they are dropped and captured again, and
    the tokens stay the eager steps'."""
    target, draft = make_pair("llama", ctx=1024)
    gen = graphed(SpeculativeGenerator(target, draft, policy="fixed", k=2))
    eager = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    short, long = torch.tensor([[3, 4, 5]]), torch.randint(2, 48, (1, 300), generator=torch.Generator().manual_seed(0))
    gen.generate(short, max_new_tokens=6, temperature=0)
    first = gen.steps.graphs.captures
    assert gen.generate(long, max_new_tokens=6, temperature=0).new_tokens == \
        eager.generate(long, max_new_tokens=6, temperature=0).new_tokens
    assert gen.steps.graphs.captures > first


def test_cuda_graphs_argument_is_checked():
    target, draft = make_pair("llama")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a target on a CUDA device"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be None, True or False"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, cuda_graphs="yes")
    assert not SpeculativeGenerator(target, draft, policy="fixed", k=2).cuda_graphs  # a CPU: eager steps
    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs replay bucketed steps"):
        StepRunner(None, cuda_graphs=True)
    with pytest.raises(ValueError, match="compile: True compiles the forwards that CUDA graphs capture"):
        SpeculativeGenerator(target, draft, policy="fixed", k=2, compile=True)  # no CUDA graphs on a CPU
    with pytest.raises(ValueError, match="mode: the steps are captured in this runner's CUDA graphs"):
        StepRunner(BUCKETS, cuda_graphs=True, compile=True, mode="reduce-overhead")


def test_compiled_forwards_in_replayed_steps_give_the_eager_steps_tokens():
    """``compile=True`` with graphs: the models' forwards traced whole (``fullgraph``; ``aot_eager`` here, inductor on
    a GPU) and recorded; fixed K and SpecDec++ emit the eager steps' greedy tokens (fp32) at one row and at a batch
    padded to its bucket, each model's forward traced at most four times (shapes made dynamic at their first
    change), not once per step and width."""
    target, draft = make_pair("llama")
    head = head_for(draft)
    g = torch.Generator().manual_seed(3)
    calls = [torch.randint(2, 48, (1, 7), generator=g), torch.randint(2, 48, (3, 6), generator=g)]
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counters outlive reset()
    for name, kw in (("fixed", dict(k=3)), ("specdecpp", dict(threshold=0.6, head=head))):
        gen = SpeculativeGenerator(target, draft, policy=name, **kw)
        gen.steps = StepRunner(BUCKETS, cuda_graphs="emulate", compile=True, backend="aot_eager")
        eager = SpeculativeGenerator(target, draft, policy=name, **kw)
        for ids in calls:
            assert gen.generate(ids, max_new_tokens=12).new_tokens == eager.generate(ids, max_new_tokens=12).new_tokens
        assert gen.steps.graphs.captures > 0
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    # per generator and model: one row, then many; one token, then many
    assert 0 < frames <= 2 * 2 * 4, f"{frames} compilations"


def test_a_batch_beyond_the_largest_bucket_runs_eager_steps():
    """With graphs on, a batch larger than the largest bucket is served (eager steps over its rows until finished
    rows bring it within a bucket) and emits plain decoding's greedy tokens."""
    target, draft = make_pair("llama")
    gen = graphed(SpeculativeGenerator(target, draft, policy="fixed", k=2))
    ids = torch.randint(2, 48, (BUCKETS[-1] + 3, 4), generator=torch.Generator().manual_seed(2))
    out = gen.generate(ids, max_new_tokens=5, temperature=0)
    plain = SpeculativeGenerator(target, None, policy="autoregressive")
    assert out.new_tokens == plain.generate(ids, max_new_tokens=5, temperature=0).new_tokens


def test_a_graph_reads_the_tensors_it_was_captured_with_and_copies_in_others():
    """A replay passed the memory it was captured with copies nothing and reads its current values (the runner's
    persistent inputs, an earlier graph's outputs); another tensor is copied in; a tensor passed in two places, or
    one the step writes in place, gets a buffer of its own at capture."""
    from specdec_ext.engine.graphs import StepGraphs

    graphs = StepGraphs(emulate=True)
    a, b, state = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), torch.zeros(2)

    def fn(x, y, s):
        s.add_(1)
        return (2 * x + y,)

    (out,) = graphs.replay("k", fn, [a, b, state], [state])
    assert out.tolist() == [12.0, 24.0] and state.tolist() == [0.0, 0.0]  # the warm-up's write restored
    a.mul_(3)  # the captured input itself, changed in place: read at the next replay, no copy
    assert graphs.replay("k", fn, [a, b, state], [state])[0].tolist() == [16.0, 32.0]
    c = torch.tensor([5.0, 6.0])  # another tensor: copied into the captured one
    assert graphs.replay("k", fn, [c, b, state], [state])[0].tolist() == [20.0, 32.0]
    assert a.tolist() == [5.0, 6.0] and graphs.captures == 1

    (twice,) = graphs.replay("twice", lambda x, y: (x - y,), [a, a], [])
    assert twice.tolist() == [0.0, 0.0]
    p, q = torch.tensor([7.0, 7.0]), torch.tensor([1.0, 2.0])  # distinct tensors into the two slots: both count
    assert graphs.replay("twice", lambda x, y: (x - y,), [p, q], [])[0].tolist() == [6.0, 5.0]


def test_a_recorded_graph_replays_the_ops_of_its_capture_and_none_of_its_python():
    """As a CUDA graph: a replay reads its inputs' current values, but a host value the step read at capture stays
    as it was, the step's Python (here a counter) does not run again, and a host read inside a step raises. Re-running
    the step's Python, as a stand-in that called the step again would, gives another answer: the engine's tests of
    replayed rounds against eager ones catch a round that keeps state on the host inside a captured step."""
    from specdec_ext.engine.graphs import StepGraphs

    graphs = StepGraphs(emulate=True)
    x, host = torch.tensor([1.0, 2.0]), {"scale": 2.0, "calls": 0}

    def fn(x):
        host["calls"] += 1
        return (x * host["scale"] + torch.tensor([float(host["calls"])]),)

    (out,) = graphs.replay("k", fn, [x], [])
    assert out.tolist() == [3.0, 5.0] and host["calls"] == 1  # the capture ran the Python once
    host["scale"] = 10.0
    x.copy_(torch.tensor([3.0, 4.0]))
    (out,) = graphs.replay("k", fn, [x], [])
    assert out.tolist() == [7.0, 9.0] and host["calls"] == 1  # the new inputs; the host's values as captured
    assert fn(x)[0].tolist() == [32.0, 42.0]  # what running the step's Python again would have given
    with pytest.raises(RuntimeError, match="read a device value on the host"):
        graphs.replay("read", lambda x: (x * float(x.sum()),), [x], [])


@pytest.mark.parametrize("name,kw", [("fixed", {"k": 3}), ("specdecpp", {"threshold": 0.3, "k_max": 6}),
                                     ("specdecpp", {"threshold": "auto", "k_max": 8, "_head": "proposal",
                                                    "select": False})],
                         ids=["fixed", "specdecpp", "specdecpp-auto"])
@pytest.mark.parametrize("early_exit", [False, (1, 3), True, "device"], ids=["to-cap", "tiers", "early-exit", "device"])
def test_the_steps_between_two_reads_replay_as_one_graph(name, kw, early_exit):
    """The draft steps between two reads of the stop flags replay as one graph, and those that reach the round's
    cap together with the verification: a round of fixed K, or drafting to the cap, is one replay; with reads after
    steps R, a round replays one graph per span it ran, and one more for the verification when its rows stopped
    drafting at a read; with ``early_exit="device"`` every round is one replay whose steps after the first run on
    the GPU's own reading of the stop flags, so it drafts the steps a read after every step would (fewer than the
    cap in some rounds). Greedy and seeded rows, a batch padded to its bucket (one row for ``auto``, whose batches
    run the verification budget, a rule that is not captured); the tokens are the eager steps'."""
    from specdec_ext.engine import graphs as graphs_module

    target, draft = make_pair("llama")
    gen = graphed(make_gen(target, draft, name, kw, early_exit=early_exit))
    eager = make_gen(target, draft, name, kw, early_exit=early_exit)
    rounds, replays = [], [0]
    launch, read = gen.steps.launch, gen.steps.read
    replay, chain = graphs_module.StepGraphs.replay, graphs_module.StepGraphs.replay_chain

    def launched(draft_, target_, inp, plan, ee, **kw):
        before = replays[0]
        out = launch(draft_, target_, inp, plan, ee, **kw)
        out.seen = (plan.cap, replays[0] - before)
        return out

    def counted(out):
        result = read(out)
        rounds.append((out.seen[0], result.steps, out.seen[1]))
        return result

    def counting(self, *args, **kwargs):
        replays[0] += 1
        return replay(self, *args, **kwargs)

    def counting_chains(self, *args, **kwargs):  # a composed graph: one replay
        replays[0] += 1
        return chain(self, *args, **kwargs)

    gen.steps.launch, gen.steps.read = launched, counted
    g = torch.Generator().manual_seed(6)
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(graphs_module.StepGraphs, "replay", counting)
        m.setattr(graphs_module.StepGraphs, "replay_chain", counting_chains)
        for ids in (torch.randint(2, 48, (3, 6), generator=g), torch.randint(2, 48, (1, 9), generator=g)):
            if kw.get("threshold") == "auto" and ids.shape[0] > 1:
                continue
            for t in temperatures:
                want = eager.generate(ids, max_new_tokens=20, temperature=t, seed=2).new_tokens
                assert gen.generate(ids, max_new_tokens=20, temperature=t, seed=2).new_tokens == want
    assert any(steps > 1 for _, steps, _ in rounds)
    if early_exit == "device":
        assert all(n == 1 for _, _, n in rounds)
        if name != "fixed":  # the conditional steps skipped: rounds that ended before their cap
            assert any(0 < steps < cap for cap, steps, _ in rounds)
        return
    reads = set() if name == "fixed" or early_exit is False else set(range(1, 64)) if early_exit is True \
        else set(early_exit)
    for cap, steps, n in rounds:
        if steps == 0:  # a plain step
            assert n == 1
            continue
        spans = 1 + len([r for r in reads if r < min(steps, cap)])
        assert n == spans + (steps < cap), (cap, steps, n)
    if early_exit is False or name == "fixed":
        assert all(n == 1 for _, _, n in rounds)


def test_a_rounds_row_inputs_are_written_where_its_graphs_read_them():
    """With buckets, a round's per-row integers land in the bucket's persistent buffer, padding rows 0 (token 0, room
    0, stream 0), the same memory every round, which the round's steps then read without a copy; without buckets,
    one tensor of the live rows with the same values."""
    from specdec_ext.engine.steps import RoundInputs
    from specdec_ext.engine.sampling import RowSampling, SamplingConfig

    cpu = torch.device("cpu")
    bucketed, live = StepRunner(BUCKETS, cuda_graphs="emulate"), StepRunner()
    args = ([5, 6, 7], [1, 2, 3], [4, 0, 2], [False, True, False], [(9, 1), (8, 2), (7, 3)], cpu, cpu)
    got = bucketed.row_inputs(*args)
    want = live.row_inputs(*args)
    for a, b in zip(got, want):
        assert a.tolist() == b.tolist()
    assert got[3].tolist() == [0, 1, 0] and got[4].tolist() == [[9, 1], [8, 2], [7, 3]]
    assert live.row_inputs([5], [1], [4], [False], [(9, 1)], cpu, cpu)[3] is None  # no single row: no extra
    rows = RowSampling.of([SamplingConfig(0.0)] * 3, 48, cpu)
    inp = bucketed._persistent(RoundInputs(*got[:4], rows, rows, got[4], 6, 5), 4)
    assert [t.data_ptr() for t in (inp.last, inp.prev, inp.room, inp.extra, inp.seeds)] == \
        [t.data_ptr() for t in got]  # read where they were written: no copy
    assert inp.last.tolist() == [5, 6, 7, 0] and inp.room.tolist() == [4, 0, 2, 0]
    assert inp.seeds.tolist() == [[9, 1], [8, 2], [7, 3], [0, 0]]
    again = bucketed.row_inputs([3, 4, 8], [5, 6, 1], [1, 1, 1], [False] * 3, [(1, 2), (3, 4), (5, 6)], cpu, cpu)
    assert again[0].data_ptr() == got[0].data_ptr() and again[3] is None
    assert bucketed._persistent(RoundInputs(*again[:4], rows, rows, again[4], 6, 5), 4).last.tolist() == [3, 4, 8, 0]


def test_a_recorded_chain_runs_its_middle_pieces_only_where_their_flags_hold():
    """``StepGraphs.replay_chain`` recorded (the CPU's stand-in for the composed graph of conditional nodes): each
    middle piece runs where the flag the pieces before it wrote holds, on the shared tensors the first piece made,
    kept at their addresses from replay to replay; a negative control that ignores the flags is told apart."""
    from specdec_ext.engine import graphs as graphs_module

    x = torch.zeros(4)
    gate = torch.zeros(2, dtype=torch.bool)  # the inputs' flags: for piece 1, and piece 1's for piece 2

    def run(graphs):
        got, kept = [], None
        for (a, b), _ in CHAIN_CASES:
            gate.copy_(torch.tensor([a, b]))
            shared, (out,) = graphs.replay_chain("chain", chain_pieces("cpu"), [x, gate], [])
            kept = kept or [t.data_ptr() for t in shared]
            assert [t.data_ptr() for t in shared] == kept
            got.append(out[0].item())
        return got

    graphs = graphs_module.StepGraphs(emulate=True)
    assert run(graphs) == [want for _, want in CHAIN_CASES] and graphs.captures == 1
    with pytest.MonkeyPatch.context() as m:  # every middle piece run, whatever the flags
        m.setattr(graphs_module, "_run_middle",
                  lambda pieces, static, shared, every: [p(*static, *shared) for p in pieces[1:-1]])
        assert run(graphs_module.StepGraphs(emulate=True)) != [want for _, want in CHAIN_CASES]


def test_steps_decided_on_the_device_draft_what_a_read_after_every_step_drafts():
    """``early_exit="device"`` (SpecDec++ with a fixed h, recorded graphs): each round is one replay, and it drafts
    the same candidates, in the same number of draft forwards, as a round that reads after every step; the draft's
    cache is rolled back by the steps that ran, so later rounds stay target-only decoding's (greedy, fp32)."""
    target, draft = make_pair("llama")
    ids = torch.randint(2, 48, (1, 7), generator=torch.Generator().manual_seed(8))
    kw = {"threshold": 0.3, "k_max": 6}  # rows stop before the cap in most rounds
    device = graphed(make_gen(target, draft, "specdecpp", kw, early_exit="device"))
    every = graphed(make_gen(target, draft, "specdecpp", kw, early_exit=True))
    a = device.generate(ids, max_new_tokens=30, temperature=0)
    b = every.generate(ids, max_new_tokens=30, temperature=0)
    assert a.new_tokens == b.new_tokens == [target_only(target, ids[0], 30)]
    assert a.stats.draft_calls == b.stats.draft_calls and [r.candidates for r in a.stats.rounds] == \
        [r.candidates for r in b.stats.rounds]
    assert a.stats.draft_calls < 6 * len(a.stats.rounds)  # steps were skipped


@pytest.mark.slow
@pytest.mark.parametrize("early_exit", ["device", (1, 3)], ids=["device", "tiers"])
def test_sampling_through_replayed_steps_is_lossless(early_exit):
    """Seeded sampling (T = 1) through recorded graphs of 64-row rounds, SpecDec++ with a fixed h: with the steps
    decided on the device (skipped steps' candidates and logits left at 0, the draft rolled back by the steps that
    ran) and with tiers, each of the first three positions follows the target's exact marginal (chi-square)."""
    target, draft = make_pair("llama", vocab=12, noise=0.5, ctx=48)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marg = exact_marginals(target, prompt, SamplingConfig(1.0), 3)
    gen = graphed(make_gen(target, draft, "specdecpp", {"threshold": 0.3, "k_max": 4}, early_exit=early_exit))
    toks, accepted, discarded = sampled_rows(gen, prompt, 3, 1000)
    for i in range(3):
        assert_follows(toks[:, i], marg[i], f"{early_exit} through recorded graphs, position {i + 1}")
    assert accepted > 0 and discarded > 0, "speculation was not exercised"
