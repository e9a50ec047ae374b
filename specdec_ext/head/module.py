"""The SpecDec++ acceptance prediction head (Huang, Guo, Wang 2024, Sec. 3.2), with optional
draft-confidence inputs.

A small network that predicts the probability that the target accepts a draft candidate:

    x_0 = h + W_f (f - mu) / sigma + b_f,   x_l = x_{l-1} + SiLU(W_l x_{l-1} + b_l)  (l = 1..L),
    p_hat = sigmoid(w_out . x_L + b_out),

where h is a draft hidden state (the input of the draft's LM head; left out when ``use_hidden`` is
False) and f the candidate's draft-confidence features (``head/features.py``: q(y), top-1 minus
top-2 margin, entropy of q; none for the paper's head), normalised with statistics of the training set.

Which hidden state the head reads (``input_position``):

* ``"proposal"``: the state from which the candidate was sampled (its LM head gave q). It is known
  before the candidate is fed back to the draft, so the stop decision after candidate k costs no draft
  forward and a round may end at any K >= 1.
* ``"candidate"`` (the paper's head, Sec. 3.2): the state at the candidate, after it is fed to the
  draft. That forward also proposes the next candidate, so a decision on candidate k ends the round
  with K = k + 1 candidates (the reference implementation's order) and K = 1 is unreachable.

Unlike the official code, whose blocks are one module repeated (shared weights), the L blocks here
are independent. Checkpoints follow Hugging Face Hub mixin conventions: a directory with
``config.json`` and ``model.safetensors``, loadable offline from a local path.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from .features import CONFIDENCE_FEATURES, check_feature_names, confidence_features

INPUT_POSITIONS = ("proposal", "candidate")
DECODING_MODES = ("greedy", "sample")


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module, PyTorchModelHubMixin, library_name="specdec_ext", tags=["speculative-decoding", "specdec++"]):
    """Acceptance prediction head.

    Args:
        hidden_size: H, the draft model's hidden size (also the head's width).
        num_layers: L residual blocks (paper: 3).
        features: names of draft-confidence features it reads (``head.features.FEATURES``); () for the paper's head.
        use_hidden: read the draft hidden state (False: a head on the features alone).
        input_position: ``"proposal"`` or ``"candidate"`` (paper), see the module docstring.
        decoding: ``"greedy"`` or ``"sample"``: the decoding its labels were made for (None: unknown).
        temperature: the sampling temperature of its labels (``decoding == "sample"``).
        mean_accept: mean acceptance of its training labels (a prior for the goodput stop rule).
        draft_model / target_model: names of the pair it was trained for (recorded in config.json).
        draft_fingerprint: ``fingerprint(draft)`` of the draft it was trained for (checked at load).
        training: training settings (recorded in config.json).

    ``forward(hidden [..., H] or None, features [..., F] or None) -> logit [...]`` (float32);
    ``predict(...) -> p_accept [...]`` in [0, 1].
    """

    def __init__(self, hidden_size: int, num_layers: int = 3, features: Sequence[str] = (), use_hidden: bool = True,
                 input_position: str = "candidate", decoding: Optional[str] = None, temperature: Optional[float] = None,
                 mean_accept: Optional[float] = None, draft_model: Optional[str] = None,
                 target_model: Optional[str] = None, draft_fingerprint: Optional[str] = None,
                 training: Optional[dict[str, Any]] = None):
        super().__init__()
        if hidden_size < 1 or num_layers < 0:
            raise ValueError(f"AcceptanceHead: need hidden_size >= 1 and num_layers >= 0, got {hidden_size}, {num_layers}")
        if input_position not in INPUT_POSITIONS:
            raise ValueError(f"AcceptanceHead: input_position must be one of {INPUT_POSITIONS}, got {input_position!r}")
        if decoding is not None and decoding not in DECODING_MODES:
            raise ValueError(f"AcceptanceHead: decoding must be one of {DECODING_MODES} or None, got {decoding!r}")
        self.features = check_feature_names(features)
        if not use_hidden and not self.features:
            raise ValueError("AcceptanceHead: a head with use_hidden=False needs at least one confidence feature")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.use_hidden = use_hidden
        self.input_position = input_position
        self.decoding = decoding
        self.temperature = temperature
        self.mean_accept = mean_accept
        self.draft_model = draft_model
        self.target_model = target_model
        self.draft_fingerprint = draft_fingerprint
        self.training_config = dict(training or {})
        F = len(self.features)
        self.feature_proj = nn.Linear(F, hidden_size) if F else None
        self.register_buffer("feature_mean", torch.zeros(F))
        self.register_buffer("feature_std", torch.ones(F))
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_layers))
        self.out = nn.Linear(hidden_size, 1)

    # ------------------------------------------------------------------------------ forward
    def _input(self, hidden: Optional[torch.Tensor], features: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = self.out.weight.dtype
        x = None
        if self.use_hidden:
            if hidden is None:
                raise ValueError("AcceptanceHead: this head reads the draft hidden state: pass hidden [..., H]")
            if hidden.shape[-1] != self.hidden_size:
                raise ValueError(f"AcceptanceHead: hidden has size {hidden.shape[-1]} in its last dimension, but this head "
                                 f"was built for hidden_size = {self.hidden_size}")
            x = hidden.to(dtype)
        if self.features:
            if features is None or features.shape[-1] != len(self.features):
                got = None if features is None else list(features.shape)
                raise ValueError(f"AcceptanceHead: this head reads the confidence features {list(self.features)}: "
                                 f"pass features [..., {len(self.features)}], got {got}")
            f = self.feature_proj((features.to(dtype) - self.feature_mean) / self.feature_std)
            x = f if x is None else x + f
        return x

    def forward(self, hidden: Optional[torch.Tensor], features: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self._input(hidden, features)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1).float()

    @torch.no_grad()
    def predict(self, hidden: Optional[torch.Tensor], features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Predicted acceptance probability, float32, shape ``[...]``."""
        return torch.sigmoid(self(hidden, features))

    def features_of(self, dist: torch.Tensor, tokens: torch.Tensor, history: Optional[torch.Tensor] = None,
                    logits: bool = False) -> Optional[torch.Tensor]:
        """This head's input features for candidates ``tokens`` ``[B]`` under the draft distribution ``dist``
        ``[B, V]`` (probabilities, or logits with ``logits=True``): float32 ``[B, F]`` in the order of
        ``self.features``, or None for a head without features. ``history`` ``[B]``: the rows'
        acceptance-history values, for a head that reads ``recent_accept``."""
        if not self.features:
            return None
        conf = [n for n in self.features if n in CONFIDENCE_FEATURES]
        cols = dict(zip(conf, confidence_features(dist, tokens, conf, logits=logits).unbind(-1))) if conf else {}
        if "recent_accept" in self.features:
            if history is None:
                raise ValueError("AcceptanceHead: this head reads recent_accept: pass the rows' history [B]")
            cols["recent_accept"] = history.to(dist.device, torch.float32)
        return torch.stack([cols[n] for n in self.features], -1)

    def set_feature_normalization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Set the features' normalisation (statistics of the training set; std is clamped to >= 1e-6)."""
        F = len(self.features)
        if tuple(mean.shape) != (F,) or tuple(std.shape) != (F,):
            raise ValueError(f"feature normalisation: need mean and std of shape [{F}]")
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std.clamp_min(1e-6))

    # ------------------------------------------------------------------------------ checkpoints
    def config_dict(self) -> dict:
        """The constructor arguments that rebuild this head, as saved in ``config.json`` (current values)."""
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "features": list(self.features),
                "use_hidden": self.use_hidden, "input_position": self.input_position, "decoding": self.decoding,
                "temperature": self.temperature, "mean_accept": self.mean_accept, "draft_model": self.draft_model,
                "target_model": self.target_model, "draft_fingerprint": self.draft_fingerprint,
                "training": self.training_config}

    def save_pretrained(self, save_directory, **kwargs):
        """Write ``config.json`` (:meth:`config_dict`) and ``model.safetensors`` to ``save_directory``."""
        kwargs.setdefault("config", self.config_dict())
        return super().save_pretrained(save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a head saved by :meth:`save_pretrained` (a directory with ``config.json`` and
        ``model.safetensors``), or from the Hugging Face Hub by repository id.

        Raises: FileNotFoundError for a local path that is not such a directory."""
        path = Path(str(pretrained_model_name_or_path))
        looks_local = path.is_absolute() or str(pretrained_model_name_or_path).startswith((".", "~")) or path.exists() \
            or len(path.parts) > 2
        if looks_local and not (path / "config.json").is_file():
            raise FileNotFoundError(f"no acceptance head in {path}: expected a directory with config.json and "
                                    "model.safetensors (made by `specdec train-head`)")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, map_location: str = "cpu", strict: bool = False, **kwargs):
        if os.path.isdir(model_id):  # local: load quietly (the mixin prints to stdout, ahead of generated text)
            model_kwargs = {k: v for k, v in kwargs.items()
                            if k not in ("revision", "cache_dir", "force_download", "local_files_only", "token",
                                         "proxies", "resume_download")}
            model = cls(**model_kwargs)
            return cls._load_as_safetensor(model, os.path.join(model_id, "model.safetensors"), map_location, strict)
        return super()._from_pretrained(model_id=model_id, map_location=map_location, strict=strict, **kwargs)

    # ------------------------------------------------------------------------------ fused op
    def fused_weights(self, device=None) -> tuple:
        """Weights for ``ops.acceptance_head_step``, float32, on ``device``:
        ``(feature_weight [H, F] or None, feature_bias [H] or None, block_weight [L, H, H], block_bias [L, H],
        out_weight [H], out_bias [1])``, with the features' normalisation folded into the first two."""
        H, L = self.hidden_size, self.num_layers
        dev = device if device is not None else self.out.weight.device

        def f32(t):
            return t.detach().to(dev, torch.float32).contiguous()

        fw = fb = None
        if self.features:
            w, b = self.feature_proj.weight.detach().float(), self.feature_proj.bias.detach().float()
            std, mean = self.feature_std.float(), self.feature_mean.float()
            fw, fb = f32(w / std), f32(b - (w / std) @ mean)
        if L:
            bw = torch.stack([blk.linear.weight for blk in self.blocks])
            bb = torch.stack([blk.linear.bias for blk in self.blocks])
        else:
            bw, bb = torch.zeros(0, H, H), torch.zeros(0, H)
        return (fw, fb, f32(bw), f32(bb), f32(self.out.weight.reshape(H)), f32(self.out.bias.reshape(1)))

    # ------------------------------------------------------------------------------ checks
    def check_draft(self, draft_hidden_size: int, draft_fingerprint: Optional[str] = None,
                    allow_other_draft: bool = False) -> None:
        """Check that this head can read the draft: its hidden size, and (when both are known) the
        fingerprint of the draft it was trained for (``engine.models.fingerprint``).

        Raises: ValueError for another hidden size; ValueError for another draft of the same size, or a
        warning instead when ``allow_other_draft`` (its predictions would be about another model)."""
        if self.use_hidden and draft_hidden_size != self.hidden_size:
            raise ValueError(f"acceptance head was trained for hidden_size = {self.hidden_size}, but the draft model's "
                             f"hidden size is {draft_hidden_size}: this head belongs to another draft model")
        if draft_fingerprint and self.draft_fingerprint and draft_fingerprint != self.draft_fingerprint:
            msg = (f"acceptance head was trained for the draft {self.draft_model or ''} with fingerprint "
                   f"{self.draft_fingerprint}, but this draft's fingerprint is {draft_fingerprint}: a head predicts "
                   "acceptance for the draft it was trained with (retrain it with `specdec train-head`)")
            if not allow_other_draft:
                raise ValueError(msg + "; allow_other_draft=True (--allow-other-draft) uses it all the same")
            warnings.warn(msg, stacklevel=2)

    def describe(self) -> str:
        ins = (["hidden"] if self.use_hidden else []) + list(self.features)
        return f"{self.input_position} head on {'+'.join(ins)}" + (f", {self.decoding}" if self.decoding else "")
