// The AVX2 arch and decoders (see kernels.h): a 16-lane vector as two 8-lane halves (lanes 0-7, 8-15),
// so the reduction is the one every path follows.
#pragma once

#include "engine.h"

#if MS_AVX2
namespace ms {

struct Arch2 {
  struct V {
    __m256 lo, hi;
  };
  static constexpr int W = 16;
  static constexpr int R1 = 2;  // rows per pass for one token
  static constexpr int TT = 3;  // tokens per tile of the many-token path (12 of the 16 registers accumulate)
  static constexpr int TD = 4;  // tokens from which the many-token path decodes rows into a buffer (above)
  static constexpr int RT = 1;  // rows per pass of the few-token path
  static constexpr bool SIMD = true;
  static MS_INLINE V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static MS_INLINE V set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static MS_INLINE V loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static MS_INLINE void storeu(float* p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  static MS_INLINE void store_part(float* p, V a, int64_t n) {
    if (n == 16) return storeu(p, a);
    alignas(32) float t[16];
    storeu(t, a);
    std::memcpy(p, t, size_t(n) * 4);
  }
  static MS_INLINE V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  // a value held in registers (GCC otherwise reloads a reused operand from memory at every use)
  static MS_INLINE void keep(V& a) { asm volatile("" : "+x"(a.lo), "+x"(a.hi)); }
  static MS_INLINE float hsum8(__m256 t) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // lanes i + i+4
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                       // + i+2
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));                                   // + i+1
    return _mm_cvtss_f32(s);
  }
  static MS_INLINE float hsum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }  // lanes i + i+8 first
  // n <= 8 elements of dtype dt at element c0 of p, zeros after
  static MS_INLINE __m256 load8_dt(const uint8_t* p, int dt, int64_t c0, int64_t n) {
    if (__builtin_expect(n == 8, 1)) {
      if (dt == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + c0);
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c0));
      if (dt == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      return _mm256_cvtph_ps(h);
    }
    alignas(32) float t[8] = {0};
    for (int64_t i = 0; i < n; ++i) t[i] = ld_dt(p, dt, c0 + i);
    return _mm256_load_ps(t);
  }
  // ggml's direct decoders (engine.h DecG): 16 weights each as two halves, ggml_group's float operations
  static MS_INLINE __m256 nib8(const uint8_t* p, int hi, __m256 dl, __m256 ml) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    b = hi ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(b)), ml);
  }
  static MS_INLINE V dq_nibbles(const uint8_t* p, int hi, float dl, float ml) {
    const __m256 d = _mm256_set1_ps(dl), m = _mm256_set1_ps(ml);
    return {nib8(p, hi, d, m), nib8(p + 8, hi, d, m)};
  }
  static MS_INLINE __m256 q6_8(const uint8_t* ql, int k, const uint8_t* qh, __m256 dl) {
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql)));
    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh)));
    lo = k < 2 ? _mm256_and_si256(lo, _mm256_set1_epi32(15)) : _mm256_srli_epi32(lo, 4);
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi32(h, 2 * k), _mm256_set1_epi32(3));
    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hb, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(dl, _mm256_cvtepi32_ps(q));
  }
  static MS_INLINE V dq_q6(const uint8_t* ql, int k, const uint8_t* qh, float dl) {
    const __m256 d = _mm256_set1_ps(dl);
    return {q6_8(ql, k, qh, d), q6_8(ql + 8, k, qh + 8, d)};
  }
  static MS_INLINE __m256 i8_8(const uint8_t* p, __m256 d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))), d);
  }
  static MS_INLINE V dq_i8(const uint8_t* p, float d) {
    const __m256 dv = _mm256_set1_ps(d);
    return {i8_8(p, dv), i8_8(p + 8, dv)};
  }
  static MS_INLINE V load_dt(const uint8_t* p, int dt, int64_t c0, int64_t n) {
    return {load8_dt(p, dt, c0, n < 8 ? n : 8), load8_dt(p, dt, c0 + 8, n > 8 ? n - 8 : 0)};
  }
};


