"""The ``specdec`` command: generate, demo, bench, train-head, zoo train, zoo report.

Every user error ends in one line on stderr, ``specdec: error: ...``, and exit status 2 (``--debug``
shows the traceback). Generated text goes to stdout; statistics and progress go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .cli_models import DTYPES, UsageError, _check_device, _dtype, _lookup, _model_args, _model_dir, _models

HF = argparse.ArgumentDefaultsHelpFormatter


def _threshold(text: str):
    """A stop threshold: 'auto' or a number."""
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}")


def _policy_args(p):
    p.add_argument("--policy", default="specdecpp",
                   choices=["specdecpp", "fixed", "heuristic", "confidence", "adaedl", "autoregressive"],
                   help="candidate-length policy")
    p.add_argument("--k", type=int, default=4, help="candidate length K for --policy fixed")
    p.add_argument("--threshold", type=_threshold, default="auto",
                   help="SpecDec++ stop threshold h in [0, 1], or 'auto' (the cost-aware goodput rule)")
    p.add_argument("--k-min", type=int, default=1, help="SpecDec++ lower bound on K")
    p.add_argument("--k-max", type=int, default=20, help="SpecDec++ upper bound on K")
    p.add_argument("--lookup", action="store_true",
                   help="prompt lookup beside the draft model: each round copies from the context or drafts, whichever "
                        "promises more tokens per ms (policies/lookup.py, CopyOrDraft)")


def _policy(args, head):
    from .policies import make_policy

    if args.policy == "fixed":
        return make_policy("fixed", k=args.k)
    if args.policy == "specdecpp" and _lookup(args):  # SpecDec++'s stop rule over the copies (no head)
        return make_policy("lookup", threshold=args.threshold, k_max=min(args.k_max, 8))
    if args.policy == "specdecpp":
        return make_policy("specdecpp", head=head, threshold=args.threshold, k_min=args.k_min, k_max=args.k_max)
    return make_policy(args.policy)


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def cmd_generate(args):
    from transformers import TextStreamer

    from .engine import SpeculativeGenerator
    from .engine.tensor_parallel import is_main_process
    from .prompts import encode_prompt, load_prompts

    if isinstance(args.chat, str):  # --chat "MESSAGE": the message is the prompt
        if args.prompt is not None or args.file or args.prompts is not None:
            raise UsageError("--chat MESSAGE is the prompt: drop --prompt/--file/--prompts, or use a bare --chat")
        args.prompt, args.chat = args.chat, True
    if args.prompts is not None and args.out is None:
        raise UsageError("--prompts writes a batch job: give --out results.jsonl")
    if args.out is not None and args.prompts is None:
        raise UsageError("--out is for batch jobs: give --prompts FILE (or a data set name)")
    lookup = _lookup(args)
    pair = _models(args, args.policy == "specdecpp" and not lookup, lookup_ok=True)
    speculative = args.policy != "autoregressive"
    gen = SpeculativeGenerator(pair.target, "ngram" if lookup and speculative else pair.draft,
                               policy=_policy(args, pair.head), lookup=args.lookup and speculative)
    main = is_main_process()  # under --tp every rank generates; rank 0 prints and writes
    log = _log if main else (lambda *a: None)
    if args.prompts is not None:
        from .jobs import run_job
        from .prompts import load_prompt_records

        run_job(gen, pair.tokenizer, load_prompt_records(args.prompts, limit=args.limit), args.out, args.batch_size,
                args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.chat, log=log,
                progress=main, handle_signals=True)
        return
    if args.prompt is not None:
        prompts = [args.prompt]
    elif args.file:
        prompts = load_prompts(args.file)
    else:
        prompts = [load_prompts(args.dataset)[args.index]]
    for text in prompts:
        ids = encode_prompt(pair.tokenizer, text, args.chat)
        if not ids:
            raise UsageError("the prompt is empty (it has no token); give at least one token of text")
        streamer = TextStreamer(pair.tokenizer, skip_prompt=args.chat, skip_special_tokens=args.chat) if main else None
        if main and args.chat:
            print(f"> {text}\n", flush=True)
        out = gen.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=pair.tokenizer.eos_token_id,
                           streamer=streamer)
        st = out.stats
        log("-" * 72)
        log(f"policy {st.policy}: {st.new_tokens} tokens in {st.wall_ms:.0f} ms ({st.tokens_per_s:.1f} tokens/s), "
            f"{len(st.rounds)} rounds, target calls {st.target_calls}, draft calls {st.draft_calls}")
        log(f"mean candidate length {st.mean_candidate_length:.2f}, mean accepted length {st.mean_accepted_length:.2f}, "
            f"acceptance rate {st.acceptance_rate:.3f}, discarded draft tokens {st.discarded}")
        log(f"time: draft {st.draft_ms:.0f} ms, verify {st.verify_ms:.0f} ms, overhead {st.overhead_ms:.0f} ms "
            f"({st.overhead_ms_per_round:.2f} ms/round), prefill {st.prefill_ms:.0f} ms")
        if args.rounds:
            for i, r in enumerate(st.rounds):
                log(f"  round {i:3d}: candidates {r.candidates} accepted {r.accepted} emitted {r.emitted} "
                     f"draft {r.draft_ms:.1f} ms verify {r.verify_ms:.1f} ms")


def cmd_demo(args):
    from .benchmark import Method, format_table, run_benchmark, summarize
    from .policies import CopyOrDraft, make_policy
    from .prompts import load_prompts

    from .zoo.named import PAIRS

    t0 = time.time()
    if args.k is None:
        args.k = PAIRS[args.pair].best_k if args.pair in PAIRS else 6
    pair = _models(args, True)
    prompts = load_prompts("humaneval", limit=args.prompts)
    methods = [Method("plain", "ours", lambda **_: make_policy("autoregressive"), family="plain"),
               Method(f"fixed K={args.k}", "ours", lambda **_: make_policy("fixed", k=args.k), family="fixed"),
               Method(f"specdec++ {'auto' if args.threshold == 'auto' else f'h={args.threshold:g}'}", "ours",
                      lambda **_: make_policy("specdecpp", head=pair.head, threshold=args.threshold), family="specdecpp"),
               Method("prompt lookup, specdec++ " + ("auto" if args.threshold == "auto" else f"h={args.threshold:g}"),
                      "ours", lambda **_: make_policy("lookup", threshold=args.threshold), family="lookup-auto",
                      draft="ngram"),
               Method("copy or draft, specdec++ " + ("auto" if args.threshold == "auto" else f"h={args.threshold:g}"),
                      "ours", lambda **_: CopyOrDraft(make_policy("specdecpp", head=pair.head, threshold=args.threshold)),
                      family="copy-or-draft", draft="both")]
    print(f"specdec demo: {len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens each, "
          f"temperature {args.temperature}, {args.pair or 'bundled'} pair (target "
          f"{sum(p.numel() for p in pair.target.parameters()) / 1e6:.1f}M, draft {_own_params(pair) / 1e6:.1f}M "
          f"parameters of its own; target in "
          f"{str(pair.target.dtype).replace('torch.', '')}, draft in {str(pair.draft.dtype).replace('torch.', '')})")
    recs = run_benchmark(pair, prompts, methods, args.max_new_tokens, args.temperature, args.seed)
    spec = [r for r in recs if r.method == methods[2].name]
    for r in spec[: args.show]:
        print("\n" + "=" * 72 + f"\nHumanEval prompt {r.prompt} (end) + SpecDec++ completion:\n" + "=" * 72)
        tail = "\n".join(prompts[r.prompt].rstrip("\n").splitlines()[-4:])
        print(tail + "\n" + pair.tokenizer.decode(r.tokens))
    rows = summarize(recs, methods, greedy=args.temperature == 0, exact=pair.target.dtype == torch.float32)
    print("\n" + format_table(rows))
    print(f"\n(measured in this run on {torch.get_num_threads()} threads; speedup = median over prompts of tokens/s "
          f"relative to plain decoding; total {time.time() - t0:.0f} s)")


def _own_params(pair) -> int:
    """The draft's parameters that are not the target's tensors (a distilled draft shares the embedding)."""
    theirs = {p.data_ptr() for p in pair.target.parameters()}
    return sum(p.numel() for p in pair.draft.parameters() if p.data_ptr() not in theirs)


def cmd_bench(args):
    import transformers  # noqa: F401 (imported before the memory the pair's loading adds is measured)

    from .benchmark import resident_mib
    from .benchmark_cli import run

    before = resident_mib()
    pair = _models(args, need_head=True)
    run(args, pair, memory=(before, resident_mib()))


def _shard(args):
    """``--shard I/N``, or under torchrun with --data-only, the rank's share (RANK of WORLD_SIZE)."""
    if args.shard is not None:
        if not args.data_only:
            raise UsageError("--shard generates a share of the training data: use it with --data-only")
        try:
            i, n = (int(x) for x in args.shard.split("/"))
        except ValueError:
            raise UsageError(f"--shard: expected I/N (e.g. 0/4), got {args.shard!r}")
        if not (n >= 1 and 0 <= i < n):
            raise UsageError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
        return i, n
    from .engine.tensor_parallel import launched_world_size, rank

    world = launched_world_size()
    if args.data_only and world > 1:
        return rank(), world
    return None


