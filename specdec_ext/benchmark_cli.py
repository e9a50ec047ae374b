"""``specdec bench``: the benchmark suite's options, outputs (JSON, Markdown, PNG) and the cost-model
replay. The ``specdec`` command (``cli.py``) parses the options and loads the models, then calls
:func:`run`; this module never imports the command line."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

import torch

from .benchmark import (DEFAULT_KS, DEFAULT_THRESHOLDS, LOOKUP_KS, PAPER_THRESHOLDS, format_table, machine_description,
                        pair_memory, run_benchmark, save_json, standard_methods, summarize)
from .engine.admission import ADMISSION_MODES, DEFAULT_ADMISSION


def _numbers(kind):
    def parse(text: str):
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}")
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    return parse


def add_arguments(p):
    """The benchmark's options (the parser shows each default)."""
    p.add_argument("--dataset", default="humaneval",
                   help="humaneval, stdlib, a .jsonl file, or a text file of prompts separated by blank lines")
    p.add_argument("--prompts", type=int, default=None, help="number of prompts (None: all; --quick: 6)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (texts are compared with plain decoding)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt 0 (prompt i uses seed + i)")
    p.add_argument("--quick", action="store_true", help="a few prompts and methods: minutes, for the README")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' own generate / assisted generation")
    p.add_argument("--auto-copies", type=int, default=0,
                   help="n more arms of SpecDec++ threshold='auto', identical, each its own policy: how far identical "
                        "arms fall apart in this run (its noise)")
    p.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=None,
                   help="also transformers' generate(cache_implementation='static'), whose forward transformers "
                        "compiles on a GPU (default: on with --device cuda, off elsewhere)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="directory for JSON, Markdown and plots")
    p.add_argument("--cost-ratios", default="0.05,0.1,0.2", help="draft/target cost ratios for the replay")
    p.add_argument("--ks", type=_numbers(int), default=DEFAULT_KS, help="fixed candidate lengths K")
    p.add_argument("--lookup-ks", type=_numbers(int), default=LOOKUP_KS,
                   help="prompt lookup's fixed candidate lengths K (arms 'lookup K=k', beside 'lookup heuristic' and, "
                        "unless --no-hf, transformers' prompt_lookup_num_tokens=10)")
    p.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup arms")
    p.add_argument("--eagle-ks", type=_numbers(int), default=(),
                   help="the pair's feature draft (EAGLE) at these fixed K (arms 'eagle K=k', beside 'eagle confidence' "
                        "and 'copy or eagle, confidence'); needs a pair with one")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run the target's GGUF file through llama.cpp (llama-cpp-python, an optional install), "
                        "plain and with its prompt lookup, after our arms, same prompt tokens and threads; the JSON's "
                        "meta.decode_prefill gives every arm's decode and prefill rates apart")
    p.add_argument("--llama-cpp-lookup", type=int, default=10,
                   help="tokens llama.cpp's prompt-lookup decoding proposes a round (its num_pred_tokens)")
    p.add_argument("--thresholds", type=_numbers(float), default=DEFAULT_THRESHOLDS,
                   help="SpecDec++ stop thresholds h; threshold='auto' runs as well")
    p.add_argument("--auto-uncalibrated", action="store_true",
                   help="also threshold='auto' with the head's survivals uncalibrated (calibrate=False)")
    p.add_argument("--auto-rule-only", action="store_true",
                   help="also threshold='auto' with select=False: the goodput rule alone, without the choice of stop "
                        "rule by measured goodput")
    p.add_argument("--no-adaptive", action="store_true",
                   help="skip the adaptive baselines (heuristic, confidence, AdaEDL)")
    p.add_argument("--no-paper", action="store_true", help="skip the paper-recipe head's arms")
    p.add_argument("--paper-thresholds", type=_numbers(float), default=PAPER_THRESHOLDS,
                   help="stop thresholds of the paper-recipe head, bounds [2, 20] (bundled pair)")
    p.add_argument("--no-fp32-plain", action="store_true",
                   help="skip plain decoding of a float32 copy of a bf16 target (the fp32 reference)")
    p.add_argument("--hf-ks", type=_numbers(int), default=None,
                   help="K values for transformers' assisted generation (None: the --ks values)")
    p.add_argument("--batch-sizes", type=_numbers(int), default=None,
                   help="the batch benchmark: prompts as concurrent requests, B at a time for each size "
                        "(e.g. 1,4,16,64), for plain decoding, fixed K, SpecDec++ and the heuristic; continuous "
                        "batching (a finished request's row goes to the next one) unless --static-batches")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --batch-sizes: passes over the streams per batch size, the method order changing per pass "
                        "(the figures pool every pass; on a shared machine one pass can drift by 10-20%%)")
    p.add_argument("--static-batches", action="store_true",
                   help="with --batch-sizes: static batches (groups of B; a finished row is not refilled)")
    p.add_argument("--draft-context", type=int, default=None,
                   help="with --batch-sizes: the draft reads at most the last N tokens of each request's context "
                        "(default: all of it)")
    p.add_argument("--length-spread", type=int, default=0,
                   help="with --batch-sizes: each request asks for its own number of new tokens, drawn uniformly "
                        "(seeded) from --max-new-tokens +- S, as a server's requests differ (default 0: all equal)")
    p.add_argument("--serve", action="store_true",
                   help="serving latency (TTFT, TPOT, ITL, end to end) under requests arriving at --rates, served "
                        "by continuous batching at the one size in --batch-sizes (default 16): plain, fixed K (the "
                        "first of --ks), SpecDec++ auto and the batch budget")
    p.add_argument("--rates", default="2,8,32,inf",
                   help="with --serve: request rates in requests/s (inf: all at once), comma-separated")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="with --serve: the gamma shape of the arrival gaps (1: Poisson arrivals; below 1 burstier)")
    p.add_argument("--admission", choices=ADMISSION_MODES, default=None,
                   help=f"with --batch-sizes (default {DEFAULT_ADMISSION}): when queued requests join the batch: "
                        "eager (after every round that frees a slot), grouped (once the free slots' lost throughput "
                        "reaches an admission's measured fixed cost; fewer prefill calls, for launch-bound GPUs) or "
                        "ahead (as eager, from the queue's next min(B, 16) requests prefilled together)")


