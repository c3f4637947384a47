// The q8 activation mode's kernels (q8.h): the activation quantizers (one scalar form, shared by every path)
// and the integer dot products of Q4_K, Q5_K, Q6_K (Q8_K activations), Q8_0, Q4_0, Q5_0 and IQ4_NL (Q8_0
// activations) weights on the portable, AVX2 and AVX-512 paths.
#include "q8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "arch_avx512.h"
#include "engine.h"

namespace ms {

int q8_type_of(const Lin& L) {
  if (L.kind == AFFINE) {  // 4- and 8-bit codes, whole 64-value chunks, no input rotation
    // groups of 32 or of whole 64-value chunks (a chunk's lanes take one scale, or its two blocks' two)
    if (L.act != ACT_Q8 || (L.bits != 4 && L.bits != 8) || L.in % 64 || (L.group != 32 && L.group % 64) ||
        L.group < 32 || L.in % L.group || L.rot_b)
      return Q8_NONE;
    return (L.bits == 4 ? Q8_A4 : Q8_A8) | int(L.group << 4);
  }
  const GgmlTraits* t = L.kind == GGML && L.act == ACT_Q8 ? ggml_traits(L.bits) : nullptr;
  if (t == nullptr || t->q8 == Q8_NONE) return Q8_NONE;
  return L.in % (t->q8 == Q8_KB ? 256 : 32) ? Q8_NONE : t->q8;
}

// float32 group sums an affine row keeps: a multiple of 16 (the kernels read 16 at a time)
static int64_t affine_sums(int type, int64_t in) { return (in / q8_group(type) + 15) / 16 * 16; }

int64_t q8_stride(int type, int64_t in) {
  if (q8_affine(type)) return (2 * in + 4 * affine_sums(type, in) + 63) / 64 * 64;
  const int64_t nb = type == Q8_KB ? in / 256 : in / 32;
  const int64_t sums = type == Q8_KB ? 2 * (in / 16) : 4 * nb;
  return (in + 4 * nb + sums + 64 + 63) / 64 * 64;  // 64 spare bytes: a last half chunk's vector load
}

// ggml's nearest_int: round half to even through the float32 add of 1.5 * 2^23 (|v| < 2^22)
static inline int nearest(float v) {
  const float m = v + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &m, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// An affine type's rows (q8.h): blocks of 32, d = amax / 127 in float32 (no fp16 rounding: nothing to match)
static void quantize_affine(int type, const float* x, int64_t ldx, int64_t n, int64_t in, Q8Rows& out) {
  const int64_t nb = in / 32, G = q8_group(type), ng = in / G;
  const bool four = q8_base(type) == Q8_A4;
  std::vector<float> bd(static_cast<size_t>(nb)), e(static_cast<size_t>(nb));  // per block: d, d x code sum
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * ldx;
    uint8_t* r = out.row(t);
    int8_t* q = reinterpret_cast<int8_t*>(r);
    float* dexp = reinterpret_cast<float*>(r + in);
    float* sums = reinterpret_cast<float*>(r + 2 * in);
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xt + 32 * b;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const bool tiny = std::isinf(id);  // amax < 127 / FLT_MAX: x * id would be +-inf, so x / amax first
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) {
        const int v = std::max(-127, std::min(127, nearest(tiny ? xb[j] / amax * 127.0f : xb[j] * id)));
        const int64_t i = 32 * b + j, c = i / 64, k = i % 64;
        q[four ? 64 * c + (k % 2) * 32 + k / 2 : i] = int8_t(v);
        s += v;
      }
      bd[size_t(b)] = amax / 127.0f;
      e[size_t(b)] = bd[size_t(b)] * float(s);
    }
    for (int64_t c = 0; c < in / 64; ++c)
      for (int l = 0; l < 16; ++l) dexp[16 * c + l] = bd[size_t(2 * c + (four ? (l / 4) % 2 : l / 8))];
    for (int64_t g = 0; g < ng; ++g) {
      float a = 0.0f;
      for (int64_t b = g * G / 32; b < (g + 1) * G / 32; ++b) a += e[size_t(b)];
      sums[g] = a;
    }
  }
}

