"""Helpers shared by the engine, losslessness and benchmark tests: acceptance heads for the tiny test
drafts, the list of policies every suite runs, and a generator factory."""

from __future__ import annotations

import math

import torch

from specdec_ext import AcceptanceHead, SpeculativeGenerator
from specdec_ext.head.features import FEATURES
from specdec_ext.policies.goodput import CostModel

# (policy name, keyword arguments); "_head" picks the acceptance head (default: the paper's kind)
POLICIES = [("autoregressive", {}), ("fixed", {"k": 1}), ("fixed", {"k": 4}), ("heuristic", {}), ("confidence", {}),
            ("adaedl", {}), ("specdecpp", {"threshold": 0.3, "k_min": 2}),
            ("specdecpp", {"threshold": 0.7, "k_min": 1, "k_max": 6}),
            ("specdecpp", {"threshold": 0.5, "_head": "proposal"}),
            ("specdecpp", {"threshold": "auto", "k_max": 8, "_head": "proposal"})]
PIDS = [n + "-" + "-".join(k.strip("_") + str(v) for k, v in kw.items()) for n, kw in POLICIES]

# a GPU-like cost model for tests (no profiling): flat verification, draft step 0.15 of it
TEST_COSTS = CostModel([10.0] * 30, 1.5, 0.0, 0.2, {"kind": "test"})


def head_for(draft, bias=1.5, seed=0, kind="candidate"):
    """A random acceptance head for ``draft``: the paper's kind (hidden state at the candidate), or a
    "proposal" head reading the hidden state and every feature (confidence and acceptance history)."""
    torch.manual_seed(seed)
    H = draft.get_output_embeddings().weight.shape[1]
    if kind == "candidate":
        head = AcceptanceHead(H, num_layers=2)
    else:
        head = AcceptanceHead(H, num_layers=2, features=FEATURES, input_position="proposal", mean_accept=0.7)
        head.set_feature_normalization(torch.tensor([0.5, 0.3, 2.0, 0.75]), torch.tensor([0.3, 0.3, 1.0, 0.2]))
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

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(t) for t in text.split()]}


def make_gen(target, draft, name, kw, **extra):
    """A SpeculativeGenerator for one entry of ``POLICIES`` (test costs for cost-aware policies)."""
    kw = dict(kw)
    kind = kw.pop("_head", "candidate")
    return SpeculativeGenerator(target, draft, policy=name, head=head_for(draft, kind=kind), costs=TEST_COSTS,
                                **extra, **kw)
