// The AVX-512 arch and decoders (see kernels.h): F, BW, VL and VBMI, 16 lanes.
#pragma once

#include "arch_avx2.h"

#if MS_AVX512
namespace ms {

struct Arch5 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int R1 = 4;  // rows per pass for one token
  static constexpr int TT = 5;  // tokens per tile of the many-token path (4 x 5 accumulators)
  static constexpr int TD = 8;  // tokens from which the many-token path decodes rows into a buffer (above)
  static constexpr int RT = 2;  // rows per pass of the few-token path
  static constexpr bool SIMD = true;
  static MS_INLINE V zero() { return _mm512_setzero_ps(); }
  static MS_INLINE V set1(float a) { return _mm512_set1_ps(a); }
  static MS_INLINE V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static MS_INLINE void storeu(float* p, V a) { _mm512_storeu_ps(p, a); }
  static MS_INLINE void store_part(float* p, V a, int64_t n) {
    _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), a);
  }
  static MS_INLINE V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // a value held in a register (GCC otherwise reloads a reused operand from memory at every use)
  static MS_INLINE void keep(V& a) { asm volatile("" : "+v"(a)); }
  static MS_INLINE float hsum(V a) {  // lanes i + i+8, then the 8-lane tree
    return Arch2::hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
  }
  // ggml's direct decoders (engine.h DecG): 16 weights each, the float operations of ggml_group
  // dl * nibble - ml, the low (hi 0) or high nibbles of 16 bytes (Q4_K)
  static MS_INLINE V dq_nibbles(const uint8_t* p, int hi, float dl, float ml) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = hi ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    return _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dl), _mm512_cvtepi32_ps(b)), _mm512_set1_ps(ml));
  }
  // dl * ((low nibble (k < 2) or high one | bit pair k of qh << 4) - 32) (Q6_K)
  static MS_INLINE V dq_q6(const uint8_t* ql, int k, const uint8_t* qh, float dl) {
    __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql)));
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh)));
    lo = k < 2 ? _mm512_and_si512(lo, _mm512_set1_epi32(15)) : _mm512_srli_epi32(lo, 4);
    const __m512i hb = _mm512_and_si512(_mm512_srli_epi32(h, unsigned(2 * k)), _mm512_set1_epi32(3));
    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hb, 4)), _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_cvtepi32_ps(q));
  }
  // int8 * d (Q8_0)
  static MS_INLINE V dq_i8(const uint8_t* p, float d) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
  }
  // n <= 16 elements of dtype dt at element c0 of p, zeros after
  static MS_INLINE V load_dt(const uint8_t* p, int dt, int64_t c0, int64_t n) {
    const __mmask16 m = __mmask16((1u << n) - 1);
    if (dt == F32) return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + c0);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p + 2 * c0);
    if (dt == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
};

// Bit-stream codes, 16 per vector, natural order: one byte permute of a masked load.
struct Codes5 {
  __m512i idx, shift, mask;
  __mmask64 lmask;
  int bits;
  explicit Codes5(int b) : bits(b) {
    alignas(64) uint8_t ix[64];
    alignas(64) int32_t sh[16];
    for (int d = 0; d < 16; ++d) {
      int bit = d * b;
      for (int k = 0; k < 4; ++k) ix[4 * d + k] = uint8_t(std::min(63, (bit >> 3) + k));
      sh[d] = bit & 7;
    }
    idx = _mm512_load_si512(ix);
    shift = _mm512_load_si512(sh);
    mask = _mm512_set1_epi32((1 << b) - 1);
    lmask = (__mmask64(1) << (2 * b)) - 1;  // 16 codes = 2b bytes
  }
  // codes in the low bits of each lane, higher bits holding the next codes (for table lookups)
  MS_INLINE __m512i get_raw(const uint8_t* row, int64_t v) const {
    __m512i raw = _mm512_maskz_loadu_epi8(lmask, row + v * 2 * bits);
    return _mm512_srlv_epi32(_mm512_permutexvar_epi8(idx, raw), shift);
  }
  template <int B>  // the same for a width known at compile time (B == bits)
  MS_INLINE __m512i get_raw(const uint8_t* row, int64_t v) const {
    __m512i raw = _mm512_maskz_loadu_epi8(__mmask64((1ull << (2 * B)) - 1), row + v * 2 * B);
    return _mm512_srlv_epi32(_mm512_permutexvar_epi8(idx, raw), shift);
  }
  MS_INLINE __m512i get(const uint8_t* row, int64_t v) const { return _mm512_and_si512(get_raw(row, v), mask); }
};

