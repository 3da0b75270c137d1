"""Microbenchmark: W8A8 int8 linear (cpu_backend::w8a8_linear, activations
quantized per token inside the call) vs our bf16 linear (cpu_backend::linear),
torch's bf16 linear, and the host's CPU int8 path (oneDNN:
`onednn_scaled_int8_quant` + `onednn_scaled_mm`, what CPUInt8ScaledMMLinearKernel
runs without AMX), per ISA library, same shapes, same process.

    .venv/bin/python -m benchmarks.kernels_w8a8 [--isas avx2,avx512] [--threads 2]
                                                [--out benchmarks/results/kernels_w8a8.md]

Shapes: the decoder-layer linears of Qwen2.5-0.5B (qkv 1152x896, o 896x896,
gate_up 9728x896, down 896x4864), M = 1, 16, 64; x bf16, dynamic symmetric
per-token activations, per-channel weight scales. Medians of `--iters` calls,
weights rotated through copies totalling > 96 MiB so M = 1 reads come from DRAM.
"""

from __future__ import annotations

from benchmarks import isa_runs
from benchmarks.isa_runs import QWEN05_LINEARS as SHAPES
from benchmarks.isa_runs import ROTATE_BYTES, median_ms


def _host_int8():
    """The host's oneDNN int8 ops, or None when its extension does not load."""
    try:
        from vllm import _custom_ops as hops

        hops.onednn_scaled_int8_quant  # noqa: B018
        import vllm._C  # noqa: F401
        return hops
    except Exception:  # noqa: BLE001
        return None


def worker(threads: int, iters: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from cpu_backend import ops
    from cpu_backend.ops import linear as dense
    from cpu_backend.quantization.formats import int8_kernel_layout as kernel_layout

    isa = ops.load()
    hops = _host_int8()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        ws = w.abs().amax(1) / 127
        q = torch.round(w / ws[:, None]).clamp(-128, 127).to(torch.int8)
        copies = max(1, ROTATE_BYTES // (n * k))
        ours = [kernel_layout(q, ws) for _ in range(copies)]
        copies_bf16 = max(1, ROTATE_BYTES // (n * k * 2))
        packed = [dense.pack_linear_weight(w.bfloat16()) for _ in range(copies_bf16)]
        wb = [w.bfloat16().clone() for _ in range(copies_bf16)]
        handlers = None
        if hops is not None:
            handlers = [hops.create_onednn_scaled_mm(q.t(),
                                                     ws.reshape(-1, 1).float(), torch.bfloat16,
                                                     True, False, 32) for _ in range(copies)]
        for m in (1, 16, 64):
            x = torch.randn(m, k, generator=gen).bfloat16()
            row = {"layer": name, "n": n, "k": k, "m": m}

            def ours_call(i):
                lay = ours[i % len(ours)]
                torch.ops.cpu_backend.w8a8_linear(x, lay["qweight"], lay["wsum"], lay["w_scale"], n)

            row["w8a8_ms"] = median_ms(ours_call, iters)
            row["bf16_ms"] = median_ms(lambda i: dense.linear(x, packed[i % len(packed)], n), iters)
            row["torch_bf16_ms"] = median_ms(
                lambda i: torch.nn.functional.linear(x, wb[i % len(wb)]), iters)
            if handlers is not None:
                def host_call(i):
                    xq, xs, xzp = hops.onednn_scaled_int8_quant(x, None, None, True)
                    out = torch.empty((m, n), dtype=x.dtype)
                    hops.onednn_scaled_mm(handlers[i % len(handlers)], xq, out, xs, xzp, None, None)
                row["host_int8_ms"] = median_ms(host_call, iters)
            rows.append(row)
    return {"isa": isa, "threads": threads, "rows": rows, "host_int8": hops is not None}


def render(results: list[dict]) -> str:
    out = ["# w8a8_linear vs bf16 linears and the host's oneDNN int8 (Qwen2.5-0.5B decoder shapes)",
           "", "Medians (ms); x bf16, dynamic per-token int8 activations (quantization included "
           "in both int8 columns). Shared 2-core machine: noisy.", ""]
    for r in results:
        out += [f"## {r['isa']} ({r['threads']} threads)", "",
                "| layer | M | w8a8 (ours) | our bf16 | torch bf16 | host int8 (oneDNN) | "
                "ours vs our bf16 | ours vs host int8 |",
                "|---|---|---|---|---|---|---|---|"]
        for x in r["rows"]:
            host = x.get("host_int8_ms")
            host_ms = "n/a" if host is None else f"{host:.3f}"
            host_ratio = "n/a" if host is None else f"{host / x['w8a8_ms']:.2f}x"
            out.append(f"| {x['layer']} {x['n']}x{x['k']} | {x['m']} | {x['w8a8_ms']:.3f} | "
                       f"{x['bf16_ms']:.3f} | {x['torch_bf16_ms']:.3f} | "
                       f"{host_ms} | {x['bf16_ms'] / x['w8a8_ms']:.2f}x | {host_ratio} |")
        for m in (1, 16, 64):
            sel = [x for x in r["rows"] if x["m"] == m]
            t = {c: sum(x.get(c, float("nan")) for x in sel)
                 for c in ("w8a8_ms", "bf16_ms", "torch_bf16_ms", "host_int8_ms")}
            out.append(f"\nOne decoder layer at M={m}: w8a8 {t['w8a8_ms']:.3f} ms, our bf16 "
                       f"{t['bf16_ms']:.3f}, torch bf16 {t['torch_bf16_ms']:.3f}, host int8 "
                       f"{t['host_int8_ms']:.3f}")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    isa_runs.main("benchmarks.kernels_w8a8", worker, render, "benchmarks/results/kernels_w8a8.md")


if __name__ == "__main__":
    main()