void q8_quantize(int type, const float* x, int64_t ldx, int64_t n, int64_t in, Q8Rows& out) {
  out.type = type;
  out.in = in;
  out.n = n;
  out.stride = q8_stride(type, in);
  out.data.assign(size_t(n * out.stride), 0);
  if (q8_affine(type)) return quantize_affine(type, x, ldx, n, in, out);
  const int64_t B = type == Q8_KB ? 256 : 32, nb = in / B;
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * ldx;
    uint8_t* r = out.row(t);
    int8_t* q = reinterpret_cast<int8_t*>(r);
    float* d = reinterpret_cast<float*>(r + in);
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xt + b * B;
      int8_t* qb = q + b * B;
      if (type == Q8_KB) {
        float amax = 0.0f, mx = 0.0f;
        for (int64_t j = 0; j < B; ++j) {
          const float a = std::fabs(xb[j]);
          if (a > amax) amax = a, mx = xb[j];
        }
        int16_t* bs = reinterpret_cast<int16_t*>(r + in + 4 * nb) + b * 16;
        if (amax == 0.0f) {  // codes, sums and scale stay 0
          d[b] = 0.0f;
          continue;
        }
        const float iscale = -127.0f / mx;
        for (int64_t j = 0; j < B; ++j) qb[j] = int8_t(std::min(127, nearest(iscale * xb[j])));
        for (int k = 0; k < 16; ++k) {
          int s = 0;
          for (int j = 0; j < 16; ++j) s += qb[16 * k + j];
          bs[k] = int16_t(s);
        }
        d[b] = 1.0f / iscale;
      } else {
        float amax = 0.0f;
        for (int64_t j = 0; j < B; ++j) amax = std::max(amax, std::fabs(xb[j]));
        d[b] = half_to_float(to_f16(amax / 127.0f));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int64_t j = 0; j < B; ++j) {
          qb[j] = int8_t(std::max(-128, std::min(127, nearest(xb[j] * id))));
          s += qb[j];
        }
        reinterpret_cast<int32_t*>(r + in + 4 * nb)[b] = s;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Weight blocks: ggml-common.h layouts (moestream/quant/ggml.py), the scale decoding of ggml_group (engine.h),
// the block sizes of traits.h.

// how far ahead the SIMD paths prefetch the next rows' bytes (the rows are read one after another)
constexpr int64_t Q8_AHEAD_ROWS = 4;

// The unsigned codes of chunk j (values 64j..64j+63) of a K-quant block, and the scale of each 4-value
// group g (lane g % 16 of chunk g / 16); for the portable path (the SIMD paths decode the same in registers).
template <int T>
static void kblock_codes(const uint8_t* b, uint8_t* w, int16_t* scale4) {
  if constexpr (T == G_Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int n = 0; n < 2; ++n)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[64 * n + l], c = ql[64 * n + 32 + l], h = qh[32 * n + l];
        w[128 * n + l] = uint8_t((a & 15) | ((h & 3) << 4));
        w[128 * n + 32 + l] = uint8_t((c & 15) | (((h >> 2) & 3) << 4));
        w[128 * n + 64 + l] = uint8_t((a >> 4) | (((h >> 4) & 3) << 4));
        w[128 * n + 96 + l] = uint8_t((c >> 4) | (((h >> 6) & 3) << 4));
      }
    for (int g = 0; g < 64; ++g) scale4[g] = int8_t(b[192 + g / 4]);
  } else {
    const uint8_t* qs = b + (T == G_Q4_K ? 16 : 48);
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
        if constexpr (T == G_Q5_K) {
          lo |= ((b[16 + l] >> (2 * j)) & 1) << 4;
          hi |= ((b[16 + l] >> (2 * j + 1)) & 1) << 4;
        }
        w[64 * j + l] = uint8_t(lo);
        w[64 * j + 32 + l] = uint8_t(hi);
      }
    for (int g = 0; g < 64; ++g) {
      int s, m;
      k4_scale_min(b + 4, g / 8, s, m);
      scale4[g] = int16_t(s);
    }
  }
}

// The block's integer offsets for token activations (block b's 16-sums bsums), in 8 lanes: lane i the pair of
// 16-sums 2i, 2i+1. Q4_K/Q5_K: min of sub-block i times its 32-sum; Q6_K: 32 x (scale 2i x sum 2i + scale 2i+1
// x sum 2i+1) (the codes are stored + 32)
template <int T>
static MS_INLINE void kblock_offsets(const uint8_t* b, const int16_t* bsums, int32_t* off) {
  for (int i = 0; i < 8; ++i) {
    if constexpr (T == G_Q6_K) {
      off[i] = 32 * (int32_t(int8_t(b[192 + 2 * i])) * bsums[2 * i] + int32_t(int8_t(b[193 + 2 * i])) * bsums[2 * i + 1]);
    } else {
      int sc, m;
      k4_scale_min(b + 4, i, sc, m);
      off[i] = m * bsums[2 * i] + m * bsums[2 * i + 1];
    }
  }
}

template <int T>
static MS_INLINE void kblock_d(const uint8_t* b, float& d, float& dm) {
  if constexpr (T == G_Q6_K) {
    d = ggml_f16(b + 208);
    dm = d;
  } else {
    d = ggml_f16(b);
    dm = ggml_f16(b + 2);
  }
}


// ---- portable ----------------------------------------------------------------------------------------------

// y[t * ldy + r] = dot(row r's bytes, token t's quantized row, token t's block scales) for the rows [r0, r1)
template <class Dot>
static MS_INLINE void portable_rows(const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy,
                                    Dot dot) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = L.w + L.stored(r) * L.row_bytes;
    for (int64_t t = 0; t < xa.n; ++t) {
      const uint8_t* xr = xa.row(t);
      y[t * ldy + r] = dot(row, xr, reinterpret_cast<const float*>(xr + L.in));
    }
  }
}

template <int T>
static void krows_portable(const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const int64_t nb = L.in / 256, in = L.in;
  portable_rows(L, xa, r0, r1, y, ldy, [nb, in](const uint8_t* row, const uint8_t* xr, const float* dx) {
    uint8_t w[256];
    int16_t s4[64];
    const int16_t* bs = reinterpret_cast<const int16_t*>(xr + in + 4 * nb);
    float acc[16] = {0}, m[8] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * block_bytes<T>();
      kblock_codes<T>(blk, w, s4);
      const int8_t* xq = reinterpret_cast<const int8_t*>(xr) + 256 * b;
      int32_t isum[16] = {0};
      for (int g = 0; g < 64; ++g) {
        int32_t p = 0;
        for (int i = 0; i < 4; ++i) p += int32_t(w[4 * g + i]) * xq[4 * g + i];
        isum[g % 16] += s4[g] * p;
      }
      float d, dm;
      kblock_d<T>(blk, d, dm);
      const float dd = d * dx[b], ddm = dm * dx[b];
      for (int l = 0; l < 16; ++l) acc[l] = std::fma(float(isum[l]), dd, acc[l]);
      int32_t off[8];
      kblock_offsets<T>(blk, bs + 16 * b, off);
      for (int i = 0; i < 8; ++i) m[i] = std::fma(float(off[i]), ddm, m[i]);
    }
    return tree_sum<16>(acc) - tree_sum<8>(m);  // tree_sum<8>: Arch2::hsum8
  });
}

// The 32-value types against Q8_0 activations (Q8_0, Q4_0, Q5_0, IQ4_NL): a block is a float16 scale d (first)
// and 32 signed codes, weight = d * code (ggml_group's operations)

