"""int8 copy of an unquantized LM head (`VLLM_CPU_BACKEND_LM_HEAD_QUANT`).

Batch-1 decode reads every weight once per token, and the LM head of a small
model with a large vocabulary is a large share of those bytes: Qwen2.5-0.5B's
tied 151936 x 896 head is 272 MB in bf16, 28% of the bf16 model's bytes per
token and 60% of a GPTQ int4 model's. Checkpoints seldom quantize it (a tied
head cannot be, in GPTQ/AWQ), so `CpuBackendLMHeadMethod`
(cpu_backend/ops/linear_layers.py) can run the logits GEMM on
`cpu_backend::wna16_linear` over a round-to-nearest int8 copy made at load
(symmetric, one scale per vocabulary row): half the bytes of bf16.

The original weight stays for the embedding lookup of tied models. Lossy
(each weight moves by up to half a quantization step), so by default (`auto`)
only checkpoints that are quantized already get it: their user chose smaller
weights over exact ones, and there the head is most of what is left to read
(llama.cpp's 4-bit files keep the output matrix at 6 bits for the same
reason). Unquantized models keep their head unless `int8` is asked for.
Measured on SmolLM2-135M-Instruct: perplexity x0.997 and the same top-1 at
every position the bf16 head decides, in bf16 and as GPTQ 4-bit
(integration/test_engine_lm_head_quant.py).
An int4 copy (groups of 64) cost it x1.13 perplexity and 11% of those
top-1s, for 4% more decode speed than int8 on the Qwen2.5-0.5B shape, so
there is none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_backend.quantization import formats

# mode -> bits; one group (scale) per vocabulary row
MODES = {"int8": 8}
# Rows quantized at a time (a multiple of the kernel's 16-column panels), so a
# large vocabulary never needs a float32 copy of the whole head.
CHUNK_ROWS = 512 * formats.KERNEL_NR


@dataclass(frozen=True)
class QuantizedHead:
    """The operands of cpu_backend::wna16_linear for one LM head shard."""

    mode: str
    bits: int
    group_size: int
    out_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zs: torch.Tensor

    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.ops.cpu_backend.wna16_linear(
            x, self.qweight, self.scales, self.zs, self.bits, self.group_size,
            self.out_features, None, bias, out_dtype,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zs))


def resolve_mode(setting: str, quant_config) -> str:
    """The head's mode from the variable's value ('auto', 'none', 'int8') and
    the model's quantization config (None for an unquantized checkpoint)."""
    if setting == "auto":
        return "none" if quant_config is None else "int8"
    return setting


def quantize_head(weight: torch.Tensor, mode: str) -> QuantizedHead:
    """weight [vocab, hidden] (any float dtype) -> its `mode` copy in kernel layout."""
    if mode not in MODES:
        raise ValueError(f"LM head quantization {mode!r}: expected one of {list(MODES)}")
    bits = MODES[mode]
    n = weight.shape[0]
    parts = []
    for r0 in range(0, n, CHUNK_ROWS):
        v = formats.quantize_rtn(weight[r0:r0 + CHUNK_ROWS], bits, -1, sym=True)
        parts.append(formats.kernel_layout(v["q"], v["zero"], v["scale"], v["g_idx"], bits,
                                           drop_symmetric_zs=True))
    return QuantizedHead(
        mode=mode, bits=bits, group_size=parts[0]["group_size"], out_features=n,
        qweight=torch.cat([p["qweight"] for p in parts]),
        scales=torch.cat([p["scales"] for p in parts]),
        zs=torch.cat([p["zs"] for p in parts]),
    )