def cmd_train_head(args):
    from .prompts import load_prompts
    from .training.head_data import HeadDataConfig
    from .training.head_train import HeadTrainConfig
    from .training.pipeline import RECIPES, run_pipeline

    if not args.pair and not (args.target and args.draft):
        raise UsageError("train-head needs --pair NAME, or --target and --draft")
    args.draft_dtype, args.device_map_auto = "float32", False
    pair = _models(args, need_head=False)
    prompts = load_prompts(args.prompts, limit=args.limit)
    spec = RECIPES[args.recipe]
    features = spec["features"] if args.features is None else tuple(f for f in args.features.split(",") if f)
    try:
        weights = None if args.rejection_weight == "auto" else [float(w) for w in args.rejection_weight.split(",")]
    except ValueError:
        raise UsageError(f"--rejection-weight: expected 'auto' or comma-separated numbers, got {args.rejection_weight!r}")
    eval_prompts = None if args.eval_prompts == "none" else load_prompts(args.eval_prompts, limit=args.eval_limit)
    shard = _shard(args)
    report = run_pipeline(
        pair.target, pair.draft, pair.tokenizer, prompts, args.out, recipe=args.recipe,
        data_cfg=HeadDataConfig(decoding=args.decoding, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                batch_size=args.batch_size, seed=args.seed, chat=args.chat),
        train_cfg=HeadTrainConfig(num_layers=args.layers, features=features, use_hidden=not args.no_hidden, lr=args.lr,
                                  epochs=args.epochs, seed=args.seed),
        weights=weights, eval_prompts=eval_prompts, work_dir=args.work_dir,
        target_name=args.pair or Path(args.target).name, draft_name=f"{args.pair} draft" if args.pair else
        Path(args.draft).name, log=_log, shard=shard,
        data_only=args.data_only)
    if args.data_only:
        if int(os.environ.get("RANK", "0")) == 0 or shard is None:
            print(json.dumps(report, indent=2))
        return
    print(json.dumps({"chosen_rejection_weight": report["chosen_rejection_weight"], "validation": report["held_out"],
                      "evaluation": report.get("evaluation")}, indent=2))


