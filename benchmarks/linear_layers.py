"""Microbenchmark: every linear layer of a model's decoder at M rows, ours vs torch.

    .venv/bin/python -m benchmarks.linear_layers [--model smollm2|qwen05] [--rows 64,128,1024,4096]
                                                 [--threads 2] [--repeat 7]

One pass = the fused qkv, o, fused gate_up and down linears of all layers
(random bf16 weights of the model's shapes, one copy per layer, so a pass
streams the whole decoder's weights like a real step), x bf16 [M, K]. Ours:
cpu_backend::linear on the library `cpu_backend.isa` selects (set
VLLM_CPU_BACKEND_ISA to compare libraries); torch: F.linear on the unpacked
weights (oneDNN, weights reordered per call); host: the in-tree backend's
linear, `vllm._custom_ops.onednn_mm` on weights prepacked once (skipped where
the host's library lacks it). Passes alternate; medians of --repeat.
Prints GFLOP/s and the weight bytes read per second. No LM head (its rows
are the sampled tokens, not the prompt).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

MODELS = {  # hidden, intermediate, layers, q width, k/v width
    "smollm2": (576, 1536, 30, 576, 192),
    "qwen05": (896, 4864, 24, 896, 128),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--rows", default="64,128,1024,4096")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()

    import torch

    from cpu_backend import ops
    from cpu_backend.ops import linear as L

    torch.set_num_threads(args.threads)
    hidden, inter, layers, q, kv = MODELS[args.model]
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n, k in shapes]
               for _ in range(layers)]
    packed = [[L.pack_linear_weight(w) for w in layer] for layer in weights]
    host = host_handlers(weights)
    weight_bytes = sum(n * k * 2 for n, k in shapes) * layers
    print(f"{args.model}: {layers} layers x {len(shapes)} linears, ours on {ops.load()}, "
          f"{args.threads} threads, median of {args.repeat}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in shapes}

        def ours():
            for layer in packed:
                for (n, k), pw in zip(shapes, layer):
                    L.linear(xs[k], pw, n)

        def reference():
            for layer in weights:
                for (n, k), w in zip(shapes, layer):
                    torch.nn.functional.linear(xs[k], w)

        def host_linear():
            for layer in host:
                for (n, k), mm in zip(shapes, layer):
                    mm(xs[k], None)

        runs = {"ours": (ours, []), "torch": (reference, [])}
        if host:
            runs["host"] = (host_linear, [])
        for fn, _ in runs.values():
            fn()  # warm-up
        for _ in range(args.repeat):
            for fn, times in runs.values():
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        flops = sum(2 * m * n * k for n, k in shapes) * layers
        for name, (_, times) in runs.items():
            t = statistics.median(times)
            print(f"M={m:5d} {name:5s}: {t * 1e3:8.2f} ms  {flops / t / 1e9:6.0f} GFLOP/s  "
                  f"{weight_bytes / t / 1e9:5.1f} GB/s of weights")


def host_handlers(weights):
    """The in-tree backend's linear per weight, mm(x, bias), on oneDNN handlers prepacked once; [] without them."""
    try:
        from vllm import _custom_ops as host_ops
    except Exception as e:  # the host's _C may not load on this CPU
        print(f"host onednn_mm unavailable: {e}")
        return []
    if not host_ops._supports_onednn:
        print("host onednn_mm unavailable: the host's _C has no create_onednn_mm_handler")
        return []
    return [[functools.partial(host_ops.onednn_mm, host_ops.create_onednn_mm(w.t(), 32)) for w in layer]
            for layer in weights]


if __name__ == "__main__":
    main()
