// Shared by every path: scalar decoding, ggml's block decoders, the canonical exp and the dot engine
// (templates over an arch A and a decoder D; see kernels.h for the one reduction every path follows).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "traits.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MS_AVX2 1
#else
#define MS_AVX2 0
#endif
#if MS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define MS_AVX512 1
#else
#define MS_AVX512 0
#endif

namespace ms {

// float32 rounded to the nearest fp16 value (ties to even), as float32 (PyTorch's .half().float())
static inline float c10_half_round(float f) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(f, 0));
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return f;  // inf, nan
  if (a >= 0x477ff000u) return std::copysign(std::numeric_limits<float>::infinity(), f);  // >= 65520
  if (a < 0x38800000u) return std::nearbyint(f * 16777216.0f) / 16777216.0f;  // subnormal: multiples of 2^-24
  u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;  // 10 mantissa bits, ties to even
  float r;
  std::memcpy(&r, &u, 4);
  return r;
#endif
}

// ---------------------------------------------------------------------------------------
// Scalars: scale dtypes, e8m0, fp8, bit-stream codes.

#define MS_UNROLL _Pragma("GCC unroll 16")
#define MS_INLINE inline __attribute__((always_inline))
// the hot loops stay functions of their own: inlined into their caller, GCC stops unrolling them (the
// accumulators then live on the stack, half the speed)
#define MS_NOINLINE __attribute__((noinline))

// IEEE fp16 bits -> float32 (exact)
static MS_INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400u));
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

template <int DT>
static MS_INLINE float ldf(const uint8_t* p, int64_t i) {
  if constexpr (DT == F32) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  } else if constexpr (DT == BF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    uint32_t u = uint32_t(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return half_to_float(h);
  }
}

// e8m0 exponent byte -> 2^(e - 127) as float32 (e = 0: 2^-127, a float32 subnormal; 255: NaN)
struct E8m0Table {
  float v[256];
  E8m0Table() {
    for (int e = 0; e < 256; ++e) v[e] = e == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, e - 127);
  }
};
static const E8m0Table& e8m0_table() {
  static const E8m0Table t;
  return t;
}

// fp8 e4m3fn byte -> float32 (exact; 0x7f/0xff are NaN)
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      int e = (c >> 3) & 15, m = c & 7;
      float x = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
      if ((c & 0x7f) == 0x7f) x = std::numeric_limits<float>::quiet_NaN();
      v[c] = (c & 0x80) ? -x : x;
    }
  }
};
static const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// code j of a little-endian bit stream of `bits`-bit codes (bits <= 8), reading no byte past `end`
static MS_INLINE uint32_t stream_code(const uint8_t* p, const uint8_t* end, int64_t j, int bits) {
  int64_t bit = j * bits;
  const uint8_t* q = p + (bit >> 3);
  uint32_t v = q[0];
  if (q + 1 < end) v |= uint32_t(q[1]) << 8;
  return (v >> (bit & 7)) & ((1u << bits) - 1);
}

// Base-3 trits (20 per uint32 word, t_i = word / 3^i % 3) of one row as a 2-bit code stream in `out`
// (in / 4 bytes, plus 8 of slack): ten trits at a time through a 3^10-entry table (236 KB).
struct TritTable {
  std::vector<uint32_t> v;
  TritTable() : v(59049) {
    for (int c = 0; c < 59049; ++c) {
      uint32_t x = uint32_t(c), bits = 0;
      for (int i = 0; i < 10; ++i, x /= 3) bits |= (x % 3) << (2 * i);
      v[size_t(c)] = bits;
    }
  }
};

static inline void trits_to_stream(const uint8_t* words, int64_t nwords, uint8_t* out) {
  static const TritTable table;
  const uint32_t* t = table.v.data();
  for (int64_t i = 0; i < nwords; ++i) {
    uint32_t w;
    std::memcpy(&w, words + 4 * i, 4);
    const uint32_t hi = w / 59049u;
    const uint64_t bits = uint64_t(t[w - 59049u * hi]) | uint64_t(t[hi < 59049u ? hi : 0]) << 20;
    std::memcpy(out + 5 * i, &bits, 8);  // 40 bits used; the next word overwrites the rest
  }
}

// Per-decoder scratch rows for transcoded trits: a decoder keeps up to 8 rows in flight.
struct TritScratch {
  std::vector<uint8_t> buf[8];
  int next = 0;
  const uint8_t* row(const Lin& L, const uint8_t* words) {
    std::vector<uint8_t>& b = buf[next++ & 7];
    const int64_t nwords = L.row_bytes / 4;
    b.resize(size_t(5 * nwords + 8));
    trits_to_stream(words, nwords, b.data());
    return b.data();
  }
};

static MS_INLINE uint32_t tq3_code(const uint8_t* row, int64_t j) {
  uint32_t word;
  std::memcpy(&word, row + 4 * (j / 10), 4);
  return (word >> (3 * (j % 10))) & 7;
}

// Internal kinds: codebooks split by their packing.
// K_AFFINE4: affine with 4-bit codes, the width fixed at compile time (the same operations as K_AFFINE at 4 bits,
// without a test of the width at every vector; about 5% on the one-token path, measured).
enum K : int { K_AFFINE = 0, K_FP8 = 1, K_MXFP4 = 2, K_CB = 3, K_CB3 = 4, K_TRIT = 5, K_FLOAT = 6, K_AFFINE4 = 7 };
template <int KIND>
constexpr bool affine_kind() { return KIND == K_AFFINE || KIND == K_AFFINE4; }

// How far ahead of the codes being decoded a row's bytes are prefetched: one pass of the one-token path's `rows`
// rows on (the next pass's rows at the same offset; the streams of a few rows at a time are too short for the
// hardware prefetchers to run ahead across pages), at least PREFETCH_BYTES.
constexpr int64_t PREFETCH_BYTES = 768;

static MS_INLINE int64_t prefetch_distance(const Lin& L, int rows) {
  return std::max<int64_t>(PREFETCH_BYTES, rows * L.row_bytes * std::max<int64_t>(1, L.row_step));
}

static MS_INLINE void prefetch_ahead(const uint8_t* p, int64_t distance) {
#if defined(__GNUC__)
  __builtin_prefetch(p + distance, 0, 3);
#else
  (void)p, (void)distance;
#endif
}

// Per-row state every decoder keeps: stored row pointer, scale (and bias) row pointers.
struct RowPtrs {
  const uint8_t* p;  // the row's codes
  const uint8_t* s;  // the row's scales (fp8: its block row's)
  const uint8_t* b;  // the row's biases (affine)
};

static MS_INLINE float ld_dt(const uint8_t* p, int dt, int64_t i) {
  switch (dt) {
    case F32: return ldf<F32>(p, i);
    case BF16: return ldf<BF16>(p, i);
    default: return ldf<F16>(p, i);
  }
}

