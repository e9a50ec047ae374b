"""CUDA graphs of the round's steps (``engine/graphs.py``). Off CUDA the graphs are recorded, not captured
(``StepRunner(cuda_graphs="emulate")``): each replay runs on the kept input buffers and writes the outputs kept
from capture, so these tests check the plumbing a captured graph depends on (inputs copied in, outputs read before
the next replay overwrites them, caches' lengths unchanged by capture, graphs dropped with a replaced cache). The
CUDA tests (``tests/test_cuda_engine.py``) run the captured graphs themselves."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from support import PIDS, POLICIES, head_for, make_gen
from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.round import BUCKETS, StepRunner


def graphed(gen) -> SpeculativeGenerator:
    gen.steps = StepRunner(BUCKETS, cuda_graphs="emulate")
    return gen


@pytest.mark.parametrize("name,kw", POLICIES, ids=PIDS)
@pytest.mark.parametrize("early_exit", [True, False, (1, 3)], ids=["early-exit", "to-cap", "tiers"])
def test_replayed_steps_give_the_eager_steps_tokens(name, kw, early_exit):
    """Every policy, greedy and seeded sampling, a batch padded to its bucket and one row: the replayed steps emit
    exactly the eager steps' tokens (fp32), and a second round of the calls captures nothing new. ``threshold="auto"`` plans
    its rounds from measured times, so its seeded samples differ from run to run (the candidates drawn differ; the
    distribution does not): greedy only there."""
    target, draft = make_pair("llama")
    g = torch.Generator().manual_seed(1)
    gen = graphed(make_gen(target, draft, name, kw, early_exit=early_exit))
    eager = make_gen(target, draft, name, kw, early_exit=early_exit)
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)
    calls = [(torch.randint(2, 48, (3, 6), generator=g), t) for t in temperatures]
    calls += [(torch.randint(2, 48, (1, 9), generator=g), t) for t in temperatures]
    for ids, temperature in calls:
        want = eager.generate(ids, max_new_tokens=20, temperature=temperature, seed=5).new_tokens
        assert gen.generate(ids, max_new_tokens=20, temperature=temperature, seed=5).new_tokens == want
    captured = gen.steps.graphs.captures
    assert captured > 0
    for ids, temperature in calls:
        want = eager.generate(ids, max_new_tokens=20, temperature=temperature, seed=5).new_tokens
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
