"""The engine end to end on a CUDA device: greedy outputs equal target-only decoding on the same device for
every policy (one row, a ragged batch, continuous batching, both draft runners), a row's seeded samples equal
its output alone, and sampling follows the target's exact marginals (chi-square). Skipped without a CUDA device
(and without a CUDA build of the extension)."""

from __future__ import annotations

import pytest
import torch

from models import make_pair
from stats import assert_follows
from support import (CHAIN_CASES, PIDS, POLICIES, chain_pieces, exact_marginals, keeping, make_gen, sampled_rows,
                     target_only)
from specdec_ext import SpeculativeGenerator, ops
from specdec_ext.engine.backends import LeanBackend, _right_aligned
from specdec_ext.engine.graphs import chain_nodes
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.engine.sampling import SamplingConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not built"),
]


@pytest.fixture(scope="module")
def cuda_pair():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 greedy margins, as on the CPU
    target, draft = make_pair("llama")
    return target.cuda(), draft.cuda()


def prompts(V, n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.parametrize("fast_draft", [True, False], ids=["fast-draft", "hf-draft"])
@pytest.mark.parametrize("name,kw", POLICIES, ids=PIDS)
def test_greedy_equals_target_only_on_cuda(cuda_pair, name, kw, fast_draft):
    target, draft = cuda_pair
    gen = make_gen(target, draft, name, kw, fast_draft=fast_draft)
    ps = prompts(target.config.vocab_size)
    want = [target_only(target, p, 12) for p in ps]
    one = gen.generate(ps[0].view(1, -1).cuda(), max_new_tokens=12, temperature=0.0)
    assert one.new_tokens[0] == want[0]
    ids, mask = _right_aligned([p.tolist() for p in ps], max(len(p) for p in ps))  # left padding
    batch = gen.generate(ids.cuda(), attention_mask=mask.long().cuda(), max_new_tokens=12, temperature=0.0)
    assert batch.new_tokens == want
    cont = gen.generate_continuous([p.cuda() for p in ps], batch_size=2, max_new_tokens=12, temperature=0.0)
    assert cont.new_tokens == want
    if name != "autoregressive":
        assert batch.stats.accepted > 0, "speculation was not exercised"


@pytest.mark.parametrize("name,kw", [POLICIES[2], POLICIES[7]], ids=[PIDS[2], PIDS[7]])
def test_a_rows_seeded_samples_equal_its_output_alone_on_cuda(cuda_pair, name, kw):
    target, draft = cuda_pair
    gen = make_gen(target, draft, name, kw)
    ps = prompts(target.config.vocab_size, n=3, seed=4)
    cont = gen.generate_continuous([p.cuda() for p in ps], batch_size=2, max_new_tokens=10, temperature=1.0, seed=9)
    for i, p in enumerate(ps):
        alone = gen.generate(p.view(1, -1).cuda(), max_new_tokens=10, temperature=1.0, seed=9 + i)
        assert cont.new_tokens[i] == alone.new_tokens[0], f"request {i} differs from its output alone"


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [POLICIES[2], POLICIES[6], POLICIES[9]], ids=[PIDS[2], PIDS[6], PIDS[9]])
def test_engine_sampling_on_cuda_is_lossless(name, kw):
    target, draft = make_pair("llama", vocab=12, noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    cfg = SamplingConfig(1.0)
    marg = exact_marginals(target, prompt, cfg, 3)  # enumerated on the CPU, in fp32
    gen = make_gen(target.cuda(), draft.cuda(), name, kw)
    out = gen.generate(prompt.expand(3000, -1).cuda(), max_new_tokens=3, temperature=1.0, seed=1000)
    toks = torch.tensor(out.new_tokens)
    for i in range(3):
        assert_follows(toks[:, i], marg[i], f"{name} on CUDA, position {i + 1}")
    assert out.stats.accepted > 0 and out.stats.discarded > 0, "speculation was not exercised"


def test_forwards_on_cuda_run_without_cudnn_attention(cuda_pair, monkeypatch):
    """Both backends' forwards on CUDA leave cuDNN's attention out (engine/runner.py: it builds a plan per new
    shape, and decoding makes one every step), and torch's global choice is as it was afterwards."""
    target, draft = cuda_pair
    before = torch.backends.cuda.cudnn_sdp_enabled()
    seen = []
    runner, lean = CausalLMRunner(target, "target"), LeanBackend(draft, "draft")
    for obj, name in ((runner, "_forward"), (lean.lean_model, "forward")):
        inner = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _f=inner, **k: (
            seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())), _f(*a, **k))[1])
    runner.start(1)
    runner.forward(torch.tensor([[3, 4, 5]], device="cuda"), keep=1)
    lean.start(1, 16)
    lean.forward(torch.tensor([[3, 4, 5]], device="cuda"), 1, 3)
    assert seen == [(False, True), (False, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("name,kw", [POLICIES[0], POLICIES[2], POLICIES[7], POLICIES[9]],
                         ids=[PIDS[0], PIDS[2], PIDS[7], PIDS[9]])
def test_captured_steps_give_the_eager_steps_tokens_on_cuda(cuda_pair, name, kw):
    """On CUDA the rounds replay captured graphs by default (``cuda_graphs``), overlapped where the policy plans
    ahead: greedy and seeded samples equal the eager steps' (``cuda_graphs=False``) for one row and a batch padded
    to its bucket, and graphs were captured (``threshold="auto"`` plans from measured times: greedy only)."""
    target, draft = cuda_pair
    gen, eager = make_gen(target, draft, name, kw), make_gen(target, draft, name, kw, cuda_graphs=False)
    assert gen.cuda_graphs and not eager.cuda_graphs
    ps = prompts(target.config.vocab_size, n=3, seed=6)
    ids, mask = _right_aligned([p.tolist() for p in ps], max(len(p) for p in ps))
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)
    for t in temperatures:
        for x, m in ((ps[0].view(1, -1), None), (ids, mask.long())):
            kwargs = dict(max_new_tokens=14, temperature=t, seed=3)
            if m is not None:
                kwargs["attention_mask"] = m.cuda()
            assert gen.generate(x.cuda(), **kwargs).new_tokens == eager.generate(x.cuda(), **kwargs).new_tokens
    assert gen.steps.graphs.captures > 0


@pytest.mark.filterwarnings("default::DeprecationWarning")  # torch's inductor imports its own deprecated names
@pytest.mark.parametrize("name,kw", [POLICIES[2], POLICIES[9]], ids=[PIDS[2], PIDS[9]])
def test_compiled_forwards_in_graphs_give_target_only_greedy_tokens_on_cuda(cuda_pair, name, kw):
    """``compile=True``: the graphs replay inductor-compiled forwards; greedy tokens (fp32) for one row and a batch
    padded to its bucket equal target-only decoding's through eager steps."""
    target, draft = cuda_pair
    gen = make_gen(target, draft, name, kw, compile=True)
    plain = SpeculativeGenerator(target, None, policy="autoregressive", cuda_graphs=False)
    ps = prompts(target.config.vocab_size, n=3, seed=8)
    ids, mask = _right_aligned([p.tolist() for p in ps], max(len(p) for p in ps))
    for x, m in ((ps[0].view(1, -1), None), (ids, mask.long())):
        kwargs = dict(max_new_tokens=14, temperature=0)
        if m is not None:
            kwargs["attention_mask"] = m.cuda()
        assert gen.generate(x.cuda(), **kwargs).new_tokens == plain.generate(x.cuda(), **kwargs).new_tokens
    assert gen.steps.graphs.captures > 0 and gen.steps.compile

needs_chain = pytest.mark.skipif(not chain_nodes(), reason="the extension was not built for CUDA")


@needs_chain
def test_a_composed_graph_runs_its_middle_pieces_only_where_their_flags_hold_on_cuda():
    """``StepGraphs.replay_chain`` on a GPU: pieces captured apart and composed under conditional nodes; at each
    replay the GPU reads each flag, written by the pieces before it, with no read-back: a piece's writes land only
    where it ran, and a skipped piece's flag leaves the next one skipped."""
    from specdec_ext.engine.graphs import StepGraphs

    graphs = StepGraphs()
    x = torch.zeros(4, device="cuda")
    gate = torch.zeros(2, dtype=torch.bool, device="cuda")  # the inputs' flags: for piece 1, and piece 1's for 2
    for (a, b), want in CHAIN_CASES:
        gate.copy_(torch.tensor([a, b]))
        _, (out,) = graphs.replay_chain("chain", chain_pieces("cuda"), [x, gate], [])
        torch.cuda.synchronize()
        assert out.tolist() == [want] * 4, (a, b)
    assert graphs.captures == 1


@needs_chain
@pytest.mark.parametrize("kw", [{"threshold": 0.3, "k_max": 6}, {"threshold": "auto", "k_max": 8, "_head": "proposal"}],
                         ids=["h0.3", "auto"])
def test_steps_decided_on_the_device_give_target_only_tokens_on_cuda(cuda_pair, kw):
    """``early_exit="device"``: each round one captured graph whose draft steps after the first are conditional
    nodes; greedy tokens (fp32) for one row and a batch padded to its bucket equal target-only decoding's, and (a
    fixed h) the rounds draft the candidates a read after every step drafts, in as many draft forwards."""
    target, draft = cuda_pair
    gen = make_gen(target, draft, "specdecpp", kw, early_exit="device")
    every = make_gen(target, draft, "specdecpp", kw, early_exit=True)
    ps = prompts(target.config.vocab_size, n=3, seed=10)
    ids, mask = _right_aligned([p.tolist() for p in ps], max(len(p) for p in ps))
    one = gen.generate(ps[0].view(1, -1).cuda(), max_new_tokens=16, temperature=0)
    assert one.new_tokens[0] == target_only(target, ps[0], 16)
    if kw["threshold"] != "auto":  # auto plans from measured times
        base = every.generate(ps[0].view(1, -1).cuda(), max_new_tokens=16, temperature=0)
        assert [r.candidates for r in one.stats.rounds] == [r.candidates for r in base.stats.rounds]
        batch = gen.generate(ids.cuda(), attention_mask=mask.long().cuda(), max_new_tokens=16, temperature=0)
        assert batch.new_tokens == [target_only(target, p, 16) for p in ps]
    assert gen.steps.graphs.captures > 0


@needs_chain
@pytest.mark.slow
def test_sampling_through_conditional_nodes_is_lossless_on_cuda():
    """Seeded sampling (T = 1) through captured rounds of 64 rows with ``early_exit="device"``: each of the first
    three positions follows the target's exact marginal (chi-square, the CPU's enumeration in fp32)."""
    target, draft = make_pair("llama", vocab=12, noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marg = exact_marginals(target, prompt, SamplingConfig(1.0), 3)
    gen = make_gen(target.cuda(), draft.cuda(), "specdecpp", {"threshold": 0.3, "k_max": 4}, early_exit="device")
    toks, accepted, _ = sampled_rows(gen, prompt, 3, 1000)
    for i in range(3):
        assert_follows(toks[:, i], marg[i], f"conditional nodes on CUDA, position {i + 1}")
    assert accepted > 0 and gen.steps.graphs.captures > 0


@pytest.mark.parametrize("name,kw,early_exit,strict", [
    ("fixed", {"k": 3}, False, True),
    ("specdecpp", {"threshold": 0.3, "k_max": 6}, "device" if chain_nodes() else False, True),
    ("specdecpp", {"threshold": "auto", "k_max": 8, "_head": "confidence"}, False, False)],
    ids=["fixed-3", "h0.3", "auto"])
def test_overlapped_rounds_on_cuda_emit_the_tokens_of_rounds_one_at_a_time(cuda_pair, name, kw, early_exit, strict):
    """Overlapped rounds on a GPU (the default with CUDA graphs): one row and a batch padded to its bucket, EOS on,
    greedy (and seeded sampling but for ``threshold="auto"``, which plans from measured times) emit the tokens of
    rounds one at a time (``overlap=False``), greedy ones target-only decoding's, and rounds were launched ahead;
    ``strict``: a negative control (rounds launched ahead with a stale last token) emits other greedy tokens, and a
    second identical call (every graph captured) launches each round ahead with torch's synchronizing CUDA calls
    made errors (``torch.cuda.set_sync_debug_mode``): nothing in planning, advancing the inputs on the device or
    launching waits for the GPU."""
    from specdec_ext.engine.scheduler import Scheduler

    target, draft = cuda_pair
    over = make_gen(target, draft, name, kw, early_exit=early_exit)
    one = make_gen(target, draft, name, kw, early_exit=early_exit, overlap=False)
    assert over.cuda_graphs and over.overlap and not one.overlap
    ps = prompts(target.config.vocab_size, n=3, seed=12)
    ids, mask = _right_aligned([p.tolist() for p in ps], max(len(p) for p in ps))
    temperatures = (0.0,) if kw.get("threshold") == "auto" else (0.0, 1.0)
    calls = [dict(input_ids=ps[0].view(1, -1).cuda())] + \
        [dict(input_ids=ids.cuda(), attention_mask=mask.long().cuda(), eos_token_id=eos) for eos in (None, 7)]
    ahead, launch = [], Scheduler._launch_ahead

    def counted(self, flight):
        out = launch(self, flight)
        ahead.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Scheduler, "_launch_ahead", counted)
        for t in temperatures:
            for call in calls:
                kwargs = dict(call, max_new_tokens=18, temperature=t, seed=4)
                assert over.generate(**kwargs).new_tokens == one.generate(**kwargs).new_tokens, (t, call.keys())
        assert over.generate(calls[0]["input_ids"], max_new_tokens=18, temperature=0).new_tokens[0] == \
            target_only(target, ps[0], 18)
    assert any(ahead), "no round was launched ahead"
    if not strict:
        return
    control = make_gen(target, draft, name, kw, early_exit=early_exit)  # negative control: a stale last token
    control.steps.advance = keeping(control, "last")
    x = torch.randint(2, 48, (1, 8), generator=torch.Generator().manual_seed(8))
    want = target_only(target, x[0], 16)
    assert len(set(want)) > 4  # a varied continuation: a stale token is not the right one by chance
    assert control.generate(x.cuda(), max_new_tokens=16, temperature=0).new_tokens[0] != want

    def no_sync(self, flight):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, flight)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Scheduler, "_launch_ahead", no_sync)
        for call in calls:
            over.generate(**dict(call, max_new_tokens=18, temperature=0, seed=4))


@pytest.mark.slow
def test_sampling_through_overlapped_captured_rounds_is_lossless_on_cuda():
    """Seeded sampling (T = 1) through captured, overlapped rounds of 64 rows (fixed K = 3, each call's later rounds
    launched before the one before is read): each of the first four positions follows the target's exact marginal
    (chi-square, the CPU's enumeration in fp32)."""
    target, draft = make_pair("llama", vocab=12, noise=0.5)
    prompt = torch.tensor([[0, 5, 7, 3, 9]])
    marg = exact_marginals(target, prompt, SamplingConfig(1.0), 4)
    gen = SpeculativeGenerator(target.cuda(), draft.cuda(), policy="fixed", k=3)
    assert gen.cuda_graphs and gen.overlap
    toks, accepted, _ = sampled_rows(gen, prompt, 4, 5000)
    for i in range(4):
        assert_follows(toks[:, i], marg[i], f"overlapped rounds on CUDA, position {i + 1}")
    assert accepted > 0 and gen.steps.graphs.captures > 0