static MS_INLINE RowPtrs row_ptrs(const Lin& L, int64_t row) {
  const int64_t sr = L.stored(row);
  const int64_t es = L.s_dt == F32 ? 4 : 2;
  RowPtrs r;
  r.p = L.w + sr * L.row_bytes;
  r.s = r.b = nullptr;
  if (L.kind == FLOAT) return r;
  if (L.kind == FP8) {
    r.s = L.s + (sr / L.bn) * L.s_row * es;
  } else if (L.kind == MXFP4) {
    r.s = L.s + sr * L.s_row;
  } else {
    r.s = L.s + sr * L.s_row * es;
  }
  r.b = L.kind == AFFINE ? L.b + sr * L.s_row * (L.b_dt == F32 ? 4 : 2) : nullptr;
  return r;
}

template <int KIND>
static MS_INLINE float group_scale(const Lin& L, const RowPtrs& r, int64_t g) {
  if constexpr (KIND == K_MXFP4) return e8m0_table().v[r.s[g]];
  else return ld_dt(r.s, L.s_dt, g);
}


// ---------------------------------------------------------------------------------------
// ggml blocks (GGUF files; layouts in moestream/quant/ggml.py, from ggml-common.h): any arch. group()
// dequantizes one sub-block (16 or 32 weights sharing a scale) into the row's buffer with the float
// operations of ggml's dequantize_row_* (multiply, then add or subtract: -ffp-contract=off), so the
// weights are the reference's bits; load() reads W of them.

static MS_INLINE float ggml_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// the IQ4 types' code values (ggml-common.h kvalues_iq4nl)
static constexpr float IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K sub-block s (of 8): its 6-bit scale and min from the block's 12 scale bytes `sc` (ggml's
// get_scale_min_k4)
static MS_INLINE void k4_scale_min(const uint8_t* sc, int s, int& scale, int& mn) {
  if (s < 4) {
    scale = sc[s] & 63;
    mn = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
    mn = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// sub-block g (of `group` weights) of a ggml row, dequantized into out[group]
template <int T>
static MS_INLINE void ggml_group(const uint8_t* row, int64_t g, float* out) {
  if constexpr (T == G_IQ4_NL || T == G_IQ4_XS) {
    const uint8_t* qs;
    float dl;
    if constexpr (T == G_IQ4_NL) {
      const uint8_t* b = row + g * block_bytes<G_IQ4_NL>();
      dl = ggml_f16(b);
      qs = b + 2;
    } else {  // 8 sub-blocks of 32: 4 low scale bits in scales_l, 2 high ones in the uint16 scales_h
      const uint8_t* b = row + (g / 8) * block_bytes<G_IQ4_XS>();
      const int ib = int(g % 8);
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
      dl = ggml_f16(b) * float(ls - 32);
      qs = b + 8 + 16 * ib;
    }
    for (int j = 0; j < 16; ++j) {
      out[j] = dl * IQ4_VALUES[qs[j] & 15];
      out[j + 16] = dl * IQ4_VALUES[qs[j] >> 4];
    }
  } else if constexpr (T == G_Q4_0 || T == G_Q4_1 || T == G_Q5_0 || T == G_Q5_1 || T == G_Q8_0) {
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + g * size;
    const float d = ggml_f16(b);
    if constexpr (T == G_Q8_0) {
      for (int j = 0; j < 32; ++j) out[j] = float(int8_t(b[2 + j])) * d;
    } else if constexpr (T == G_Q4_0) {
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(int(b[2 + j] & 15) - 8);
        out[j + 16] = d * float(int(b[2 + j] >> 4) - 8);
      }
    } else if constexpr (T == G_Q4_1) {
      const float m = ggml_f16(b + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(b[4 + j] & 15) + m;
        out[j + 16] = d * float(b[4 + j] >> 4) + m;
      }
    } else {
      constexpr int hs = T == G_Q5_0 ? 2 : 4;  // qh after d (and m)
      uint32_t qh;
      std::memcpy(&qh, b + hs, 4);
      const uint8_t* qs = b + hs + 4;
      const float m = T == G_Q5_1 ? ggml_f16(b + 2) : 0.0f;
      for (int j = 0; j < 16; ++j) {
        const int lo = int((qs[j] & 15) | (((qh >> j) & 1) << 4)), hi = int((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        if constexpr (T == G_Q5_0) {
          out[j] = d * float(lo - 16);
          out[j + 16] = d * float(hi - 16);
        } else {
          out[j] = d * float(lo) + m;
          out[j + 16] = d * float(hi) + m;
        }
      }
    }
  } else if constexpr (T == G_Q2_K || T == G_Q3_K || T == G_Q6_K) {  // 16 sub-blocks of 16
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + (g / 16) * size;
    const int s = int(g % 16);
    if constexpr (T == G_Q6_K) {
      const float dl = ggml_f16(b + 208) * float(int8_t(b[192 + s]));
      const int n = s / 8, k = (s % 8) / 2, l0 = (s % 2) * 16;  // chunk of 128, run of 32, offset in it
      const uint8_t* ql = b + n * 64 + (k % 2) * 32;
      const uint8_t* qh = b + 128 + n * 32;
      for (int l = 0; l < 16; ++l) {
        const int low = (k < 2 ? ql[l0 + l] & 15 : ql[l0 + l] >> 4), high = (qh[l0 + l] >> (2 * k)) & 3;
        out[l] = dl * float((low | (high << 4)) - 32);
      }
    } else {
      const int n = s / 8, shift = 2 * ((s % 8) / 2), l0 = (s % 2) * 16;
      const uint8_t* q = b + (T == G_Q2_K ? 16 : 32) + n * 32 + l0;
      if constexpr (T == G_Q2_K) {
        const float dl = ggml_f16(b + 80) * float(b[s] & 15), ml = ggml_f16(b + 82) * float(b[s] >> 4);
        for (int l = 0; l < 16; ++l) out[l] = dl * float((q[l] >> shift) & 3) - ml;
      } else {
        const uint8_t* sc = b + 96;
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const float dl = ggml_f16(b + 108) * float(int(int8_t(uint8_t(low | (high << 4)))) - 32);
        const uint8_t* hm = b + l0;
        for (int l = 0; l < 16; ++l) {
          const int code = int((q[l] >> shift) & 3) - (((hm[l] >> (s / 2)) & 1) ? 0 : 4);
          out[l] = dl * float(code);
        }
      }
    }
  } else {  // Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + (g / 8) * size;
    const int s = int(g % 8);
    int scale, mn;
    k4_scale_min(b + 4, s, scale, mn);
    const float dl = ggml_f16(b) * float(scale), ml = ggml_f16(b + 2) * float(mn);
    const uint8_t* qs = b + (T == G_Q4_K ? 16 : 48) + (s / 2) * 32;
    for (int l = 0; l < 32; ++l) {
      int q = s % 2 ? qs[l] >> 4 : qs[l] & 15;
      if constexpr (T == G_Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
      out[l] = dl * float(q) - ml;
    }
  }
}

// MXFP4, the codebook (IQ1-IQ3) and ternary (TQ) types. `grid`: the codebook type's grid as the gguf
// package holds it (native.py hands its values over as bytes: uint8, int8 for IQ1's -1, 0, 1), entries of
// 8 (IQ2, IQ1) or 4 (IQ3) values. ggml's float operations: db = d * (0.5 + s) * 0.25 (IQ2), then
// db * grid value, negated by its sign bit (the reference multiplies by +-1: the same bits).

// e8m0 byte -> 2^(e - 128) as float32 (ggml_e8m0_to_fp32_half: e < 2 a subnormal, 255 -> 2^127)
static MS_INLINE float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000u) << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP4's code values: the e2m1 values doubled (ggml-common.h kvalues_mxfp4)
static constexpr float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's ksigns_iq2xs: a 7-bit sign index and, as bit 7, its parity (the count of minus signs is even)
static MS_INLINE uint32_t ksign(uint32_t i) { return i | (uint32_t(__builtin_popcount(i) & 1) << 7); }

static MS_INLINE uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

static MS_INLINE uint32_t ld32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// SIMD: the AVX2 and AVX-512 paths decode 8 weights per instruction sequence (the same float operations,
// so the same bits); the portable path keeps the scalar loops below.
#if MS_AVX2
// v with lane j negated where bit j of `signs` is set (an exact sign flip, as the reference's * -1)
static MS_INLINE __m256 negate_by_bits(__m256 v, uint32_t signs) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(signs)), bit), bit);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(set, 31)));
}
#endif

