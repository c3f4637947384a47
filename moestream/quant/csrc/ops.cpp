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

// The canonical 16-lane dot of a (float32, n) and b (dtype dt, n) continued from acc (kernels.h's
// reduction; a last partial vector leaves its missing lanes as zero products).
MS_INLINE void dot_acc(const float* a, const uint8_t* b, int dt, int64_t n, float* acc) {
  int64_t i = 0;
  float bv[16];
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) bv[l] = ld(b, dt, i + l);
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(a[i + l], bv[l], acc[l]);
  }
  if (i < n) {
    float av[16];
    for (int l = 0; l < 16; ++l) {
      av[l] = i + l < n ? a[i + l] : 0.0f;
      bv[l] = i + l < n ? ld(b, dt, i + l) : 0.0f;
    }
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(av[l], bv[l], acc[l]);
  }
}

// a [n] float32, dtype dt: sum of squares by the canonical reduction
MS_INLINE float sum_squares(const uint8_t* x, int dt, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  float v[16];
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) v[l] = ld(x, dt, i + l);
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(v[l], v[l], acc[l]);
  }
  if (i < n) {
    for (int l = 0; l < 16; ++l) v[l] = i + l < n ? ld(x, dt, i + l) : 0.0f;
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(v[l], v[l], acc[l]);
  }
  return tree_sum<16>(acc);
}

// value rounded to dtype dt and back (the rounding a cast to dt makes)
MS_INLINE float round_dt(float v, int dt) {
  if (dt == BF16) return bf16_to_float(to_bf16(v));
  if (dt == F16) return c10_half_round(v);
  return v;
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
int ms_attention(const int64_t* a, const void* const* p) {
  const int64_t T = a[0], Hq = a[1], Hkv = a[2], D1 = a[3], D2 = a[4], Dv = a[5], start = a[7], window = a[8];
  const int64_t nk = a[9];
  const int dt = int(a[6]);
  if (T < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D1 < 0 || D2 < 0 || Dv < 1 || nk < 0 || dt < 0 || dt > 2) return -1;
  const float scale = ms::f32_bits(a[16]);
  const float *q = ms::in_arg<float>(p[0]), *sinks = ms::in_arg<float>(p[4]);
  const uint8_t *k1 = ms::in_arg<uint8_t>(p[1]), *k2 = ms::in_arg<uint8_t>(p[2]), *v = ms::in_arg<uint8_t>(p[3]),
                *mask = ms::in_arg<uint8_t>(p[6]);
  float* out = ms::out_arg<float>(p[5]);
  const int64_t es = dt == ms::F32 ? 4 : 2, rep = Hq / Hkv;
  const int64_t items = T * Hq;
  const int threads = ms::threads_for(items, (D1 + D2 + Dv) * std::max<int64_t>(1, nk));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> s(static_cast<size_t>(std::max<int64_t>(1, nk)));
    std::vector<int64_t> at(static_cast<size_t>(std::max<int64_t>(1, nk)));
    std::vector<float> o(static_cast<size_t>(Dv));
    int nt = 1, id = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    id = omp_get_thread_num();
#endif
    const int64_t per = (items + nt - 1) / nt, i0 = id * per, i1 = std::min(items, i0 + per);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t = it / Hq, h = it % Hq, kh = h / rep;
      const int64_t pos = start + t, hi = std::min(pos, nk - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const float* qt = q + t * a[17] + h * a[18];
      int64_t n = 0;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= hi; ++j) {
        if (mask != nullptr && !mask[t * a[21] + j]) continue;
        float acc[16] = {0};
        ms::dot_acc(qt, k1 + (kh * a[10] + j * a[11]) * es, dt, D1, acc);
        if (D2 > 0) ms::dot_acc(qt + D1, k2 + (kh * a[12] + j * a[13]) * es, dt, D2, acc);
        const float sc = ms::tree_sum<16>(acc) * scale;
        s[size_t(n)] = sc;
        at[size_t(n)] = j;
        ++n;
        m = std::max(m, sc);
      }
      const float sink = sinks != nullptr ? sinks[h] : 0.0f;
      if (sinks != nullptr) m = std::max(m, sink);
      float l = 0.0f;
      for (int64_t i = 0; i < Dv; ++i) o[size_t(i)] = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float e = ms::exp_c(s[size_t(i)] - m);
        l = l + e;
        const uint8_t* vj = v + (kh * a[14] + at[size_t(i)] * a[15]) * es;
        for (int64_t d = 0; d < Dv; ++d) o[size_t(d)] = std::fma(e, ms::ld(vj, dt, d), o[size_t(d)]);
      }
      if (sinks != nullptr) l = l + ms::exp_c(sink - m);
      float* ot = out + t * a[19] + h * a[20];
      for (int64_t d = 0; d < Dv; ++d) ot[d] = n > 0 ? o[size_t(d)] / l : 0.0f;
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