def _command_line(args) -> str:
    """The ``specdec bench`` command that reproduces this run's settings (recorded in the results)."""
    parts = ["specdec bench"]
    for key in ("pair", "dataset", "prompts", "max_new_tokens", "temperature", "target_dtype", "draft_dtype",
                "weights", "attn_implementation"):
        if getattr(args, key, None) is not None:
            parts.append(f"--{key.replace('_', '-')} {getattr(args, key)}")
    if args.quick:
        parts.append("--quick")
    else:
        for key in ("ks", "thresholds", "paper_thresholds", "hf_ks", "lookup_ks", "eagle_ks"):
            if getattr(args, key, None):
                parts.append(f"--{key.replace('_', '-')} " + ",".join(f"{x:g}" for x in getattr(args, key)))
    for key in ("no_hf", "no_fp32_plain", "auto_uncalibrated", "auto_rule_only", "no_adaptive", "no_paper", "no_lookup",
                "llama_cpp"):
        if getattr(args, key, False):
            parts.append(f"--{key.replace('_', '-')}")
    if getattr(args, "hf_static", None) is not None:
        parts.append("--hf-static" if args.hf_static else "--no-hf-static")
    if getattr(args, "auto_copies", 0):
        parts.append(f"--auto-copies {args.auto_copies}")
    return " ".join(parts)


def _gguf(args, pair) -> Optional[Path]:
    """The target's GGUF file: the named pair's (``--pair``) or ``--target X.gguf``; None for a model directory."""
    from .zoo.gguf import is_gguf
    from .zoo.named import target_file

    if getattr(args, "pair", None):
        return target_file(args.pair)
    target = getattr(args, "target", None)
    return Path(target) if target and is_gguf(Path(target)) else None