// 8 weights from two 4-value grid entries (8-value grids: g1 = g0 + 4): db * value, negated by bit j of signs
template <bool SIMD, class Q>
static MS_INLINE void grid8(const Q* g0, const Q* g1, float db, uint32_t signs, float* out) {
#if MS_AVX2
  if constexpr (SIMD) {
    const __m128i raw = _mm_set_epi32(0, 0, int(ld32(g1)), int(ld32(g0)));
    const __m256i q = std::is_signed<Q>::value ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
    _mm256_storeu_ps(out, negate_by_bits(_mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(q)), signs));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) {
    const float v = db * float(j < 4 ? g0[j] : g1[j - 4]);
    out[j] = (signs >> j) & 1 ? -v : v;
  }
}

// IQ1's delta: 0.125, negative when `neg` (bit 31 only) is set; no branch (the bit is random in the data)
static MS_INLINE float iq1_delta(uint32_t neg) {
  const uint32_t bits = 0x3E000000u | neg;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IQ1: 8 weights dl * (grid value + delta)
template <bool SIMD>
static MS_INLINE void grid8_delta(const int8_t* g, float dl, float delta, float* out) {
#if MS_AVX2
  if constexpr (SIMD) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g))));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(dl), _mm256_add_ps(q, _mm256_set1_ps(delta))));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) out[j] = dl * (float(g[j]) + delta);
}

// TQ1_0: base-3 digit k (pow = 3^k) of 8 bytes: d * ((((p * pow) mod 256) * 3 >> 8) - 1)
template <bool SIMD>
static MS_INLINE void trits8(const uint8_t* p, uint32_t pow, float d, float* out) {
#if MS_AVX2
  if constexpr (SIMD) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    q = _mm256_and_si256(_mm256_mullo_epi32(q, _mm256_set1_epi32(int(pow))), _mm256_set1_epi32(255));
    q = _mm256_srli_epi32(_mm256_add_epi32(q, _mm256_add_epi32(q, q)), 8);
    q = _mm256_sub_epi32(q, _mm256_set1_epi32(1));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) {
    const uint8_t q = uint8_t(p[j] * pow);  // mod 256: the digit becomes the leading one of a base-3 fraction
    out[j] = d * float(int((uint32_t(q) * 3) >> 8) - 1);
  }
}

// sub-block g (of `group` weights: 16 for IQ2_XS, IQ2_S, IQ1_M, else 32) of a row of these types into out
template <int T, bool SIMD>
static MS_INLINE void ggml_group_x(const uint8_t* row, int64_t g, const uint8_t* grid, float* out) {
  if constexpr (T == G_MXFP4) {
    const uint8_t* b = row + g * block_bytes<G_MXFP4>();
    const float d = e8m0_half(b[0]);
#if MS_AVX2
    if constexpr (SIMD) {  // the 16 code values as int8 through a byte shuffle
      const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)), m = _mm_set1_epi8(15);
      const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(qs, m));
      const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(qs, 4), m));
      const __m256 dv = _mm256_set1_ps(d);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int k = 0; k < 4; ++k)
        _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k]))));
      return;
    }
