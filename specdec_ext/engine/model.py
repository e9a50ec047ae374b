"""The lean model: a Llama, Qwen2 or Qwen3 causal LM's weights prepared once, and one forward over a static KV cache.

A small model's step is dominated by per-module Python and dispatcher overhead, not arithmetic (on the bundled
pair the 2 x 256 draft spends about 1 ms per token in ``transformers``' forward for about 0.1 ms of work, and the
8 x 512 target 7-11 ms for about 2 ms of weight reads). :class:`LeanModel` computes the same function with a handful
of fused matmuls per layer (QKV and gate/up concatenated at load, as gpt-fast's ``model.py``), reading the model's
own weights, over a :class:`~specdec_ext.engine.cache.StaticCache`. Its forward has what CUDA-graph capture needs:
no host synchronisation, no shape that depends on data, writes into preallocated buffers at positions computed on
the device.

On a CPU the matmuls go through oneDNN with weights packed once (``torch.ops.mkldnn._linear_pointwise``): at the
few rows of a decoding step, torch's default ``F.linear`` (MKL's sgemm) is far from the hardware's speed on some
processors (an fp32 ``[4, 256] x [256, 8192]`` LM-head matmul: 0.8-1.2 ms through ``F.linear``, 0.12 ms packed, on a
2-core AMD EPYC; ``1bd1639:docs/results/draft_linear.json``), and attention runs through ``ops.decode_attention``
for decode steps and verifications. In float32 a forward of a few tokens (a decode step, a verification) runs its
layers as one ``ops.decoder_layers`` call instead (``csrc/cpu/layer_cpu.cpp``, each layer ``ops.decoder_layer``'s
function: the weights read once from panels at the rate the CPU streams memory, one dispatch a forward; a model
quantized by ``engine.weights.quantize`` is read there as int8 panels or blocks). A model whose weights multiply
int8 activations (``"q4a8"``) runs every forward, prefills included, through the fused op: its function is that op's,
which transformers' modules do not compute. The prepared weights are kept per model and rebuilt when a weight
changes.

It computes the distribution the model defines in another order of operations than ``transformers``' modules: in
float32 the greedy tokens equal ``transformers``' ``generate()`` (tested), in bfloat16 near-ties may round either
way, as between any two kernels. Plain decoding and speculation run the same forward, so speculation is lossless
with respect to it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from .. import checks, ops
from . import onednn_linear, weights
from .attention import kernel_takes
from .cache import StaticCache
from .models import tensors_key
from .packed import PackedEmbedding
from .runner import sliding_layout, usable_device
from .subset_head import SubsetLMHead
from .tensor_parallel import tp_size

# model -> {packed: (fingerprint of its weights, the prepared weights)}: packing costs a few ms
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

MODEL_TYPES = ("llama", "qwen2", "qwen3")  # Qwen2: biases on q, k, v; Qwen3: RMSNorm of each head's q and k

Rows = Union[None, slice, torch.Tensor]

# On a CPU, oneDNN compiles and keeps a primitive per matmul shape (up to 1,024 of them): prefills of every length
# bring new token counts, and a server's resident memory climbed for thousands of requests (bench/soak.py, B = 16:
# +42% from its 200th request to its 2,000th without buckets, +3.5% with them). Forwards of more than this many
# tokens per row (prefills: decode steps and verifications take at most attention.MAX_QUERIES) run their projections
# over a token count padded to one of eight buckets per octave (:func:`bucketed_rows`), so the shapes a server meets
# are few and met early.
BUCKET_ABOVE = 16


def bucketed_rows(m: int) -> int:
    """``m`` rounded up to one of eight sizes per octave (at most 12.5% more): 16, 18, ..., 30, 32, 36, ..., 60, 64,
    72, ..., 120, 128, 144, ...; ``m`` itself up to 16."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def supports(model) -> bool:
    """True for the causal LMs the lean model reproduces: Llama, Qwen2 and Qwen3 (SiLU MLP without biases, an output
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


packed_linear_available = onednn_linear.available


def uses_packed(device: torch.device, dtype: torch.dtype, packed: Optional[bool] = None) -> bool:
    """Whether a :class:`LeanModel` made with ``packed`` for a model of ``dtype`` on ``device`` uses packed weights
    (the profile's cache key records it: the two cost differently)."""
    return packed_linear_available(device, dtype) if packed is None else bool(packed)


ATTENTION = ("auto", "cache", "sdpa")  # LeanModel's attention kernels

# Forwards of at most this many tokens in all (B x n: decode steps and verifications of a few rows), by the model's
# dtype, run each layer as one ops.decoder_layer call over weights packed in panels (on a CPU); more tokens go through
# oneDNN's matmuls, which reuse each weight across rows (a prefill, a batch's verification). bench/fused_layers.py on
# SmolLM2-135M, 256 columns of context (docs/results/smollm2.json.gz): on a 2-core Intel Xeon with AMX
# (fused_layers*_xeon_amx), the fused forward 0.52-0.67x the torch-op one at 1-16 tokens in float32, 0.54-0.87x at
# 1-12 and level at 16 in bfloat16; on a 2-core AMD EPYC with AVX-512 (fused_layers*, before the AVX-512 kernel's
# 16-row blocks and panel groups), float32 0.74x at 1 token, 0.87x at 16 (1.07-1.09x at 20 in a separate run).
FUSED_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
# Panels copy the linear weights (beside oneDNN's packed copy): made for models of at most this many bytes of them.
FUSED_MAX_BYTES = 2 << 30


# A model whose weights are held only packed (quantized) runs forwards of more than this many tokens in all (prefills)
# over each layer's weights unpacked just before its products (ops.unpack_linear_weight, then a library matmul on
# them), fewer through the fused op. SmolLM2-135M "q4" on a 2-core Intel Xeon with AMX, bfloat16: unpacking all 30
# layers takes about 25 ms a forward and the matmul packs each weight again for itself, so the two paths are level
# near 64 tokens (17 tokens: 31 against 88 ms; 64: 93 against 98 ms); a 256-token prefill 0.19-0.21 s against the
# fused op's 0.37 s (1.2-1.35k against 0.69k tokens/s; float weights packed once for oneDNN: 1.7k).
UNPACK_ABOVE = 64


class Panels(NamedTuple):
    """A layer's weights as ``ops.decoder_layer`` reads them: ``ops.pack_linear_weight`` of QKV, the output
    projection, gate/up and down."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Layer(NamedTuple):
    """One decoder layer's weights as the lean model reads them (QKV and gate/up concatenated; packed for oneDNN
    where it packs): ``qkv_bias`` (Qwen2) and ``q_norm`` / ``k_norm`` (Qwen3) are None where absent."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LeanModel:
    """A Llama, Qwen2 or Qwen3 model's prepared weights and its forward over a static cache (module docstring).
    ``packed``: run the matmuls through oneDNN with packed weights (False: ``F.linear``; None: wherever oneDNN has a
    packed path for the model's dtype). ``attention``: ``"auto"``, the CPU's decode-attention kernel
    (``ops.decode_attention``) where it can serve and SDPA elsewhere; ``"cache"``, ``ops.cache_attention`` (each
    row's live columns only; the flash-decoding kernel on a GPU, not yet the default there: unmeasured on one);
    ``"sdpa"``, torch's ``scaled_dot_product_attention`` everywhere. ``fused``: forwards of at most
    :data:`FUSED_MAX_ROWS` tokens (for its dtype) run their layers as one ``ops.decoder_layers`` call (the LM head as
    ``ops.packed_linear``) over a copy of the weights in panels (True; None: wherever :meth:`fusable`; False: never);
    a quantized model (``engine.weights``), which holds only those panels, runs forwards of up to
    :data:`UNPACK_ABOVE` tokens so and longer ones over each layer's weights unpacked before its products; a model
    with int8 activations (``"q4a8"``) runs every forward fused.

    Raises:
        ValueError: a model it does not reproduce (:func:`supports`), a model on the meta device, ``packed=True``
            where packed weights are not available, ``fused=True`` where :meth:`fusable` is False, or a ``"q4a8"``
            model that cannot run fused."""

    def __init__(self, model, name: str = "draft", packed: Optional[bool] = None, attention: str = "auto",
                 fused: Optional[bool] = None):
        if not supports(model):
            raise ValueError(f"the {name} model ({type(model).__name__}) is not a Llama, Qwen2 or Qwen3 model the lean "
                             "forward reproduces (one device, no sliding-window layers)")
        cfg = model.config
        self.model, self.name = model, name
        base = model.model
        self.device = usable_device(model, name)
        self.dtype = base.norm.weight.dtype
        if packed and not packed_linear_available(self.device, self.dtype):
            raise ValueError(f"LeanModel: packed=True needs a CPU float32/bfloat16 model and a torch with oneDNN "
                             f"(bfloat16: a CPU with oneDNN's bf16 path) (got {self.dtype} on {self.device}, oneDNN "
                             f"available: {torch.backends.mkldnn.is_available()})")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION))}, got {attention!r}")
        self.attention = attention
        # weights held only packed (engine/weights.py's quantize): no float matrix is kept and no oneDNN copy made;
        # forwards of up to UNPACK_ABOVE tokens run the fused op, longer ones (prefills) multiply each layer's
        # weights unpacked just before its products; int8 activations' function is the fused op's alone: it runs
        # every forward
        self.fused_only = weights.held_packed(model)
        self.int8_activations = weights.kind(model) in weights.INT8_ACTIVATIONS
        self.packed = uses_packed(self.device, self.dtype, packed) and not self.fused_only
        self._linear: Callable = (self._unpacked_linear if self.fused_only else
                                  onednn_linear.linear if self.packed else F.linear)
        self._unpacked: dict = {}  # (K, N, dtype) -> the [K, N] buffer a layer's weights are unpacked into
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.gqa = bool(self.n_heads != self.n_kv)  # a constant where a compiled forward reads it
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_pos = cfg.max_position_embeddings
        emb = base.embed_tokens
        self._embed = emb if isinstance(emb, PackedEmbedding) else functools.partial(F.embedding, weight=emb.weight)
        self.final_norm = base.norm.weight
        self.layers, self.lm_head, self.cos, self.sin = self._prepare(model)
        head = model.get_output_embeddings()
        self.subset = head if isinstance(head, SubsetLMHead) else None  # a draft's vocabulary subset (FR-Spec)
        self.vocab_rows = head.rows if isinstance(head, SubsetLMHead) else head.out_features
        can_fuse = self.fusable(model)
        if fused and not can_fuse:
            raise ValueError(f"LeanModel: fused=True needs a float32 or bfloat16 model on a CPU, the compiled extension, "
                             f"attention='auto', every projection's out features a multiple of 16 and at most "
                             f"{FUSED_MAX_BYTES} bytes of linear weights (the {name} model: {self.dtype} on "
                             f"{self.device}, attention={attention!r})")
        self.fused = can_fuse if fused is None else bool(fused)
        if self.int8_activations and not self.fused:
            raise ValueError(f"the {name} model's weights are {weights.kind(model)!r} (int8 activations), which only "
                             "the fused CPU op computes: it needs fused=None or True, the compiled extension and "
                             f"attention='auto' (got fused={fused!r}, attention={attention!r})")
        self.panels, self.head_panels = self._panels(model) if self.fused else (None, None)
        # ops.decoder_layers' per-layer arguments but the caches (checks.LAYER_LISTS' order), one list each
        self.stack = tuple(list(t) for t in zip(*(
            (layer.input_norm, panel.qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, panel.o, layer.post_norm,
             panel.gate_up, panel.down) for layer, panel in zip(self.layers, self.panels)))) if self.fused else None
        # called as tap(slots, starts, x) by each forward before its final norm (a feature draft's record of the
        # target's hidden states, engine/feature_draft.py): slots ``[b]`` int64, starts ``[b]`` the rows' lengths
        # before the forward, x ``[b, n, H]`` the last layer's output at those positions. None: nothing is called.
        self.tap: Optional[Callable] = None

    def fusable(self, model) -> bool:
        """Whether this model's decode steps can run through ``ops.decoder_layers`` (the class docstring's ``fused``):
        float32 or bfloat16 on a CPU with the compiled extension, ``attention="auto"``, an even head dimension, every
        projection's out features a multiple of 16, and at most :data:`FUSED_MAX_BYTES` of linear weights to copy
        into panels."""
        d, H = self.head_dim, model.config.hidden_size
        inter = model.config.intermediate_size
        widths = ((self.n_heads + 2 * self.n_kv) * d, H, 2 * inter)
        linear = sum(p.numel() * p.element_size() for n_, p in model.named_parameters() if n_.endswith("proj.weight"))
        return (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and ops.HAS_EXTENSION
                and self.attention == "auto" and d % 2 == 0 and all(w % 16 == 0 for w in widths)
                and linear <= FUSED_MAX_BYTES)

    def _panels(self, model) -> tuple:
        """Each layer's :class:`Panels` and the LM head's panels, kept per model as :meth:`_prepare`'s weights are."""
        kept = _PREPARED.setdefault(model, {})
        key = tensors_key(model)
        hit = kept.get("panels")
        if hit is not None and hit[0] == key:
            return hit[1]
        layers, head = weights.panels(model)  # in the model's float dtype, as int8 rows or as blocks
        prepared = ([Panels(*layer) for layer in layers], head)
        kept["panels"] = (key, prepared)
        return prepared

    def _prepare(self, model) -> tuple:
        """The per-layer weights (QKV and gate/up concatenated, packed when ``packed``), the LM head and the RoPE
        tables, kept per model while its weights stay the same tensors at the same version. A model whose weights are
        held only packed (quantized) gets the packings it holds (no copy: its forwards run the fused op, or unpack
        a layer's weights before its products)."""
        kept = _PREPARED.setdefault(model, {})  # packed -> (fingerprint, prepared): both kinds, for side-by-side runs
        key, kind = tensors_key(model), "fused only" if self.fused_only else self.packed
        hit = kept.get(kind)
        if hit is not None and hit[0] == key:
            return hit[1]
        pack = onednn_linear.pack if self.packed else (lambda w: w)
        base = model.model
        held = weights.panels(model) if self.fused_only else None
        with torch.no_grad():
            layers = []
            for i, layer in enumerate(base.layers):
                a = layer.self_attn
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                qkv, o, gate_up, down = held[0][i] if held else tuple(  # QKV and gate/up concatenated
                    pack(weights.joined(p, names)) for p, names in weights.projections(layer))
                layers.append(Layer(
                    layer.input_layernorm.weight, qkv,
                    torch.cat(biases, 0) if all(b is not None for b in biases) else None,
                    a.q_norm.weight if hasattr(a, "q_norm") else None,
                    a.k_norm.weight if hasattr(a, "k_norm") else None,
                    o, layer.post_attention_layernorm.weight, gate_up, down,
                ))
            lm_head = held[1] if held else pack(model.get_output_embeddings().weight)
            pos = torch.arange(self.max_pos, device=self.device).unsqueeze(0)
            cos, sin = base.rotary_emb(self.final_norm[None, None], pos)
            prepared = (layers, lm_head, cos[0].to(self.dtype), sin[0].to(self.dtype))  # cos/sin [max_pos, head_dim]
        kept[kind] = (key, prepared)
        return prepared

    def cache(self, slots: int, max_len: int) -> StaticCache:
        """An empty :class:`StaticCache` of ``slots`` rows and ``max_len`` columns for this model.

        Raises ValueError for a ``max_len`` beyond the model's positions."""
        if max_len > self.max_pos:
            raise ValueError(f"max_len must be at most the {self.name} model's {self.max_pos} positions, got {max_len}")
        return StaticCache(len(self.layers), slots, self.n_kv, max_len, self.head_dim, self.dtype, self.device)

    def _rms(self, x, w):
        # transformers' LlamaRMSNorm (x * rsqrt(mean(x^2) + eps) in float32, rounded, times w); F.rms_norm without a
        # weight gives those float32 values bitwise (torch 2.13, CPU) in one op instead of five: 0.1 ms of a 5 ms
        # step, where the weight stream has left the host's caches cold
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @staticmethod
    def _rope(x, cos, sin):  # x [B, h, n, d]; cos/sin [B, 1, n, d]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _unpacked_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` times the float weight a layer's packing ``w`` (every out width a multiple of 16) stands for,
        unpacked into a buffer kept per shape (one for all layers: each product is done before the next unpacks;
        about 7 MB for SmolLM2-135M in bfloat16), which spares a fresh one's page faults, most of an unpacking's
        time."""
        K, N = checks.packed_in_features(w), w.shape[0] * ops.PANEL
        buf = self._unpacked.get((K, N, x.dtype))
        if buf is None:
            buf = self._unpacked[(K, N, x.dtype)] = torch.empty(K, N, dtype=x.dtype, device=x.device)
        ops.unpack_linear_weight(w, N, x.dtype, out=buf)
        return F.linear(x, buf.t())

    def _project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, n, in]`` times the (packed) weight ``w``: ``[B, n, out]``. On a CPU, a forward of more than
        :data:`BUCKET_ABOVE` tokens per row multiplies ``x``'s rows zero-padded to :func:`bucketed_rows` (one matmul
        shape per bucket for oneDNN to keep) and drops the padding's rows."""
        B, n, k = x.shape
        m = B * n
        if n <= BUCKET_ABOVE or self.device.type != "cpu" or bucketed_rows(m) == m:
            return self._linear(x, w)
        y = self._linear(F.pad(x.reshape(m, k), (0, 0, 0, bucketed_rows(m) - m)), w)
        return y[:m].view(B, n, -1)

    def qkv(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A layer's queries, keys and values ``[B, heads, n, d]`` from its input ``x`` ``[B, n, H]``: input norm,
        the fused projection (and its bias), each head's q / k norm where the model has them, RoPE."""
        B, n, _ = x.shape
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        y = self._project(self._rms(x, layer.input_norm), layer.qkv)
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
        x = x + self._project(attn.reshape(B, n, self.n_heads * self.head_dim), layer.o)
        g, u = self._project(self._rms(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return x + self._project(F.silu(g) * u, layer.down)

    def forward(self, cache: StaticCache, tokens: torch.Tensor, rows: Rows = None, keep: int = 1,
                width: Optional[int] = None, start: Optional[int] = None,
                embeds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over ``tokens`` ``[b, n]`` int64, row i's at positions ``lengths[s_i] .. lengths[s_i] + n - 1`` of
        its slot s_i: the slots ``0 .. b - 1`` (``rows`` None), a ``slice`` of them, or an index tensor ``[b]``.

        Writes the tokens' keys and values into ``cache`` and advances those slots' lengths by n. ``width``: the
        columns attention reads, at least every row's length after the forward (None: the whole cache, which compiled
        and captured steps use; eager calls pass the widest row's, known on the host). ``start``: the length every
        row has, where the host knows they share one (one request, or rows of one length): the positions, masks and
        writes are then slices, not per-row indices; None reads each row's length on the device (what compiled and
        captured steps do). Positions past the cache's ``max_len`` write its scratch column (rows computed beyond
        what they keep; ``engine/cache.py``). ``embeds``: the first layer's input ``[b, n, H]`` in the model's dtype
        instead of the tokens' embeddings (a feature draft's, ``engine/feature_draft.py``).

        Returns float32 logits ``[b, keep, V]`` of the last ``keep`` positions and the final norm's output there
        ``[b, keep, H]`` (the LM head's input, which acceptance heads read). A draft with a
        :class:`~specdec_ext.engine.subset_head.SubsetLMHead` computes its N rows and gives the rest -inf."""
        b, n = tokens.shape
        if self.fused and (b * n <= FUSED_MAX_ROWS[self.dtype] or self.int8_activations
                           or (self.fused_only and b * n <= UNPACK_ABOVE)):
            return self._fused_forward(cache, tokens, rows, keep, embeds)
        M = cache.max_len
        W = M + 1 if width is None else width
        index = rows if isinstance(rows, torch.Tensor) else None
        span = slice(0, b) if rows is None else rows
        dev = tokens.device
        if start is not None and start + n <= M and index is None:  # one length: slices
            pos = torch.arange(start, start + n, device=dev)
            cos, sin = self.cos[start: start + n], self.sin[start: start + n]  # [n, d]
            at = None
        else:
            lengths = cache.lengths[index] if index is not None else cache.lengths[span]
            pos = lengths.unsqueeze(1) + torch.arange(n, device=dev)  # [b, n]
            at = pos.clamp_max(M)  # the columns written: positions past max_len into the scratch column
            rot = pos.clamp_max(self.max_pos - 1)
            cos, sin = self.cos[rot].unsqueeze(1), self.sin[rot].unsqueeze(1)  # [b, 1, n, d]
            slot = index if index is not None else torch.arange(span.start, span.start + b, device=dev)
            # each (row, kv head, position)'s row in the cache seen as [slots * kv_heads * columns, head_dim]
            heads = torch.arange(self.n_kv, device=dev).view(1, -1, 1)
            flat = ((slot.view(b, 1, 1) * self.n_kv + heads) * (M + 1) + at.view(b, 1, n)).reshape(-1)
        kernel = self.attention == "auto" and kernel_takes(dev, n)
        starts = mask = None
        if self.attention == "cache":  # each row's first position, on the device (the op needs no mask)
            starts = pos[:, 0].contiguous() if pos.dim() == 2 else torch.full((b,), start, dtype=torch.int64, device=dev)
        else:  # [b or 1, 1, n, W]: query i sees the columns up to its position
            rows_pos = pos.view(1, n) if pos.dim() == 1 else pos
            mask = (torch.arange(W, device=dev).view(1, 1, W) <= rows_pos.unsqueeze(2)).unsqueeze(1)
        x = self._embed(tokens) if embeds is None else embeds
        for li, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, x, cos, sin)
            kc, vc = cache.k[li], cache.v[li]
            if at is None:
                kc[span, :, start: start + n] = k
                vc[span, :, start: start + n] = v
            else:  # [b, kv, n, d] into columns pos of each row's slot
                kc.view(-1, self.head_dim).index_copy_(0, flat, k.reshape(-1, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, flat, v.reshape(-1, self.head_dim))
            keys = (kc[index] if index is not None else kc[span])[:, :, :W]
            values = (vc[index] if index is not None else vc[span])[:, :, :W]
            if starts is not None:  # [b, n, hq, d]
                o = ops.cache_attention(q, keys, values, starts, self.head_dim ** -0.5)
            elif kernel:
                o = ops.decode_attention(q, keys, values, mask, self.head_dim ** -0.5)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                   enable_gqa=self.gqa).transpose(1, 2)
            x = self.block_out(layer, x, o)
        if self.tap is not None:
            slot = index if index is not None else torch.arange(span.start or 0, (span.start or 0) + b, device=dev)
            self.tap(slot, cache.lengths[slot], x)
        hn = self._rms(x[:, -keep:], self.final_norm)
        if index is not None:
            cache.lengths.index_add_(0, index, torch.full_like(index, n))
        else:
            cache.lengths[span] += n
        if self.fused_only:  # the kept positions only: the packed product
            logits = ops.packed_linear(hn, self.lm_head, self.vocab_rows).float()
        else:
            logits = self._linear(hn, self.lm_head).float()
        return (logits if self.subset is None else self.subset.scatter(logits)), hn

    def _fused_forward(self, cache: StaticCache, tokens: torch.Tensor, rows: Rows, keep: int,
                       embeds: Optional[torch.Tensor] = None):
        """:meth:`forward` with the layers one ``ops.decoder_layers`` call (each layer ``ops.decoder_layer``'s
        function) and the LM head ``ops.packed_linear``: the same function, the lengths read from the cache by the
        kernel (so ``width`` and ``start`` are not needed)."""
        b, n = tokens.shape
        if isinstance(rows, torch.Tensor):
            slots = rows
        elif rows is None or rows.start in (None, 0):
            slots = None
        else:
            slots = torch.arange(rows.start, rows.start + b, device=tokens.device)
        x = self._embed(tokens) if embeds is None else embeds
        x = ops.decoder_layers(x, *self.stack, cache.k, cache.v, cache.lengths, slots, self.cos, self.sin, self.n_heads,
                               self.eps)
        if self.tap is not None:
            slot = slots if slots is not None else torch.arange(b, device=tokens.device)
            self.tap(slot, cache.lengths[slot], x)
        hn = self._rms(x[:, -keep:], self.final_norm)
        if slots is not None:
            cache.lengths.index_add_(0, slots, torch.full_like(slots, n))
        else:
            cache.lengths[:b] += n
        logits = ops.packed_linear(hn, self.head_panels, self.vocab_rows).float()  # float32, as the torch-op path
        return (logits if self.subset is None else self.subset.scatter(logits)), hn
