"""How the engine's lean forward scales to real model sizes on one device: random-weight Llama shapes (``1b``:
Llama-3.2-1B's, ``8b``: Llama-3.1-8B's, ``tiny``: a CPU self-check) in bfloat16, at B = 1 over a static KV cache
of ``--context`` filled columns, a one-token step (plain decoding, a draft step) and a (K + 1)-token step (a
verification), each eager and replayed from a CUDA graph (``engine/graphs.py``'s capture, as the step runner does;
off CUDA the recorded stand-in, so the script checks itself on a CPU), against the time to read the weights once at
the copy bandwidth measured in the same run.

Per shape: the bytes a step must read (every weight, the input embedding one row; a tied LM head counted once),
that bandwidth (``2 x bytes / time`` of a large device-to-device copy: a read and a write per byte), the weight-read
time (bytes / bandwidth, ms), each step's median ms (CUDA events around ``--repeats`` calls, the cache's length set
back before each; on a CPU the host clock), and the ratios ``graph_1 / weight_read`` and ``graph_K+1 / graph_1``.
The logits of a replay are checked against the eager step's on the same cache (``max_abs_diff``). ``--compile
BACKEND`` adds a graph of the forward compiled as ``StepRunner(compile=True)`` compiles it (``graph_compiled_ms``).
Each step's launches, counted by torch's profiler over one call of each arm (``<arm>_launches``, and per layer):
on CUDA the kernels and copies the device ran, elsewhere the top-level aten ops dispatched (what would each be a
launch). ``--round DRAFT,TARGET`` (default ``1b,8b`` where both are probed) adds a speculative round at those
shapes: K one-token steps of the draft and the target's (K + 1)-token verification, from graphs
(``round_ms``), against K + 1 plain steps of the target (``k1_plain_ms``); ``draft_over_target`` is the cost ratio c
of one draft step to one target step (Leviathan et al. 2023, Sec. 3.4) and ``break_even_tokens`` the tokens a
round must emit to match plain decoding (``round_ms`` over one target step).

    python bench/scale_probe.py --device cuda --shapes 1b,8b --out gpu_check/scale_probe.json
    python bench/scale_probe.py --device cuda --shapes 1b --compile inductor [--coordinate-descent]
    python bench/scale_probe.py --shapes tiny          # a CPU, seconds
    python bench/scale_probe.py --shapes tiny --round tiny,tiny   # the round's row too
    python bench/scale_probe.py --shapes smollm2-135m,smollm2-135m-draft --round smollm2-135m-draft,smollm2-135m \
        --dtype float32 --context 256   # the real pair on a CPU, against the rate torch.sum reads (sum_read_GBps)
    python bench/scale_probe.py --shapes smollm2-135m --weights q4 --context 256   # the file's blocks, read as stored

``--weights q8`` / ``q4`` / ``q4a8`` (the real pair only) holds the models' linear weights as int8 rows / the GGUF
file's own blocks / those blocks times int8 activations (``engine/weights.py``); their bytes are then counted as the
fused op reads them. Without it the real pair's weights are float (``weights=None``), whatever ``load_pair``'s
default.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from specdec_ext.engine import weights
from specdec_ext.engine.backends import LeanBackend
from specdec_ext.engine.graphs import StepGraphs
from specdec_ext.engine.models import param_count
from specdec_ext.engine.round import BUCKETS, StepRunner
from specdec_ext.engine.runner import sdpa_backends

# (hidden, layers, heads, kv heads, MLP width, vocabulary, tied embeddings): the published configurations' shapes
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 512, False),
    "1b": (2048, 16, 32, 8, 8192, 128256, True),
    "8b": (4096, 32, 32, 8, 14336, 128256, False),
}


def random_llama(shape: str, device: str, dtype=torch.bfloat16, max_positions: int = 4096):
    """A ``LlamaForCausalLM`` of ``SHAPES[shape]`` with random weights (normal, sd 0.02; norms 1), made on
    ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, heads, kv, mlp, vocab, tied = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=mlp, vocab_size=vocab, tie_word_embeddings=tied,
                      max_position_embeddings=max_positions, rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


REAL = ("smollm2-135m", "smollm2-135m-draft")  # the named pair's target and its distilled draft, real weights


