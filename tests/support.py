"""Helpers shared by the engine, losslessness and benchmark tests: acceptance heads for the tiny test
drafts, the list of policies every suite runs, and a generator factory."""

from __future__ import annotations

import math

import torch

from specdec_ext import AcceptanceHead, SpeculativeGenerator
from specdec_ext.head.features import CONFIDENCE_FEATURES, FEATURES
from specdec_ext.engine.round import BUCKETS, StepRunner
from specdec_ext.engine.sampling import SamplingConfig, process_logits
from specdec_ext.policies.costs import BatchCosts, CostModel
from specdec_ext.zoo import unpacked_pair
from stats import assert_follows

# (policy name, keyword arguments); "_head" picks the acceptance head (default: the paper's kind)
POLICIES = [("autoregressive", {}), ("fixed", {"k": 1}), ("fixed", {"k": 4}), ("heuristic", {}), ("confidence", {}),
            ("adaedl", {}), ("specdecpp", {"threshold": 0.3, "k_min": 2}),
            ("specdecpp", {"threshold": 0.7, "k_min": 1, "k_max": 6}),
            ("specdecpp", {"threshold": 0.5, "_head": "proposal"}),
            ("specdecpp", {"threshold": "auto", "k_max": 8, "_head": "proposal"})]
PIDS = [n + "-" + "-".join(k.strip("_") + str(v) for k, v in kw.items()) for n, kw in POLICIES]
# one policy of each way of running rounds: plain decoding, a fixed K, a stop rule (which decides from the draft's side
# only, so which rule it is cannot change what happens after it), and the verification budget of a cost-aware batch;
# for what the engine does around rounds (admissions, processed distributions), once each way is enough
EACH_WAY = {"autoregressive-", "fixed-k4", "specdecpp-threshold0.3-k_min2",
            "specdecpp-thresholdauto-k_max8-headproposal"}
EACH_WAY_POLICIES = [policy for policy, pid in zip(POLICIES, PIDS) if pid in EACH_WAY]
EACH_WAY_PIDS = [pid for pid in PIDS if pid in EACH_WAY]

# a GPU-like cost model for tests (no profiling): flat verification, draft step 0.15 of it
TEST_COSTS = CostModel([10.0] * 30, 1.5, 0.0, 0.2, {"kind": "test"})
# batch costs for the verification budget: GPU-like, flat in rows and nearly flat in tokens (the batch drafts deep)
TEST_BATCH_COSTS = BatchCosts([1, 8192], [[10.0 + 1.6 * k for k in range(9)]] * 2,
                              [[10.0 + 0.1 * n for n in range(1, 10)]] * 2, {"kind": "test"})