def llama_cpp_arms(args, pair, ids, methods, records) -> dict:
    """``--llama-cpp``: llama.cpp plain and with its prompt lookup on the target's GGUF file (``llamacpp.py``) over
    the prompts' token ids ``ids``, its records and methods appended to ``records`` and ``methods`` (family ``llama.cpp``; their greedy texts are not
    checked against ours: llama.cpp multiplies the stored quantized weights by quantized activations). Returns what
    the JSON's ``meta.llama_cpp`` records (the repack, or why it is skipped).

    Raises ValueError where the target is not a GGUF file."""
    from . import llamacpp
    from .benchmark import Method, RunRecord

    why = llamacpp.missing()
    if why is not None:
        print(why)
        return {"skipped": why}
    gguf = _gguf(args, pair)
    if gguf is None:
        raise ValueError("--llama-cpp runs the target's GGUF file: give --pair NAME or --target FILE.gguf")
    out = {"file": gguf.name, "threads": torch.get_num_threads()}
    for name, lookup in (("llama.cpp plain", 0), ("llama.cpp prompt lookup", args.llama_cpp_lookup)):
        print(f"{name}: {len(ids)} prompts")
        res = llamacpp.run(str(gguf), ids, args.max_new_tokens, torch.get_num_threads(), lookup,
                           pair.tokenizer.eos_token_id)
        methods.append(Method(name, "llama.cpp", family="llama.cpp", param=lookup or None, target="gguf"))
        records += [RunRecord(name, i, len(r["tokens"]), r["wall_s"], 0, 0, tokens=r["tokens"], forward_s=r["wall_s"],
                              engine={"prefill_ms": 1e3 * r["prefill_s"]}) for i, r in enumerate(res["records"])]
        out[name] = {"repack": res["repack"], "note": res["note"], **res["memory"]}
        if res["note"]:
            print(res["note"])
    return out


def decode_prefill(records, lengths: list) -> dict:
    """Per method, over all prompts: decode tokens/s (the tokens after the first over the time after the prefill)
    and prefill tokens/s (prompt tokens, ``lengths[prompt]``, over the time to the first token), from each record's
    ``prefill_ms``."""
    out = {}
    for name in dict.fromkeys(r.method for r in records):
        recs = [r for r in records if r.method == name and r.engine and "prefill_ms" in r.engine]
        pre = sum(r.engine["prefill_ms"] for r in recs) / 1e3
        dec = sum(r.wall_s for r in recs) - pre
        if recs and pre > 0 and dec > 0:
            out[name] = {"decode_tokens_per_s": sum(max(0, r.new_tokens - 1) for r in recs) / dec,
                         "prefill_tokens_per_s": sum(lengths[r.prompt] for r in recs) / pre}
    return out


def cost_model_replay(records, rows, ratios: list[float]) -> list[dict]:
    """Speedup each method would reach if a draft forward cost c target forwards and verifying
    K + 1 tokens cost one target forward (as on a GPU): tokens / (target calls + c * draft calls),
    from the calls recorded in this run; plain decoding is 1 target call per token."""
    out = []
    for row in rows:
        recs = [r for r in records if r.method == row["method"]]
        tokens = sum(r.new_tokens for r in recs)
        tc = sum(r.target_calls for r in recs)
        dc = sum(r.draft_calls for r in recs)
        if tc == 0:  # an engine whose calls are not counted (llama.cpp)
            continue
        out.append({"method": row["method"], **{f"c={c:g}": tokens / (tc + c * dc) for c in ratios}})
    return out