template <int T>
static MS_INLINE void sblock_codes(const uint8_t* b, int8_t* q) {
  if constexpr (T == G_Q8_0) {
    std::memcpy(q, b + 2, 32);
  } else if constexpr (T == G_Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = int8_t(int((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      q[j + 16] = int8_t(int((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  } else {
    for (int j = 0; j < 16; ++j) {
      const int lo = b[2 + j] & 15, hi = b[2 + j] >> 4;
      q[j] = int8_t(T == G_IQ4_NL ? int(IQ4_VALUES[lo]) : lo - 8);
      q[j + 16] = int8_t(T == G_IQ4_NL ? int(IQ4_VALUES[hi]) : hi - 8);
    }
  }
}

template <int T>
static void srows_portable(const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const int64_t nb = L.in / 32;
  portable_rows(L, xa, r0, r1, y, ldy, [nb](const uint8_t* row, const uint8_t* xr, const float* dx) {
    int8_t wq[32];
    float acc[16] = {0};
    for (int64_t c = 0; c < (nb + 1) / 2; ++c) {
      for (int l = 0; l < 16; ++l) {
        const int64_t b = 2 * c + l / 8;
        int32_t p = 0;
        float dd = 0.0f;  // a missing second block: fma(0, 0, acc), as the SIMD paths' zero lanes
        if (b < nb) {
          sblock_codes<T>(row + b * block_bytes<T>(), wq);
          const int8_t* xq = reinterpret_cast<const int8_t*>(xr) + 32 * b;
          for (int i = 0; i < 4; ++i) p += int32_t(wq[4 * (l % 8) + i]) * xq[4 * (l % 8) + i];
          dd = ggml_f16(row + b * block_bytes<T>()) * dx[b];
        }
        acc[l] = std::fma(float(p), dd, acc[l]);
      }
    }
    return tree_sum<16>(acc);
  });
}

// ---- AVX2 (and the AVX-512 path's 256-bit helpers) ----------------------------------------------------------
#if MS_AVX2
static MS_INLINE __m256i nib_lo(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(15)); }
static MS_INLINE __m256i nib_hi(__m256i q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(15)); }
static MS_INLINE __m256i bits_at(__m256i q, int sh, int mask) {  // (q >> sh) & mask per byte, sh < 8
  return _mm256_and_si256(_mm256_srli_epi16(q, sh), _mm256_set1_epi8(char(mask)));
}
static MS_INLINE __m256i ld256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The two 32-value halves (unsigned codes) of chunk j of a K-quant block
template <int T>
static MS_INLINE void kchunk(const uint8_t* b, int j, __m256i& lo, __m256i& hi) {
  if constexpr (T == G_Q6_K) {
    const int n = j / 2, h = j % 2;
    const __m256i qa = ld256(b + 64 * n), qc = ld256(b + 64 * n + 32), qh = ld256(b + 128 + 32 * n);
    const __m256i a = h ? nib_hi(qa) : nib_lo(qa), c = h ? nib_hi(qc) : nib_lo(qc);
    lo = _mm256_or_si256(a, _mm256_slli_epi16(bits_at(qh, 4 * h, 3), 4));
    hi = _mm256_or_si256(c, _mm256_slli_epi16(bits_at(qh, 4 * h + 2, 3), 4));
  } else {
    const __m256i q = ld256(b + (T == G_Q4_K ? 16 : 48) + 32 * j);
    lo = nib_lo(q);
    hi = nib_hi(q);
    if constexpr (T == G_Q5_K) {
      const __m256i qh = ld256(b + 16);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(bits_at(qh, 2 * j, 1), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(bits_at(qh, 2 * j + 1, 1), 4));
    }
  }
}

// A K-quant block's scales decoded once: sc[16] (Q4_K/Q5_K: the 8 sub-block scales; Q6_K: the 16 int8
// scales) and, for madd against the activation's 16-sums, the offset weights (Q4_K/Q5_K: each min twice;
// Q6_K: the scales)
template <int T>
struct KScales {
  alignas(32) int16_t sc[16];
  alignas(32) int16_t off[16];
  MS_INLINE explicit KScales(const uint8_t* b) {
    if constexpr (T == G_Q6_K) {
      for (int k = 0; k < 16; ++k) sc[k] = off[k] = int8_t(b[192 + k]);
    } else {  // k4_scale_min's values, four bytes per 32-bit word
      uint32_t u[3];
      std::memcpy(u, b + 4, 12);
      const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, hi2 = 0x30303030;
      const uint32_t w[4] = {u[0] & lo6, (u[2] & lo4) | ((u[0] >> 2) & hi2), u[1] & lo6,
                             ((u[2] >> 4) & lo4) | ((u[1] >> 2) & hi2)};
      uint8_t v[16];  // scales 0-7, mins 0-7
      std::memcpy(v, w, 16);
      for (int s = 0; s < 8; ++s) {
        sc[s] = int16_t(v[s]);
        off[2 * s] = off[2 * s + 1] = int16_t(v[8 + s]);
      }
    }
  }
  // int16 scales for madd: the 8 lanes of one 32-value half of chunk j, lane i's scale at int16 positions 2i, 2i+1
  MS_INLINE void chunk(int j, __m256i& slo, __m256i& shi) const {
    if constexpr (T == G_Q6_K) {  // lanes 4k..4k+3 share scale 4j + k of the chunk
      slo = _mm256_set_m128i(_mm_set1_epi16(sc[4 * j + 1]), _mm_set1_epi16(sc[4 * j]));
      shi = _mm256_set_m128i(_mm_set1_epi16(sc[4 * j + 3]), _mm_set1_epi16(sc[4 * j + 2]));
    } else {
      slo = _mm256_set1_epi16(sc[2 * j]);
      shi = _mm256_set1_epi16(sc[2 * j + 1]);
    }
  }
  MS_INLINE __m256i offsets() const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(off)); }
};

// the block's 8 offset lanes (kblock_offsets) with one madd
template <int T>
static MS_INLINE __m256 kblock_offsets_simd(__m256i offw, const int16_t* bsums) {
  __m256i o = _mm256_madd_epi16(offw, ld256(bsums));
  if constexpr (T == G_Q6_K) o = _mm256_slli_epi32(o, 5);
  return _mm256_cvtepi32_ps(o);
}

static MS_INLINE void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// AVX2: R tokens of one row, tokens t0..t0+R-1
template <int T, int R>
static MS_NOINLINE void krow_avx2(const uint8_t* row, int64_t nb, const Q8Rows& xa, int64_t t0, float* y, int64_t ldy,
                                  int64_t ahead) {
  const int64_t in = xa.in;
  __m256 acc_lo[R], acc_hi[R], m[R];
  for (int t = 0; t < R; ++t) acc_lo[t] = acc_hi[t] = m[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes<T>();
    prefetch_block(blk + ahead, block_bytes<T>());
    const KScales<T> ks(blk);
    __m256i is_lo[R], is_hi[R];
    for (int t = 0; t < R; ++t) is_lo[t] = is_hi[t] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i wl, wh, sl, sh;
      kchunk<T>(blk, j, wl, wh);
      ks.chunk(j, sl, sh);
      for (int t = 0; t < R; ++t) {
        const uint8_t* xq = xa.row(t0 + t) + 256 * b + 64 * j;
        is_lo[t] = _mm256_add_epi32(is_lo[t], _mm256_madd_epi16(_mm256_maddubs_epi16(wl, ld256(xq)), sl));
        is_hi[t] = _mm256_add_epi32(is_hi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(wh, ld256(xq + 32)), sh));
      }
    }
    float d, dm;
    kblock_d<T>(blk, d, dm);
    for (int t = 0; t < R; ++t) {
      const uint8_t* xr = xa.row(t0 + t);
      const float dx = reinterpret_cast<const float*>(xr + in)[b];
      const __m256 dd = _mm256_set1_ps(d * dx);
      acc_lo[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is_lo[t]), dd, acc_lo[t]);
      acc_hi[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is_hi[t]), dd, acc_hi[t]);
      const int16_t* bs = reinterpret_cast<const int16_t*>(xr + in + 4 * nb) + 16 * b;
      m[t] = _mm256_fmadd_ps(kblock_offsets_simd<T>(ks.offsets(), bs), _mm256_set1_ps(dm * dx), m[t]);
    }
  }
  for (int t = 0; t < R; ++t)
    y[(t0 + t) * ldy] = Arch2::hsum8(_mm256_add_ps(acc_lo[t], acc_hi[t])) - Arch2::hsum8(m[t]);
}

