"""Microbenchmark: weight-only int4/int8 linear (cpu_backend::wna16_linear) vs
our bf16 linear (cpu_backend::linear), per ISA library.

    .venv/bin/python -m benchmarks.kernels_wna16 [--isas avx2,avx512,portable] [--threads 2]
                                                 [--out benchmarks/results/kernels_wna16.md]

Shapes: the decoder-layer linears of Qwen2.5-0.5B (qkv 1152x896, o 896x896,
gate_up 9728x896, down 896x4864), M = 1 (decode) and 64 (prefill); x bf16,
int4/int8 GPTQ-style group 128 with zero points; int4 also W4A8 (int8_act:
activations quantized to int8 per 32 inputs). Times are medians of
`--iters` calls, weights rotated through copies totalling > 96 MiB so M = 1
reads come from DRAM, like a model whose layers do not stay in cache.
"read GB/s" counts bytes actually read per call: the packed weights
(K*N/2 or K*N bytes) plus fp32 scales and zs (2 * 4 * N * K/128).
"""

from __future__ import annotations

from benchmarks import isa_runs
from benchmarks.isa_runs import QWEN05_LINEARS as SHAPES
from benchmarks.isa_runs import ROTATE_BYTES, median_ms


def worker(threads: int, iters: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from cpu_backend import ops
    from cpu_backend.ops import linear as dense
    from cpu_backend.quantization import formats

    isa = ops.load()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        copies_bf16 = max(1, ROTATE_BYTES // (n * k * 2))
        packed = [dense.pack_linear_weight(w.bfloat16()) for _ in range(copies_bf16)]
        quant = {}
        for bits in (4, 8):
            v = formats.quantize_rtn(w, bits, 128, sym=False)
            lay = formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], bits)
            nbytes = lay["qweight"].numel() + 8 * lay["scales"].numel()
            copies = max(1, ROTATE_BYTES // nbytes)
            quant[bits] = ([{key: (t.clone() if torch.is_tensor(t) else t) for key, t in lay.items()}
                            for _ in range(copies)], nbytes)
        for m in (1, 64):
            x = torch.randn(m, k, generator=gen).bfloat16()
            row = {"layer": name, "n": n, "k": k, "m": m}
            row["bf16_ms"] = median_ms(
                lambda i: dense.linear(x, packed[i % len(packed)], n), iters)
            row["bf16_gbs"] = n * k * 2 / row["bf16_ms"] / 1e6
            for key, bits, a8 in (("int8", 8, False), ("int4", 4, False), ("w4a8", 4, True)):
                lays, nbytes = quant[bits]

                def call(i, lays=lays, bits=bits, a8=a8):
                    lay = lays[i % len(lays)]
                    torch.ops.cpu_backend.wna16_linear(x, lay["qweight"], lay["scales"], lay["zs"],
                                                       bits, lay["group_size"], n, None, None, None, a8)
                ms = median_ms(call, iters)
                row[f"{key}_ms"] = ms
                row[f"{key}_gbs"] = nbytes / ms / 1e6
            rows.append(row)
    return {"isa": isa, "threads": threads, "rows": rows}


def render(results: list[dict]) -> str:
    out = ["# wna16_linear vs bf16 linear (Qwen2.5-0.5B decoder shapes, x bf16)", "",
           "Medians; GB/s = bytes actually read per call. Shared 2-core machine: noisy.", ""]
    for r in results:
        out += [f"## {r['isa']} ({r['threads']} threads)", "",
                "| layer | M | bf16 ms | int8 ms | int4 ms | int4 W4A8 ms | int4 / W4A8 vs bf16 "
                "| bf16 GB/s | int8 GB/s | int4 GB/s | W4A8 GB/s |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in r["rows"]:
            out.append(f"| {x['layer']} {x['n']}x{x['k']} | {x['m']} | {x['bf16_ms']:.3f} | "
                       f"{x['int8_ms']:.3f} | {x['int4_ms']:.3f} | {x['w4a8_ms']:.3f} | "
                       f"{x['bf16_ms'] / x['int4_ms']:.2f}x / {x['bf16_ms'] / x['w4a8_ms']:.2f}x | "
                       f"{x['bf16_gbs']:.1f} | {x['int8_gbs']:.1f} | {x['int4_gbs']:.1f} | "
                       f"{x['w4a8_gbs']:.1f} |")
        for m in (1, 64):
            rows = [x for x in r["rows"] if x["m"] == m]
            tot = {key: sum(x[f"{key}_ms"] for x in rows) for key in ("bf16", "int4", "w4a8")}
            out += ["", f"One decoder layer at M={m}: bf16 {tot['bf16']:.3f} ms, int4 {tot['int4']:.3f} ms "
                    f"({tot['bf16'] / tot['int4']:.2f}x), W4A8 {tot['w4a8']:.3f} ms "
                    f"({tot['bf16'] / tot['w4a8']:.2f}x)"]
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    isa_runs.main("benchmarks.kernels_wna16", worker, render, "benchmarks/results/kernels_wna16.md")


if __name__ == "__main__":
    main()