def cmd_train_draft(args):
    from tqdm import tqdm

    from .training.draft_train import distill_draft
    from .zoo import load_models
    from .zoo.named import PAIRS, target_file

    _check_device(args.device)
    target = target_file(args.target) if args.target in PAIRS else _model_dir(args.target, "--target")
    try:
        layers = tuple(int(x) for x in (args.layers or ("0" if args.kind == "eagle" else "0,1")).split(","))
    except ValueError:
        raise UsageError(f"--layers: expected comma-separated layer indices of the target (e.g. 0,1), got {args.layers!r}")
    if args.kind == "eagle" and len(layers) != 1:
        raise UsageError(f"--layers: a feature draft (--kind eagle) is one decoder layer: give one index, got "
                         f"{args.layers!r}")
    pair = load_models(target, None, None, _dtype(args.target_dtype, args.device), device=args.device,
                       attn_implementation=None)
    common = dict(prompts=args.prompts, max_new_tokens=args.max_new_tokens, vocab=args.vocab, minutes=args.minutes,
                  batch_size=args.batch_size, lr=args.lr, seed=args.seed, log=_log, progress=tqdm)
    work = args.work_dir or Path(args.out) / "work"
    if args.kind == "eagle":
        from .training.feature_train import train_feature_draft

        metrics = train_feature_draft(pair.target, pair.tokenizer, args.out, work, layer=layers[0], **common)
    else:
        metrics = distill_draft(pair.target, pair.tokenizer, args.out, work, layers=layers, **common)
    print(json.dumps({k: metrics[k] for k in ("vocab_subset", "before", "after", "stage_minutes")}, indent=2))


def cmd_zoo_train(args):
    from .zoo.train import ZooConfig, train_pair

    train_pair(args.out, args.work_dir, ZooConfig(seed=args.seed), log=_log)


