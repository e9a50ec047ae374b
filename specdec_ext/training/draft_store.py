"""How a distilled draft (:mod:`.draft_train`) is stored: only what it does not share with its target.

A directory with ``config.json`` (the draft's Llama configuration, plus ``"specdec_draft"``: what it takes from the
target, the target's fingerprint and the distillation's record) and ``model.safetensors`` holding the decoder
layers' matrices as int8 with one float32 scale per output row (symmetric, round to nearest), the norms in float32
and the subset's token ids. Token embedding and output rows come from the target when the draft is loaded
(:func:`load_draft`). A feature draft (:class:`~specdec_ext.engine.feature_draft.FeatureDraft`, ``"kind": "eagle"``
in its record) stores its ``fc`` in float16 beside its one decoder layer. Two decoder layers of SmolLM2-135M take
7.1 MB this way, against 28 MB in float32; the int8 rounding moves the draft's distribution a little, not the
output's (speculation is lossless for any draft), and the shipped draft is the one every figure measures.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Union

import torch

from ..engine.models import output_rows, to_dtype
from ..engine.packed import PackedEmbedding
from ..engine.subset_head import SubsetLMHead

KEY = "specdec_draft"
FORMAT = 1


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.squeeze(1)


def save_draft(draft, out: Union[str, Path], target_fingerprint: str, record: dict) -> Path:
    """Write ``draft`` (a model of :func:`~specdec_ext.training.draft_train.new_draft`) to ``out``: its
    configuration and the tensors it does not share with its target (module docstring). Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    fc = getattr(draft, "fc", None)  # a FeatureDraft: its fc, then its one-layer model as any draft
    if fc is not None:  # float16: int8 rows would round the embedding's half, small beside the feature's
        tensors["fc.weight"] = fc.weight.detach().to(torch.float16).contiguous()
        tensors["fc.bias"] = fc.bias.detach().float().contiguous()
        draft = draft.model
    for name, t in draft.model.layers.state_dict().items():
        name = f"model.layers.{name}"
        if t.dim() == 2:
            q, s = _quantize(t)
            tensors[name + ".int8"] = q.contiguous()
            tensors[name + ".scale"] = s.contiguous()
        else:
            tensors[name] = t.detach().float().contiguous()
    tensors["model.norm.weight"] = draft.model.norm.weight.detach().float().contiguous()
    tensors["lm_head.token_ids"] = draft.lm_head.token_ids.to(torch.int32).cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": f"{KEY}/{FORMAT}"})
    cfg = draft.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "quantization_config"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    cfg[KEY] = {"format": FORMAT, "shares": "the target's token embedding and its output rows of lm_head.token_ids",
                "target_fingerprint": target_fingerprint, **record}
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    return out


def is_stored_draft(path: Union[str, Path, None]) -> bool:
    """True for a directory :func:`save_draft` wrote."""
    if path is None:
        return False
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and KEY in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def attach_target_rows(draft, target, token_ids: torch.Tensor) -> None:
    """Give ``draft`` the target's token embedding (shared where the dtypes agree, else a cast copy) and a
    :class:`SubsetLMHead` of the target's output rows ``token_ids``, both frozen, in the draft's dtype."""
    dtype = draft.model.norm.weight.dtype
    emb = target.get_input_embeddings()
    if isinstance(emb, PackedEmbedding):  # a quantized target's embedding, read from its blocks: shared
        draft.model.embed_tokens = emb if emb.dtype == dtype else emb.shared(dtype)
    else:
        shared = emb.weight if emb.weight.dtype == dtype else emb.weight.detach().to(dtype)
        draft.model.embed_tokens.weight = torch.nn.Parameter(shared, requires_grad=False)
    rows = output_rows(target, token_ids).to(dtype)
    draft.lm_head = SubsetLMHead(rows, token_ids, emb.num_embeddings).requires_grad_(False)
    draft.config.vocab_size = emb.num_embeddings


def _no_init():
    """transformers' context that skips weight initialisation (``initialization.no_init_weights`` in 5.x), or none."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def load_draft(path: Union[str, Path], target, dtype: torch.dtype = torch.float32, check: bool = True):
    """The draft stored in ``path`` for ``target``, in ``dtype`` on the target's device.

    Raises ValueError (one line naming the directory) when ``check`` and the target is not the one the draft was
    distilled for (its fingerprint), or when the stored tensors do not fit the configuration."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..engine.models import fingerprint

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    meta = raw.pop(KEY)
    if check and meta.get("target_fingerprint") not in (None, fingerprint(target)):
        raise ValueError(f"{path}: this draft was distilled for another target (fingerprint "
                         f"{meta.get('target_fingerprint')}, this target's {fingerprint(target)})")
    raw.pop("dtype", None)
    cfg = LlamaConfig.from_dict(raw)
    cfg.tie_word_embeddings = False
    with _no_init():  # every tensor is loaded or attached below: no random initialisation (1.4 s for two drafts)
        draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    blob = load_file(str(path / "model.safetensors"))
    state = {}
    for name, t in blob.items():
        if name.endswith(".int8"):
            state[name[: -len(".int8")]] = t.float() * blob[name[: -len(".int8")] + ".scale"].unsqueeze(1)
        elif not name.endswith(".scale") and name.startswith("model."):
            state[name] = t
        elif name in ("fc.weight", "fc.bias"):
            state[name] = t.float()
    layers = {k[len("model.layers."):]: v for k, v in state.items() if k.startswith("model.layers.")}
    try:
        draft.model.layers.load_state_dict(layers)
        draft.model.norm.weight.data.copy_(state["model.norm.weight"])
    except (RuntimeError, KeyError) as e:
        raise ValueError(f"{path}: the stored tensors do not fit its config.json ({str(e).splitlines()[0][:200]})") \
            from None
    token_ids = blob["lm_head.token_ids"].long()
    draft = to_dtype(draft, dtype, target.device)
    attach_target_rows(draft, target, token_ids)
    draft.config._name_or_path = path.name
    if meta.get("kind") == "eagle":
        from ..engine.feature_draft import FeatureDraft

        if "fc.weight" not in state or "fc.bias" not in state:
            raise ValueError(f"{path}: a feature draft (kind 'eagle') must store fc.weight and fc.bias")
        H = cfg.hidden_size
        fc = torch.nn.Linear(2 * H, H, bias=True)
        fc.weight.data.copy_(state["fc.weight"])
        fc.bias.data.copy_(state["fc.bias"])
        draft = FeatureDraft(draft, fc.to(dtype=dtype, device=target.device))
    return draft.eval().requires_grad_(False)