#endif
    for (int j = 0; j < 16; ++j) {
      out[j] = d * MXFP4_VALUES[b[1 + j] & 15];
      out[j + 16] = d * MXFP4_VALUES[b[1 + j] >> 4];
    }
  } else if constexpr (T == G_IQ2_XXS) {
    const uint8_t* b = row + (g / 8) * block_bytes<G_IQ2_XXS>();
    const int ib = int(g % 8);
    const uint32_t aux0 = ld32(b + 2 + 8 * ib), aux1 = ld32(b + 6 + 8 * ib);
    const float db = ggml_f16(b) * (0.5f + float(aux1 >> 28)) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      const uint8_t* gr = grid + 8 * ((aux0 >> (8 * l)) & 255);
      grid8<SIMD>(gr, gr + 4, db, ksign((aux1 >> (7 * l)) & 127), out + 8 * l);
    }
  } else if constexpr (T == G_IQ2_XS || T == G_IQ2_S) {  // 16 sub-blocks of 16
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + (g / 16) * size;
    const int s = int(g % 16);
    const float db = ggml_f16(b) * (0.5f + float((b[size - 8 + s / 2] >> (4 * (s % 2))) & 15)) * 0.25f;
    for (int l = 0; l < 2; ++l) {
      const int k = 2 * s + l;
      if constexpr (T == G_IQ2_XS) {
        const uint32_t q = ld16(b + 2 + 2 * k);
        const uint8_t* gr = grid + 8 * (q & 511);
        grid8<SIMD>(gr, gr + 4, db, ksign(q >> 9), out + 8 * l);
      } else {
        const uint8_t* gr = grid + 8 * (b[2 + k] | (((b[66 + k / 4] >> (2 * (k % 4))) & 3u) << 8));
        grid8<SIMD>(gr, gr + 4, db, b[34 + k], out + 8 * l);
      }
    }
  } else if constexpr (T == G_IQ3_XXS) {
    const uint8_t* b = row + (g / 8) * block_bytes<G_IQ3_XXS>();
    const int ib = int(g % 8);
    const uint32_t aux = ld32(b + 66 + 4 * ib);
    const float db = ggml_f16(b) * (0.5f + float(aux >> 28)) * 0.5f;
    const uint8_t* qs = b + 2 + 8 * ib;
    for (int l = 0; l < 4; ++l)
      grid8<SIMD>(grid + 4 * qs[2 * l], grid + 4 * qs[2 * l + 1], db, ksign((aux >> (7 * l)) & 127), out + 8 * l);
  } else if constexpr (T == G_IQ3_S) {
    const uint8_t* b = row + (g / 8) * block_bytes<G_IQ3_S>();
    const int ib = int(g % 8);
    const float db = ggml_f16(b) * float(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 15));
    const uint32_t qh = b[66 + ib];
    const uint8_t* qs = b + 2 + 8 * ib;
    for (int l = 0; l < 4; ++l) {
      const uint32_t i0 = qs[2 * l] | (((qh >> (2 * l)) & 1u) << 8), i1 = qs[2 * l + 1] | (((qh >> (2 * l + 1)) & 1u) << 8);
      grid8<SIMD>(grid + 4 * i0, grid + 4 * i1, db, b[74 + 4 * ib + l], out + 8 * l);
    }
  } else if constexpr (T == G_IQ1_S) {
    const int8_t* gr = reinterpret_cast<const int8_t*>(grid);
    const uint8_t* b = row + (g / 8) * block_bytes<G_IQ1_S>();
    const int ib = int(g % 8);
    const uint32_t qh = ld16(b + 34 + 2 * ib);
    const float dl = ggml_f16(b) * float(2 * ((qh >> 12) & 7) + 1), delta = iq1_delta((qh & 0x8000u) << 16);
    for (int l = 0; l < 4; ++l)
      grid8_delta<SIMD>(gr + 8 * (b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7u) << 8)), dl, delta, out + 8 * l);
  } else if constexpr (T == G_IQ1_M) {  // 16 sub-blocks of 16; d is the top nibbles of the 4 scale words
    const int8_t* gr = reinterpret_cast<const int8_t*>(grid);
    const uint8_t* b = row + (g / 16) * block_bytes<G_IQ1_M>();
    const int s = int(g % 16);
    uint64_t sc;  // the 4 scale words; word i's top nibble is bits 4 i of d
    std::memcpy(&sc, b + 48, 8);
    const uint16_t dbits = uint16_t(((sc >> 12) & 0xF) | ((sc >> 24) & 0xF0) | ((sc >> 36) & 0xF00) | ((sc >> 48) & 0xF000));
    const float dl = half_to_float(dbits) * float(2 * ((sc >> (16 * (s / 4) + 3 * (s % 4))) & 7) + 1);
    for (int l = 0; l < 2; ++l) {
      const int k = 2 * s + l;
      const uint32_t nib = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
      grid8_delta<SIMD>(gr + 8 * (b[k] | ((nib & 7) << 8)), dl, iq1_delta((nib & 8) << 28), out + 8 * l);
    }
  } else if constexpr (T == G_TQ1_0) {
    static constexpr uint32_t POW3[5] = {1, 3, 9, 27, 81};
    const uint8_t* b = row + (g / 8) * block_bytes<G_TQ1_0>();
    const int gg = int(g % 8);
    const float d = ggml_f16(b + 52);
    if (gg < 5) {  // weights 32 k + m: digit k of qs[m], m < 32
      for (int r = 0; r < 4; ++r) trits8<SIMD>(b + 8 * r, POW3[gg], d, out + 8 * r);
    } else if (gg < 7) {  // weights 160 + 16 k + m: digit k of qs[32 + m]
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 2; ++r) trits8<SIMD>(b + 32 + 8 * r, POW3[2 * (gg - 5) + h], d, out + 16 * h + 8 * r);
    } else {  // digit 4 of qs[32..48], then weights 240 + 4 k + m: digit k of qh[m]
      for (int r = 0; r < 2; ++r) trits8<SIMD>(b + 32 + 8 * r, POW3[4], d, out + 8 * r);
      for (int i = 0; i < 16; ++i) {
        const uint8_t q = uint8_t(b[48 + i % 4] * POW3[i / 4]);
        out[16 + i] = d * float(int((uint32_t(q) * 3) >> 8) - 1);
      }
    }
  } else {  // TQ2_0: 2-bit codes as Q2_K's
    const uint8_t* b = row + (g / 8) * block_bytes<G_TQ2_0>();
    const int gg = int(g % 8), shift = 2 * (gg % 4);
    const uint8_t* q = b + 32 * (gg / 4);
    const float d = ggml_f16(b + 64);
    for (int m = 0; m < 32; ++m) out[m] = d * float(int((q[m] >> shift) & 3) - 1);
  }
}

// The legacy and k-quant sub-blocks with AVX2 (8 lanes at a time; both SIMD paths), the same float operations
// as ggml_group's loops, so the same bits; the types without a SIMD form fall back to ggml_group.
#if MS_AVX2
static MS_INLINE __m256 cvt8(__m128i bytes_lo8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes_lo8)); }

// 8 lanes of bit j of the 32-bit word h, for lanes j = j0..j0+7, as 0 or 16
static MS_INLINE __m256i bit4(uint32_t h, int j0) {
  const __m256i sh = _mm256_setr_epi32(j0, j0 + 1, j0 + 2, j0 + 3, j0 + 4, j0 + 5, j0 + 6, j0 + 7);
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(h)), sh), _mm256_set1_epi32(1)), 4);
}
#endif