// A 32-value block's signed codes (sblock_codes) in one register
template <int T>
static MS_INLINE __m256i sblock256(const uint8_t* b) {
  if constexpr (T == G_Q8_0) {
    return ld256(b + 2);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (T == G_Q5_0 ? 6 : 2)));
    const __m128i m = _mm_set1_epi8(15);
    const __m256i n = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    if constexpr (T == G_IQ4_NL) {
      const __m128i tab = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
      return _mm256_shuffle_epi8(_mm256_set_m128i(tab, tab), n);
    } else if constexpr (T == G_Q5_0) {  // bit j of qh as 16 in byte j
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                           3, 3, 3, 3, 3, 3);
      const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
      const __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)), sel), bit);
      const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(h, bit), _mm256_set1_epi8(16));
      return _mm256_sub_epi8(_mm256_or_si256(n, hi), _mm256_set1_epi8(16));
    } else {
      return _mm256_sub_epi8(n, _mm256_set1_epi8(8));
    }
  }
}

// signed x signed bytes, sums of 4 per int32 lane (|w| <= 128, |x| <= 127: no int16 saturation)
static MS_INLINE __m256i dot_ss8(__m256i aw, __m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

template <int T, int R>
static MS_NOINLINE void q80_row_avx2(const uint8_t* row, int64_t nb, const Q8Rows& xa, int64_t t0, float* y,
                                     int64_t ldy, int64_t ahead) {
  const int64_t in = xa.in;
  __m256 acc_lo[R], acc_hi[R];
  for (int t = 0; t < R; ++t) acc_lo[t] = acc_hi[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < (nb + 1) / 2; ++c) {
    const int64_t b0 = 2 * c;
    const bool two = b0 + 1 < nb;
    constexpr int64_t SB = block_bytes<T>();
    prefetch_block(row + b0 * SB + ahead, 2 * SB);
    const __m256i w0 = sblock256<T>(row + b0 * SB);
    const __m256i w1 = two ? sblock256<T>(row + (b0 + 1) * SB) : _mm256_setzero_si256();
    const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
    const float d0 = ggml_f16(row + b0 * SB), d1 = two ? ggml_f16(row + (b0 + 1) * SB) : 0.0f;
    for (int t = 0; t < R; ++t) {
      const uint8_t* xr = xa.row(t0 + t);
      const float* dx = reinterpret_cast<const float*>(xr + in);
      const __m256i x0 = ld256(xr + 32 * b0), x1 = two ? ld256(xr + 32 * b0 + 32) : _mm256_setzero_si256();
      acc_lo[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_ss8(a0, w0, x0)), _mm256_set1_ps(d0 * dx[b0]), acc_lo[t]);
      acc_hi[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_ss8(a1, w1, x1)),
                                  _mm256_set1_ps(two ? d1 * dx[b0 + 1] : 0.0f), acc_hi[t]);
    }
  }
  for (int t = 0; t < R; ++t) y[(t0 + t) * ldy] = Arch2::hsum8(_mm256_add_ps(acc_lo[t], acc_hi[t]));
}
#endif

// ---- AVX-512 ------------------------------------------------------------------------------------------------
#if MS_AVX512
static MS_INLINE __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static MS_INLINE __m512i ld512(const void* p) { return _mm512_loadu_si512(p); }

