// The ops every kernel library exports; registered in registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace cpu_backend {

// Which library of setup.py's ISA_LIBS this is: "amx", "avx512", "avx_vnni", "avx2" or "portable".
std::string isa();

// Output features per packed panel (NR) in this build.
int64_t linear_pack_nr();

// Whether pack_linear_weight interleaves pairs of K rows for this dtype
// (bf16 on the avx512 build, for VDPBF16PS); see linear.cpp.
bool linear_pack_pairs(at::ScalarType dtype);

// weight [N, K] (bf16/fp16/fp32) -> [ceil(N/NR), K, NR], same dtype, zero padded.
at::Tensor pack_linear_weight(const at::Tensor& weight);

// y[..., n] = x[..., K] @ W^T + bias, W given packed; y has x's dtype unless
// out_dtype is given (the LM head asks for float32 logits).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed_weight, int64_t n,
                  const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> out_dtype);

// Paged attention (attention.cpp): query token t of request token_req[t] at
// position token_pos[t] attends that request's cached keys up to token_pos[t].
// kv_format: kv_format.h (k_scale/v_scale: per-tensor scales of fp8 formats).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& token_req,
                     const at::Tensor& token_pos, double scale, int64_t sliding_window,
                     double softcap, const std::optional<at::Tensor>& alibi_slopes,
                     int64_t kv_format, double k_scale, double v_scale);

// key/value [tokens, kv_heads, head_size] into their slots in the cache's
// format (kv_cache.cpp); slot < 0 is skipped.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping, int64_t kv_format, double k_scale, double v_scale);

// RMSNorm (norm.cpp), rounding like vLLM's native rms_norm. x: [rows, hidden], or
// [tokens, heads, head_dim] (per-head q/k norms) into a contiguous out; weight in x's dtype or fp32.
void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
              double eps);
// In place: residual <- x + residual; x <- rms_norm(that sum).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                        double eps);

// linear into a given contiguous tensor of x's leading shape and n columns (linear.cpp).
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed_weight, int64_t n,
                const std::optional<at::Tensor>& bias);
// out = silu(x[..., :d]) * x[..., d:] (activation.cpp).
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// The out forms of the int4/int8-weight linears (linear_wna16.cpp, linear_w8a8.cpp).
void wna16_linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t n,
                      const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias,
                      bool int8_act);
void w8a8_linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wsum,
                     const at::Tensor& w_scale, int64_t n, std::optional<double> input_scale,
                     std::optional<int64_t> input_zp, bool symmetric, const std::optional<at::Tensor>& bias);

}  // namespace cpu_backend