def perturbed(model, params, noise: float, seed: int):
    """``model`` in eval mode after Gaussian noise of ``noise`` times each of ``params``' standard deviation (1 for a
    single number) was added to them: a draft that partly agrees with the target it was made from."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * noise * (p.std() if p.numel() > 1 else 1.0))
    return model.eval()


def head_for(draft, bias=1.5, seed=0, kind="candidate"):
    """A random acceptance head for ``draft``: the paper's kind (hidden state at the candidate), a "proposal" head
    reading the hidden state and every feature (confidence and acceptance history), or a "confidence" one (a
    proposal head reading the confidence features only, as the bundled heads do)."""
    torch.manual_seed(seed)
    H = draft.get_output_embeddings().weight.shape[1]
    if kind == "candidate":
        head = AcceptanceHead(H, num_layers=2)
    else:
        n = len(FEATURES) if kind == "proposal" else len(CONFIDENCE_FEATURES)
        head = AcceptanceHead(H, num_layers=2, features=FEATURES[:n], input_position="proposal", mean_accept=0.7)
        head.set_feature_normalization(torch.tensor([0.5, 0.3, 2.0, 0.75][:n]), torch.tensor([0.3, 0.3, 1.0, 0.2][:n]))
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head


def constant_head(draft, p_accept: float, kind: str = "candidate"):
    """A head whose prediction is p_accept whatever its inputs (zero weights, biased output)."""
    head = AcceptanceHead(draft.get_output_embeddings().weight.shape[1], num_layers=1,
                          input_position=kind, features=() if kind == "candidate" else ("token_prob",))
    with torch.no_grad():
        for prm in head.parameters():
            prm.zero_()
        head.out.bias.fill_(math.log(p_accept / (1 - p_accept)))
    return head


class DigitTokenizer:
    """Text of space-separated integers <-> ids; enough of a tokenizer for the data pipeline and benchmark."""

    eos_token_id = 1
    pad_token_id = 1
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def target_only(target, prompt, n: int) -> list[int]:
    """transformers' greedy decoding of ``n`` tokens after ``prompt`` ``[t]`` by the target alone (no EOS), on the
    target's device."""
    out = target.generate(prompt.view(1, -1).to(target.device), max_new_tokens=n, do_sample=False, pad_token_id=1,
                          eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_gen(target, draft, name, kw, **extra):
    """A SpeculativeGenerator for one entry of ``POLICIES`` (test costs for cost-aware policies)."""
    kw = dict(kw)
    kind = kw.pop("_head", "candidate")
    extra.setdefault("batch_costs", TEST_BATCH_COSTS)
    return SpeculativeGenerator(target, draft, policy=name, head=head_for(draft, kind=kind), costs=TEST_COSTS,
                                **extra, **kw)


# ------------------------------------------------------------------------------ op cases (test_ops,
# test_lossless_ops, test_cuda_ops) and exact target marginals (test_lossless_engine, test_sliding_window)
def make_case(B, K, V, dtype=torch.float32, seed=0, ragged=True, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * sharp, -1)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharp, -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    u = torch.rand(B, K + 1, generator=g).clamp_min(2**-24)
    n = torch.randint(0, K + 1, (B,), generator=g) if ragged else None
    return ids, q.to(dtype), p.to(dtype), n, u


def logits_case(B, K, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dl = (torch.randn(B, K, V, generator=g) * 2).to(dtype)
    tl = (torch.randn(B, K + 1, V, generator=g) * 2).to(dtype)
    ids = torch.multinomial(torch.softmax(dl.float().reshape(-1, V), -1), 1, generator=g).view(B, K)
    # greedy rows get the target's argmax as candidates, with an occasional mismatch
    temp = torch.tensor([0.0, 0.6, 1.0, 1.7] * B)[:B]
    for b in range(0, B, 4):
        ids[b] = tl[b, :K].float().argmax(-1)
        if b % 8 == 0:
            ids[b, K // 2] = (ids[b, K // 2] + 1) % V
    u = torch.rand(B, K + 1, generator=g).clamp_min(2**-24)
    n = torch.randint(0, K + 1, (B,), generator=g)
    return ids, dl, tl, temp, n, u


def head_args(B=6, H=32, L=3, dtype=torch.float32, seed=0, F=0):
    """(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight, out_bias)."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(B, H, generator=g).to(dtype)
    feats = (torch.rand(B, F, generator=g), torch.randn(H, F, generator=g) * 0.5, torch.randn(H, generator=g) * 0.1) \
        if F else (None, None, None)
    return (hid, *feats, torch.randn(L, H, H, generator=g) * 0.2, torch.randn(L, H, generator=g) * 0.1,
            torch.randn(H, generator=g) * 0.3, torch.randn(1, generator=g))


def check_positions(out, num, target, what, focus=0):
    """Chi-square at every position some chain reached; every chain must reach ``focus``."""
    K = out.shape[1] - 1
    assert bool((num >= focus).all()), f"{what}: a chain stopped before the focus position {focus}"
    for i in range(K + 1):
        reached = num >= i
        if int(reached.sum()) == 0:
            assert i > focus
            continue
        assert_follows(out[reached, i], target[i], f"{what}, position {i}")


def _probs(K, V, seed, sharp=1.5, rows=None):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows or K, V, generator=g, dtype=torch.float64) * sharp, -1)


def case(name, K, V, seed=0, focus=0):
    """Draft/target rows for a named case. Before position ``focus`` the draft equals the target, so
    every chain is accepted up to ``focus`` and the case's structure is tested there (focus = K
    tests the bonus token)."""
    q, p = _case(name, K, V, seed)
    q[:focus] = p[:focus]
    return q, p


def _case(name, K, V, seed):
    q = _probs(K, V, seed)
    p = _probs(K + 1, V, seed + 1000)
    if name == "q zeros where p > 0":
        q[:, : V // 2] = 0
        q = q / q.sum(-1, keepdim=True)
    elif name == "p = q":
        p[:K] = q
    elif name == "one-hot target":
        p = torch.zeros(K + 1, V, dtype=torch.float64)
        p[torch.arange(K + 1), torch.arange(K + 1) % V] = 1
    elif name == "adversarial":  # draft = softmax(-target logits): mass exactly where the target has little
        logits = torch.randn(K + 1, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 2
        p = torch.softmax(logits, -1)
        q = torch.softmax(-logits[:K], -1)
    return q, p


@torch.inference_mode()
def sampled_rows(gen, prompt: torch.Tensor, n_pos: int, seed: int, calls: int = 47, rows: int = 64) -> tuple:
    """``calls`` seeded calls (T = 1) of ``rows`` copies of ``prompt`` ``[1, t]`` (on ``gen``'s target's device), each
    row its own seed from ``seed`` on (47 x 64 = 3008 rows: captured rounds of a full bucket): ``(tokens [calls *
    rows, n_pos], candidates accepted, candidates discarded)`` over all of them."""
    toks, accepted, discarded = [], 0, 0
    x = prompt.expand(rows, -1).to(gen.target.device)
    for call in range(calls):
        out = gen.generate(x, max_new_tokens=n_pos, temperature=1.0, seed=seed + rows * call)
        toks += out.new_tokens
        accepted, discarded = accepted + out.stats.accepted, discarded + out.stats.discarded
    return torch.tensor(toks), accepted, discarded


def exact_marginals(target, prompt: torch.Tensor, cfg: SamplingConfig, n_pos: int, eos=None) -> list[torch.Tensor]:
    """Marginal distribution of generated positions 1..n_pos under target-only sampling; with ``eos`` (a token id),
    position i's distribution over the sequences that have not ended (emitted ``eos``) before it."""
    V = target.config.vocab_size
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    weights = torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(n_pos):
        if eos is not None:  # sequences that emitted EOS end: they have no next position
            weights = weights * (prefixes != eos).all(1).double()
        ids = torch.cat([prompt.expand(prefixes.shape[0], -1), prefixes], 1)
        with torch.no_grad():  # plain numbers: a chi-square reads them
            probs = process_logits(target(ids).logits[:, -1], cfg).double()
        joint = (weights.unsqueeze(1) * probs)
        marginals.append(joint.sum(0) / weights.sum())
        weights = joint.reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(prefixes.shape[0]).unsqueeze(1)], 1)
    return marginals


