"""Kernel benchmark: the fused verify op against Hugging Face's `_speculative_sampling` composition; with
``--attention``, attention over a KV cache on the CPU.

Both start from the same logits (temperature 1): Hugging Face's function softmaxes [1, K, V] and
[1, K+1, V], gathers, compares, builds the residual and calls multinomial; it handles batch size
1, so a batch of B rows is B calls. The fused op (`chain_verify_logits`) does the whole batch in
one call without writing probabilities. Run side by side in one process, alternating, medians.

    python bench/bench_ops.py [--quick] [--device cpu|cuda] [--out bench/results]

On CUDA each call is timed from a synchronised start to a synchronised end (host wall clock, so launch
overhead counts, as it does in a decoding loop), and the fused op is also timed replayed from a captured
CUDA graph ("fused_graph_us").

``--attention``: torch's fused kernel, an explicit one and this project's ``ops.decode_attention``, by queries per row.
Why: in the batch benchmark plain decoding of the bf16 target gave fewer tokens/s at B = 64 than at B = 16, and
profiling one target forward put 80% of it in ``aten::_scaled_dot_product_flash_attention_for_cpu``. One attention
layer of the bundled target's shape (8 heads of 64, a boolean mask as the runners pass it) over ``[B, heads, C, 64]``
keys and values, for n = 1, 2, 5 queries per row, timed as ``F.scaled_dot_product_attention`` (transformers' "sdpa"),
as matmul -> masked softmax (fp32) -> matmul, and as ``ops.decode_attention`` (``attn_implementation=
"specdec_decode"``, ``engine/attention.py``), on the same inputs (10% of the columns holes); medians, ms per call.

    python bench/bench_ops.py --attention [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.generation.utils import _speculative_sampling

from specdec_ext import ops
from specdec_ext.benchmark import balanced_order
from specdec_ext.engine.profile import processor_name


def make_inputs(B, K, V, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, K + 1, V, generator=g) * 3
    draft = target[:, :K] + torch.randn(B, K, V, generator=g)  # a draft that mostly agrees
    ids = torch.multinomial(torch.softmax(draft.reshape(-1, V), -1), 1, generator=g).view(B, K)
    return ids.to(device), draft.to(device), target.to(device)


# transformers < 5.2x takes is_done_candidate (whether the candidates ended in EOS) as a fifth argument
_EOS_ARG = (False,) if "is_done_candidate" in inspect.signature(_speculative_sampling).parameters else ()


def hf_composition(ids, draft, target):
    K = ids.shape[1]
    for b in range(ids.shape[0]):
        _speculative_sampling(ids[b : b + 1], draft[b : b + 1], K, target[b : b + 1], *_EOS_ARG)


def fused(ids, draft, target, temp, so):
    ops.chain_verify_logits(ids, draft, target, temp, philox_seed_offset=so)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_pair(fns, repeats, device="cpu", balanced=False):
    """Median µs per call of each function, alternating so that drift hits all alike; with ``balanced`` the order
    changes from repeat to repeat (``benchmark.balanced_order``: each function runs directly after each other one
    equally often; on a GPU a call can find the caches, and the clocks, as the one before left them). A rotation of
    one order would keep each function's predecessor in all but one repeat of n."""
    times = {name: [] for name in fns}
    names = list(fns)
    for rep in range(repeats):
        for name in (balanced_order(names, rep) if balanced else names):
            fn = fns[name]
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def graphed(fn):
    """``fn`` captured once in a CUDA graph; returns the replay (the op's outputs live in the graph's pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def explicit_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), masked) v with the softmax in fp32; q ``[B, h, n, d]``, k/v ``[B, h, C, d]``,
    mask ``[B, 1, n, C]`` bool (True: may attend)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v)


def attention_inputs(B, heads, C, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, n, 64, generator=g).to(dtype)
    k = torch.randn(B, heads, C, 64, generator=g).to(dtype)
    v = torch.randn(B, heads, C, 64, generator=g).to(dtype)
    mask = torch.rand(B, 1, n, C, generator=g) > 0.1  # holes, as rows with rejected positions have
    mask[..., -1] = True
    return q, k, v, mask


def timed(fn, reps):
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def attention_main(args) -> None:
    reps = 5 if args.quick else args.reps
    sizes = [(16, 384), (64, 384)] if args.quick else [(4, 128), (16, 128), (16, 384), (64, 128), (64, 384)]
    rows = []
    print("| dtype | B | cache columns | queries per row | sdpa ms | explicit ms | kernel ms | sdpa / explicit "
          "| sdpa / kernel | max abs diff (explicit, kernel) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for B, C in sizes:
            for n in (1, 2, 5):
                q, k, v, mask = attention_inputs(B, 8, C, n, dtype)
                sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps)
                explicit = timed(lambda: explicit_attention(q, k, v, mask), reps)
                kernel = timed(lambda: ops.decode_attention(q, k, v, mask, 64 ** -0.5), reps)
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
                diff = (want - explicit_attention(q, k, v, mask).float()).abs().max().item()
                kdiff = (want - ops.decode_attention(q, k, v, mask, 64 ** -0.5).transpose(1, 2).float()).abs().max().item()
                row = {"dtype": str(dtype).replace("torch.", ""), "B": B, "columns": C, "queries": n,
                       "sdpa_ms": sdpa, "explicit_ms": explicit, "kernel_ms": kernel, "max_abs_diff": diff,
                       "kernel_max_abs_diff": kdiff}
                rows.append(row)
                print(f"| {row['dtype']} | {B} | {C} | {n} | {sdpa:.2f} | {explicit:.2f} | {kernel:.2f} "
                      f"| {sdpa / explicit:.2f}× | {sdpa / kernel:.2f}× | {diff:.1e}, {kdiff:.1e} |", flush=True)
    meta = {"processor": processor_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "heads": 8, "head_dim": 64, "reps": reps,
            "command": "python bench/bench_ops.py --attention" + (" --quick" if args.quick else "")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'attention_cpu.json'}")



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--attention", action="store_true", help="attention over a KV cache on the CPU instead")
    ap.add_argument("--reps", type=int, default=15, help="--attention: repetitions of each call")
    args = ap.parse_args(argv)
    if args.attention:
        return attention_main(args)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    Bs, Ks, Vs = ([1, 8], [1, 8], [32000]) if args.quick else ([1, 8, 64], [1, 4, 8], [32000, 128256])
    rows = []
    graph_col = f" {'graph (us)':>11}" if dev == "cuda" else ""
    print(f"{'B':>3} {'K':>2} {'V':>7} | {'HF composition (us)':>20} {'fused op (us)':>14}{graph_col} {'speedup':>8}")
    for V in Vs:
        for B in Bs:
            for K in Ks:
                ids, draft, target = make_inputs(B, K, V, device=dev)
                temp = torch.ones(B, device=dev)
                so = torch.tensor([1, 2], device=dev)
                work = B * (K + 1) * V
                repeats = max(3, min(50, int(2e8 / work)))
                if dev == "cuda":
                    repeats = 50
                fns = {"hf": lambda: hf_composition(ids, draft, target), "fused": lambda: fused(ids, draft, target, temp, so)}
                if dev == "cuda":
                    fns["fused_graph"] = graphed(lambda: fused(ids, draft, target, temp, so))
                for fn in fns.values():
                    fn()  # warm-up
                med = time_pair(fns, repeats, dev)
                ratio = med["hf"] / med["fused"]
                row = {"B": B, "K": K, "V": V, "hf_us": med["hf"], "fused_us": med["fused"], "speedup": ratio,
                       "repeats": repeats}
                if dev == "cuda":
                    row["fused_graph_us"] = med["fused_graph"]
                rows.append(row)
                graph = f" {med['fused_graph']:>11.1f}" if dev == "cuda" else ""
                print(f"{B:>3} {K:>2} {V:>7} | {med['hf']:>20.1f} {med['fused']:>14.1f}{graph} {ratio:>7.1f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "device": dev}
    if dev == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    stem = "ops" if dev == "cpu" else "ops_cuda"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    graph_head, graph_rule = (" fused, CUDA graph (µs) |", "---|") if dev == "cuda" else ("", "")
    md = [f"| B | K | V | HF `_speculative_sampling` (µs) | fused `chain_verify_logits` (µs) |{graph_head} speedup |",
          f"|---|---|---|---|---|{graph_rule}---|"]
    for r in rows:
        graph = f" {r['fused_graph_us']:.0f} |" if dev == "cuda" else ""
        md.append(f"| {r['B']} | {r['K']} | {r['V']} | {r['hf_us']:.0f} | {r['fused_us']:.0f} |{graph} {r['speedup']:.1f}× |")
    (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out / f'{stem}.json'} and {args.out / f'{stem}.md'}")


if __name__ == "__main__":
    main()
