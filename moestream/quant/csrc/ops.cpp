// The rest of a token's arithmetic on the CPU: attention over the KV cache, RMSNorm and the elementwise
// activations. Plain C++ with the reductions spelled out (no fast-math, no contraction), so the compiler's
// vectorization keeps the bits: every machine computes the same values. Each output depends only on its
// own inputs -- a query's attention on its keys and values at the positions it may see, never on the
// cache's capacity, the number of queries in the call or the thread count (threads split queries and
// rows, never a sum).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ms {
namespace {

// a float of dtype dt at element i of p
MS_INLINE float ld(const uint8_t* p, int dt, int64_t i) { return ld_dt(p, dt, i); }


// a [n] of dtype DT: sum of squares by the canonical reduction (the dtype a template argument: no switch per value)
template <int DT>
MS_INLINE float sum_squares_t(const uint8_t* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  float v[16];
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) v[l] = ldf<DT>(x, i + l);
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(v[l], v[l], acc[l]);
  }
  if (i < n) {
    for (int l = 0; l < 16; ++l) v[l] = i + l < n ? ldf<DT>(x, i + l) : 0.0f;
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(v[l], v[l], acc[l]);
  }
  return tree_sum<16>(acc);
}

// a [n] float32, dtype dt: sum of squares by the canonical reduction
MS_INLINE float sum_squares(const uint8_t* x, int dt, int64_t n) {
  if (dt == F32) return sum_squares_t<F32>(x, n);
  if (dt == BF16) return sum_squares_t<BF16>(x, n);
  return sum_squares_t<F16>(x, n);
}

// value rounded to dtype dt and back (the rounding a cast to dt makes)
MS_INLINE float round_dt(float v, int dt) {
  if (dt == BF16) return bf16_to_float(to_bf16(v));
  if (dt == F16) return c10_half_round(v);
  return v;
}

// mode 0 of ms_rmsnorm with x, w and out all of dtype DT: out = w * round(x r), rounded (the same operations)
template <int DT>
void norm_row_same(const uint8_t* xr, const uint8_t* w, uint8_t* orow, int64_t d, float r) {
  for (int64_t i = 0; i < d; ++i) st_dt(orow, DT, i, ldf<DT>(w, i) * round_dt(ldf<DT>(xr, i) * r, DT));
}

int threads_for(int64_t items, int64_t work_per_item) {
  int t = 1;
#ifdef _OPENMP
  if (!omp_in_parallel()) {
    const int64_t want = std::max<int64_t>(1, items * std::max<int64_t>(1, work_per_item) / (int64_t(1) << 15));
    t = int(std::min<int64_t>({int64_t(omp_get_max_threads()), items, want}));
  }
#endif
  return std::max(1, t);
}


// q . k by the canonical reduction (16 lanes, then tree_sum<16>), over rows zero-padded to whole 16-lane steps
// (a padded lane adds fma(0, 0, acc): the unpadded loop's tail). One fma per lane and step, so the SIMD
// registers give the scalar loop's bits; the compiler keeps 16 scalar chains otherwise.
MS_INLINE float dot16(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  __m256 x = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
  }
  __m256 x = _mm256_add_ps(v0, v1);
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // tree_sum<16>'s steps: t[i] + t[i+8] (above), t[i] + t[i+4], t[i] + t[i+2], t[0] + t[1]
  __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
#else
  float acc[16] = {0};
  for (int64_t i = 0; i < n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  return tree_sum<16>(acc);
#endif
}

MS_INLINE int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// n values of dtype DT into float32 dst, then zeros up to the padded length np
template <int DT>
MS_INLINE void to_float(const uint8_t* src, int64_t n, int64_t np, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ldf<DT>(src, i);
  for (int64_t i = n; i < np; ++i) dst[i] = 0.0f;
}

struct Attn {
  int64_t T, Hq, Hkv, D1, D2, Dv, start, window, nk, rep, es;
  const int64_t* a;
  float scale;
  const float* q;
  const uint8_t *k1, *k2, *v, *mask;
  const float* sinks;
  float* out;
};

constexpr int64_t PV_KEYS = 4;  // keys per pass over a head's output accumulator (kept in registers)
constexpr int64_t GROUP_HEADS = 16;  // query heads sharing one pass over their key head's rows