def model_for(shape: str, device: str, dtype: torch.dtype, max_positions: int, quantized: Optional[str] = None):
    """A random-weight model of ``SHAPES[shape]``, or a real one of :data:`REAL` (``load_pair``'s target or draft,
    with ``quantized`` weights where given)."""
    if shape in SHAPES:
        return random_llama(shape, device, dtype, max_positions)
    from specdec_ext.zoo import load_pair

    pair = load_pair(shape.removesuffix("-draft"), target_dtype=dtype, draft_dtype=dtype, device=device,
                     with_head=False, weights=quantized)
    return pair.draft if shape.endswith("-draft") else pair.target


def sum_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes read per second by ``torch.sum`` over a float32 buffer of ``nbytes``: how fast this device streams
    memory into arithmetic (on a CPU, the rate a memory-bound matrix-vector product can reach)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    buf.sum()
    times = [_timed(lambda: buf.sum(), device) for _ in range(repeats)]
    return nbytes / (statistics.median(times) / 1e3)


def weight_bytes(model) -> int:
    """Bytes a step reads from the weights: every parameter once (a tied LM head is the embedding's tensor, counted
    once), the input embedding table only where it is a tensor of its own (a step gathers a row or a few of it); for
    quantized weights the linear layers as stored (int8 and a scale per row) and the norms."""
    if weights.kind(model) is not None:
        norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
        return weights.weight_bytes(model) + norms
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy of ``nbytes`` (a read and a write of each: 2 x nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_timed(lambda: dst.copy_(src), device) for _ in range(repeats)]
    return 2 * nbytes / (statistics.median(times) / 1e3)


def _timed(fn, device: str) -> float:
    """ms of one ``fn()``: CUDA events on CUDA, the host clock elsewhere."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def launches(fn, device: str) -> int:
    """What one call of ``fn`` launches: on CUDA the kernels and copies the device ran (torch's profiler, graph
    replays included), elsewhere the top-level aten ops it dispatched."""
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    return sum(e.name.startswith("aten::") and e.cpu_parent is None for e in prof.events())


def ops_table(fn, calls: int, top: int = 12) -> list:
    """torch's profiler over ``calls`` calls of ``fn`` (CPU): the ``top`` ops by self time, each with its ms per call,
    its share of the calls' wall time and its count per call."""
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / calls,
             "share": e.self_cpu_time_total / 1e3 / calls / wall, "count": e.count // calls} for e in rows]