def spy_draft_reads(monkeypatch) -> list:
    """The longest context the draft sees at its first read of a request from now on: the tokens it reads (a
    backend's ``append`` into an empty draft row) and the two each round feeds, appended to the returned list."""
    from specdec_ext.engine import backends

    widths = []
    for cls in (backends.LeanBackend, backends.HFBackend):
        def spy(self, slots, seqs, starts, real=cls.append):
            if self.name == "draft" and any(s == 0 for s in starts):
                widths.append(max(len(q) for q, s in zip(seqs, starts) if s == 0) + 2)
            return real(self, slots, seqs, starts)

        monkeypatch.setattr(cls, "append", spy)
    return widths


def bundled(name: str):
    """The bundled pair's model directory ``name`` (target or draft), its weights unpacked."""
    return unpacked_pair() / name


# StepGraphs.replay_chain's check (tests/test_graphs.py recorded, tests/test_cuda_engine.py on a GPU): each gate's pair
# of flags (piece 1 runs, piece 1 lets piece 2 run) and what the chain returns, y = 2 * (((0 + 1) * 10) + 5)
CHAIN_CASES = (((True, True), 30.0), ((True, False), 20.0), ((False, True), 2.0), ((True, True), 30.0))


def chain_pieces(device: str) -> list:
    """Four pieces for StepGraphs.replay_chain over inputs ``(x, gate)``: the first makes y = x + 1 and the flags
    (the first from ``gate[0]``); piece 1 multiplies y by 10 and sets the second flag from ``gate[1]``; piece 2 adds 5;
    the last returns ``(2 y,)``."""
    def first(x, gate):
        flags = torch.zeros(2, dtype=torch.bool, device=device)
        flags[0].copy_(gate[0])
        return x + 1, flags

    def times_ten(x, gate, y, flags):
        y.mul_(10)
        flags[1].copy_(gate[1])

    def plus_five(x, gate, y, flags):
        y.add_(5)

    def last(x, gate, y, flags):
        return (y * 2,)

    return [first, times_ten, plus_five, last]


