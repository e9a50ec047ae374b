"""The SpecDec++ acceptance prediction head (Huang, Guo, Wang 2024, Sec. 3.2).

A small network on the draft model's last hidden state (the input of its LM head) at a candidate
token's position, predicting the probability that the target accepts that candidate:

    x_0 = h,  x_l = x_{l-1} + SiLU(W_l x_{l-1} + b_l)  (l = 1..L, L independent blocks),
    p_hat = sigmoid(w_out . x_L + b_out).

Unlike the official code, whose blocks are one module repeated (shared weights), the L blocks here
are independent. Checkpoints follow Hugging Face Hub mixin conventions: a directory with
``config.json`` and ``model.safetensors``, loadable offline from a local path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module, PyTorchModelHubMixin, library_name="specdec_ext", tags=["speculative-decoding", "specdec++"]):
    """Acceptance prediction head.

    Args:
        hidden_size: H, the draft model's hidden size.
        num_layers: L residual blocks (paper: 3).
        draft_model / target_model: names or paths of the pair it was trained for (recorded in config.json).
        training: training settings (recorded in config.json).

    ``forward(hidden [..., H]) -> logit [...]`` (float32); ``predict(hidden) -> p_accept [...]`` in [0, 1].
    """

    def __init__(self, hidden_size: int, num_layers: int = 3, draft_model: Optional[str] = None,
                 target_model: Optional[str] = None, training: Optional[dict[str, Any]] = None):
        super().__init__()
        if hidden_size < 1 or num_layers < 0:
            raise ValueError(f"AcceptanceHead: need hidden_size >= 1 and num_layers >= 0, got {hidden_size}, {num_layers}")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.draft_model = draft_model
        self.target_model = target_model
        self.training_config = dict(training or {})
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_layers))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"AcceptanceHead: hidden has size {hidden.shape[-1]} in its last dimension, but this head "
                             f"was built for hidden_size = {self.hidden_size}")
        x = hidden.to(self.out.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1).float()

    @torch.no_grad()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted acceptance probability, float32, shape ``hidden.shape[:-1]``."""
        return torch.sigmoid(self(hidden))

    def fused_weights(self, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_weight [L, H, H], block_bias [L, H], out_weight [H], out_bias [1]) as float32, for the fused op."""
        H, L = self.hidden_size, self.num_layers
        dev = device if device is not None else self.out.weight.device
        if L:
            w = torch.stack([b.linear.weight for b in self.blocks])
            b = torch.stack([b.linear.bias for b in self.blocks])
        else:
            w = torch.zeros(0, H, H)
            b = torch.zeros(0, H)
        return (w.detach().to(dev, torch.float32).contiguous(), b.detach().to(dev, torch.float32).contiguous(),
                self.out.weight.detach().reshape(H).to(dev, torch.float32).contiguous(),
                self.out.bias.detach().reshape(1).to(dev, torch.float32).contiguous())

    def check_draft(self, draft_hidden_size: int) -> None:
        """Raise ValueError if this head cannot read a draft model with ``draft_hidden_size``."""
        if draft_hidden_size != self.hidden_size:
            raise ValueError(f"acceptance head was trained for hidden_size = {self.hidden_size}, but the draft model's "
                             f"hidden size is {draft_hidden_size}: this head belongs to another draft model")