def probe(shape: str, device: str, context: int, k: int, repeats: int, compile_backend: Optional[str] = None,
          attention: str = "auto", dtype: torch.dtype = torch.bfloat16, quantized: Optional[str] = None) -> dict:
    """One shape's row (module docstring); the steps under inference mode, as the engine's rounds run. With
    ``compile_backend`` (``"inductor"`` on a GPU) also a graph of the forward compiled as the step runner compiles it
    (``StepRunner(compile=True)``: ``torch.compile(fullgraph=True)`` before capture), ``graph_compiled_ms``."""
    model = model_for(shape, device, dtype, max(4096, 2 * (context + k + 2)), quantized)
    backend = LeanBackend(model, "target", attention=attention)
    graphs = StepGraphs(emulate=not device.startswith("cuda"))
    compiled = None
    if compile_backend is not None:
        runner = StepRunner(BUCKETS, compile=True, backend=compile_backend,
                            cuda_graphs=True if device.startswith("cuda") else "emulate")
        compiled = runner._forward(backend)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    row = {"shape": shape, "attention": attention, "parameters": param_count(model),
           "weight_bytes": weight_bytes(model), "context": context, "k": k, "steps": {}}
    with torch.inference_mode():
        backend.start(1, context + k + 2)  # the cache's tensors made here, as a call's are
        lengths = backend.cache.lengths
        graphs.check([backend])
        for n in (1, k + 1):
            tokens = torch.randint(0, vocab, (1, n), generator=g).to(device)

            def step(t, n=n):
                with sdpa_backends(backend.device):
                    return backend.step(t, n)

            def eager(t=tokens, step=step):
                lengths.fill_(context)
                return step(t)

            def replay(t=tokens, step=step, n=n):
                lengths.fill_(context)
                return graphs.replay(("scale", n), step, [t], [lengths])

            def replay_compiled(t=tokens, n=n):
                def fn(t):
                    with sdpa_backends(backend.device):
                        return compiled(t, n)
                lengths.fill_(context)
                return graphs.replay(("scale-compiled", n), fn, [t], [lengths])

            arms = [("eager", eager), ("graph", replay)] + ([("graph_compiled", replay_compiled)] if compiled else [])
            want = eager()[0].clone()
            got = {name: fn()[0].clone() for name, fn in arms[1:]}
            for _, fn in arms:  # warm: allocator, cuBLAS handles, the graphs
                fn()
            times = {name: [] for name, _ in arms}
            for i in range(repeats):  # the order of the arms turns each time
                for name, fn in arms[i % len(arms):] + arms[: i % len(arms)]:
                    times[name].append(_timed(fn, device))
            entry = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
            for name, fn in arms:
                entry[f"{name}_launches"] = launches(fn, device)
                entry[f"{name}_launches_per_layer"] = entry[f"{name}_launches"] / model.config.num_hidden_layers
            if not device.startswith("cuda"):  # where the eager step's time goes, by op (self time, 5 calls)
                entry["eager_by_op"] = ops_table(eager, 5)
            live = torch.isfinite(want)  # a draft's vocabulary subset leaves -inf elsewhere
            entry["max_abs_diff"] = float((got["graph"] - want)[live].abs().max())
            if compiled:  # compiled kernels round in their own order: reported, not required to be 0
                entry["compiled_max_abs_diff"] = float((got["graph_compiled"] - want)[live].abs().max())
            row["steps"][f"{n}-token"] = entry
    del backend, model, graphs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def speculative_round(draft: dict, target: dict, k: int, compiled: bool) -> dict:
    """A round of ``k`` draft steps and the target's (k + 1)-token verification, from the probed steps' graphs
    (module docstring), and with compiled forwards where they were probed."""
    out = {"draft": draft["shape"], "target": target["shape"], "k": k}
    for arm in ("graph",) + (("graph_compiled",) if compiled else ()):
        one = target["steps"]["1-token"][f"{arm}_ms"]
        step = draft["steps"]["1-token"][f"{arm}_ms"]
        prefix = "" if arm == "graph" else "compiled_"
        out[prefix + "round_ms"] = k * step + target["steps"][f"{k + 1}-token"][f"{arm}_ms"]
        out[prefix + "k1_plain_ms"] = (k + 1) * one
        out[prefix + "draft_over_target"] = step / one
        out[prefix + "break_even_tokens"] = out[prefix + "round_ms"] / one
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {sorted(SHAPES) + list(REAL)} (the last two: "
                                                     "real weights, the smollm2-135m pair's target and draft)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the models' dtype")
    ap.add_argument("--context", type=int, default=512, help="filled cache columns each step attends to")
    ap.add_argument("--k", type=int, default=4, help="candidates of the verification step (K + 1 tokens)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="the bandwidth copy's size (default 2048 on CUDA, 64 elsewhere)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="also a graph of the forward compiled by torch.compile with this backend (inductor on a GPU; "
                         "minutes per shape there), as StepRunner(compile=True) compiles it")
    ap.add_argument("--coordinate-descent", action="store_true",
                    help="with --compile inductor: inductor's coordinate_descent_tuning on (each kernel's launch "
                         "configuration tuned by search; longer compiles)")
    ap.add_argument("--attention", default="auto", choices=("auto", "cache", "sdpa"),
                    help="the lean model's attention: auto (the CPU kernel, SDPA on a GPU), cache (ops.cache_attention: "
                         "each row's live columns, the flash-decoding kernel on a GPU), sdpa")
    ap.add_argument("--round", default=None, metavar="DRAFT,TARGET",
                    help="a speculative round at these two probed shapes (default 1b,8b where both are probed)")
    ap.add_argument("--weights", default=None, choices=("q8", "q4", "q4a8"),
                    help="the real pair's linear weights quantized (engine/weights.py), counted as stored")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES and s not in REAL]
    if args.weights and not set(shapes) <= set(REAL):
        raise SystemExit(f"--weights {args.weights}: for the real pair's shapes {list(REAL)}, got {args.shapes!r}")
    if bad or not shapes:
        raise SystemExit(f"--shapes: expected some of {sorted(SHAPES) + list(REAL)}, got {args.shapes!r}")
    dtype = getattr(torch, args.dtype)
    if args.context < 1 or args.k < 1 or args.repeats < 1:
        raise SystemExit("--context, --k and --repeats: expected integers >= 1")
    pair = args.round.split(",") if args.round else (["1b", "8b"] if {"1b", "8b"} <= set(shapes) else None)
    if pair is not None and (len(pair) != 2 or not set(pair) <= set(shapes)):
        raise SystemExit(f"--round: expected DRAFT,TARGET among the probed --shapes {shapes}, got {args.round!r}")
    if args.coordinate_descent:
        if args.compile != "inductor":
            raise SystemExit("--coordinate-descent: tunes inductor's kernels, expected --compile inductor")
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    cuda = args.device.startswith("cuda")
    mib = args.copy_mib if args.copy_mib is not None else (2048 if cuda else 64)
    bandwidth = copy_bandwidth(args.device, mib << 20)
    rows = []
    for s in shapes:
        r = probe(s, args.device, args.context, args.k, args.repeats, args.compile, args.attention, dtype, args.weights)
        r["weight_read_ms"] = r["weight_bytes"] / bandwidth * 1e3
        one, wide = r["steps"]["1-token"], r["steps"][f"{args.k + 1}-token"]
        if not cuda:  # the rate torch.sum reads a buffer of the weights' size, measured beside the steps
            r["sum_read_GBps"] = sum_bandwidth(args.device, r["weight_bytes"]) / 1e9
            r["weight_read_sum_ms"] = r["weight_bytes"] / (r["sum_read_GBps"] * 1e9) * 1e3
            r["eager_1_over_sum_read"] = one["eager_ms"] / r["weight_read_sum_ms"]
            r["eager_k1_over_eager_1"] = wide["eager_ms"] / one["eager_ms"]
            print(f"{s}: torch.sum reads {r['sum_read_GBps']:.1f} GB/s: the weights in {r['weight_read_sum_ms']:.2f} ms; "
                  f"the eager 1-token step is {r['eager_1_over_sum_read']:.2f}x that, {args.k + 1} tokens "
                  f"{r['eager_k1_over_eager_1']:.2f}x one", flush=True)
        r["graph_1_over_weight_read"] = one["graph_ms"] / r["weight_read_ms"]
        r["graph_k1_over_graph_1"] = wide["graph_ms"] / one["graph_ms"]
        if args.compile:
            r["graph_compiled_1_over_weight_read"] = one["graph_compiled_ms"] / r["weight_read_ms"]
            r["graph_compiled_k1_over_graph_compiled_1"] = wide["graph_compiled_ms"] / one["graph_compiled_ms"]
        print(f"{s}: {r['parameters'] / 1e9:.2f}B parameters, weights {r['weight_bytes'] / 2**30:.2f} GiB read in "
              f"{r['weight_read_ms']:.3f} ms; 1 token {one['eager_ms']:.3f} ms eager, {one['graph_ms']:.3f} ms graph "
              f"({r['graph_1_over_weight_read']:.2f}x the read); {args.k + 1} tokens {wide['eager_ms']:.3f} / "
              f"{wide['graph_ms']:.3f} ms ({r['graph_k1_over_graph_1']:.2f}x one)"
              + (f"; compiled graphs {one['graph_compiled_ms']:.3f} / {wide['graph_compiled_ms']:.3f} ms "
                 f"({r['graph_compiled_1_over_weight_read']:.2f}x the read)" if args.compile else ""), flush=True)
        rows.append(r)
    result_round = None if pair is None else speculative_round(*(next(r for r in rows if r["shape"] == s)
                                                                 for s in pair), args.k, bool(args.compile))
    if result_round is not None:
        print(f"round: {args.k} {pair[0]} draft steps and a {pair[1]} verification {result_round['round_ms']:.3f} ms "
              f"against {args.k + 1} plain steps {result_round['k1_plain_ms']:.3f} ms; c = "
              f"{result_round['draft_over_target']:.3f}, break-even {result_round['break_even_tokens']:.2f} tokens "
              "a round", flush=True)
    meta = {"device": torch.cuda.get_device_name(args.device) if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__, "dtype": args.dtype, "batch_size": 1, "copy_bandwidth_GBps": bandwidth / 1e9,
            "graphs": "captured" if cuda else "recorded (no CUDA)",
            "coordinate_descent_tuning": args.coordinate_descent,
            "launches": "CUDA kernels and copies" if cuda else "top-level aten ops (no CUDA)",
            "command": "python bench/scale_probe.py " + " ".join(argv if argv is not None else [])}
    result = {"meta": meta, "rows": rows} | ({"round": result_round} if result_round is not None else {})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