def cache_case(B=3, Hq=8, Hkv=2, n=3, C=40, D=64, dtype=torch.float32, starts=(0, 17, 37), seed=1, device="cpu"):
    """query [B, Hq, n, D] (a transposed view), key and value views of the first B slots of a cache with spare slots
    and columns (as the lean model passes them), starts [B]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B + 2, Hkv, C + 3, D, generator=g).to(dtype)[:B, :, :C]
    v = torch.randn(B + 2, Hkv, C + 3, D, generator=g).to(dtype)[:B, :, :C]
    s = torch.tensor(list(starts)[:B], dtype=torch.int64)
    return [t.to(device) for t in (q, k, v, s)]


def advance_case(P=8, W=5, rows=6, seed=0, accepted=True):
    """Persistent row inputs and a round's outputs for ``advance_rows``: P rows, W emitted columns, negative error
    codes and counts past W - 1 among the accepted ones."""
    g = torch.Generator().manual_seed(seed)
    last, prev = torch.randint(0, 90, (P,), generator=g), torch.randint(0, 90, (P,), generator=g)
    room, seeds = torch.randint(0, 30, (P,), generator=g), torch.randint(0, 2**40, (P, 2), generator=g)
    emitted = torch.randint(0, 90, (P, W), generator=g)
    acc = torch.randint(-2, W + 2, (P,), generator=g) if accepted else None
    return [last, prev, room, seeds, emitted, acc, rows]


def keeping(gen, name: str):
    """A broken ``StepRunner.advance`` (negative controls): ``gen``'s, but the input ``name`` (``"last"`` or
    ``"room"``) left as the round before had it."""
    advance, at = gen.steps.advance, {"last": 0, "room": 2}[name]

    def broken(launched, drafting, draws):
        kept = gen.steps._buffers[launched.P][name][0][: launched.B].clone()
        out = advance(launched, drafting, draws)
        out[at].copy_(kept)
        return out

    return broken


def graphed(gen, overlap: bool = False):
    """``gen`` with recorded graphs, its rounds one at a time (``overlap=False``: what the eager rounds do) or
    overlapped where they can be (tests/test_overlap.py)."""
    gen.steps = StepRunner(BUCKETS, cuda_graphs="emulate")
    gen.overlap = overlap
    return gen


def greedy_against_target(gen, target, prompt_ids: int = 48, pad_left=((1, 2), (2, 4))) -> torch.Tensor:
    """Greedy decoding of 3 left-padded rows of 7 random ids in [2, prompt_ids) (rows ``pad_left``'s (row, pads)
    padded) through ``gen`` and through the target's own ``generate()``: asserts the two are equal and that
    speculation was exercised; returns the emitted tokens ``[3, 32]``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, prompt_ids, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in pad_left:
        mask[row, :pads] = 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=1,
                          eos_token_id=None)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=32, temperature=0, pad_token_id=1)
    assert torch.equal(out.sequences, ref), "greedy output differs from the target's own generate()"
    assert out.stats.accepted > 0 and out.stats.discarded > 0, "speculation was not exercised"
    return out.sequences[:, ids.shape[1]:]
