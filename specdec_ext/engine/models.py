"""Facts about a Hugging Face causal LM that the engine, the head pipeline and the zoo all need."""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Optional, Sequence

import torch

from .. import ops
from .packed import PackedLinear


def vocab_size(model) -> int:
    """V, the number of rows of the model's output embedding (its LM head; the width of a
    :class:`~specdec_ext.engine.subset_head.SubsetLMHead`'s logits)."""
    emb = model.get_output_embeddings()
    if emb is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings: not a causal LM")
    return getattr(emb, "vocab_size", None) or getattr(emb, "out_features", None) or emb.weight.shape[0]


def _config_ids(cfg, key: str) -> list[int]:
    """The token ids ``cfg`` names under ``key`` (one id or a list; none where unset)."""
    value = getattr(cfg, key, None)
    return [i for i in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(i, int) and i >= 0]


def special_ids(model) -> list[int]:
    """The special token ids ``model``'s config names (BOS, EOS, padding, decoder start), sorted, without repeats."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return sorted({i for key in keys for i in _config_ids(model.config, key)})


def stand_in_id(model) -> int:
    """The id a model reads in place of one beyond its embedding rows (a token only a larger-vocabulary partner can
    emit): its config's padding, EOS or BOS id, whichever it names first within its rows, else 0."""
    rows = vocab_size(model)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        ids = _config_ids(model.config, key)
        if ids and ids[0] < rows:
            return ids[0]
    return 0


def check_vocabularies(target, draft, tokenizers: Optional[Sequence] = None) -> None:
    """Refuse a draft and target that cannot share one tokenizer; accept embedding sizes that differ by padding rows.

    Pairs often share a tokenizer but not an embedding size (Qwen2.5 0.5B to 3B have 151,936 rows, 7B and larger
    152,064: rows no tokenizer id reaches). With ``tokenizers`` (the target's and the draft's), the two must have the
    same vocabulary and special tokens and both models must embed every id they produce. Without, the special ids
    both configs name must lie within the smaller model's rows, and a one-line warning names the larger model's
    extra rows, taken as padding.

    Raises:
        ValueError: one line naming both sizes and what differs."""
    vt, vd = vocab_size(target), vocab_size(draft)
    sizes = f"the target has V = {vt} embedding rows and the draft V = {vd}"
    small = min(vt, vd)
    if tokenizers is not None and all(t is not None for t in tokenizers):
        tt, dt = tokenizers
        if tt.get_vocab() != dt.get_vocab():
            raise ValueError(f"vocabulary mismatch: the target's and the draft's tokenizers differ in their vocabulary "
                             f"({len(tt)} and {len(dt)} entries); {sizes}")
        if sorted(tt.all_special_tokens) != sorted(dt.all_special_tokens):
            raise ValueError(f"vocabulary mismatch: the tokenizers' special tokens differ ({sorted(tt.all_special_tokens)}"
                             f" and {sorted(dt.all_special_tokens)}); {sizes}")
        if len(tt) > small:
            raise ValueError(f"vocabulary mismatch: the tokenizer produces ids up to {len(tt) - 1} but {sizes}")
        return
    if vt == vd:
        return
    beyond = [i for i in sorted(set(special_ids(target)) | set(special_ids(draft))) if i >= small]
    if beyond:
        raise ValueError(f"vocabulary mismatch: {sizes}, and the special token ids {beyond} lie beyond the smaller's "
                         "rows; speculative decoding needs a draft and target that share one tokenizer")
    larger = "target" if vt > vd else "draft"
    warnings.warn(f"{sizes}: the {larger}'s rows {small}..{max(vt, vd) - 1} are taken as padding no tokenizer "
                  "produces (pass tokenizers=(target's, draft's) to check)", stacklevel=4)


def hidden_size(model) -> int:
    """H, the width of the LM head's input (the hidden state an acceptance head reads)."""
    return model.get_output_embeddings().in_features


def output_rows(model, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``token_ids`` ``[N]`` int64 of the output layer's weight ``[N, H]``, in the model's float dtype (a
    quantized model's, held packed: the values its blocks stand for)."""
    head = model.get_output_embeddings()
    if isinstance(head, PackedLinear):
        return head.rows(token_ids).to(model.model.norm.weight.dtype)
    return head.weight.detach()[token_ids.to(head.weight.device)]


_ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def to_dtype(model, dtype: torch.dtype, device=None):
    """``model.to(device, dtype)`` with its rotary embeddings' inverse frequencies kept in float32, as transformers'
    ``from_pretrained(dtype=...)`` keeps them: ``Module.to`` would round them to bfloat16 (2^-9 relative, so the
    fastest pair of dimensions would turn ~1 rad off by position 500). Returns ``model``."""
    kept = {name: b.float() for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in _ROTARY_BUFFERS}
    model.to(device=device, dtype=dtype)
    for name, b in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = b.to(device) if device is not None else b
    return model


def param_count(model) -> int:
    """The number of the model's parameters (elements, over every tensor; a quantized model's packed matrices as the
    weights they stand for, a tied embedding read from the output layer's blocks once)."""
    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
    return packed + sum(p.numel() for p in model.parameters())


def context_length(model) -> Optional[int]:
    return getattr(model.config, "max_position_embeddings", None)


def model_name(model) -> str:
    """A portable name: the directory's last component, or the class name (never an absolute path)."""
    name = getattr(model.config, "_name_or_path", "") or ""
    return name.rstrip("/").split("/")[-1] if name else type(model).__name__


_NAME_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache")


def tensors_key(model) -> tuple:
    """Which tensors hold ``model``'s parameters and how often each was written in place: equal while they stay the
    same (what is prepared from the weights, packed copies, is kept under it)."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


@torch.no_grad()
def fingerprint(model) -> str:
    """A short hash of a model's configuration and a few of its weights (rounded to bfloat16, so the same
    model loaded in float32 or bfloat16, on any device, has the same fingerprint). A model quantized by
    ``engine.weights.quantize`` keeps the fingerprint of its float weights: the drafts and heads made for it serve
    it."""
    kept = getattr(model, "specdec_float_fingerprint", None)
    if kept is not None:
        return kept
    cfg = model.config.to_dict()
    for k in _NAME_KEYS:
        cfg.pop(k, None)
    h = hashlib.sha1(json.dumps(cfg, sort_keys=True, default=str).encode())
    for module, rows in ((model.get_output_embeddings(), slice(0, 8)), (model.get_input_embeddings(), slice(-8, None))):
        weight = getattr(module, "weight", None)
        if weight is None:  # engine.packed's modules (a quantized model's): the rows its blocks stand for
            n = getattr(module, "out_features", None) or module.num_embeddings
            picked = ops.packed_rows(module.packed, torch.arange(n)[rows], n)
        else:
            if hasattr(weight, "full_tensor"):  # a tensor-parallel (DTensor) weight: the whole matrix, as on one device
                weight = weight.full_tensor()
            picked = weight[rows]
        h.update(picked.detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()[:16]
