// Elementwise math on VecF32x16, written once over the ops every ISA's vector
// type provides (fma, +, -, *, /, max/min with x86 NaN semantics, select_lt,
// round, scale_pow2, abs, copysign). Included by vec.h after the ISA header.
//
// exp: Cephes expf. n = round(x / ln2); r = x - n ln2 in two parts (Cody-Waite,
// the high part exact for |n| < 2^15); exp(r) by a degree-7 polynomial on
// |r| <= ln2/2; times 2^n by scale_pow2. ~1 ulp over the normal range. Inputs
// are clamped to [-110, 89]: below, the result rounds to 0 (so -inf -> 0);
// above, 2^n overflows to inf (so +inf -> inf). Subnormal results are
// produced by scale_pow2's rounding. NaN propagates (max/min keep the NaN in
// their second operand).
#pragma once

namespace cpu_backend {

CB_ALWAYS_INLINE VecF32x16 exp(VecF32x16 x) {
  using V = VecF32x16;
  x = min(V::broadcast(89.0f), max(V::broadcast(-110.0f), x));
  const V n = (x * V::broadcast(1.44269504088896341f)).round();
  V r = fma(n, V::broadcast(-0.693359375f), x);
  r = fma(n, V::broadcast(2.12194440e-4f), r);
  V p = V::broadcast(1.9875691500e-4f);
  p = fma(p, r, V::broadcast(1.3981999507e-3f));
  p = fma(p, r, V::broadcast(8.3334519073e-3f));
  p = fma(p, r, V::broadcast(4.1665795894e-2f));
  p = fma(p, r, V::broadcast(1.6666665459e-1f));
  p = fma(p, r, V::broadcast(5.0000001201e-1f));
  const V y = fma(p, r * r, r + V::broadcast(1.0f));
  return y.scale_pow2(n);
}

// tanh(x) = sign(x) (1 - t) / (1 + t), t = exp(-2|x|): no overflow; absolute
// error ~1e-7 (relative error grows for |x| < 1e-3, where tanh(x) ~ x is tiny).
CB_ALWAYS_INLINE VecF32x16 tanh(VecF32x16 x) {
  using V = VecF32x16;
  const V t = exp(x.abs() * V::broadcast(-2.0f));
  const V one = V::broadcast(1.0f);
  return ((one - t) / (one + t)).copysign(x);
}

// x * sigmoid(x) = x / (1 + exp(-x)).
CB_ALWAYS_INLINE VecF32x16 silu(VecF32x16 x) {
  return x / (VecF32x16::broadcast(1.0f) + exp(x * VecF32x16::broadcast(-1.0f)));
}

// erf: Eigen's rational approximation (odd degree-13 numerator over even
// degree-8 denominator) on x clamped to [-4, 4] (erf(4) rounds to 1 in fp32).
CB_ALWAYS_INLINE VecF32x16 erf(VecF32x16 x) {
  using V = VecF32x16;
  x = min(V::broadcast(4.0f), max(V::broadcast(-4.0f), x));
  const V x2 = x * x;
  V p = V::broadcast(-2.72614225801306e-10f);
  p = fma(p, x2, V::broadcast(2.77068142495902e-08f));
  p = fma(p, x2, V::broadcast(-2.10102402082508e-06f));
  p = fma(p, x2, V::broadcast(-5.69250639462346e-05f));
  p = fma(p, x2, V::broadcast(-7.34990630326855e-04f));
  p = fma(p, x2, V::broadcast(-2.95459980854025e-03f));
  p = fma(p, x2, V::broadcast(-1.60960333262415e-02f));
  p = p * x;
  V q = V::broadcast(-1.45660718464996e-05f);
  q = fma(q, x2, V::broadcast(-2.13374055278905e-04f));
  q = fma(q, x2, V::broadcast(-1.68282697438203e-03f));
  q = fma(q, x2, V::broadcast(-7.37332916720468e-03f));
  q = fma(q, x2, V::broadcast(-1.42647390514189e-02f));
  return p / q;
}

// GELU, exact (erf) and tanh-approximated, as torch.nn.functional.gelu.
CB_ALWAYS_INLINE VecF32x16 gelu_erf(VecF32x16 x) {
  using V = VecF32x16;
  const V half_x = x * V::broadcast(0.5f);
  return fma(half_x, erf(x * V::broadcast(0.70710678118654752f)), half_x);
}
CB_ALWAYS_INLINE VecF32x16 gelu_tanh(VecF32x16 x) {
  using V = VecF32x16;
  const V inner = x * fma(x * x, V::broadcast(0.7978845608028654f * 0.044715f), V::broadcast(0.7978845608028654f));
  const V half_x = x * V::broadcast(0.5f);
  return fma(half_x, tanh(inner), half_x);
}

}  // namespace cpu_backend