template <int T, int R>
static MS_NOINLINE void krow_avx512(const uint8_t* row, int64_t nb, const Q8Rows& xa, int64_t t0, float* y,
                                    int64_t ldy, int64_t ahead) {
  const int64_t in = xa.in;
  __m512 acc[R];
  __m256 m[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps(), m[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes<T>();
    prefetch_block(blk + ahead, block_bytes<T>());
    const KScales<T> ks(blk);
    __m512i is[R];
    for (int t = 0; t < R; ++t) is[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m256i wl, wh, sl, sh;
      kchunk<T>(blk, j, wl, wh);
      ks.chunk(j, sl, sh);
      const __m512i w = join(wl, wh), s = join(sl, sh);
      for (int t = 0; t < R; ++t) {
        const __m512i x = ld512(xa.row(t0 + t) + 256 * b + 64 * j);
        is[t] = _mm512_add_epi32(is[t], _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), s));
      }
    }
    float d, dm;
    kblock_d<T>(blk, d, dm);
    for (int t = 0; t < R; ++t) {
      const uint8_t* xr = xa.row(t0 + t);
      const float dx = reinterpret_cast<const float*>(xr + in)[b];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_set1_ps(d * dx), acc[t]);
      const int16_t* bs = reinterpret_cast<const int16_t*>(xr + in + 4 * nb) + 16 * b;
      m[t] = _mm256_fmadd_ps(kblock_offsets_simd<T>(ks.offsets(), bs), _mm256_set1_ps(dm * dx), m[t]);
    }
  }
  for (int t = 0; t < R; ++t) y[(t0 + t) * ldy] = Arch5::hsum(acc[t]) - Arch2::hsum8(m[t]);
}

// signed x signed bytes, sums of 4 per int32 lane: |w| as unsigned, x negated where w < 0
static MS_INLINE __m512i dot_ss8_512(__m512i aw, __mmask64 neg, __m512i x) {
  const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), _mm512_set1_epi16(1));
#endif
}

template <int T, int R>
static MS_NOINLINE void q80_row_avx512(const uint8_t* row, int64_t nb, const Q8Rows& xa, int64_t t0, float* y,
                                       int64_t ldy, int64_t ahead) {
  const int64_t in = xa.in;
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < (nb + 1) / 2; ++c) {
    const int64_t b0 = 2 * c;
    const bool two = b0 + 1 < nb;
    constexpr int64_t SB = block_bytes<T>();
    prefetch_block(row + b0 * SB + ahead, 2 * SB);
    const __m512i w = join(sblock256<T>(row + b0 * SB), two ? sblock256<T>(row + (b0 + 1) * SB) : _mm256_setzero_si256());
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const float d0 = ggml_f16(row + b0 * SB), d1 = two ? ggml_f16(row + (b0 + 1) * SB) : 0.0f;
    // lanes 0-7 block b0's scale, 8-15 block b0 + 1's (0 when missing): d_w * d_x per lane as one multiply
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 dw = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(_mm_setr_ps(d0, d1, 0.0f, 0.0f)));
    const __mmask16 got = two ? 0x3 : 0x1;
    for (int t = 0; t < R; ++t) {
      const uint8_t* xr = xa.row(t0 + t);
      const float* dx = reinterpret_cast<const float*>(xr + in);
      const __m512i x = ld512(xr + 32 * b0);  // a missing second block: its weights are 0 (the row has spare bytes)
      const __m512 dd = _mm512_mul_ps(dw, _mm512_permutexvar_ps(half, _mm512_maskz_loadu_ps(got, dx + b0)));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_ss8_512(aw, neg, x)), dd, acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) y[(t0 + t) * ldy] = Arch5::hsum(acc[t]);
}
#endif

// ---- MLX affine weights, 4- and 8-bit codes (Q8_A4, Q8_A8) -------------------------------------------------
// weight = scale_g * q + bias_g per group g, so for one row and token
//   y = sum_c fma-chain(float(isum_c[l]), scale_g(c, l) * d(c, l)) + sum_g bias_g * sums_g,
// isum_c[l] the exact integer sum of lane l's 4 code x activation-code products in 64-value chunk c (Q8_A4: lanes
// 0-7 the chunk's even values, the low nibbles, 8-15 its odd ones; Q8_A8: values 4l..4l+3), d(c, l) the lane's
// activation block scale, sums_g the activation row's per-group sum of d x code sum (q8.h). The scale products go
// into one 16-lane accumulator chunk by chunk, the bias products into a second one 16 groups at a time, each
// summed by the tree of kernels.h, then added: the same bits on every path.

// A row's group value g (scale or bias) as float32 (the engine's ld_dt: exact widening)
static MS_INLINE float group_value(const uint8_t* p, int dt, int64_t g) { return ld_dt(p, dt, g); }

// the scale of chunk c's lane l (groups of 32: the lane's block's group; wider: the chunk's one group)
template <int BITS>
static MS_INLINE int64_t lane_group(int64_t c, int l, int64_t G) {
  const int64_t blk = 2 * c + (BITS == 4 ? (l / 4) % 2 : l / 8);
  return blk * 32 / G;
}

// chunk c's first group, c * 64 / G, stepped chunk by chunk (no division per chunk and row: G is a runtime value)
struct ChunkGroups {
  int64_t per, left, g = 0;  // chunks per group (0: groups of 32, two a chunk)
  explicit ChunkGroups(int64_t G) : per(G >= 64 ? G / 64 : 0), left(per) {}
  MS_INLINE void next() {
    if (per == 0) g += 2;
    else if (--left == 0) ++g, left = per;
  }
};

// Chunks are taken 16 at a time (1,024 values): each row's scales of those chunks (at most 32 groups) are widened
// to float32 once per segment into a buffer, so the chunk loop reads a float (no dtype switch per chunk and row).
constexpr int64_t SEG = 16;

template <class Load16>
static MS_INLINE void segment_scales(const uint8_t* s, int64_t g0, int64_t ng, bool g32, float* out, Load16&& load16) {
  load16(s, g0, out);
  if (g32 && g0 + 16 < ng) load16(s, g0 + 16, out + 16);
}