template <int T, bool SIMD>
static MS_INLINE void ggml_group_s(const uint8_t* row, int64_t g, float* out) {
#if MS_AVX2
  if constexpr (SIMD && (T == G_Q4_0 || T == G_Q4_1 || T == G_Q8_0 || T == G_Q5_0 || T == G_Q5_1)) {
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + g * size;
    const __m256 d = _mm256_set1_ps(ggml_f16(b));
    if constexpr (T == G_Q8_0) {
      for (int k = 0; k < 4; ++k) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k)));
        _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
      }
      return;
    } else {
      constexpr int qo = T == G_Q4_0 ? 2 : T == G_Q4_1 ? 4 : T == G_Q5_0 ? 6 : 8;  // where the nibbles start
      const uint8_t* qs = b + qo;
      const __m256i m15 = _mm256_set1_epi32(15);
      uint32_t qh = 0;
      if constexpr (T == G_Q5_0 || T == G_Q5_1) std::memcpy(&qh, b + qo - 4, 4);
      const __m256 m = T == G_Q4_1 || T == G_Q5_1 ? _mm256_set1_ps(ggml_f16(b + 2)) : _mm256_setzero_ps();
      for (int k = 0; k < 2; ++k) {
        const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * k)));
        __m256i lo = _mm256_and_si256(raw, m15), hi = _mm256_srli_epi32(raw, 4);
        if constexpr (T == G_Q5_0 || T == G_Q5_1) {
          lo = _mm256_or_si256(lo, bit4(qh, 8 * k));
          hi = _mm256_or_si256(hi, bit4(qh, 16 + 8 * k));
        }
        if constexpr (T == G_Q4_0 || T == G_Q5_0) {
          const __m256i off = _mm256_set1_epi32(T == G_Q4_0 ? 8 : 16);
          _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, off))));
          _mm256_storeu_ps(out + 16 + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, off))));
        } else {
          _mm256_storeu_ps(out + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), m));
          _mm256_storeu_ps(out + 16 + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)), m));
        }
      }
      return;
    }
  }
  if constexpr (SIMD && (T == G_Q4_K || T == G_Q5_K)) {
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + (g / 8) * size;
    const int s = int(g % 8);
    int scale, mn;
    k4_scale_min(b + 4, s, scale, mn);
    const __m256 dl = _mm256_set1_ps(ggml_f16(b) * float(scale)), ml = _mm256_set1_ps(ggml_f16(b + 2) * float(mn));
    const uint8_t* qs = b + (T == G_Q4_K ? 16 : 48) + (s / 2) * 32;
    const __m256i m15 = _mm256_set1_epi32(15);
    for (int k = 0; k < 4; ++k) {
      const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * k)));
      __m256i q = s % 2 ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, m15);
      if constexpr (T == G_Q5_K) {
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * k)));
        q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, s), _mm256_set1_epi32(1)), 4));
      }
      _mm256_storeu_ps(out + 8 * k, _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(q)), ml));
    }
    return;
  }
  if constexpr (SIMD && (T == G_Q6_K || T == G_Q2_K || T == G_Q3_K)) {
    constexpr int64_t size = block_bytes<T>();
    const uint8_t* b = row + (g / 16) * size;
    const int s = int(g % 16);
    const __m256i m3 = _mm256_set1_epi32(3);
    if constexpr (T == G_Q6_K) {
      const __m256 dl = _mm256_set1_ps(ggml_f16(b + 208) * float(int8_t(b[192 + s])));
      const int n = s / 8, k = (s % 8) / 2, l0 = (s % 2) * 16;
      const uint8_t* ql = b + n * 64 + (k % 2) * 32 + l0;
      const uint8_t* qh = b + 128 + n * 32 + l0;
      for (int j = 0; j < 2; ++j) {
        const __m256i lraw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + 8 * j)));
        const __m256i hraw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh + 8 * j)));
        const __m256i low = k < 2 ? _mm256_and_si256(lraw, _mm256_set1_epi32(15)) : _mm256_srli_epi32(lraw, 4);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(hraw, 2 * k), m3);
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
        _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(dl, _mm256_cvtepi32_ps(q)));
      }
      return;
    } else {
      const int n = s / 8, shift = 2 * ((s % 8) / 2), l0 = (s % 2) * 16;
      const uint8_t* q = b + (T == G_Q2_K ? 16 : 32) + n * 32 + l0;
      if constexpr (T == G_Q2_K) {
        const __m256 dl = _mm256_set1_ps(ggml_f16(b + 80) * float(b[s] & 15));
        const __m256 ml = _mm256_set1_ps(ggml_f16(b + 82) * float(b[s] >> 4));
        for (int j = 0; j < 2; ++j) {
          const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)));
          const __m256i c = _mm256_and_si256(_mm256_srli_epi32(raw, shift), m3);
          _mm256_storeu_ps(out + 8 * j, _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(c)), ml));
        }
      } else {
        const uint8_t* sc = b + 96;
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const __m256 dl = _mm256_set1_ps(ggml_f16(b + 108) * float(int(int8_t(uint8_t(low | (high << 4)))) - 32));
        const uint8_t* hm = b + l0;
        for (int j = 0; j < 2; ++j) {
          const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)));
          const __m256i hraw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hm + 8 * j)));
          const __m256i hb = _mm256_and_si256(_mm256_srli_epi32(hraw, s / 2), _mm256_set1_epi32(1));
          // (bit set ? 0 : 4) = 4 - 4 * bit
          const __m256i c = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(raw, shift), m3),
                                             _mm256_sub_epi32(_mm256_set1_epi32(4), _mm256_slli_epi32(hb, 2)));
          _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(dl, _mm256_cvtepi32_ps(c)));
        }
      }
      return;
    }
  }
#endif
  ggml_group<T>(row, g, out);
}

// ggml types a SIMD arch decodes straight into registers (A::dq_nibbles, dq_q6, dq_i8: the same float operations
// as ggml_group's loops); the others go through a sub-block buffer
template <int T>
constexpr bool ggml_direct() { return T == G_Q4_K || T == G_Q6_K || T == G_Q8_0; }

template <class A, int T>
struct DecG {
  using V = typename A::V;
  static constexpr bool DIRECT = A::SIMD && ggml_direct<T>();
  const Lin& L;
  struct Row {
    const uint8_t* p;
    int64_t g0;  // first vector of the buffered group
    const uint8_t* q;   // direct: the sub-block's codes (Q6_K: its low bits)
    const uint8_t* qh;  // direct Q6_K: its high bits
    float dl, ml;       // direct: the sub-block's scale and min
    int sel;            // direct: which nibble (Q4_K), which bit pair (Q6_K)
    alignas(64) float w[32];
  };
  int64_t group_bytes;  // stored bytes per sub-block (about: the block's header is spread over its sub-blocks)
  int64_t ahead;        // prefetch_distance
  explicit DecG(const Lin& l)
      : L(l), group_bytes(l.row_bytes * l.group / std::max<int64_t>(1, l.in)), ahead(prefetch_distance(l, A::R1)) {}
  MS_INLINE void start(Row& r, int64_t row) const { r.p = L.w + L.stored(row) * L.row_bytes; }
  MS_INLINE void prefetch(const Row& r, int64_t g) const { prefetch_ahead(r.p + g * group_bytes, ahead); }
  MS_INLINE void group(Row& r, int64_t g) const {
    r.g0 = g * (L.group / A::W);
    if constexpr (DIRECT && T == G_Q4_K) {
      const uint8_t* b = r.p + (g / 8) * block_bytes<G_Q4_K>();
      const int s = int(g % 8);
      int scale, mn;
      k4_scale_min(b + 4, s, scale, mn);
      r.dl = ggml_f16(b) * float(scale);
      r.ml = ggml_f16(b + 2) * float(mn);
      r.q = b + 16 + (s / 2) * 32;
      r.sel = s % 2;
    } else if constexpr (DIRECT && T == G_Q6_K) {
      const uint8_t* b = r.p + (g / 16) * block_bytes<G_Q6_K>();
      const int s = int(g % 16);
      r.dl = ggml_f16(b + 208) * float(int8_t(b[192 + s]));
      const int n = s / 8, k = (s % 8) / 2, l0 = (s % 2) * 16;
      r.q = b + n * 64 + (k % 2) * 32 + l0;
      r.qh = b + 128 + n * 32 + l0;
      r.sel = k;
    } else if constexpr (DIRECT && T == G_Q8_0) {
      const uint8_t* b = r.p + g * block_bytes<G_Q8_0>();
      r.dl = ggml_f16(b);
      r.q = b + 2;
    } else if constexpr (T >= G_MXFP4) {
      ggml_group_x<T, A::SIMD>(r.p, g, L.s, r.w);
    } else {
      ggml_group_s<T, A::SIMD>(r.p, g, r.w);
    }
  }
  MS_INLINE V load(const Row& r, int64_t v) const {
    if constexpr (DIRECT && T == G_Q4_K) return A::dq_nibbles(r.q + 16 * (v - r.g0), r.sel, r.dl, r.ml);
    else if constexpr (DIRECT && T == G_Q6_K) return A::dq_q6(r.q, r.sel, r.qh, r.dl);
    else if constexpr (DIRECT && T == G_Q8_0) return A::dq_i8(r.q + 16 * (v - r.g0), r.dl);
    else return A::loadu(r.w + (v - r.g0) * A::W);
  }
};