// Bit-stream codes of `bits` (<= 8) in natural order, 8 per vector, in int32 lanes: lane d
// takes the 32-bit window at byte (d*bits)/8, shifted right by (d*bits)%8, masked. Reads 16
// bytes from the vector's first byte; a row's last vectors read a zero-padded copy.
struct Codes2 {
  __m256i idx, shift, mask;
  int bits;
  int64_t row_bytes, safe;  // vectors v < safe can read 16 bytes in place
  Codes2(int b, int64_t rb, int64_t nvec) : bits(b), row_bytes(rb) {
    alignas(32) uint8_t ix[32];
    alignas(32) int32_t sh[8];
    for (int d = 0; d < 8; ++d) {
      int bit = d * b;
      // both 128-bit halves of the shuffle see the same 16 bytes
      for (int k = 0; k < 4; ++k) ix[4 * d + k] = uint8_t(std::min(15, (bit >> 3) + k));
      sh[d] = bit & 7;
    }
    idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(ix));
    shift = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh));
    mask = _mm256_set1_epi32((1 << b) - 1);
    safe = rb < 16 ? 0 : std::min<int64_t>(nvec, (rb - 16) / b + 1);
  }
  MS_INLINE __m256i get(const uint8_t* row, int64_t v) const { return _mm256_and_si256(get_raw(row, v), mask); }
  // codes in the low bits of each lane, higher bits holding the next codes (for table lookups)
  MS_INLINE __m256i get_raw(const uint8_t* row, int64_t v) const {
    const uint8_t* p = row + v * bits;
    __m128i raw;
    if (__builtin_expect(v < safe, 1)) {
      raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint8_t tmp[16] = {0};
      std::memcpy(tmp, p, size_t(std::min<int64_t>(16, row + row_bytes - p)));
      raw = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
    }
    __m256i win = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(raw), idx);
    return _mm256_srlv_epi32(win, shift);
  }
};