template <int BITS>
static void arows_portable(const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const int64_t in = L.in, G = L.group, nc = in / 64, ng = in / G;
  for (int64_t r = r0; r < r1; ++r) {
    const RowPtrs rp = row_ptrs(L, r);
    for (int64_t t = 0; t < xa.n; ++t) {
      const uint8_t* xr = xa.row(t);
      const int8_t* xq = reinterpret_cast<const int8_t*>(xr);
      const float* dexp = reinterpret_cast<const float*>(xr + in);
      const float* sums = reinterpret_cast<const float*>(xr + 2 * in);
      float acc[16] = {0}, mv[16] = {0};
      for (int64_t c = 0; c < nc; ++c) {
        uint8_t w[64];  // the chunk's codes in the activations' order
        for (int k = 0; k < 32; ++k) {
          if constexpr (BITS == 4) {
            const uint8_t b = rp.p[32 * c + k];
            w[k] = b & 15;
            w[32 + k] = b >> 4;
          } else {
            w[k] = rp.p[64 * c + k];
            w[32 + k] = rp.p[64 * c + 32 + k];
          }
        }
        for (int l = 0; l < 16; ++l) {
          int32_t p = 0;
          for (int i = 0; i < 4; ++i) p += int32_t(w[4 * l + i]) * xq[64 * c + 4 * l + i];
          const float sd = group_value(rp.s, L.s_dt, lane_group<BITS>(c, l, G)) * dexp[16 * c + l];
          acc[l] = std::fma(float(p), sd, acc[l]);
        }
      }
      for (int64_t g0 = 0; g0 < ng; g0 += 16)
        for (int l = 0; l < 16; ++l) {
          const float b = g0 + l < ng ? group_value(rp.b, L.b_dt, g0 + l) : 0.0f;
          mv[l] = std::fma(b, sums[g0 + l], mv[l]);
        }
      y[t * ldy + r] = tree_sum<16>(acc) + tree_sum<16>(mv);
    }
  }
}

// 16 group values from g0 (those past ng zero), float32
static MS_INLINE void group_values16(const uint8_t* p, int dt, int64_t g0, int64_t ng, float* out) {
  for (int l = 0; l < 16; ++l) out[l] = g0 + l < ng ? group_value(p, dt, g0 + l) : 0.0f;
}

#if MS_AVX2
// unsigned codes (<= 15 for 4 bits) x signed activation codes (|x| <= 127), 4 per int32 lane, exact:
// maddubs cannot saturate below 16 x 127 x 2. 8-bit codes: (q - 128) x x by sign and magnitude (|q - 128| <= 128),
// then 128 x the lane's activation sum.
template <int BITS>
static MS_INLINE __m256i adot_avx2(__m256i w, __m256i x) {
  const __m256i one16 = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one16);
  } else {
    const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws)), one16);
    const __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), one16);
    return _mm256_add_epi32(p, _mm256_slli_epi32(xs, 7));
  }
}

// AVX2: NR rows x R tokens (the rows' codes unpacked once per R tokens, a token's codes loaded once per NR rows)
template <int BITS, int NR, int R>
static MS_NOINLINE void atile_avx2(const Lin& L, const RowPtrs* rp, const Q8Rows& xa, int64_t t0, float* y,
                                   int64_t ldy, int64_t ahead) {
  const int64_t in = L.in, G = L.group, nc = in / 64, ng = in / G;
  __m256 acc_lo[NR][R], acc_hi[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) acc_lo[i][t] = acc_hi[i][t] = _mm256_setzero_ps();
  const bool g32 = G == 32;
  const uint8_t* xr[R];
  for (int t = 0; t < R; ++t) xr[t] = xa.row(t0 + t);
  alignas(32) float sc[NR][32];
  ChunkGroups cg(G);
  for (int64_t c0 = 0; c0 < nc; c0 += SEG) {
    const int64_t c1 = std::min(nc, c0 + SEG), sg0 = cg.g;
    for (int i = 0; i < NR; ++i)
      segment_scales(rp[i].s, sg0, ng, g32, sc[i],
                     [&](const uint8_t* p, int64_t g, float* o) { group_values16(p, L.s_dt, g, ng, o); });
    for (int64_t c = c0; c < c1; ++c, cg.next()) {
      const int64_t j = cg.g - sg0;
      __m256i wl[NR], wh[NR];
      __m256 s_lo[NR], s_hi[NR];
      for (int i = 0; i < NR; ++i) {
        const uint8_t* wp = rp[i].p + c * (BITS * 8);
        if (BITS == 8 || c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + ahead), _MM_HINT_T0);
        if constexpr (BITS == 4) {
          const __m256i q = ld256(wp);
          wl[i] = nib_lo(q);
          wh[i] = nib_hi(q);
        } else {
          wl[i] = ld256(wp);
          wh[i] = ld256(wp + 32);
        }
        // lanes 0-7 and 8-15; groups of 32: the lanes of the chunk's second block take its second scale
        const __m256 a = _mm256_set1_ps(sc[i][j]), b = g32 ? _mm256_set1_ps(sc[i][j + 1]) : a;
        s_lo[i] = BITS == 4 ? _mm256_blend_ps(a, b, 0xF0) : a;
        s_hi[i] = BITS == 4 ? s_lo[i] : b;
      }
      for (int t = 0; t < R; ++t) {
        const float* dexp = reinterpret_cast<const float*>(xr[t] + in) + 16 * c;
        const __m256i xl = ld256(xr[t] + 64 * c), xh = ld256(xr[t] + 64 * c + 32);
        const __m256 dl = _mm256_loadu_ps(dexp), dh = _mm256_loadu_ps(dexp + 8);
        for (int i = 0; i < NR; ++i) {
          acc_lo[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(adot_avx2<BITS>(wl[i], xl)), _mm256_mul_ps(s_lo[i], dl),
                                         acc_lo[i][t]);
          acc_hi[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(adot_avx2<BITS>(wh[i], xh)), _mm256_mul_ps(s_hi[i], dh),
                                         acc_hi[i][t]);
        }
      }
    }
  }
  float part[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) {
      part[i][t] = Arch2::hsum8(_mm256_add_ps(acc_lo[i][t], acc_hi[i][t]));
      acc_lo[i][t] = acc_hi[i][t] = _mm256_setzero_ps();  // now the bias products' accumulators
    }
  alignas(32) float bv[16];
  for (int64_t g0 = 0; g0 < ng; g0 += 16)
    for (int i = 0; i < NR; ++i) {
      group_values16(rp[i].b, L.b_dt, g0, ng, bv);
      const __m256 b_lo = _mm256_load_ps(bv), b_hi = _mm256_load_ps(bv + 8);
      for (int t = 0; t < R; ++t) {
        const float* sums = reinterpret_cast<const float*>(xa.row(t0 + t) + 2 * in) + g0;
        acc_lo[i][t] = _mm256_fmadd_ps(b_lo, _mm256_loadu_ps(sums), acc_lo[i][t]);
        acc_hi[i][t] = _mm256_fmadd_ps(b_hi, _mm256_loadu_ps(sums + 8), acc_hi[i][t]);
      }
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t)
      y[(t0 + t) * ldy + i] = part[i][t] + Arch2::hsum8(_mm256_add_ps(acc_lo[i][t], acc_hi[i][t]));
}
#endif