// ---------------------------------------------------------------------------------------
// The canonical exp: n = floor(x log2 e + 1/2), r = x - n ln 2 (two fma steps), a degree-6 polynomial
// in r by Horner's rule in fma, times 2^n through the exponent bits. Every operation is exactly
// rounded IEEE arithmetic, so a compiler vectorizing it keeps its bits: the same on every path and
// machine. Relative error under 2 ulp on [-87.3, 88.7]; below that 0, above it +inf; NaN stays NaN.
static MS_INLINE float exp_c(float x) {
  const float hi = 88.72283f, lo = -87.33654f;
  const bool nan = x != x, over = x > hi, under = x < lo;
  float xc = over ? hi : (under ? lo : (nan ? 0.0f : x));
  const float n = std::floor(std::fma(xc, 1.44269504088896341f, 0.5f));
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r);
  p = p + 1.0f;
  // 2^n in two factors (n down to -126 and up to 128 stay normal: 2^(n/2) twice)
  const int ni = int(n);
  const int a = ni / 2, b = ni - a;
  uint32_t ua = uint32_t(a + 127) << 23, ub = uint32_t(b + 127) << 23;
  float fa, fb;
  std::memcpy(&fa, &ua, 4);
  std::memcpy(&fb, &ub, 4);
  float y = p * fa * fb;
  if (over) y = std::numeric_limits<float>::infinity();
  if (under) y = 0.0f;
  if (nan) y = x;
  return y;
}

// float32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as PyTorch's .to(torch.bfloat16)
static MS_INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static MS_INLINE float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> fp16 bits, round to nearest even (exact in every case, as _cvtss_sh)
static MS_INLINE uint16_t to_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  // through c10_half_round's value, then the bit pattern
  const float r = c10_half_round(f);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
  if (a >= 0x38800000u) return uint16_t(sign | (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3ffu));
  return uint16_t(sign | uint32_t(std::fabs(r) * 16777216.0f));  // subnormal: multiples of 2^-24
#endif
}