template <int KIND>
struct Dec5 {
  using V = __m512;
  int64_t full;  // float: whole vectors in a row
  const Lin& L;
  Codes5 codes;
  __m512 lut;
  __m512i tq_idx[5], tq_sh[5];
  __m512 iota_lo, iota_hi;  // affine tables: code values 0..15 (periodic below 4 bits) and 16..31
  struct Row {
    RowPtrs q;
    __m512 s, b;  // affine scale and bias (6, 8 bits) or its value table (<= 5 bits: s, b = codes 0-15,
                  // 16-31); fp8 scale; the scaled value table (mxfp4, codebooks) in s
  };
  mutable TritScratch trits;
  int64_t group_bytes;  // stored bytes of one group's codes (about: ten-per-word packing)
  int64_t ahead;  // prefetch_distance (engine.h)
  explicit Dec5(const Lin& l)
      : L(l), full(l.in / 16), codes(KIND == K_TRIT ? 2 : (affine_kind<KIND>() || KIND == K_CB ? l.bits : 4)) {
    group_bytes = L.row_bytes * L.group / std::max<int64_t>(1, L.in);
    ahead = prefetch_distance(L, Arch5::R1);
    lut = _mm512_loadu_ps(L.lut);
    alignas(64) float io[32];
    for (int i = 0; i < 32; ++i) io[i] = float(L.bits < 5 ? (i & ((1 << L.bits) - 1)) : i);
    iota_lo = _mm512_load_ps(io);
    iota_hi = _mm512_load_ps(io + 16);
    if constexpr (KIND == K_CB3) {  // codes j = 16v + d in word j / 10 at bit 3 (j % 10): period 5 vectors
      for (int m = 0; m < 5; ++m) {
        alignas(64) int32_t ix[16], sh[16];
        for (int d = 0; d < 16; ++d) {
          int j = 16 * m + d;
          ix[d] = j / 10;
          sh[d] = 3 * (j % 10);
        }
        tq_idx[m] = _mm512_load_si512(ix);
        tq_sh[m] = _mm512_load_si512(sh);
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
    r.s = _mm512_set1_ps(s);
    if constexpr (affine_kind<KIND>()) {
      r.b = _mm512_set1_ps(ld_dt(r.q.b, L.b_dt, g));
      if (KIND == K_AFFINE4 || L.bits <= 5) {  // the group's values fma(q, s, b) for every code: the same bits as per weight
        __m512 lo = _mm512_fmadd_ps(iota_lo, r.s, r.b);
        r.b = _mm512_fmadd_ps(iota_hi, r.s, r.b);
        r.s = lo;
      }
    }
    if constexpr (KIND == K_MXFP4 || KIND == K_CB || KIND == K_CB3 || KIND == K_TRIT) r.s = _mm512_mul_ps(lut, r.s);
  }
  MS_INLINE __m512 load(const Row& r, int64_t v) const {
    if constexpr (KIND == K_FLOAT) {
      return Arch5::load_dt(r.q.p, L.bits, 16 * v, v < full ? 16 : L.in - 16 * v);
    } else if constexpr (KIND == K_AFFINE4) {
      return _mm512_permutexvar_ps(codes.get_raw<4>(r.q.p, v), r.s);  // low 4 bits index
    } else if constexpr (KIND == K_AFFINE) {
      if (L.bits <= 4) return _mm512_permutexvar_ps(codes.get_raw(r.q.p, v), r.s);  // low 4 bits index
      if (L.bits == 5) return _mm512_permutex2var_ps(r.s, codes.get_raw(r.q.p, v), r.b);  // low 5 bits
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes.get(r.q.p, v)), r.s, r.b);
    } else if constexpr (KIND == K_FP8) {
      __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.q.p + v * 16)));
      __m256i h = _mm256_slli_epi16(w, 7);
      h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
      return _mm512_mul_ps(_mm512_cvtph_ps(h), r.s);
    } else if constexpr (KIND == K_CB3) {
      const int m = int(v % 5);
      const int64_t off = 32 * (v / 5);
      const int64_t left = L.row_bytes - off;
      const __mmask16 km = left >= 32 ? __mmask16(0xff) : __mmask16((1u << (left / 4)) - 1);
      __m512i c = _mm512_permutexvar_epi32(tq_idx[m], _mm512_maskz_loadu_epi32(km, r.q.p + off));
      c = _mm512_srlv_epi32(c, tq_sh[m]);  // the table ignores bits above 3: entries 8-15 repeat 0-7
      return _mm512_permutexvar_ps(c, r.s);
    } else if constexpr (KIND == K_CB || KIND == K_TRIT) {
      return _mm512_permutexvar_ps(codes.get_raw(r.q.p, v), r.s);  // tables periodic in the code width
    } else {
      return _mm512_permutexvar_ps(codes.get(r.q.p, v), r.s);
    }
  }
};
}  // namespace ms
#endif
