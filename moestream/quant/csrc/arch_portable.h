// The portable arch and decoders (see kernels.h): plain C++ over 16-lane arrays, compiled anywhere
// (ARM64 included); the compiler vectorizes what it can, which keeps the bits (no fast-math, no
// contraction: every fma is std::fma).
#pragma once

#include "engine.h"

namespace ms {

struct VP {
  float v[16];
};

struct ArchP {
  using V = VP;
  static constexpr int W = 16;
  static constexpr int R1 = 1;  // rows per pass for one token
  static constexpr int TT = 4;  // tokens per tile of the many-token path
  static constexpr int TD = 4;  // tokens from which the many-token path decodes rows into a buffer (above)
  static constexpr int RT = 1;  // rows per pass of the few-token path
  static constexpr bool SIMD = false;
  static MS_INLINE V zero() {
    V r;
    for (int i = 0; i < 16; ++i) r.v[i] = 0.0f;
    return r;
  }
  static MS_INLINE V set1(float a) {
    V r;
    for (int i = 0; i < 16; ++i) r.v[i] = a;
    return r;
  }
  static MS_INLINE V loadu(const float* p) {
    V r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static MS_INLINE void storeu(float* p, const V& a) {
    for (int i = 0; i < 16; ++i) p[i] = a.v[i];
  }
  static MS_INLINE void store_part(float* p, const V& a, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = a.v[i];
  }
  static MS_INLINE V fma(const V& a, const V& b, const V& c) {
    V r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  static MS_INLINE void keep(V&) {}
  // (the ggml direct decoders are SIMD-only: the portable path keeps ggml_group's loops)
  static MS_INLINE V dq_nibbles(const uint8_t*, int, float, float) { return zero(); }
  static MS_INLINE V dq_q6(const uint8_t*, int, const uint8_t*, float) { return zero(); }
  static MS_INLINE V dq_i8(const uint8_t*, float) { return zero(); }
  static MS_INLINE float hsum(const V& a) {
    float t[16];
    for (int i = 0; i < 16; ++i) t[i] = a.v[i];
    return tree_sum<16>(t);
  }
  // n <= 16 elements of dtype dt at element c0 of p, zeros after
  static MS_INLINE V load_dt(const uint8_t* p, int dt, int64_t c0, int64_t n) {
    V r;
    for (int i = 0; i < 16; ++i) r.v[i] = i < n ? ld_dt(p, dt, c0 + i) : 0.0f;
    return r;
  }
};

template <int KIND>
struct DecP {
  using V = VP;
  const Lin& L;
  struct Row {
    RowPtrs q;
    const uint8_t* end;
    float s, b;
  };
  mutable TritScratch trits;
  int64_t full;  // float: whole vectors in a row
  explicit DecP(const Lin& l) : L(l), full(l.in / 16) {}
  MS_INLINE void start(Row& r, int64_t row) const {
    r.q = row_ptrs(L, row);
    r.end = r.q.p + L.row_bytes;
    if constexpr (KIND == K_TRIT) {
      r.q.p = trits.row(L, r.q.p);
      r.end = r.q.p + L.in / 4;
    }
  }
  MS_INLINE void prefetch(const Row&, int64_t) const {}
  MS_INLINE void group(Row& r, int64_t g) const {
    if constexpr (KIND == K_FLOAT) return;
    r.s = group_scale<KIND>(L, r.q, g);
    if constexpr (affine_kind<KIND>()) r.b = ld_dt(r.q.b, L.b_dt, g);
  }
  MS_INLINE V load(const Row& r, int64_t v) const {
    V o;
    const int64_t j0 = v * 16;
    if constexpr (KIND == K_FLOAT) {
      return ArchP::load_dt(r.q.p, L.bits, j0, v < full ? 16 : L.in - j0);
    } else if constexpr (affine_kind<KIND>()) {
      for (int i = 0; i < 16; ++i) o.v[i] = std::fma(float(stream_code(r.q.p, r.end, j0 + i, L.bits)), r.s, r.b);
    } else if constexpr (KIND == K_FP8) {
      const float* t = fp8_table().v;
      for (int i = 0; i < 16; ++i) o.v[i] = t[r.q.p[j0 + i]] * r.s;
    } else if constexpr (KIND == K_MXFP4) {
      for (int i = 0; i < 16; ++i) o.v[i] = L.lut[stream_code(r.q.p, r.end, j0 + i, 4)] * r.s;
    } else if constexpr (KIND == K_CB || KIND == K_TRIT) {
      const int bits = KIND == K_TRIT ? 2 : L.bits;
      for (int i = 0; i < 16; ++i) o.v[i] = L.lut[stream_code(r.q.p, r.end, j0 + i, bits)] * r.s;
    } else {
      for (int i = 0; i < 16; ++i) o.v[i] = L.lut[tq3_code(r.q.p, j0 + i)] * r.s;
    }
    return o;
  }
};

}  // namespace ms