def _save_plot(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> str:
    """Label, save and close one figure; returns the file name."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def plots(rows, out: Path, prefix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fam = lambda f: sorted([r for r in rows if r["family"] == f], key=lambda r: r["param"])  # noqa: E731
    spp, paper, fixed = fam("specdecpp"), fam("specdecpp-paper"), fam("fixed")
    auto = [r for r in rows if r["family"] == "specdecpp-auto"]
    if spp or paper:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
        if spp:
            ax.plot([r["param"] for r in spp], [r["speedup"] for r in spp], "o-", color="C3", label="SpecDec++ (this head)")
        if paper:
            ax.plot([r["param"] for r in paper], [r["speedup"] for r in paper], "^-", color="C1",
                    label="SpecDec++ (paper-recipe head)")
        if auto:
            ax.axhline(auto[0]["speedup"], color="C3", lw=1.5, ls=":", label="SpecDec++ threshold='auto'")
        for i, r in enumerate(fixed):
            ax.axhline(r["speedup"], color=plt.cm.Blues(0.35 + 0.6 * i / max(1, len(fixed))), lw=1, ls="--")
            ax.annotate(f"K={r['param']:g}", (1.0, r["speedup"]), fontsize=6, xytext=(2, 0), textcoords="offset points")
        ax.axhline(1.0, color="black", lw=1.2, label="plain decoding")
        made.append(_save_plot(fig, ax, "stop threshold h", "speedup over plain decoding (median over prompts)",
                               "SpecDec++ vs fixed candidate length K (dashed)", out / f"{prefix}tokens_per_s_vs_threshold.png"))
    if spp or fixed or paper:
        fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
        for key, rs, style, name in (("K", fixed, "s-", "fixed K"), ("h", spp, "o-", "SpecDec++ (this head)"),
                                     ("h", paper, "^-", "SpecDec++ (paper head)")):
            if rs:
                ax.plot([r["verification_rate"] for r in rs], [r["discard_rate"] for r in rs], style, label=name)
                for r in rs:
                    ax.annotate(f"{key}={r['param']:g}", (r["verification_rate"], r["discard_rate"]),
                                fontsize=6, xytext=(3, 3), textcoords="offset points")
        for r, mark, name in ((auto[0] if auto else None, "rP", "SpecDec++ auto"),
                              (next((r for r in rows if r["family"] == "oracle"), None), "k*", "oracle")):
            if r is not None and "verification_rate" in r:
                ax.plot([r["verification_rate"]], [r["discard_rate"]], mark, ms=10, label=name)
        made.append(_save_plot(fig, ax, "verification rate (target calls per token)",
                               "discard rate (discarded draft tokens per token)", "Pareto front (SpecDec++ Fig. 3 style)",
                               out / f"{prefix}pareto.png"))
    return made


def selection(methods, out: Path, prefix: str = "", window: int = 100) -> tuple:
    """What ``threshold="auto"``'s stop-rule selector did in each auto arm of the run
    (:class:`~specdec_ext.policies.select.StopSelector`): the arms, the one played in each round, the share of the last
    quarter of the rounds each took (the arm it settled on first), and its goodput estimates at the end; with a plot
    of each arm's share of every ``window`` rounds over the run. Returns ``(report, lines, plot file or None)``."""
    report, lines = {}, []
    for m in methods:
        sel = getattr(m._instance, "selector", None) if m.family.startswith("specdecpp-auto") else None
        if sel is None or not sel.history:
            continue
        played = list(sel.history)
        names = sel.names()
        late = sel.shares(max(1, len(played) // 4))
        settled = max(late, key=late.get)
        report[m.name] = {"arms": names, "played": played, "settled": settled, "late_shares": late,
                          "estimates": [{"arm": n, "tokens_per_ms": r, "over_reference": rel,
                                         "sd": sd if sd != float("inf") else None, "rounds": w}
                                        for n, r, rel, sd, w in sel.estimates()],
                          "cost_fit_ms": {"round": sel.time.c[0], "draft_step": sel.time.c[1],
                                          "verified_token": sel.time.c[2]},
                          "selection_us_per_round": sel.cost()[0], "selection_share_of_round": sel.cost()[1]}
        us, share = sel.cost()
        lines.append(f"{m.name}: settled on {settled} ({late[settled]:.0%} of its last {max(1, len(played) // 4)} "
                     f"rounds); over the run " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                          sorted(sel.shares().items(), key=lambda kv: -kv[1]))
                     + f"; the selection's own cost {us:.0f} us per round, {share:.2%} of a round")
    if not report:
        return report, lines, None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(report.values()))
    names, played = first["arms"], first["played"]
    starts = list(range(0, len(played), window))
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    shares = [[played[s: s + window].count(a) / len(played[s: s + window]) for s in starts] for a in range(len(names))]
    ax.stackplot([s + window / 2 for s in starts], shares, labels=names, alpha=0.85)
    ax.set_ylim(0, 1)
    ax.set_xlim(0, len(played))
    name = _save_plot(fig, ax, f"round (windows of {window})", "share of rounds",
                      f"threshold='auto': the stop rule it played ({next(iter(report))})",
                      out / f"{prefix}auto-arms.png")
    return report, lines, name


def run(args, pair, memory: tuple = (None, None)):
    """``specdec bench`` with the models the command line loaded (``cli._models``); ``memory``: the process's
    resident memory (MiB) before and after loading them, for ``meta.memory``."""
    from .prompts import load_prompts

    t0 = time.time()
    n = args.prompts if args.prompts is not None else (6 if args.quick else None)
    prompts = load_prompts(args.dataset, limit=n)
    if args.serve:
        return run_serve(args, pair, prompts, t0)
    if args.batch_sizes is not None:
        return run_batches(args, pair, prompts, t0)
    batch_only = [name for name, given in (("--repeats", args.repeats != 1), ("--static-batches", args.static_batches),
                                           ("--draft-context", args.draft_context is not None),
                                           ("--length-spread", args.length_spread != 0),
                                           ("--admission", args.admission is not None)) if given]
    if batch_only:  # options of the batch benchmark would otherwise be ignored without a word
        raise ValueError(f"{', '.join(batch_only)}: only with --batch-sizes (the batch benchmark)")
    paper = pair.heads.get("paper")
    if args.eagle_ks and pair.feature is None and args.pair not in (None, "bundled"):  # loaded where it is asked for
        from .zoo import named_feature_draft

        pair.feature = named_feature_draft(args.pair, pair.target, pair.draft.dtype)
    if args.eagle_ks and pair.feature is None:
        raise ValueError(f"--eagle-ks: the {args.pair} pair has no feature draft (`specdec train-draft --kind eagle` "
                         "makes one)")
    hf_static = args.hf_static if args.hf_static is not None else args.device.startswith("cuda")
    if args.auto_copies < 0:
        raise ValueError(f"--auto-copies: expected a count >= 0, got {args.auto_copies}")
    if args.hf_static and args.no_hf:
        raise ValueError("--hf-static: transformers' methods are skipped (--no-hf); drop one of the two")
    fp32_plain = pair.target.dtype != torch.float32 and not args.no_fp32_plain
    if args.quick:
        methods = standard_methods(pair.head, ks=(2, 3, 4), thresholds=(0.7,), hf=not args.no_hf, hf_ks=(2,),
                                   adaptive=False, paper_head=paper, paper_thresholds=(0.3,), fp32_plain=fp32_plain,
                                   hf_static=hf_static, lookup_ks=() if args.no_lookup else (4,))
        methods = [m for m in methods if m.family not in ("hf-heuristic", "hf-confidence")]
    else:
        methods = standard_methods(pair.head, ks=args.ks, thresholds=args.thresholds, hf=not args.no_hf,
                                   hf_ks=args.hf_ks, paper_head=None if args.no_paper else paper,
                                   paper_thresholds=args.paper_thresholds, adaptive=not args.no_adaptive,
                                   fp32_plain=fp32_plain, auto_uncalibrated=args.auto_uncalibrated,
                                   hf_static=hf_static, auto_copies=args.auto_copies,
                                   auto_rule_only=args.auto_rule_only,
                                   lookup_ks=() if args.no_lookup else args.lookup_ks, feature_ks=args.eagle_ks)
    print(f"specdec bench: {len(prompts)} {args.dataset} prompts x {len(methods)} methods, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, target {pair.target.dtype}, "
          f"draft {pair.draft.dtype}")
    records = run_benchmark(pair, prompts, methods, args.max_new_tokens, args.temperature, args.seed)
    ids = [pair.tokenizer(p)["input_ids"] for p in prompts]
    llama = llama_cpp_arms(args, pair, ids, methods, records) if args.llama_cpp else None
    exact = pair.target.dtype == torch.float32
    rows = summarize(records, methods, greedy=args.temperature == 0, exact=exact,
                     reference="plain fp32" if fp32_plain else None)
    ratios = [float(c) for c in args.cost_ratios.split(",")]
    replay = cost_model_replay(records, rows, ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.dataset).stem}{f'-T{args.temperature:g}' if args.temperature else ''}{'-quick' if args.quick else ''}"
    meta = {"machine": machine_description(pair), "dataset": args.dataset, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
            "target_dtype": str(pair.target.dtype).replace("torch.", ""),
            "draft_dtype": str(pair.draft.dtype).replace("torch.", ""),
            "processor": machine_description(pair)["processor"],
            "duration_s": time.time() - t0, "command": _command_line(args), "cost_model_replay": replay}
    meta["decode_prefill"] = decode_prefill(records, [len(i) for i in ids])
    if llama is not None:
        meta["llama_cpp"] = llama
    meta["memory"] = pair_memory(pair, *memory)
    chosen, chosen_lines, chosen_plot = selection(methods, args.out, prefix=f"{tag}-")
    if chosen:
        meta["auto_selection"] = chosen
    if any(m.kind == "ours" and m.policy is not None and m.instance().needs_costs for m in methods):
        from .engine import SpeculativeGenerator  # the profile the cost-aware arms started from (cached on disk)

        meta["cost_model"] = json.loads(SpeculativeGenerator(pair.target, pair.draft).costs().to_json())
    save_json(args.out / f"bench-{tag}.json.gz", records, rows, meta)
    table = format_table(rows)
    rep_lines = ["| method | " + " | ".join(f"speedup at c = {c:g}" for c in ratios) + " |",
                 "|---|" + "---|" * len(ratios)]
    rep_lines += [f"| {r['method']} | " + " | ".join(f"{r[f'c={c:g}']:.2f}×" for c in ratios) + " |" for r in replay]
    made = plots(rows, args.out, prefix=f"{tag}-") + ([chosen_plot] if chosen_plot else [])
    md = (f"{table}\n\nCost-model replay (draft/target cost ratio c; verification of K+1 tokens = 1 target call):\n\n"
          + "\n".join(rep_lines) + "\n")
    if chosen_lines:
        md += "\nthreshold='auto', the stop rule it chose by measured goodput:\n\n" + "\n".join(
            f"- {line}" for line in chosen_lines) + "\n"
    if meta["decode_prefill"]:
        md += "\nDecode and prefill apart (all prompts' tokens over their time; prefill: to the first token):\n\n"
        md += "| method | decode tokens/s | prefill tokens/s |\n|---|---|---|\n" + "".join(
            f"| {name} | {v['decode_tokens_per_s']:.1f} | {v['prefill_tokens_per_s']:.0f} |\n"
            for name, v in meta["decode_prefill"].items())
    for name, v in (llama or {}).items():
        if isinstance(v, dict) and v.get("note"):
            md += f"\n{name}: {v['note']}\n"
    if "skipped" in (llama or {}):
        md += f"\n{llama['skipped']}\n"
    if "cost_model" in meta:
        c = meta["cost_model"]
        md += (f"\nThe profiled costs the cost-aware arms started from (ms): draft step {c['draft_ms']:.2f}, per candidate "
               f"{c['step_ms']:.2f}, per round {c['round_ms']:.2f}, verification of 1 / 2 / 5 tokens "
               + " / ".join(f"{c['verify_ms'][n - 1]:.2f}" for n in (1, 2, 5) if n <= len(c["verify_ms"])) + "\n")
    (args.out / f"bench-{tag}.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out / f'bench-{tag}.json.gz'}, {args.out / f'bench-{tag}.md'}" + "".join(f", {args.out / m}" for m in made))
    print(f"duration {time.time() - t0:.0f} s")


