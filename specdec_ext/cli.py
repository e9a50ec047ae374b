"""The ``specdec`` command: generate, demo, bench, train-head, zoo train."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _models(args, need_head: bool):
    from .zoo import PAIR_DIR, load_models

    target = args.target or PAIR_DIR / "target"
    draft = args.draft or PAIR_DIR / "draft"
    head = args.head or (PAIR_DIR / "head" if (PAIR_DIR / "head" / "config.json").exists() and not args.target else None)
    if need_head and head is None:
        raise SystemExit("specdec: the specdecpp policy needs --head DIR (an acceptance head for this draft)")
    if not Path(target, "config.json").exists():
        raise SystemExit(f"specdec: no model in {target}; the bundled pair is made by `specdec zoo train`")
    return load_models(target, draft, head if need_head else None, DTYPES[args.target_dtype], DTYPES[args.draft_dtype],
                       args.device, "auto" if args.device_map_auto else None)


def _model_args(p):
    p.add_argument("--target", help="target model directory (default: the bundled pair)")
    p.add_argument("--draft", help="draft model directory (default: the bundled pair)")
    p.add_argument("--head", help="acceptance head directory (default: the bundled pair's)")
    p.add_argument("--target-dtype", default="float32", choices=DTYPES)
    p.add_argument("--draft-dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-map-auto", action="store_true", help="spread the target over GPUs (accelerate)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def _policy_args(p):
    p.add_argument("--policy", default="specdecpp",
                   choices=["specdecpp", "fixed", "heuristic", "confidence", "adaedl", "autoregressive"])
    p.add_argument("--k", type=int, default=4, help="candidate length K for --policy fixed")
    p.add_argument("--threshold", type=float, default=0.3, help="SpecDec++ stop threshold h")
    p.add_argument("--k-min", type=int, default=2)
    p.add_argument("--k-max", type=int, default=20)


def _policy(args, head):
    from .policies import make_policy

    if args.policy == "fixed":
        return make_policy("fixed", k=args.k)
    if args.policy == "specdecpp":
        return make_policy("specdecpp", head=head, threshold=args.threshold, k_min=args.k_min, k_max=args.k_max)
    return make_policy(args.policy)


def cmd_generate(args):
    from transformers import TextStreamer

    from .data import load_prompts
    from .engine import SpeculativeGenerator

    pair = _models(args, args.policy == "specdecpp")
    if args.prompt is not None:
        prompts = [args.prompt]
    elif args.file:
        prompts = [Path(args.file).read_text()]
    else:
        prompts = [load_prompts(args.dataset)[args.index]]
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=_policy(args, pair.head))
    for text in prompts:
        ids = torch.tensor([pair.tokenizer(text, add_special_tokens=False)["input_ids"]])
        streamer = TextStreamer(pair.tokenizer, skip_prompt=False)
        out = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, eos_token_id=pair.tokenizer.eos_token_id, streamer=streamer)
        st = out.stats
        print("\n" + "-" * 72)
        print(f"policy {st.policy}: {st.new_tokens} tokens in {st.wall_ms:.0f} ms ({st.tokens_per_s:.1f} tokens/s), "
              f"{len(st.rounds)} rounds, target calls {st.target_calls}, draft calls {st.draft_calls}")
        print(f"mean candidate length {st.mean_candidate_length:.2f}, mean accepted length {st.mean_accepted_length:.2f}, "
              f"acceptance rate {st.acceptance_rate:.3f}, discarded draft tokens {st.discarded}")
        print(f"time: draft {st.draft_ms:.0f} ms, verify {st.verify_ms:.0f} ms, overhead {st.overhead_ms:.0f} ms "
              f"({st.overhead_ms_per_round:.2f} ms/round), prefill {st.prefill_ms:.0f} ms")
        if args.rounds:
            for i, r in enumerate(st.rounds):
                print(f"  round {i:3d}: candidates {r.candidates} accepted {r.accepted} emitted {r.emitted} "
                      f"draft {r.draft_ms:.1f} ms verify {r.verify_ms:.1f} ms")


def cmd_demo(args):
    from .benchmark import Method, format_table, run_benchmark, summarize
    from .data import load_prompts
    from .policies import make_policy

    t0 = time.time()
    pair = _models(args, True)
    prompts = load_prompts("humaneval", limit=args.prompts)
    methods = [Method("plain", "ours", lambda **_: make_policy("autoregressive"), family="plain"),
               Method(f"fixed K={args.k}", "ours", lambda **_: make_policy("fixed", k=args.k), family="fixed"),
               Method(f"specdec++ h={args.threshold:g}", "ours",
                      lambda **_: make_policy("specdecpp", head=pair.head, threshold=args.threshold), family="specdecpp")]
    print(f"specdec demo: {len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens each, "
          f"temperature {args.temperature}, bundled pair (target {sum(p.numel() for p in pair.target.parameters()) / 1e6:.1f}M, "
          f"draft {sum(p.numel() for p in pair.draft.parameters()) / 1e6:.1f}M parameters)")
    recs = run_benchmark(pair, prompts, methods, args.max_new_tokens, args.temperature, args.seed)
    spec = [r for r in recs if r.method == methods[2].name]
    for r in spec[: args.show]:
        print("\n" + "=" * 72 + f"\nHumanEval prompt {r.prompt} (end) + SpecDec++ completion:\n" + "=" * 72)
        tail = "\n".join(prompts[r.prompt].rstrip("\n").splitlines()[-4:])
        print(tail + "\n" + pair.tokenizer.decode(r.tokens))
    rows = summarize(recs, methods, greedy=args.temperature == 0)
    print("\n" + format_table(rows))
    print(f"\n(measured in this run on {torch.get_num_threads()} threads; speedup = median over prompts of tokens/s "
          f"relative to plain decoding; total {time.time() - t0:.0f} s)")


def cmd_bench(args):
    from .benchmark_cli import main as bench_main

    bench_main(args)


def cmd_train_head(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import load_prompts
    from .head.data import HeadDataConfig
    from .head.pipeline import run_pipeline
    from .head.train import HeadTrainConfig

    target = AutoModelForCausalLM.from_pretrained(args.target, local_files_only=True, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    prompts = load_prompts(args.prompts, limit=args.limit)
    report = run_pipeline(target, draft, tok, prompts, args.out,
                          HeadDataConfig(args.max_new_tokens, args.temperature, args.mix_ratio, batch_size=args.batch_size,
                                         seed=args.seed),
                          HeadTrainConfig(args.layers, args.rejection_weight, args.lr, epochs=args.epochs, seed=args.seed),
                          data_file=args.data_file, target_name=str(args.target), draft_name=str(args.draft))
    print(json.dumps(report["held_out"], indent=2))


def cmd_zoo_train(args):
    from .zoo.train import main as zoo_main

    zoo_main(["--out", str(args.out), "--work-dir", str(args.work_dir), "--seed", str(args.seed)])


def cmd_zoo_report(args):
    from .zoo.report import format_report, pair_report

    r = pair_report(args.prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2))
    print(format_report(r))
    print(f"\n(wrote {args.out}; {r['threads']} threads)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Speculative decoding and SpecDec++ (specdec_ext).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate from a prompt with streamed output and round statistics")
    _model_args(g)
    _policy_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt")
    src.add_argument("--file")
    g.add_argument("--dataset", default="humaneval")
    g.add_argument("--index", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rounds", action="store_true", help="print every round")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="SpecDec++ vs fixed K vs plain decoding on HumanEval with the bundled pair")
    _model_args(d)
    d.add_argument("--prompts", type=int, default=8)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--k", type=int, default=2, help="fixed K (default: the best K of the README's benchmark)")
    d.add_argument("--threshold", type=float, default=0.3, help="SpecDec++ stop threshold h (the benchmark's best)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--show", type=int, default=2, help="completions to print")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="the benchmark suite (see bench/README or the project README)")
    _model_args(b)
    from .benchmark_cli import add_arguments

    add_arguments(b)
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a draft/target pair")
    t.add_argument("--target", required=True)
    t.add_argument("--draft", required=True)
    t.add_argument("--prompts", required=True, help="humaneval, stdlib, stdlib-train, a .jsonl file, or a text file "
                                                     "with prompts separated by blank lines")
    t.add_argument("--out", required=True)
    t.add_argument("--limit", type=int, default=None)
    t.add_argument("--data-file", default=None, help="reuse (or write) the generated data set here")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--mix-ratio", type=float, default=0.15)
    t.add_argument("--rejection-weight", type=float, default=6.0)
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_train_head)

    z = sub.add_parser("zoo", help="the bundled model pair")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zt = zs.add_parser("train", help="train (or resume training) the bundled pair and its head")
    from .zoo import PAIR_DIR

    zt.add_argument("--out", type=Path, default=PAIR_DIR)
    zt.add_argument("--work-dir", type=Path, default=Path(".zoo_work"))
    zt.add_argument("--seed", type=int, default=0)
    zt.set_defaults(fn=cmd_zoo_train)
    zr = zs.add_parser("report", help="measure the bundled pair: decode times, greedy agreement, losses, head metrics")
    zr.add_argument("--prompts", type=int, default=40, help="HumanEval prompts for the agreement measurement")
    zr.add_argument("--out", type=Path, default=Path("bench/results/zoo_report.json"))
    zr.add_argument("--threads", type=int, default=None)
    zr.set_defaults(fn=cmd_zoo_report)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