// Scratch of one thread: the visible positions, per head of a group its padded query, scores (then
// weights), running max, sum and output accumulator, and one converted key row and PV_KEYS value rows.
struct AttnScratch {
  int64_t dp, hc;  // padded D1 + padded D2; heads per group
  std::vector<int64_t> at;
  std::vector<float> qp, s, o, kf, vf, m, l;
  explicit AttnScratch(const Attn& A)
      : dp(pad16(A.D1) + pad16(A.D2)), hc(std::min(A.rep, GROUP_HEADS)), at(size_t(std::max<int64_t>(1, A.nk))),
        qp(size_t(hc * dp)), s(size_t(hc * std::max<int64_t>(1, A.nk))), o(size_t(hc * A.Dv)), kf(size_t(dp)),
        vf(size_t(PV_KEYS * A.Dv)), m(size_t(hc)), l(size_t(hc)) {}
};

// Query t's heads h0 .. h0+rep-1, which share key head kh. Per head the same operations in the same order
// as one head alone (ms_attention's contract): the conversion of each key and value row is shared, and the
// value sum takes PV_KEYS keys per pass, in position order for every lane.
template <int DT>
MS_NOINLINE void attend_group(const Attn& A, int64_t t, int64_t kh, int64_t h0, int64_t rep, AttnScratch& w) {
  const int64_t D1 = A.D1, D2 = A.D2, Dv = A.Dv, cap = std::max<int64_t>(1, A.nk);
  const int64_t p1 = pad16(D1), dp = w.dp;
  const int64_t* a = A.a;
  const int64_t pos = A.start + t, hi = std::min(pos, A.nk - 1);
  const int64_t lo = A.window > 0 ? std::max<int64_t>(0, pos - A.window + 1) : 0;
  int64_t n = 0;
  for (int64_t j = lo; j <= hi; ++j)
    if (A.mask == nullptr || A.mask[t * a[21] + j]) w.at[size_t(n++)] = j;
  float* kf = w.kf.data();
  float* vf = w.vf.data();
  for (int64_t r = 0; r < rep; ++r) {
    const float* qt = A.q + t * a[17] + (h0 + r) * a[18];
    float* qp = w.qp.data() + r * dp;
    for (int64_t i = 0; i < dp; ++i) qp[i] = 0.0f;
    for (int64_t i = 0; i < D1; ++i) qp[i] = qt[i];
    for (int64_t i = 0; i < D2; ++i) qp[p1 + i] = qt[D1 + i];
  }
  float* m = w.m.data();
  float* l = w.l.data();
  for (int64_t r = 0; r < rep; ++r) m[r] = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = w.at[size_t(i)];
    to_float<DT>(A.k1 + (kh * a[10] + j * a[11]) * A.es, D1, p1, kf);
    if (D2 > 0) to_float<DT>(A.k2 + (kh * a[12] + j * a[13]) * A.es, D2, dp - p1, kf + p1);
    for (int64_t r = 0; r < rep; ++r) {
      const float sc = dot16(w.qp.data() + r * dp, kf, dp) * A.scale;
      w.s[size_t(r * cap + i)] = sc;
      m[r] = std::max(m[r], sc);
    }
  }
  for (int64_t r = 0; r < rep; ++r) {
    const int64_t h = h0 + r;
    const float sink = A.sinks != nullptr ? A.sinks[h] : 0.0f;
    if (A.sinks != nullptr) m[r] = std::max(m[r], sink);
    float* sr = w.s.data() + r * cap;
    const float mr = m[r];
    for (int64_t i = 0; i < n; ++i) sr[i] = exp_c(sr[i] - mr);
    float lr = 0.0f;
    for (int64_t i = 0; i < n; ++i) lr = lr + sr[i];
    if (A.sinks != nullptr) lr = lr + exp_c(sink - mr);
    l[r] = lr;
    float* o = w.o.data() + r * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = 0.0f;
  }
  int64_t i = 0;
  for (; i + PV_KEYS <= n; i += PV_KEYS) {
    for (int64_t u = 0; u < PV_KEYS; ++u)
      to_float<DT>(A.v + (kh * a[14] + w.at[size_t(i + u)] * a[15]) * A.es, Dv, Dv, vf + u * Dv);
    const float *v0 = vf, *v1 = vf + Dv, *v2 = vf + 2 * Dv, *v3 = vf + 3 * Dv;
    for (int64_t r = 0; r < rep; ++r) {
      const float* e = w.s.data() + r * cap + i;
      const float e0 = e[0], e1 = e[1], e2 = e[2], e3 = e[3];
      float* o = w.o.data() + r * Dv;
      for (int64_t d = 0; d < Dv; ++d) {
        float x = o[d];
        x = std::fma(e0, v0[d], x);
        x = std::fma(e1, v1[d], x);
        x = std::fma(e2, v2[d], x);
        x = std::fma(e3, v3[d], x);
        o[d] = x;
      }
    }
  }
  for (; i < n; ++i) {
    to_float<DT>(A.v + (kh * a[14] + w.at[size_t(i)] * a[15]) * A.es, Dv, Dv, vf);
    for (int64_t r = 0; r < rep; ++r) {
      const float e = w.s[size_t(r * cap + i)];
      float* o = w.o.data() + r * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = std::fma(e, vf[d], o[d]);
    }
  }
  for (int64_t r = 0; r < rep; ++r) {
    const float* o = w.o.data() + r * Dv;
    float* ot = A.out + t * a[19] + (h0 + r) * a[20];
    for (int64_t d = 0; d < Dv; ++d) ot[d] = n > 0 ? o[d] / l[r] : 0.0f;
  }
}

}  // namespace
}  // namespace ms