template <int KIND>
struct Dec2 {
  using V = Arch2::V;
  const Lin& L;
  Codes2 codes;
  __m256 lut_lo, lut_hi;
  __m256i tq_idx[5], tq_sh[5];
  struct Row {
    RowPtrs q;
    __m256 s, b;    // affine scale and bias; fp8 scale
    __m256 lo, hi;  // the scaled value table (mxfp4, codebooks)
  };
  __m256 iota;  // affine tables (<= 3 bits): code values 0..7, periodic
  mutable TritScratch trits;
  int64_t group_bytes;  // stored bytes of one group's codes (about: ten-per-word packing)
  int64_t ahead;  // prefetch_distance (engine.h)
  explicit Dec2(const Lin& l)
      : L(l),
        codes(KIND == K_TRIT ? 2 : (affine_kind<KIND>() || KIND == K_CB ? l.bits : 4),
              KIND == K_TRIT ? l.in / 4 : l.row_bytes, l.in / 8) {
    group_bytes = L.row_bytes * L.group / std::max<int64_t>(1, L.in);
    ahead = prefetch_distance(L, Arch2::R1);
    lut_lo = _mm256_loadu_ps(L.lut);
    lut_hi = _mm256_loadu_ps(L.lut + 8);
    alignas(32) float io[8];
    for (int i = 0; i < 8; ++i) io[i] = float(i & ((1 << std::min(3, L.bits)) - 1));
    iota = _mm256_load_ps(io);
    if constexpr (KIND == K_CB3) {  // codes j = 8v + d in word j / 10 at bit 3 (j % 10); period 5 vectors
      for (int m = 0; m < 5; ++m) {
        alignas(32) int32_t ix[8], sh[8];
        for (int d = 0; d < 8; ++d) {
          int j = 8 * m + d;
          ix[d] = j / 10;
          sh[d] = 3 * (j % 10);
        }
        tq_idx[m] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ix));
        tq_sh[m] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh));
      }
    }
  }
  MS_INLINE void start(Row& r, int64_t row) const {
    r.q = row_ptrs(L, row);
    if constexpr (KIND == K_TRIT) r.q.p = trits.row(L, r.q.p);
  }
  MS_INLINE void prefetch(const Row& r, int64_t g) const {
    if constexpr (KIND != K_TRIT && KIND != K_FLOAT) prefetch_ahead(r.q.p + g * group_bytes, ahead);
  }
  MS_INLINE void group(Row& r, int64_t g) const {
    if constexpr (KIND == K_FLOAT) return;
    float s = group_scale<KIND>(L, r.q, g);
    if constexpr (KIND == K_FP8) s *= 256.0f;  // the fp16 view of e4m3 bits is value * 2^-8 (exact)
    r.s = _mm256_set1_ps(s);
    if constexpr (affine_kind<KIND>()) {
      r.b = _mm256_set1_ps(ld_dt(r.q.b, L.b_dt, g));
      if (KIND == K_AFFINE && L.bits <= 3) r.lo = _mm256_fmadd_ps(iota, r.s, r.b);  // fma(q, s, b) per code: the same bits
    }
    if constexpr (KIND == K_MXFP4 || KIND == K_CB || KIND == K_CB3 || KIND == K_TRIT) {
      r.lo = _mm256_mul_ps(lut_lo, r.s);
      r.hi = _mm256_mul_ps(lut_hi, r.s);
    }
  }
  MS_INLINE V load(const Row& r, int64_t v) const { return {load8(r, 2 * v), load8(r, 2 * v + 1)}; }
  // 8 weights: those of 8-lane unit v
  MS_INLINE __m256 load8(const Row& r, int64_t v) const {
    if constexpr (KIND == K_FLOAT) {
      return Arch2::load8_dt(r.q.p, L.bits, 8 * v, std::min<int64_t>(8, L.in - 8 * v));
    } else if constexpr (KIND == K_AFFINE4) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes.get(r.q.p, v)), r.s, r.b);
    } else if constexpr (KIND == K_AFFINE) {
      if (L.bits <= 3) return _mm256_permutevar8x32_ps(r.lo, codes.get_raw(r.q.p, v));  // low 3 bits index
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes.get(r.q.p, v)), r.s, r.b);
    } else if constexpr (KIND == K_FP8) {
      __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.q.p + v * 8)));
      __m128i h = _mm_slli_epi16(w, 7);                                // e4m3 bits 6..0 -> fp16 bits 13..7
      h = _mm_add_epi16(h, _mm_and_si128(h, _mm_set1_epi16(0x4000)));  // its sign: bit 14 -> 15
      return _mm256_mul_ps(_mm256_cvtph_ps(h), r.s);
    } else if constexpr (KIND == K_CB3) {
      const int m = int(v % 5);
      const int64_t off = 16 * (v / 5);
      const int64_t left = L.row_bytes - off;
      __m128i words;
      if (__builtin_expect(left >= 16, 1)) {
        words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.q.p + off));
      } else {
        alignas(16) uint8_t tmp[16] = {0};
        std::memcpy(tmp, r.q.p + off, size_t(left));
        words = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      __m256i c = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(words), tq_idx[m]);
      c = _mm256_srlv_epi32(c, tq_sh[m]);  // permutevar8x32 reads the low 3 bits: the code
      return _mm256_permutevar8x32_ps(r.lo, c);
    } else {
      if (KIND == K_TRIT || (KIND == K_CB && L.bits <= 3))  // tables periodic in the code width: no mask
        return _mm256_permutevar8x32_ps(r.lo, codes.get_raw(r.q.p, v));
      __m256i c = codes.get(r.q.p, v);
      __m256 lo = _mm256_permutevar8x32_ps(r.lo, c);
      // 16 entries: 0-7 and 8-15 by the low 3 bits, chosen by bit 3
      __m256 hi = _mm256_permutevar8x32_ps(r.hi, c);
      return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
    }
  }
};
}  // namespace ms
#endif