#if MS_AVX512
// as adot_avx2, 16 lanes (VNNI: one dpbusd, whose u8 x s8 sums of 4 are exact)
template <int BITS>
static MS_INLINE __m512i adot_avx512(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
  const __m512i one16 = _mm512_set1_epi16(1);
  if constexpr (BITS == 4) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), one16);
  } else {
    const __m512i ws = _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80)));
    const __mmask64 neg = _mm512_movepi8_mask(ws);
    const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(ws), sx), one16);
    const __m512i xs = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), x), one16);
    return _mm512_add_epi32(p, _mm512_slli_epi32(xs, 7));
  }
#endif
}

static MS_INLINE __m512 ld_values16(const uint8_t* p, int dt, int64_t g0, int64_t ng) {
  const int64_t n = std::min<int64_t>(16, ng - g0);
  const __mmask16 m = __mmask16((1u << n) - 1);
  if (dt == F32) return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + g0);
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + g0);
  if (dt == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// NR rows x R tokens, as atile_avx2
template <int BITS, int NR, int R>
static MS_NOINLINE void atile_avx512(const Lin& L, const RowPtrs* rp, const Q8Rows& xa, int64_t t0, float* y,
                                     int64_t ldy, int64_t ahead) {
  const int64_t in = L.in, G = L.group, nc = in / 64, ng = in / G;
  // groups of 32: lanes of the chunk's second block take its second scale
  const __mmask16 second = BITS == 4 ? 0xF0F0 : 0xFF00;
  __m512 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) acc[i][t] = _mm512_setzero_ps();
  const bool g32 = G == 32;
  const uint8_t* xr[R];
  for (int t = 0; t < R; ++t) xr[t] = xa.row(t0 + t);
  alignas(64) float sc[NR][32];
  ChunkGroups cg(G);
  for (int64_t c0 = 0; c0 < nc; c0 += SEG) {
    const int64_t c1 = std::min(nc, c0 + SEG), sg0 = cg.g;
    for (int i = 0; i < NR; ++i)
      segment_scales(rp[i].s, sg0, ng, g32, sc[i], [&](const uint8_t* p, int64_t g, float* o) {
        _mm512_store_ps(o, ld_values16(p, L.s_dt, g, ng));
      });
    for (int64_t c = c0; c < c1; ++c, cg.next()) {
      const int64_t j = cg.g - sg0;
      __m512i w[NR];
      __m512 sv[NR];
      for (int i = 0; i < NR; ++i) {
        const uint8_t* wp = rp[i].p + c * (BITS * 8);
        if (BITS == 8 || c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + ahead), _MM_HINT_T0);
        if constexpr (BITS == 4) {
          const __m256i q = ld256(wp);
          w[i] = join(nib_lo(q), nib_hi(q));
        } else {
          w[i] = ld512(wp);
        }
        const __m512 s0 = _mm512_set1_ps(sc[i][j]);
        sv[i] = g32 ? _mm512_mask_blend_ps(second, s0, _mm512_set1_ps(sc[i][j + 1])) : s0;
      }
      for (int t = 0; t < R; ++t) {
        const __m512i x = ld512(xr[t] + 64 * c);
        const __m512 dx = _mm512_loadu_ps(reinterpret_cast<const float*>(xr[t] + in) + 16 * c);
        for (int i = 0; i < NR; ++i)
          acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(adot_avx512<BITS>(w[i], x)), _mm512_mul_ps(sv[i], dx),
                                      acc[i][t]);
      }
    }
  }
  float part[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) part[i][t] = Arch5::hsum(acc[i][t]), acc[i][t] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < ng; g0 += 16)
    for (int i = 0; i < NR; ++i) {
      const __m512 bv = ld_values16(rp[i].b, L.b_dt, g0, ng);
      for (int t = 0; t < R; ++t)
        acc[i][t] = _mm512_fmadd_ps(bv, _mm512_loadu_ps(reinterpret_cast<const float*>(xa.row(t0 + t) + 2 * in) + g0),
                                    acc[i][t]);
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < R; ++t) y[(t0 + t) * ldy + i] = part[i][t] + Arch5::hsum(acc[i][t]);
}
#endif

// One row for every token, R tokens at a time (the weights decoded once per R); W the widest tile
template <int W, class F>
static void row_tiles(int64_t n, F&& f) {
  int64_t t = 0;
  if constexpr (W >= 8)
    for (; t + 8 <= n; t += 8) f(std::integral_constant<int, 8>(), t);
  for (; t + 4 <= n; t += 4) f(std::integral_constant<int, 4>(), t);
  if (t + 2 <= n) f(std::integral_constant<int, 2>(), t), t += 2;
  if (t < n) f(std::integral_constant<int, 1>(), t);
}

