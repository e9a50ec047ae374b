"""A lean forward pass for Llama, Qwen2 and Qwen3 models, draft and target, with a preallocated KV cache.

A small model's step is dominated by per-module Python and dispatcher overhead, not arithmetic (on the bundled
pair the 2 x 256 draft spends about 1 ms per token in ``transformers``' forward for about 0.1 ms of work, and the
8 x 512 target 7-11 ms for about 2 ms of weight reads). This runner computes the same function with a handful of
fused matmuls per layer (QKV and gate/up concatenated), reading the model's own weights, and keeps the KV cache in
preallocated buffers ``[B, kv_heads, capacity, head_dim]`` per layer, where roll-back only moves a length.

On a CPU the matmuls go through oneDNN with weights packed once (``torch.ops.mkldnn._linear_pointwise``):
at the few rows of a decoding step, torch's default ``F.linear`` (MKL's sgemm) is far from the hardware's
speed on some processors. On an AMD EPYC an fp32 ``[4, 256] x [256, 8192]`` LM-head matmul took 0.8-1.2 ms
through ``F.linear`` and 0.12 ms packed, and a draft step at batch size 4 went from 4.8 to 2.1 ms
(``1bd1639:docs/results/draft_linear.json``). The packed weights are kept per model and rebuilt when a weight
tensor changes.

As the target's runner (:func:`runner_for`, ``SpeculativeGenerator(fast_target=True)``, the default for such a
target on one device) it gives the distribution the model defines, computed in another order of operations
than ``transformers``' modules: in float32 the greedy tokens equal ``transformers``' ``generate()`` (tested), in
bfloat16 near-ties may round either way, as between any two kernels. Plain decoding and speculation run the same
runner, so speculation stays lossless with respect to it. It does not pack rows of different depths
(:attr:`packs` is False). It has the interface of ``CausalLMRunner`` (rows of a batch keep their own positions;
rejected positions become attention-mask holes).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import ops
from . import onednn_linear
from .attention import kernel_takes
from .kv_cache import copy_rows, take_rows
from .runner import CausalLMRunner, TimedRunner, new_column_mask, sliding_layout, usable_device
from .tensor_parallel import tp_size

# model -> {packed: (fingerprint of its weights, the runner's prepared weights)}: packing costs a few ms, and a
# runner is made per generation call
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


packed_linear_available = onednn_linear.available  # the lean runner's test, as before


def uses_packed(device: torch.device, dtype: torch.dtype, packed: Optional[bool] = None) -> bool:
    """Whether a :class:`FastLlamaRunner` made with ``packed`` for a model of ``dtype`` on ``device`` uses packed
    weights (the profile's cache key records it: the two cost differently)."""
    if packed is None:
        packed = FastLlamaRunner.packed_default
    return packed_linear_available(device, dtype) if packed is None else bool(packed)


def _fingerprint(model) -> tuple:
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


MODEL_TYPES = ("llama", "qwen2", "qwen3")  # Qwen2: biases on q, k, v; Qwen3: RMSNorm of each head's q and k


def supports(model) -> bool:
    """True for the causal LMs this runner reproduces: Llama, Qwen2 and Qwen3 (SiLU MLP without biases, an output
    projection without bias, static RoPE, no sliding-window layers), loaded on one device in one process (not
    spread by ``device_map``, not tensor-parallel)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return False
    if tp_size(model) != 1:
        return False
    if getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu":
        return False
    if cfg.model_type == "llama" and getattr(cfg, "attention_bias", False):
        return False
    try:
        if sliding_layout(model) is not None:
            return False
    except ValueError:
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "dynamic" in str(rope.get("rope_type", "default")):
        return False
    return hasattr(model, "model") and hasattr(model.model, "rotary_emb")


def uses_lean(model, name: str, lean: bool = True) -> bool:
    """Whether :func:`runner_for` gives ``model`` (the ``name`` role) a :class:`FastLlamaRunner`: where ``lean`` and
    :func:`supports`, and for the ``"target"`` while :attr:`FastLlamaRunner.targets`."""
    return bool(lean) and supports(model) and (name != "target" or FastLlamaRunner.targets)


def runner_for(model, name: str, lean: bool = True) -> TimedRunner:
    """The runner of ``model``: a :class:`FastLlamaRunner` where :func:`uses_lean`, else ``transformers``' forward
    through :class:`~specdec_ext.engine.runner.CausalLMRunner`."""
    return FastLlamaRunner(model, name) if uses_lean(model, name, lean) else CausalLMRunner(model, name)


class Layer(NamedTuple):
    """One decoder layer's weights as the lean runner reads them (QKV and gate/up concatenated; packed for oneDNN
    where the runner packs): ``qkv_bias`` (Qwen2) and ``q_norm`` / ``k_norm`` (Qwen3) are None where absent."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class FastLlamaRunner(TimedRunner):
    """The lean runner of a Llama, Qwen2 or Qwen3 model, draft or target (module docstring). ``packed``: run the
    matmuls through oneDNN with packed weights (False: ``F.linear``; None: :attr:`packed_default`, and where that is
    None wherever :func:`packed_linear_available`).

    Raises:
        ValueError: a model this runner does not reproduce (:func:`supports`), or ``packed=True`` where packed
            weights are not available."""

    packed_default: Optional[bool] = None  # what packed=None means, for every runner (e.g. False to compare)
    attention_kernel: bool = True  # ops.decode_attention where it can serve (uses_attention_kernel); False: SDPA
    _state = ("k", "v", "mask", "next_pos")
    packs = False  # rows of different depths are verified padded (engine/packing.py packs transformers' forward)
    targets = True  # False: every target runs through transformers' forward (process-wide; bench/target_runner.py)

    @classmethod
    def uses_attention_kernel(cls, device, queries: int) -> bool:
        """Whether a forward of ``queries`` queries per row on ``device`` goes through ``ops.decode_attention``
        (:attr:`attention_kernel`, and ``attention.kernel_takes``) rather than ``F.scaled_dot_product_attention``."""
        return cls.attention_kernel and kernel_takes(device, queries)

    def __init__(self, model, name: str = "draft", packed: Optional[bool] = None):
        if not supports(model):
            raise ValueError(f"FastLlamaRunner: {type(model).__name__} is not a supported Llama, Qwen2 or Qwen3 model "
                             "(one device, no sliding-window layers)")
        cfg = model.config
        self.model, self.name = model, name
        base = model.model
        self.device = usable_device(model, name)
        self.dtype = base.embed_tokens.weight.dtype
        if packed and not packed_linear_available(self.device, self.dtype):
            raise ValueError(f"FastLlamaRunner: packed=True needs a CPU float32/bfloat16 model and a torch with oneDNN "
                             f"(bfloat16: a CPU with oneDNN's bf16 path) (got {self.dtype} on {self.device}, oneDNN "
                             f"available: {torch.backends.mkldnn.is_available()}, bf16 path: "
                             f"{bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())})")
        self.packed = uses_packed(self.device, self.dtype, packed)
        self._linear: Callable = onednn_linear.linear if self.packed else F.linear
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_pos = cfg.max_position_embeddings
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.layers, self.lm_head, self.cos, self.sin = self._prepare(model)
        self.calls = 0
        self.seconds = 0.0  # wall time inside forward()
        self.k = self.v = None

    def _prepare(self, model) -> tuple:
        """The per-layer weights (QKV and gate/up concatenated, packed when ``packed``), the LM head and the RoPE
        tables, kept per model while its weights stay the same tensors at the same version."""
        kept = _PREPARED.setdefault(model, {})  # packed -> (fingerprint, prepared): both kinds, for side-by-side runs
        key = _fingerprint(model)
        hit = kept.get(self.packed)
        if hit is not None and hit[0] == key:
            return hit[1]
        pack = onednn_linear.pack if self.packed else (lambda w: w)
        base = model.model
        with torch.no_grad():
            layers = []
            for layer in base.layers:
                a, m = layer.self_attn, layer.mlp
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                layers.append(Layer(
                    layer.input_layernorm.weight,
                    pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).contiguous()),
                    torch.cat(biases, 0) if all(b is not None for b in biases) else None,
                    a.q_norm.weight if hasattr(a, "q_norm") else None,
                    a.k_norm.weight if hasattr(a, "k_norm") else None,
                    pack(a.o_proj.weight),
                    layer.post_attention_layernorm.weight,
                    pack(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).contiguous()),
                    pack(m.down_proj.weight),
                ))
            lm_head = pack(model.get_output_embeddings().weight)
            pos = torch.arange(self.max_pos, device=self.device).unsqueeze(0)
            cos, sin = base.rotary_emb(self.embed[:1].unsqueeze(0), pos)
            prepared = (layers, lm_head, cos[0].to(self.dtype), sin[0].to(self.dtype))  # cos/sin [max_pos, head_dim]
        kept[self.packed] = (key, prepared)
        return prepared

    # ------------------------------------------------------------------------------ state
    def start(self, batch_size: int, capacity: int = 256) -> None:
        shape = (batch_size, self.n_kv, capacity, self.head_dim)
        self.k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.int64, device=self.device)

    def close(self) -> None:
        self.k = self.v = self.mask = self.next_pos = None

    def _reserve(self, n: int) -> None:
        cap = self.k[0].shape[2]
        if self.length + n <= cap:
            return
        new = max(2 * cap, self.length + n)
        for i in range(len(self.layers)):
            for buf in (self.k, self.v):
                old = buf[i]
                grown = torch.empty(old.shape[:2] + (new,) + old.shape[3:], dtype=old.dtype, device=old.device)
                grown[:, :, : self.length] = old[:, :, : self.length]
                buf[i] = grown

    def _rms(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x, cos, sin):  # x [B, h, n, d]; cos/sin [B, 1, n, d]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def qkv(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A layer's queries, keys and values ``[B, heads, n, d]`` from its input ``x`` ``[B, n, H]``: input norm,
        the fused projection (and its bias), each head's q / k norm where the model has them, RoPE."""
        B, n, _ = x.shape
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        y = self._linear(self._rms(x, layer.input_norm), layer.qkv)
        if layer.qkv_bias is not None:
            y = y + layer.qkv_bias
        y = y.view(B, n, hq + 2 * hk, d).transpose(1, 2)
        q, k, v = y[:, :hq], y[:, hq: hq + hk], y[:, hq + hk:]
        if layer.q_norm is not None:
            q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def block_out(self, layer: Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``x`` ``[B, n, H]`` and attention output ``attn`` ``[B, n, heads, d]``:
        the output projection's residual, then the SiLU MLP's."""
        B, n, _ = x.shape
        x = x + self._linear(attn.reshape(B, n, self.n_heads * self.head_dim), layer.o)
        g, u = self._linear(self._rms(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return x + self._linear(F.silu(g) * u, layer.down)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, valid: Optional[torch.Tensor] = None, keep: int = 1,
                hidden: bool = False, rows: Optional[torch.Tensor] = None,
                packed: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Feed ``tokens`` ``[B, n]`` (``valid`` ``[B, n]`` bool marks real tokens). With ``rows`` (``[b]`` int64,
        increasing), only those rows of the batch are computed: ``tokens`` is ``[b, n]``, the other rows get holes
        in the new columns, and the results are the b rows' (``[b, keep, V]`` logits, ``[b, keep, H]`` hidden).
        ``packed=True`` is refused (ValueError): this runner does not pack rows (:attr:`packs`)."""
        if packed:
            raise ValueError(f"the {self.name} runner cannot pack this forward (FastLlamaRunner.packs is False)")
        tokens = tokens.to(self.device)
        B, n = tokens.shape
        valid = torch.ones(B, n, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device).bool()
        sub = rows is not None and rows.numel() < self.next_pos.shape[0]
        idx = rows.to(self.device) if sub else None
        steps = valid.long().cumsum(-1)
        next_pos = self.next_pos[idx] if sub else self.next_pos
        pos = (next_pos.unsqueeze(1) + (steps - 1).clamp_min(0)).clamp_max(self.max_pos - 1)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        self._reserve(n)
        C0, C1 = self.length, self.length + n
        if sub:  # rows that sit out this forward get holes
            column = torch.zeros(self.mask.shape[0], n, dtype=torch.bool, device=self.device)
            column[idx] = valid
            self.mask = torch.cat([self.mask, column], 1)
            row_mask = self.mask[idx]
        else:
            self.mask = row_mask = torch.cat([self.mask, valid], 1)
        attn_mask = new_column_mask(row_mask, n)  # [B, 1, n, C1]
        x = F.embedding(tokens, self.embed)
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        kernel = self.uses_attention_kernel(self.device, n)
        for li, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, x, cos, sin)
            if sub:  # rows sitting out get zeros, not the buffer's uninitialised bits (0 * NaN would leak into attention)
                self.k[li][:, :, C0:C1] = 0
                self.v[li][:, :, C0:C1] = 0
                self.k[li][idx, :, C0:C1] = k
                self.v[li][idx, :, C0:C1] = v
                keys, values = self.k[li][idx, :, :C1], self.v[li][idx, :, :C1]
            else:
                self.k[li][:, :, C0:C1] = k
                self.v[li][:, :, C0:C1] = v
                keys, values = self.k[li][:, :, :C1], self.v[li][:, :, :C1]
            if kernel:  # [B, n, hq, d]
                o = ops.decode_attention(q, keys, values, attn_mask, d ** -0.5)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, enable_gqa=hq != hk).transpose(1, 2)
            x = self.block_out(layer, x, o)
        hn = self._rms(x[:, -keep:], self.final_norm)
        logits = self._linear(hn, self.lm_head).float()
        if sub:
            self.next_pos = self.next_pos.index_add(0, idx, steps[:, -1])
        else:
            self.next_pos = self.next_pos + steps[:, -1]
        self.calls += 1
        return logits, (hn if hidden else None)

    def _crop_to(self, length: int) -> None:
        pass  # positions beyond the mask's width are simply overwritten by the next forward

    def _drop_front(self, n: int) -> None:
        end = self.length
        for buf in (self.k, self.v):
            for t in buf:
                t[:, :, : end - n] = t[:, :, n:end].clone()

    def _pad_front(self, n: int) -> None:
        end = self.length
        self._reserve(n)
        for buf in (self.k, self.v):
            for t in buf:
                t[:, :, n : end + n] = t[:, :, :end].clone()
                t[:, :, :n] = 0

    def _write_rows(self, idx: torch.Tensor, other: "FastLlamaRunner", src: Optional[torch.Tensor] = None,
                    lead: int = 0) -> None:
        width, end = self.length, other.length
        w = end - lead
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for a, b in zip(mine, theirs):
                copy_rows(a[:, :, width - w : width], idx, b[:, :, lead:end], src)

    def select_rows(self, index: torch.Tensor) -> None:
        idx = index.to(self.device)
        self.k = [take_rows(t, index) for t in self.k]  # in place when rows only leave
        self.v = [take_rows(t, index) for t in self.v]
        self._select_mask_rows(idx)