def run_serve(args, pair, prompts, t0):
    """``specdec bench --serve``: serving latency under arrivals (``serving.py``), its JSON, table and plots."""
    import json

    from . import serving

    sizes = args.batch_sizes or [16]
    if len(sizes) != 1 or sizes[0] < 1:
        raise ValueError(f"--batch-sizes: --serve takes one batch size >= 1, got {sizes}")
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise ValueError(f"--rates: expected comma-separated request rates (numbers or inf), got {args.rates!r}") \
            from None
    if args.temperature != 0:
        raise ValueError("--serve: greedy decoding only (--temperature 0)")
    ids = [pair.tokenizer(p)["input_ids"] for p in prompts]
    k = int(args.ks[0]) if args.ks else 2
    print(f"specdec bench --serve: {len(ids)} {args.dataset} prompts at {rates} requests/s, B = {sizes[0]}, "
          f"{args.max_new_tokens} new tokens")
    rows = serving.run(pair, ids, rates, sizes[0], args.max_new_tokens, k, args.burstiness, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.dataset).stem}-serve-b{sizes[0]}"
    meta = {"machine": machine_description(pair), "dataset": args.dataset, "prompts": len(ids),
            "max_new_tokens": args.max_new_tokens, "batch_size": sizes[0], "rates": rates,
            "burstiness": args.burstiness, "seed": args.seed, "duration_s": time.time() - t0,
            "command": _command_line(args) + f" --serve --batch-sizes {sizes[0]} --rates {args.rates}"
            + (f" --burstiness {args.burstiness:g}" if args.burstiness != 1 else "")}
    (args.out / f"bench-{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}) + "\n")
    md = serving.format_table(rows)
    (args.out / f"bench-{tag}.md").write_text(md + "\n")
    made = serving.plot(rows, args.out, prefix=f"{tag}")
    print("\n" + md)
    print(f"wrote {args.out / f'bench-{tag}.json'}, {args.out / f'bench-{tag}.md'}" + "".join(f", {args.out / m}" for m in made))


def run_batches(args, pair, prompts, t0):
    """``specdec bench --batch-sizes ...``: the batch benchmark (``batch_bench``), its JSON, table and plot."""
    from .batch_bench import batch_plot, format_batch_table, run_batch_benchmark, summarize_batches

    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"--batch-sizes: expected sizes >= 1, got {args.batch_sizes}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: expected an integer >= 1, got {args.repeats}")
    if args.draft_context is not None and args.draft_context < 1:
        raise ValueError(f"--draft-context: expected a token count >= 1, got {args.draft_context}")
    if not 0 <= args.length_spread < args.max_new_tokens or (args.length_spread and args.static_batches):
        raise ValueError(f"--length-spread: expected tokens in 0 .. --max-new-tokens - 1 = {args.max_new_tokens - 1}, "
                         f"and not with --static-batches; got {args.length_spread}")
    if args.admission is not None and args.static_batches:
        raise ValueError("--admission: static batches admit no requests mid-generation (continuous batching only)")
    methods = [m for m in standard_methods(pair.head, ks=args.ks, thresholds=args.thresholds, hf=False,
                                           oracle=False, adaptive=True)
               if m.family in ("plain", "fixed", "specdecpp", "specdecpp-auto", "heuristic")]
    print(f"specdec bench: {len(prompts)} {args.dataset} prompts as requests in "
          f"{'static batches' if args.static_batches else 'continuous batching'} of {args.batch_sizes} x "
          f"{len(methods)} methods, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"target {pair.target.dtype}, draft {pair.draft.dtype}")
    records = run_batch_benchmark(pair, prompts, methods, list(args.batch_sizes), args.max_new_tokens,
                                  args.temperature, args.seed, refill=not args.static_batches, repeats=args.repeats,
                                  draft_context=args.draft_context, length_spread=args.length_spread,
                                  admission=args.admission if not args.static_batches else None)
    rows = summarize_batches(records, methods)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.dataset).stem}{f'-T{args.temperature:g}' if args.temperature else ''}-batch"
    meta = {"machine": machine_description(pair), "dataset": args.dataset, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
            "batch_sizes": list(args.batch_sizes), "refill": not args.static_batches, "repeats": args.repeats,
            "draft_context": args.draft_context, "length_spread": args.length_spread,
            "admission": None if args.static_batches else args.admission or DEFAULT_ADMISSION,
            "target_dtype": str(pair.target.dtype).replace("torch.", ""),
            "draft_dtype": str(pair.draft.dtype).replace("torch.", ""),
            "duration_s": time.time() - t0,
            "command": _command_line(args) + " --batch-sizes " + ",".join(map(str, args.batch_sizes))
            + (" --static-batches" if args.static_batches else "")
            + (f" --repeats {args.repeats}" if args.repeats > 1 else "")
            + (f" --draft-context {args.draft_context}" if args.draft_context is not None else "")
            + (f" --length-spread {args.length_spread}" if args.length_spread else "")
            + (f" --admission {args.admission}" if args.admission is not None else "")}
    save_json(args.out / f"bench-{tag}.json.gz", records, rows, meta)
    table = format_batch_table(rows)
    (args.out / f"bench-{tag}.md").write_text(table + "\n")
    plot = batch_plot(rows, args.out / f"{tag}-throughput.png")
    print("\n" + table)
    print(f"wrote {args.out / f'bench-{tag}.json.gz'}, {args.out / f'bench-{tag}.md'}, {args.out / plot}")
    print(f"duration {time.time() - t0:.0f} s")