template <int T>
static void simd_rows(int path, const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  constexpr bool K = T == G_Q4_K || T == G_Q5_K || T == G_Q6_K;
  const int64_t nb = K ? L.in / 256 : L.in / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = L.w + L.stored(r) * L.row_bytes;
    // the row Q8_AHEAD_ROWS on (while it is one of this call's): its bytes at the offset being read here
    const int64_t ahead = r + Q8_AHEAD_ROWS < r1 ? (L.stored(r + Q8_AHEAD_ROWS) - L.stored(r)) * L.row_bytes : 0;
    float* yr = y + r;
#if MS_AVX512
    if (path == AVX512) {
      row_tiles<8>(xa.n, [&](auto R, int64_t t) {
        if constexpr (!K)
          q80_row_avx512<T, decltype(R)::value>(row, nb, xa, t, yr, ldy, ahead);
        else
          krow_avx512<T, decltype(R)::value>(row, nb, xa, t, yr, ldy, ahead);
      });
      continue;
    }
#endif
#if MS_AVX2
    row_tiles<4>(xa.n, [&](auto R, int64_t t) {
      if constexpr (!K)
        q80_row_avx2<T, decltype(R)::value>(row, nb, xa, t, yr, ldy, ahead);
      else
        krow_avx2<T, decltype(R)::value>(row, nb, xa, t, yr, ldy, ahead);
    });
#else
    (void)path, (void)row, (void)yr, (void)nb, (void)ldy, (void)ahead;
#endif
  }
}

// Tokens in tiles of TMAX, then 2 (TMAX 4) and 1: f(integral_constant R, first token)
template <int TMAX, class F>
static void token_tiles(int64_t n, F&& f) {
  int64_t t = 0;
  for (; t + TMAX <= n; t += TMAX) f(std::integral_constant<int, TMAX>(), t);
  if constexpr (TMAX >= 4)
    if (t + 2 <= n) f(std::integral_constant<int, 2>(), t), t += 2;
  for (; t < n; ++t) f(std::integral_constant<int, 1>(), t);
}

// Rows in passes of NR (AVX-512 4, AVX2 2: the accumulators fill the registers), then one at a time
template <int BITS>
static void arows_simd(int path, const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  auto pass = [&](auto NR, int64_t r, auto&& tile) {
    RowPtrs rp[decltype(NR)::value];
    for (int i = 0; i < decltype(NR)::value; ++i) rp[i] = row_ptrs(L, r + i);
    // the row Q8_AHEAD_ROWS on (while it is one of this call's): its bytes at the offset being read here
    const int64_t ahead = r + Q8_AHEAD_ROWS < r1 ? (L.stored(r + Q8_AHEAD_ROWS) - L.stored(r)) * L.row_bytes : 0;
    tile(rp, ahead);
  };
  using I1 = std::integral_constant<int, 1>;
#if MS_AVX512
  if (path == AVX512) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4)
      pass(std::integral_constant<int, 4>(), r, [&](const RowPtrs* rp, int64_t ahead) {
        token_tiles<4>(xa.n, [&](auto R, int64_t t) { atile_avx512<BITS, 4, decltype(R)::value>(L, rp, xa, t, y + r, ldy, ahead); });
      });
    for (; r < r1; ++r)
      pass(I1(), r, [&](const RowPtrs* rp, int64_t ahead) {
        token_tiles<8>(xa.n, [&](auto R, int64_t t) { atile_avx512<BITS, 1, decltype(R)::value>(L, rp, xa, t, y + r, ldy, ahead); });
      });
    return;
  }
#endif
#if MS_AVX2
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2)
    pass(std::integral_constant<int, 2>(), r, [&](const RowPtrs* rp, int64_t ahead) {
      token_tiles<2>(xa.n, [&](auto R, int64_t t) { atile_avx2<BITS, 2, decltype(R)::value>(L, rp, xa, t, y + r, ldy, ahead); });
    });
  for (; r < r1; ++r)
    pass(I1(), r, [&](const RowPtrs* rp, int64_t ahead) {
      token_tiles<4>(xa.n, [&](auto R, int64_t t) { atile_avx2<BITS, 1, decltype(R)::value>(L, rp, xa, t, y + r, ldy, ahead); });
    });
#else
  (void)path, (void)pass, (void)ldy, I1();
#endif
}

bool q8_rows(int path, const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  if ((path == AVX512 && !MS_AVX512) || (path == AVX2 && !MS_AVX2) || path < 0 || path > 2) return false;
  if (L.kind == AFFINE) {
    const bool four = L.bits == 4;
    if (path == PORTABLE)
      four ? arows_portable<4>(L, xa, r0, r1, y, ldy) : arows_portable<8>(L, xa, r0, r1, y, ldy);
    else
      four ? arows_simd<4>(path, L, xa, r0, r1, y, ldy) : arows_simd<8>(path, L, xa, r0, r1, y, ldy);
    return true;
  }
  if (path == PORTABLE) {
    switch (L.bits) {
      case G_Q4_K: krows_portable<G_Q4_K>(L, xa, r0, r1, y, ldy); break;
      case G_Q5_K: krows_portable<G_Q5_K>(L, xa, r0, r1, y, ldy); break;
      case G_Q6_K: krows_portable<G_Q6_K>(L, xa, r0, r1, y, ldy); break;
      case G_Q4_0: srows_portable<G_Q4_0>(L, xa, r0, r1, y, ldy); break;
      case G_Q5_0: srows_portable<G_Q5_0>(L, xa, r0, r1, y, ldy); break;
      case G_IQ4_NL: srows_portable<G_IQ4_NL>(L, xa, r0, r1, y, ldy); break;
      default: srows_portable<G_Q8_0>(L, xa, r0, r1, y, ldy); break;
    }
    return true;
  }
  switch (L.bits) {
    case G_Q4_K: simd_rows<G_Q4_K>(path, L, xa, r0, r1, y, ldy); break;
    case G_Q5_K: simd_rows<G_Q5_K>(path, L, xa, r0, r1, y, ldy); break;
    case G_Q6_K: simd_rows<G_Q6_K>(path, L, xa, r0, r1, y, ldy); break;
    case G_Q4_0: simd_rows<G_Q4_0>(path, L, xa, r0, r1, y, ldy); break;
    case G_Q5_0: simd_rows<G_Q5_0>(path, L, xa, r0, r1, y, ldy); break;
    case G_IQ4_NL: simd_rows<G_IQ4_NL>(path, L, xa, r0, r1, y, ldy); break;
    default: simd_rows<G_Q8_0>(path, L, xa, r0, r1, y, ldy); break;
  }
  return true;
}

}  // namespace ms