extern "C" {

// Attention of T queries over a sequence's cached keys and values.
// a: 0 T, 1 Hq, 2 Hkv, 3 D1, 4 D2, 5 Dv, 6 kv dtype, 7 start (position of query 0), 8 window (0: none),
//    9 n_keys (positions 0..n_keys-1 are cached), 10/11 k1 head/position strides, 12/13 k2's, 14/15 v's
//    (elements), 16 scale (float32 bits), 17/18 q token/head strides, 19/20 out token/head strides,
//    21 mask token stride (0: no mask)
// p: q (float32 [.., D1 + D2]: part 1 then part 2), k1 (dtype [.., D1]), k2 (dtype [.., D2] or null),
//    v (dtype [.., Dv]), sinks (float32 [Hq] or null), out (float32 [.., Dv]), mask (uint8 [T, n_keys], 1 =
//    attend, or null)
// Query t at position pos = start + t sees the cached positions j <= pos (and j > pos - window with a window,
// and mask[t, j] != 0 with a mask). Its scores s_j = dot(q, k_j) * scale (dot: the canonical reduction over
// part 1 then part 2), m = max(s_j, sink), e_j = exp_c(s_j - m), l = sum of e_j in position order (+
// exp_c(sink - m)), out = (sum of e_j v_j in position order) / l. 0, or -1 for a bad argument.
// Threads split the (query, key head) groups, never a sum.
int ms_attention(const int64_t* a, const void* const* p) {
  ms::Attn A;
  A.T = a[0], A.Hq = a[1], A.Hkv = a[2], A.D1 = a[3], A.D2 = a[4], A.Dv = a[5], A.start = a[7], A.window = a[8];
  A.nk = a[9];
  const int dt = int(a[6]);
  if (A.T < 0 || A.Hq < 1 || A.Hkv < 1 || A.Hq % A.Hkv || A.D1 < 0 || A.D2 < 0 ||
      A.Dv < 1 || A.nk < 0 || dt < 0 || dt > 2)
    return -1;
  A.a = a;
  A.scale = ms::f32_bits(a[16]);
  A.q = ms::in_arg<float>(p[0]), A.sinks = ms::in_arg<float>(p[4]);
  A.k1 = ms::in_arg<uint8_t>(p[1]), A.k2 = ms::in_arg<uint8_t>(p[2]), A.v = ms::in_arg<uint8_t>(p[3]);
  A.mask = ms::in_arg<uint8_t>(p[6]);
  A.out = ms::out_arg<float>(p[5]);
  A.es = dt == ms::F32 ? 4 : 2;
  A.rep = A.Hq / A.Hkv;
  const int64_t hc = std::min(A.rep, ms::GROUP_HEADS), groups = (A.rep + hc - 1) / hc, items = A.T * A.Hkv * groups;
  const int threads = ms::threads_for(items, hc * (A.D1 + A.D2 + A.Dv) * std::max<int64_t>(1, A.nk));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    ms::AttnScratch w(A);
    int nt = 1, id = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    id = omp_get_thread_num();
#endif
    const int64_t per = (items + nt - 1) / nt, i0 = id * per, i1 = std::min(items, i0 + per);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t = it / (A.Hkv * groups), kh = it / groups % A.Hkv, g = it % groups;
      const int64_t h0 = kh * A.rep + g * hc, nh = std::min(hc, A.rep - g * hc);
      if (dt == ms::F32) ms::attend_group<ms::F32>(A, t, kh, h0, nh, w);
      else if (dt == ms::BF16) ms::attend_group<ms::BF16>(A, t, kh, h0, nh, w);
      else ms::attend_group<ms::F16>(A, t, kh, h0, nh, w);
    }
  }
  return 0;
}

