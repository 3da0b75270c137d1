"""The CustomOp overrides of cpu_backend.ops.custom_ops: after
`register_custom_ops()`, the host's SiluAndMul / GeluAndMul / RotaryEmbedding
(and a cache-only RotaryEmbedding subclass) instantiate as ours, dispatch to
our kernels on this platform, and agree with the host's forward_native
(tolerances as in test_kernels_activation.py: fp32 1e-5 here, bf16 2 ulps).
Runs in a subprocess: registration changes the host's global OOT registry.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _worker() -> dict:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

    from cpu_backend import stats
    from cpu_backend.ops import custom_ops

    registered = custom_ops.register_custom_ops()
    failures = []
    with set_current_vllm_config(VllmConfig()):
        gen = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-6)):
            x = torch.randn(5, 2 * 96, generator=gen).to(dtype)
            for layer in (SiluAndMul(), GeluAndMul("none"), GeluAndMul("tanh")):
                before = sum(stats.kernel_calls().values())
                got, want = layer(x), layer.forward_native(x)
                if type(layer).__module__ != custom_ops.__name__:
                    failures.append(f"{type(layer).__name__} is the host's class")
                if sum(stats.kernel_calls().values()) != before + 1:
                    failures.append(f"{type(layer).__name__} did not run our kernel")
                if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
                    failures.append(f"{type(layer).__name__} {dtype} differs from forward_native")
            ropes = (
                RotaryEmbedding(64, 32, 2048, 10000.0, True, dtype),
                RotaryEmbedding(64, 64, 2048, 10000.0, False, dtype),
                Llama3RotaryEmbedding(64, 64, 2048, 500000.0, True, dtype, 8.0, 1.0, 4.0, 1024),
            )
            for rope in ropes:
                pos = torch.randint(0, 2048, (7,), generator=gen)
                q = torch.randn(7, 4 * 64, generator=gen).to(dtype)
                k = torch.randn(7, 2 * 64, generator=gen).to(dtype)
                want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
                before = sum(stats.kernel_calls().values())
                got_q, got_k = rope(pos, q, k)
                if type(rope).__module__ != custom_ops.__name__:
                    failures.append(f"{type(rope).__name__} is the host's class")
                if sum(stats.kernel_calls().values()) != before + 1:
                    failures.append(f"{type(rope).__name__} did not run our kernel")
                # 2 ulps at the inputs' magnitude (~4): 2^-4 bf16
                atol = 1e-5 if dtype == torch.float32 else 2.0**-4
                for got, want in ((got_q, want_q), (got_k, want_k)):
                    if not torch.allclose(got.double(), want.double(), rtol=0, atol=atol):
                        failures.append(f"{type(rope).__name__} {dtype} differs from forward_native")
    return {"registered": registered, "failures": failures}


def test_host_layers_instantiate_as_ours_and_match_native():
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"SiluAndMul", "GeluAndMul", "RotaryEmbedding", "Llama3RotaryEmbedding"} <= set(result["registered"])
    assert result["failures"] == [], result["failures"]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