def cmd_zoo_report(args):
    from .zoo.report import format_report, pair_report

    r = pair_report(args.prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2))
    print(format_report(r))
    _log(f"(wrote {args.out}; {r['threads']} threads)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Speculative decoding and SpecDec++ (specdec_ext).")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate from prompts with streamed output and round statistics",
                       formatter_class=HF)
    _model_args(g)
    _policy_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--file", help="prompts from a .jsonl file ({\"prompt\": ...} per line) or a text file of "
                                    "prompts separated by blank lines")
    src.add_argument("--prompts", help="a batch job: prompts from a .jsonl or text file, or humaneval / stdlib; "
                                       "needs --out")
    g.add_argument("--out", type=Path, help="batch job output: one JSON record per prompt, appended; ids already "
                                            "there are skipped (resume); Ctrl-C or SIGTERM stops it between whole "
                                            "records (exit status 128 + the signal's number)")
    g.add_argument("--batch-size", type=int, default=8, help="batch job: rows generated together")
    g.add_argument("--limit", type=int, default=None, help="batch job: only the first N prompts")
    g.add_argument("--chat", nargs="?", const=True, default=False, metavar="MESSAGE",
                   help="chat: --chat \"MESSAGE\" sends MESSAGE as a user turn through the tokenizer's chat template "
                        "and streams the reply; a bare --chat wraps each --prompt/--file/--prompts prompt the same way")
    g.add_argument("--dataset", default="humaneval", help="humaneval, stdlib or stdlib-train (without --prompt/--file)")
    g.add_argument("--index", type=int, default=0, help="which prompt of --dataset")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=None, help="sampling: keep the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--rounds", action="store_true", help="print every round (to stderr)")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="SpecDec++ (with the draft, and over prompt lookup) vs fixed K vs plain decoding on "
                                    "HumanEval (the bundled pair, or --pair)",
                       formatter_class=HF)
    _model_args(d)
    d.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    d.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    d.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    d.add_argument("--k", type=int, default=None,
                   help="the fixed candidate length to compare with (default: the best of the README's benchmark of "
                        "the pair: 6 for the bundled pair, 2 for smollm2-135m)")
    d.add_argument("--threshold", type=_threshold, default="auto",
                   help="SpecDec++ stop threshold h, or 'auto' (the cost-aware goodput rule)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed")
    d.add_argument("--show", type=int, default=2, help="completions to print")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="the end-to-end benchmark (bench/README.md)", formatter_class=HF)
    _model_args(b)
    from .benchmark_cli import add_arguments

    add_arguments(b)
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a draft/target pair", formatter_class=HF)
    from .zoo.named import NAMES

    t.add_argument("--pair", choices=NAMES[1:], default=None, help="a named pair's target and draft (the head is "
                                                                  "written to --out)")
    t.add_argument("--target", help="target model directory or .gguf file")
    t.add_argument("--draft", help="draft model directory")
    t.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    t.add_argument("--prompts", required=True, help="training prompts: humaneval, stdlib, stdlib-train, a .jsonl file, "
                                                     "or a text file with prompts separated by blank lines")
    t.add_argument("--out", required=True, help="directory for the head (config.json, model.safetensors, metrics.json)")
    t.add_argument("--recipe", default="deployment", choices=["deployment", "paper"],
                   help="deployment: labels for the decoding served, proposal-position state + confidence features, "
                        "w chosen on validation; paper: SpecDec++ Sec. 4 (T = 1 soft labels, token mixing, w = 6)")
    t.add_argument("--decoding", default="greedy", choices=["greedy", "sample"],
                   help="the decoding the head will serve (recipe deployment)")
    t.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (--decoding sample)")
    t.add_argument("--features", default=None,
                   help="comma-separated inputs beside the hidden state: token_prob, margin, entropy, recent_accept "
                        "(default: the recipe's; '' for none)")
    t.add_argument("--no-hidden", action="store_true", help="a head on the features alone (ablation)")
    t.add_argument("--rejection-weight", default="auto",
                   help="w, or comma-separated candidates chosen on the validation split ('auto': the recipe's)")
    t.add_argument("--eval-prompts", default="humaneval", help="evaluation prompts (never trained on), or 'none'")
    t.add_argument("--eval-limit", type=int, default=None, help="use only the first N evaluation prompts")
    t.add_argument("--work-dir", default=None, help="where the (resumable) data sets go (default: --out)")
    t.add_argument("--data-only", action="store_true",
                   help="generate the training data set and stop (under torchrun: each rank its share)")
    t.add_argument("--shard", default=None, metavar="I/N",
                   help="with --data-only: generate shard I of N of the data set (other machines); a run without "
                        "--data-only merges complete shards and trains")
    t.add_argument("--limit", type=int, default=None, help="use only the first N training prompts")
    t.add_argument("--target-dtype", default="float32", choices=DTYPES, help="target dtype for the labels")
    t.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    t.add_argument("--max-new-tokens", type=int, default=128, help="target response length per prompt")
    t.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    t.add_argument("--layers", type=int, default=3, help="residual blocks of the head")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    t.add_argument("--epochs", type=int, default=20, help="passes over the training positions")
    t.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch")
    t.add_argument("--seed", type=int, default=0, help="seed of data generation, split and training")
    t.set_defaults(fn=cmd_train_head)

    r = sub.add_parser("train-draft", help="train a small draft for a target on its own continuations",
                       formatter_class=HF)
    r.add_argument("--kind", default="distilled", choices=["distilled", "eagle"],
                   help="distilled: decoder layers reading tokens; eagle: one layer reading the target's hidden states "
                        "(EAGLE)")
    r.add_argument("--target", required=True, help="a named pair's target (smollm2-135m), a model directory or a .gguf file")
    r.add_argument("--out", required=True, type=Path, help="directory for the draft (config.json, model.safetensors, "
                                                          "metrics.json)")
    r.add_argument("--work-dir", type=Path, default=None, help="data, teacher probabilities, checkpoints (resumable; "
                                                               "default: OUT/work)")
    r.add_argument("--prompts", type=int, default=4096, help="prompts the target continues (standard library, Python docs)")
    r.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target writes per prompt")
    r.add_argument("--vocab", type=int, default=8192, help="the draft's output vocabulary: the target's N most frequent "
                                                          "tokens (FR-Spec)")
    r.add_argument("--layers", default=None, help="the target's decoder layers the draft starts from (default 0,1; "
                                                  "eagle: one, default 0)")
    r.add_argument("--minutes", type=float, default=30.0, help="training time (wall clock)")
    r.add_argument("--lr", type=float, default=5e-4, help="AdamW peak learning rate")
    r.add_argument("--batch-size", type=int, default=64, help="rows of the target's batched decoding")
    r.add_argument("--target-dtype", default="auto", choices=["auto"] + list(DTYPES),
                   help="the target's dtype for data and teacher probabilities (auto: bfloat16 where the hardware has "
                        "bf16 matrix instructions)")
    r.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    r.add_argument("--seed", type=int, default=0, help="seed of prompts, sampling, split and training")
    r.set_defaults(fn=cmd_train_draft)

    z = sub.add_parser("zoo", help="the bundled model pair")
    zs = z.add_subparsers(dest="zoo_cmd", required=True, metavar="COMMAND")
    zt = zs.add_parser("train", help="train (or resume training) the bundled pair and its heads", formatter_class=HF)
    from .zoo import PAIR_DIR

    zt.add_argument("--out", type=Path, default=PAIR_DIR, help="where the pair is written")
    zt.add_argument("--work-dir", type=Path, default=Path(".zoo_work"), help="checkpoints and data sets (resumable)")
    zt.add_argument("--seed", type=int, default=0, help="seed of every stage")
    zt.set_defaults(fn=cmd_zoo_train)
    zr = zs.add_parser("report", help="measure the bundled pair: decode times, greedy agreement, losses, head metrics",
                       formatter_class=HF)
    zr.add_argument("--prompts", type=int, default=40, help="HumanEval prompts for the agreement measurement")
    zr.add_argument("--out", type=Path, default=Path("bench/results/zoo_report.json"), help="the report's JSON")
    zr.set_defaults(fn=cmd_zoo_report)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not sys.stderr.isatty():  # weight-loading progress bars only where someone watches them
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from .engine.tensor_parallel import end_process_group
    from .jobs import JobInterrupted

    try:
        args.fn(args)
    except JobInterrupted as e:  # a batch job stopped by SIGINT or SIGTERM, its records whole
        print(f"specdec: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except (UsageError, ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if args.debug:
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"specdec: error: {text} (--debug shows the traceback)", file=sys.stderr)
        return 2
    finally:
        end_process_group()  # a torchrun rank (--tp) must not leave its gloo group to the interpreter's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