// RMSNorm of n rows of d: r = 1 / sqrt(sum(x^2) / d + eps) (the canonical sum of squares), then by mode
// 0: out = w * round_x(x r) (transformers' Qwen3MoeRMSNorm: the weight times the normalized input cast to
//    x's dtype), 1: out = x r (1 + w) (zero-centred weight, in float32: Qwen3NextRMSNorm), 2: out = x r;
// mode 3 is the l2 norm: r = 1 / sqrt(sum(x^2) + eps), out = x r; 4: out = w x r in float32 (gpt-oss's, which
// scales before the cast).
// a: 0 n, 1 d, 2 x dtype, 3 w dtype, 4 out dtype, 5 mode, 6 x row stride, 7 out row stride (elements),
//    8 eps (float32 bits); p: x, w (or null for mode 2), out. 0, or -1 for a bad argument.
int ms_rmsnorm(const int64_t* a, const void* const* p) {
  const int64_t n = a[0], d = a[1], xs = a[6], os = a[7];
  const int xdt = int(a[2]), wdt = int(a[3]), odt = int(a[4]), mode = int(a[5]);
  if (n < 0 || d < 1 || mode < 0 || mode > 4 || xdt < 0 || xdt > 2 || odt < 0 || odt > 2) return -1;
  const float eps = ms::f32_bits(a[8]);
  const uint8_t *x = ms::in_arg<uint8_t>(p[0]), *w = ms::in_arg<uint8_t>(p[1]);
  uint8_t* out = ms::out_arg<uint8_t>(p[2]);
  const int64_t xe = xdt == ms::F32 ? 4 : 2, oe = odt == ms::F32 ? 4 : 2;
  const int threads = ms::threads_for(n, 4 * d);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* xr = x + t * xs * xe;
    uint8_t* orow = out + t * os * oe;
    const float ss = ms::sum_squares(xr, xdt, d);
    const float r = 1.0f / std::sqrt((mode == 3 ? ss : ss / float(d)) + eps);
    if (mode == 0 && xdt == wdt && xdt == odt && xdt != ms::F16) {  // a model's own norm: one dtype, no switch
      if (xdt == ms::BF16) ms::norm_row_same<ms::BF16>(xr, w, orow, d, r);
      else ms::norm_row_same<ms::F32>(xr, w, orow, d, r);
      continue;
    }
    for (int64_t i = 0; i < d; ++i) {
      const float h = ms::ld(xr, xdt, i) * r;
      float y;
      if (mode == 0) y = ms::ld(w, wdt, i) * ms::round_dt(h, xdt);
      else if (mode == 1) y = h * (1.0f + ms::ld(w, wdt, i));
      else if (mode == 4) y = ms::ld(w, wdt, i) * h;
      else y = h;
      ms::st_dt(orow, odt, i, y);
    }
  }
  return 0;
}