// the float32 whose bits are the low 32 bits of an argument field (the C API passes floats so)
static MS_INLINE float f32_bits(int64_t field) {
  const uint32_t u = uint32_t(uint64_t(field) & 0xffffffffu);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// a buffer argument as T: the C API passes every buffer as const void*, the ones written included
template <class T>
static MS_INLINE const T* in_arg(const void* p) {
  return static_cast<const T*>(p);
}
template <class T>
static MS_INLINE T* out_arg(const void* p) {
  return static_cast<T*>(const_cast<void*>(p));
}

// value v (float32) stored as dtype dt at p[i]
static MS_INLINE void st_dt(uint8_t* p, int dt, int64_t i, float v) {
  if (dt == F32) {
    std::memcpy(p + 4 * i, &v, 4);
  } else {
    const uint16_t h = dt == BF16 ? to_bf16(v) : to_f16(v);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

// a[0..N) summed in place by kernels.h's tree: (i, i+N/2), then ..., (i, i+1)
template <int N>
static MS_INLINE float tree_sum(float* a) {
  for (int h = N / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) a[i] = a[i] + a[i + h];
  return a[0];
}

// ---------------------------------------------------------------------------------------
// The dot engine (kernels.h): one 16-lane accumulator per (row, token), vectors in order, one tree.

// One vector v of R rows times T tokens into the accumulators.
template <class A, class D, int R, int T>
static MS_INLINE void fma_step(const D& dec, const typename D::Row (&st)[R], int64_t v, const float* x, int64_t ldx,
                               typename A::V (&acc)[R][T]) {
  using V = typename A::V;
  MS_UNROLL
  for (int r = 0; r < R; ++r) {
    const V w = dec.load(st[r], v);
    MS_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = A::fma(w, A::loadu(x + t * ldx + v * 16), acc[r][t]);
  }
}

// R rows x T tokens straight from the stored codes (the one-token path): x [T, ldx], vpg vectors per group.
template <class A, class D, int R, int T>
static MS_NOINLINE void dot_rows(const D& dec, int64_t row, const float* x, int64_t ldx, int64_t nvec, int64_t vpg, float* y,
                     int64_t ldy) {
  using V = typename A::V;
  V acc[R][T];
  typename D::Row st[R];
  MS_UNROLL
  for (int r = 0; r < R; ++r) {
    dec.start(st[r], row + r);
    MS_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = A::zero();
  }
  for (int64_t v = 0, g = 0; v < nvec; ++g) {
    MS_UNROLL
    for (int r = 0; r < R; ++r) {
      dec.prefetch(st[r], g);
      dec.group(st[r], g);
    }
    const int64_t end = std::min(nvec, v + vpg);
    for (; v + 1 < end; v += 2) {
      fma_step<A, D, R, T>(dec, st, v, x, ldx, acc);
      fma_step<A, D, R, T>(dec, st, v + 1, x, ldx, acc);
    }
    if (v < end) fma_step<A, D, R, T>(dec, st, v++, x, ldx, acc);
  }
  MS_UNROLL
  for (int r = 0; r < R; ++r)
    MS_UNROLL
    for (int t = 0; t < T; ++t) y[t * ldy + row + r] = A::hsum(acc[r][t]);
}

// Vectors [v0, v1) of row `row` decoded into buf: the vectors dot_rows multiplies (buf[(v - v0) * 16 ...]).
template <class A, class D>
static MS_NOINLINE void decode_row(const D& dec, int64_t row, int64_t v0, int64_t v1, int64_t vpg, float* buf) {
  typename D::Row st;
  dec.start(st, row);
  for (int64_t v = v0, g = v0 / vpg; v < v1; ++g) {
    dec.prefetch(st, g);
    dec.group(st, g);
    const int64_t end = std::min(v1, (g + 1) * vpg);
    for (; v < end; ++v) A::storeu(buf + (v - v0) * 16, dec.load(st, v));
  }
}

// R decoded rows (buf [R][ldb], vectors v0.. of each) x T tokens (x [T][ldx]) over vectors [v0, v1), continuing
// the accumulators parked in acc [R][T] (the same chains as one pass over every vector: chunking the reduction
// keeps the order).
template <class A, int R, int T>
static MS_NOINLINE void tile(const float* buf, int64_t ldb, const float* x, int64_t ldx, int64_t v0, int64_t v1,
                             float* acc_park) {
  using V = typename A::V;
  V acc[R][T];
  MS_UNROLL
  for (int r = 0; r < R; ++r)
    MS_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = A::loadu(acc_park + 16 * (r * T + t));
  for (int64_t v = v0; v < v1; ++v) {
    V xv[T];
    MS_UNROLL
    for (int t = 0; t < T; ++t) {
      xv[t] = A::loadu(x + t * ldx + v * 16);
      A::keep(xv[t]);
    }
    MS_UNROLL
    for (int r = 0; r < R; ++r) {
      const V w = A::loadu(buf + r * ldb + (v - v0) * 16);
      MS_UNROLL
      for (int t = 0; t < T; ++t) acc[r][t] = A::fma(w, xv[t], acc[r][t]);
    }
  }
  MS_UNROLL
  for (int r = 0; r < R; ++r)
    MS_UNROLL
    for (int t = 0; t < T; ++t) A::storeu(acc_park + 16 * (r * T + t), acc[r][t]);
}

// A token block of the many-token path: R rows x T tokens over one chunk of vectors.
template <class A, int R>
static void tile_chunk(const float* buf, int64_t ldb, const float* x, int64_t ldx, int64_t nt, int64_t v0, int64_t v1,
                       float* park) {
  switch (nt) {
    case 1: return tile<A, R, 1>(buf, ldb, x, ldx, v0, v1, park);
    case 2: return tile<A, R, 2>(buf, ldb, x, ldx, v0, v1, park);
    case 3: return tile<A, R, 3>(buf, ldb, x, ldx, v0, v1, park);
    case 4: if constexpr (A::TT >= 4) return tile<A, R, 4>(buf, ldb, x, ldx, v0, v1, park); break;
    case 5: if constexpr (A::TT >= 5) return tile<A, R, 5>(buf, ldb, x, ldx, v0, v1, park); break;
    default: break;
  }
}

template <class A>
static void tile_rows(const float* buf, int64_t ldb, int64_t m, const float* x, int64_t ldx, int64_t nt, int64_t v0,
                      int64_t v1, float* park) {
  static_assert(RB == 4, "tile_rows covers 1 to 4 rows");
  switch (m) {
    case 4: return tile_chunk<A, 4>(buf, ldb, x, ldx, nt, v0, v1, park);
    case 3: return tile_chunk<A, 3>(buf, ldb, x, ldx, nt, v0, v1, park);
    case 2: return tile_chunk<A, 2>(buf, ldb, x, ldx, nt, v0, v1, park);
    default: return tile_chunk<A, 1>(buf, ldb, x, ldx, nt, v0, v1, park);
  }
}

// Whether decoder D decodes at a cost of its own (the ggml blocks): the many-token path then decodes rows once.
template <class D, class = void>
struct Costly : std::false_type {};
template <class D>
struct Costly<D, std::void_t<decltype(D::COSTLY)>> : std::bool_constant<D::COSTLY> {};
template <class D>
constexpr bool costly() { return Costly<D>::value; }

// Vectors per chunk of the many-token path: RB rows of them decoded (8 KiB) and a token block's x (10 KiB at
// 5 tokens) stay in L1 while every token block passes over them.
constexpr int64_t CHUNK_VECTORS = 32;

// Rows [r0, r1) for n tokens of one decoder, n > 1: up to A::TD tokens straight from the codes (dot_rows), more
// through RB decoded rows per chunk of the reduction.
template <class A, class D>
static void rows_many(const D& dec, const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1,
                      float* y, int64_t ldy, int64_t nvec, int64_t vpg) {
  if (n <= (costly<D>() ? 1 : A::TD)) {
    for (int64_t r = r0; r < r1;) {
      const int64_t left = r1 - r;
      const bool two = A::RT > 1 && left >= 2;
      switch (n) {
        case 2: two ? dot_rows<A, D, A::RT, 2>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 2>(dec, r, x, ldx, nvec, vpg, y, ldy); break;
        case 3: two ? dot_rows<A, D, A::RT, 3>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 3>(dec, r, x, ldx, nvec, vpg, y, ldy); break;
        case 4: two ? dot_rows<A, D, A::RT, 4>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 4>(dec, r, x, ldx, nvec, vpg, y, ldy); break;
        default:
          if constexpr (A::TD >= 8) {
            if (n == 5) { two ? dot_rows<A, D, A::RT, 5>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 5>(dec, r, x, ldx, nvec, vpg, y, ldy); break; }
            if (n == 6) { two ? dot_rows<A, D, A::RT, 6>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 6>(dec, r, x, ldx, nvec, vpg, y, ldy); break; }
            if (n == 7) { two ? dot_rows<A, D, A::RT, 7>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 7>(dec, r, x, ldx, nvec, vpg, y, ldy); break; }
            two ? dot_rows<A, D, A::RT, 8>(dec, r, x, ldx, nvec, vpg, y, ldy) : dot_rows<A, D, 1, 8>(dec, r, x, ldx, nvec, vpg, y, ldy);
          }
          break;
      }
      r += two ? A::RT : 1;
    }
    return;
  }
  constexpr int TT = A::TT;
  thread_local std::vector<float> buf, park;  // park: the accumulators, 16 floats each, between chunks
  const int64_t ldb = CHUNK_VECTORS * 16;
  if (buf.size() < size_t(RB * ldb)) buf.resize(size_t(RB * ldb));
  const int64_t blocks = (n + TT - 1) / TT;
  if (park.size() < size_t(blocks * RB * TT * 16)) park.resize(size_t(blocks * RB * TT * 16));
  for (int64_t r = r0; r < r1; r += RB) {
    const int64_t m = std::min<int64_t>(RB, r1 - r);
    std::fill(park.begin(), park.end(), 0.0f);
    for (int64_t v0 = 0; v0 < nvec; v0 += CHUNK_VECTORS) {
      const int64_t v1 = std::min(nvec, v0 + CHUNK_VECTORS);
      for (int64_t i = 0; i < m; ++i) decode_row<A, D>(dec, r + i, v0, v1, vpg, buf.data() + i * ldb);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t = b * TT, nt = std::min<int64_t>(TT, n - t);
        tile_rows<A>(buf.data(), ldb, m, x + t * ldx, ldx, nt, v0, v1, park.data() + b * RB * TT * 16);
      }
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t t0 = b * TT, nt = std::min<int64_t>(TT, n - t0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t t = 0; t < nt; ++t)
          y[(t0 + t) * ldy + r + i] = A::hsum(A::loadu(park.data() + 16 * (b * RB * TT + i * nt + t)));
    }
  }
}

// Output rows [r0, r1) of y [n, ldy] for n tokens x [n, ldx] through decoder dec.
template <class A, class D>
static void rows_with(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                      int64_t ldy) {
  const D dec(L);
  const int64_t nvec = L.in16() / 16;
  const int64_t vpg = L.kind == FLOAT ? nvec : L.group / 16;
  if (n == 1) {  // weights decoded in registers
    int64_t r = r0;
    for (; r + A::R1 <= r1; r += A::R1) dot_rows<A, D, A::R1, 1>(dec, r, x, ldx, nvec, vpg, y, ldy);
    for (; r < r1; ++r) dot_rows<A, D, 1, 1>(dec, r, x, ldx, nvec, vpg, y, ldy);
    return;
  }
  rows_many<A, D>(dec, L, x, ldx, n, r0, r1, y, ldy, nvec, vpg);
}

// Weights stored input-major ([in, stored columns], kind FLOAT_T: y = x @ W): columns [c0, c1) of y for
// n tokens; each output one fma chain over the inputs in order. RC vectors of 16 columns x T tokens.
template <class A, int RC, int T>
static MS_NOINLINE void cols_tile(const Lin& L, const float* x, int64_t ldx, int64_t c, int64_t ncols, float* y, int64_t ldy) {
  using V = typename A::V;
  V acc[RC][T];
  MS_UNROLL
  for (int j = 0; j < RC; ++j)
    MS_UNROLL
    for (int t = 0; t < T; ++t) acc[j][t] = A::zero();
  const int64_t col = L.row0 + c;
  for (int64_t i = 0; i < L.in; ++i) {
    const uint8_t* wr = L.w + i * L.row_bytes;
    MS_UNROLL
    for (int j = 0; j < RC; ++j) {
      const int64_t c0 = col + 16 * j, left = std::max<int64_t>(0, std::min<int64_t>(16, ncols - 16 * j));
      const V w = A::load_dt(wr, L.bits, c0, left);
      MS_UNROLL
      for (int t = 0; t < T; ++t) acc[j][t] = A::fma(w, A::set1(x[t * ldx + i]), acc[j][t]);
    }
  }
  MS_UNROLL
  for (int j = 0; j < RC; ++j) {
    const int64_t left = std::min<int64_t>(16, ncols - 16 * j);
    if (left <= 0) break;
    MS_UNROLL
    for (int t = 0; t < T; ++t) A::store_part(y + t * ldy + c + 16 * j, acc[j][t], left);
  }
}

template <class A>
static void cols_range(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t c0, int64_t c1, float* y,
                       int64_t ldy) {
  constexpr int RC = 2, T = 4;
  for (int64_t t = 0; t < n; t += T) {
    const int64_t nt = std::min<int64_t>(T, n - t);
    for (int64_t c = c0; c < c1; c += 16 * RC) {
      const int64_t ncols = std::min<int64_t>(16 * RC, c1 - c);
      const float* xt = x + t * ldx;
      float* yt = y + t * ldy;
      switch (nt) {
        case 4: cols_tile<A, RC, 4>(L, xt, ldx, c, ncols, yt, ldy); break;
        case 3: cols_tile<A, RC, 3>(L, xt, ldx, c, ncols, yt, ldy); break;
        case 2: cols_tile<A, RC, 2>(L, xt, ldx, c, ncols, yt, ldy); break;
        default: cols_tile<A, RC, 1>(L, xt, ldx, c, ncols, yt, ldy); break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dispatch by format group (one translation unit each, per path).

// q: affine, fp8, mxfp4, codebooks, float
template <class A, template <int> class D>
static void rows_q(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                   int64_t ldy) {
  switch (L.kind) {
    case AFFINE:
      if (L.bits == 4) return rows_with<A, D<K_AFFINE4>>(L, x, ldx, n, r0, r1, y, ldy);
      return rows_with<A, D<K_AFFINE>>(L, x, ldx, n, r0, r1, y, ldy);
    case FP8: return rows_with<A, D<K_FP8>>(L, x, ldx, n, r0, r1, y, ldy);
    case MXFP4: return rows_with<A, D<K_MXFP4>>(L, x, ldx, n, r0, r1, y, ldy);
    case FLOAT: return rows_with<A, D<K_FLOAT>>(L, x, ldx, n, r0, r1, y, ldy);
    case FLOAT_T: return cols_range<A>(L, x, ldx, n, r0, r1, y, ldy);
    default:
      if (L.pack == TEN3) return rows_with<A, D<K_CB3>>(L, x, ldx, n, r0, r1, y, ldy);
      if (L.pack == TRITS) return rows_with<A, D<K_TRIT>>(L, x, ldx, n, r0, r1, y, ldy);
      return rows_with<A, D<K_CB>>(L, x, ldx, n, r0, r1, y, ldy);
  }
}

// rows_with for the ggml type among Ids that L.bits names; the last one stands for any other
template <class A, int Id, int... Rest>
static void rows_ggml(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                      int64_t ldy) {
  if constexpr (sizeof...(Rest) > 0) {
    if (L.bits != Id) return rows_ggml<A, Rest...>(L, x, ldx, n, r0, r1, y, ldy);
  }
  rows_with<A, DecG<A, Id>>(L, x, ldx, n, r0, r1, y, ldy);
}

// g: ggml's legacy and k-quant blocks
template <class A>
static void rows_g(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                   int64_t ldy) {
  rows_ggml<A, G_Q4_0, G_Q4_1, G_Q5_0, G_Q5_1, G_Q8_0, G_Q2_K, G_Q3_K, G_Q4_K, G_Q5_K, G_IQ4_NL, G_IQ4_XS, G_Q6_K>(
      L, x, ldx, n, r0, r1, y, ldy);
}

// x: ggml's MXFP4, IQ1-IQ3 and TQ blocks
template <class A>
static void rows_x(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                   int64_t ldy) {
  rows_ggml<A, G_MXFP4, G_IQ2_XXS, G_IQ2_XS, G_IQ2_S, G_IQ3_XXS, G_IQ3_S, G_IQ1_S, G_IQ1_M, G_TQ1_0, G_TQ2_0>(
      L, x, ldx, n, r0, r1, y, ldy);
}

}  // namespace ms