// The delta rule, one token at a time per head (Gated DeltaNet, Yang et al. 2024; KDA): with state S [Dk, Dv],
//   S = S * exp_c(g) (g one log decay per head, or per key channel d: row d scaled), r = S^T k,
//   S = S + k (beta (v - r))^T, out = S^T q,
// each S^T y summed over d = 0..Dk-1 in order (per output lane one fma chain). All float32; q, k [T, H, Dk],
// v [T, H, Dv], g [T, H] or [T, H, Dk], beta [T, H], contiguous; state [H, Dk, Dv] updated in place;
// out [T, H, Dv]. a: 0 T, 1 H, 2 Dk, 3 Dv, 4 per-channel g (0/1); p: q, k, v, g, beta, state, out. Heads run
// on threads (each head's recurrence is its own), so the bits depend only on the inputs, never on how a
// prompt was split into calls: the state after a chunk is the state the next call starts from.
int ms_delta_rule(const int64_t* a, const void* const* p) {
  const int64_t T = a[0], H = a[1], Dk = a[2], Dv = a[3];
  const bool per_channel = a[4] != 0;
  if (T < 0 || H < 1 || Dk < 1 || Dv < 1) return -1;
  const float *q = ms::in_arg<float>(p[0]), *k = ms::in_arg<float>(p[1]), *v = ms::in_arg<float>(p[2]),
              *g = ms::in_arg<float>(p[3]), *beta = ms::in_arg<float>(p[4]);
  float *state = ms::out_arg<float>(p[5]), *out = ms::out_arg<float>(p[6]);
  const int threads = ms::threads_for(H, T * Dk * Dv * 4);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    float* S = state + h * Dk * Dv;
    std::vector<float> r(static_cast<size_t>(Dv)), dl(static_cast<size_t>(Dv));
    for (int64_t t = 0; t < T; ++t) {
      const float* kt = k + (t * H + h) * Dk;
      const float* qt = q + (t * H + h) * Dk;
      const float* vt = v + (t * H + h) * Dv;
      if (per_channel) {
        const float* gt = g + (t * H + h) * Dk;
        for (int64_t d = 0; d < Dk; ++d) {
          const float e = ms::exp_c(gt[d]);
          for (int64_t j = 0; j < Dv; ++j) S[d * Dv + j] = S[d * Dv + j] * e;
        }
      } else {
        const float e = ms::exp_c(g[t * H + h]);
        for (int64_t i = 0; i < Dk * Dv; ++i) S[i] = S[i] * e;
      }
      for (int64_t j = 0; j < Dv; ++j) r[size_t(j)] = 0.0f;
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t j = 0; j < Dv; ++j) r[size_t(j)] = std::fma(S[d * Dv + j], kt[d], r[size_t(j)]);
      const float b = beta[t * H + h];
      for (int64_t j = 0; j < Dv; ++j) dl[size_t(j)] = (vt[j] - r[size_t(j)]) * b;
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t j = 0; j < Dv; ++j) S[d * Dv + j] = std::fma(kt[d], dl[size_t(j)], S[d * Dv + j]);
      float* ot = out + (t * H + h) * Dv;
      for (int64_t j = 0; j < Dv; ++j) ot[j] = 0.0f;
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t j = 0; j < Dv; ++j) ot[j] = std::fma(S[d * Dv + j], qt[d], ot[j]);
    }
  }
  return 0;
}

// Elementwise activation of n values (in dtype dt -> out dtype odt), in float32: op 0 silu x / (1 +
// exp_c(-x)), 1 sigmoid 1 / (1 + exp_c(-x)), 2 softplus (x above the threshold `param`: x, else
// log1p(exp_c(x))), 3 exp_c(x). 0, or -1 for a bad op.
int ms_act(int op, int64_t n, int dt, const void* x, int odt, void* out, float param) {
  if (op < 0 || op > 3 || dt < 0 || dt > 2 || odt < 0 || odt > 2) return -1;
  const uint8_t* xi = static_cast<const uint8_t*>(x);
  uint8_t* o = static_cast<uint8_t*>(out);
  const int threads = ms::threads_for(n, 16);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = ms::ld(xi, dt, i);
    float y;
    switch (op) {
      case 0: y = v / (1.0f + ms::exp_c(-v)); break;
      case 1: y = 1.0f / (1.0f + ms::exp_c(-v)); break;
      case 2: y = v > param ? v : std::log1p(ms::exp_c(v)); break;
      default: y = ms::exp_c(v); break;
    }
    ms::st_dt(o, odt, i, y);
  }
  return 0;
}

}  // extern "C"
