// The C entry points of moestream's CPU kernels (called through ctypes from moestream/quant/native.py,
// which checks every shape first): a linear, the gated expert, the compiled paths. Output rows are split
// over OpenMP threads (the runtime PyTorch loaded, so torch.set_num_threads applies), never a reduction.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <vector>

#include "engine.h"
#include "q8.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ms {

// spec: kind, bits, group, bn, out, in, row0, row_step, pack (ggml and affine: the activation mode, q8.h), row_bytes,
//       s_row, s_dt, b_dt,
//       rot_b, rot_m, (rot_scale float32 bits) | rot_half << 32
// ptrs: weight, scales, biases (affine), value table (16 float32), signs (float32 [in]),
//       H_m (float32 [m, m]), output bias (float32 [out]), unused
constexpr int SPEC = 16, PTRS = 8;

static Lin make_lin(const int64_t* spec, const void* const* ptrs) {
  Lin L;
  L.kind = int(spec[0]);
  L.bits = int(spec[1]);
  L.group = spec[2];
  L.bn = spec[3];
  L.out = spec[4];
  L.in = spec[5];
  L.row0 = spec[6];
  L.row_step = spec[7];
  if (L.kind == GGML || L.kind == AFFINE)
    L.act = int(spec[8]);
  else
    L.pack = int(spec[8]);
  L.row_bytes = spec[9];
  L.s_row = spec[10];
  L.s_dt = int(spec[11]);
  L.b_dt = int(spec[12]);
  L.rot_b = spec[13];
  L.rot_m = spec[14];
  L.rot_scale = f32_bits(spec[15]);
  L.rot_half = (uint64_t(spec[15]) >> 32) != 0;
  L.w = static_cast<const uint8_t*>(ptrs[0]);
  L.s = static_cast<const uint8_t*>(ptrs[1]);
  L.b = static_cast<const uint8_t*>(ptrs[2]);
  if (ptrs[3] != nullptr) std::memcpy(L.lut, ptrs[3], sizeof(L.lut));
  L.signs = static_cast<const float*>(ptrs[4]);
  L.hm = static_cast<const float*>(ptrs[5]);
  L.out_bias = static_cast<const float*>(ptrs[6]);
  return L;
}

// out [n, in] = H_B(signs * x) per token: MLX's blockwise Hadamard in float32 with the operations of
// moestream.quant.turboquant.blockwise_hadamard in its order (Sylvester butterflies at strides 1, 2,
// 4, ... on each of the m rows of 2^k, then H_m mixing summed i = 0..m-1, then the scale), so the
// same bits; rounded to fp16 after when rot_half.
static void rotate(const Lin& L, const float* x, int64_t n, float* out) {
  const int64_t in = L.in, B = L.rot_b, m = L.rot_m, p = B / m;
  std::vector<float> mix(static_cast<size_t>(B));
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * in;
    float* o = out + t * in;
    for (int64_t i = 0; i < in; ++i) o[i] = xt[i] * L.signs[i];
    for (int64_t blk = 0; blk < in; blk += B) {
      float* v = o + blk;
      for (int64_t r = 0; r < m; ++r) {
        float* row = v + r * p;
        for (int64_t h = 1; h < p; h *= 2)
          for (int64_t i = 0; i < p; i += 2 * h)
            for (int64_t j = i; j < i + h; ++j) {
              const float a = row[j], c = row[j + h];
              row[j] = a + c;
              row[j + h] = a - c;
            }
      }
      if (m > 1) {
        for (int64_t j = 0; j < m; ++j)
          for (int64_t c = 0; c < p; ++c) {
            float s = L.hm[j * m] * v[c];
            for (int64_t i = 1; i < m; ++i) s = s + L.hm[j * m + i] * v[i * p + c];
            mix[size_t(j * p + c)] = s;
          }
        std::memcpy(v, mix.data(), size_t(B) * sizeof(float));
      }
      for (int64_t i = 0; i < B; ++i) v[i] = v[i] * L.rot_scale;
    }
    if (L.rot_half)
      for (int64_t i = 0; i < in; ++i) o[i] = static_cast<float>(c10_half_round(o[i]));
  }
}


// The function computing L's rows on `path`, or nullptr when that path is not compiled.
// A ggml linear takes its type's decoder (traits.h); every other kind the q group's.
static RowsFn rows_fn(int path, const Lin& L) {
  static const RowsFn q[3] = {rows_portable_q, rows_avx2_q, rows_avx512_q};
  if (path < 0 || path > 2) return nullptr;
  if (path == AVX512 && !MS_AVX512) return nullptr;
  if (path == AVX2 && !MS_AVX2) return nullptr;
  if (L.kind != GGML) return q[path];
  const GgmlTraits* t = ggml_traits(L.bits);
  return t == nullptr ? nullptr : t->rows.fn[path];
}

// Blocks [0, blocks) split over threads in contiguous ranges: f(b0, b1). At least ~64K weight-token products
// (`work` per block) per thread, so small linears stay on one.
template <class F>
static void split_blocks(int64_t blocks, int64_t work, F&& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, work));
  int threads = 1;
#ifdef _OPENMP
  if (!omp_in_parallel()) threads = int(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, blocks / grain)));
#endif
  if (threads <= 1) {
    f(int64_t(0), blocks);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (blocks + nt - 1) / nt, b0 = t * per, b1 = std::min(blocks, b0 + per);
    if (b0 < b1) f(b0, b1);
  }
#endif
}

// Output rows (columns for FLOAT_T) of L for n tokens split over threads in contiguous chunks of whole
// units: f(r0, r1) computes rows [r0, r1).
template <class F>
static void split_rows(const Lin& L, int64_t n, F&& f) {
  const int64_t unit = L.kind == FLOAT_T ? 32 : RB;
  const int64_t blocks = (L.out + unit - 1) / unit;
  split_blocks(blocks, unit * L.in * std::max<int64_t>(1, std::min<int64_t>(n, 8)),
               [&](int64_t b0, int64_t b1) { f(b0 * unit, std::min(L.out, b1 * unit)); });
}

// y [n, ldy] columns 0..L.out-1 for x [n, ldx]
static void run_linear(RowsFn fn, const Lin& L, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
  split_rows(L, n, [&](int64_t r0, int64_t r1) { fn(L, x, ldx, n, r0, r1, y, ldy); });
}

// y [xa.n, ldy] = W x for activations quantized to L's q8 type (q8.h)
static void run_q8(int path, const Lin& L, const Q8Rows& xa, float* y, int64_t ldy) {
  split_rows(L, xa.n, [&](int64_t r0, int64_t r1) { q8_rows(path, L, xa, r0, r1, y, ldy); });
}

// The whole linear: rotation of the input (turboquant), the zero-padded copy of an input whose width is
// not a multiple of 16, the product, the output bias.
// In q8 mode (q8_type_of(L)) the input is quantized here, or taken already quantized from `xq` (the same
// rows: a layer's experts share one quantization of their input).
static void run_full(int path, RowsFn fn, const Lin& L, const float* x, int64_t n, float* y, int64_t ldy,
                     const Q8Rows* xq = nullptr) {
  if (const int qt = q8_type_of(L); qt != Q8_NONE) {
    Q8Rows own;
    if (xq == nullptr || xq->type != qt) {
      q8_quantize(qt, x, L.in, n, L.in, own);
      xq = &own;
    }
    run_q8(path, L, *xq, y, ldy);
    if (L.out_bias != nullptr)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t o = 0; o < L.out; ++o) y[t * ldy + o] = y[t * ldy + o] + L.out_bias[o];
    return;
  }
  std::vector<float> xr;
  int64_t ldx = L.in;
  if (L.rot_b > 0) {
    xr.resize(size_t(n * L.in));
    rotate(L, x, n, xr.data());
    x = xr.data();
  }
  if (L.kind != FLOAT_T && L.in % 16) {
    const int64_t w = L.in16();
    std::vector<float> pad(size_t(n * w), 0.0f);
    for (int64_t t = 0; t < n; ++t) std::memcpy(pad.data() + t * w, x + t * L.in, size_t(L.in) * 4);
    xr.swap(pad);
    x = xr.data();
    ldx = w;
  }
  run_linear(fn, L, x, ldx, n, y, ldy);
  if (L.out_bias != nullptr)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t o = 0; o < L.out; ++o) y[t * ldy + o] = y[t * ldy + o] + L.out_bias[o];
}

// Linears Ls[0..m) of one input x [n, in] (float32) into y_j [n, ldy_j], in one parallel region: their row
// blocks laid end to end and split over the threads (a small k or v projection beside q no longer costs a
// region of its own). Each row by the same call as run_full (a row's bits do not depend on the rows beside
// it); in q8 mode x is quantized once when every linear takes the same type. Linears run_full treats
// specially (a rotation, a width not a multiple of 16, an output bias, FLOAT_T) go through run_full.
static void run_many(int path, const Lin* Ls, const RowsFn* fns, int m, const float* x, int64_t n, float* const* ys,
                     const int64_t* ldys) {
  bool plain = true;
  const int qt = q8_type_of(Ls[0]);
  for (int j = 0; j < m; ++j) {
    const Lin& L = Ls[j];
    plain = plain && L.rot_b == 0 && L.out_bias == nullptr && L.kind != FLOAT_T && L.in % 16 == 0 &&
            L.in == Ls[0].in && q8_type_of(L) == qt;
  }
  if (!plain) {
    for (int j = 0; j < m; ++j) run_full(path, fns[j], Ls[j], x, n, ys[j], ldys[j]);
    return;
  }
  Q8Rows xq;
  if (qt != Q8_NONE) q8_quantize(qt, x, Ls[0].in, n, Ls[0].in, xq);
  std::vector<int64_t> first(size_t(m + 1), 0);  // linear j's blocks are [first[j], first[j + 1])
  for (int j = 0; j < m; ++j) first[size_t(j + 1)] = first[size_t(j)] + (Ls[j].out + RB - 1) / RB;
  const int64_t blocks = first[size_t(m)];
  auto range = [&](int64_t b0, int64_t b1) {  // blocks [b0, b1), linear by linear
    for (int j = 0; j < m && b0 < b1; ++j) {
      const int64_t lo = std::max(b0, first[size_t(j)]), hi = std::min(b1, first[size_t(j + 1)]);
      if (lo >= hi) continue;
      const int64_t r0 = (lo - first[size_t(j)]) * RB, r1 = std::min(Ls[j].out, (hi - first[size_t(j)]) * RB);
      if (qt != Q8_NONE)
        q8_rows(path, Ls[j], xq, r0, r1, ys[j], ldys[j]);
      else
        fns[j](Ls[j], x, Ls[j].in, n, r0, r1, ys[j], ldys[j]);
    }
  };
  split_blocks(blocks, RB * Ls[0].in * std::max<int64_t>(1, std::min<int64_t>(n, 8)), range);
}

float exp_canonical(float x) { return exp_c(x); }

static inline float sigmoid_c(float z) { return 1.0f / (1.0f + exp_c(-z)); }

// g [n, I] <- act(g, u) in place (ms_expert's activations)
static void activate(int act, const float* params, float* g, const float* u, int64_t n) {
  if (act == 0) {
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + exp_c(-g[i])) * u[i];
  } else if (act == 1) {
    const float beta = params[0], lb = params[1];
    for (int64_t i = 0; i < n; ++i) {
      const float a = beta * std::tanh(g[i] / beta) * sigmoid_c(g[i]);
      g[i] = a * (std::isnan(lb) ? u[i] : lb * std::tanh(u[i] / lb));
    }
  } else {
    const float alpha = params[0], limit = params[1];
    for (int64_t i = 0; i < n; ++i) {
      const float gc = std::min(g[i], limit), uc = std::min(std::max(u[i], -limit), limit);
      g[i] = (uc + 1.0f) * (gc * sigmoid_c(gc * alpha));
    }
  }
}

// One gated expert on n rows x [n, in] (float32) into y [n, out] (float32): run_full of gate and up, the
// activation, run_full of down. g and u are scratch of n * I floats.
static void expert_rows(int path, const int64_t* specs, const void* const* ptrs, const float* x, int64_t n, float* y,
                        int act, const float* params, std::vector<float>& g, std::vector<float>& u,
                        const Q8Rows* xq = nullptr) {
  Lin G = make_lin(specs, ptrs), U = make_lin(specs + SPEC, ptrs + PTRS), D = make_lin(specs + 2 * SPEC, ptrs + 2 * PTRS);
  const int64_t I = G.out;
  if (g.size() < size_t(n * I)) g.resize(size_t(n * I));
  if (u.size() < size_t(n * I)) u.resize(size_t(n * I));
  Q8Rows own;  // gate and up share their input's quantization
  if (xq == nullptr && q8_type_of(G) != Q8_NONE && q8_type_of(G) == q8_type_of(U)) {
    q8_quantize(q8_type_of(G), x, G.in, n, G.in, own);
    xq = &own;
  }
  run_full(path, rows_fn(path, G), G, x, n, g.data(), I, xq);
  run_full(path, rows_fn(path, U), U, x, n, u.data(), I, xq);
  activate(act, params, g.data(), u.data(), n * I);
  run_full(path, rows_fn(path, D), D, g.data(), n, y, D.out);
}

// value v rounded to dtype dt (the cast a torch .to(dt) makes), as float32
static inline float round_to(float v, int dt) {
  if (dt == BF16) return bf16_to_float(to_bf16(v));
  if (dt == F16) return c10_half_round(v);
  return v;
}

// sum of squares of n float32 values by the canonical reduction (16 lanes, one chain, one tree)
static float sum_squares16(const float* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(x[i + l], x[i + l], acc[l]);
  for (int l = 0; i + l < n; ++l) acc[l] = std::fma(x[i + l], x[i + l], acc[l]);
  return tree_sum<16>(acc);
}

// The decoder layer's elementwise steps with the dtype a template argument (no switch per value), rows split
// over threads when there are many (each element's value is its own: the bits do not depend on the split).
static int rows_threads(int64_t rows, int64_t per_row) {
  int t = 1;
#ifdef _OPENMP
  if (!omp_in_parallel() && rows > 1 && rows * per_row >= (int64_t(1) << 16)) t = int(std::min<int64_t>(omp_get_max_threads(), rows));
#endif
  return t;
}

// out[i] = round(a[i] + b[i]) for rows x [T, H] (out may be a)
template <int DT>
static void add_rows_t(const uint8_t* a, const uint8_t* b, uint8_t* out, int64_t T, int64_t H) {
  const int threads = rows_threads(T, H);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = t * H; i < (t + 1) * H; ++i) st_dt(out, DT, i, ldf<DT>(a, i) + ldf<DT>(b, i));
}

// h[t] = round(h[t] + s) with s = slots[t, 0] + slots[t, 1] + ... (each sum rounded: pipeline.sum_slots)
template <int DT>
static void sum_slots_add_t(const uint8_t* slots, uint8_t* h, int64_t T, int64_t K, int64_t H) {
  const int threads = rows_threads(T, K * H);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) {
      float acc = ldf<DT>(slots, (t * K) * H + i);
      for (int64_t k = 1; k < K; ++k) acc = round_to(acc + ldf<DT>(slots, (t * K + k) * H + i), DT);
      st_dt(h, DT, t * H + i, ldf<DT>(h, t * H + i) + acc);
    }
}

// float32 copy of n values of dtype DT
template <int DT>
static void widen_t(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ldf<DT>(src, i);
}

template <class F>
static void by_dt(int dt, F&& f) {
  if (dt == BF16) f(std::integral_constant<int, BF16>());
  else if (dt == F16) f(std::integral_constant<int, F16>());
  else f(std::integral_constant<int, F32>());
}
int moe_core(int path, int64_t n_e, const int64_t* specs, const void* const* ptrs, const int64_t* rows,
             const int64_t* starts, const float* x, int64_t K, int64_t h_in, int64_t h_out, const float* w, int act,
             const float* params, int x_dt, int prod_dt, int out_dt, void* out);

// Softmax routing of one token (transformers' Qwen3MoeTopKRouter, its operations spelled out so that the bits
// depend only on the logits): p_j = e_j / s with e_j = exp_c(l_j - max l) and s = e_0 + e_1 + ... in order;
// the K largest p (a tie: the lower index first), in descending order; with norm each divided by their sum
// (w_0 + w_1 + ... in order). l [E] float32; w [K] float32 (not rounded); idx [K]; p [E] scratch.
static void route_softmax_row(const float* l, int64_t E, int64_t K, bool norm, float* w, int64_t* idx, float* p) {
  float m = l[0];
  for (int64_t j = 1; j < E; ++j) m = std::max(m, l[j]);
  float s = 0.0f;
  for (int64_t j = 0; j < E; ++j) {
    p[j] = exp_c(l[j] - m);
    s += p[j];
  }
  for (int64_t j = 0; j < E; ++j) p[j] = p[j] / s;
  for (int64_t k = 0; k < K; ++k) {
    int64_t best = -1;
    for (int64_t j = 0; j < E; ++j)
      if (p[j] >= 0.0f && (best < 0 || p[j] > p[best])) best = j;
    if (best < 0) best = k;  // NaN logits: any valid index (the weights are NaN)
    idx[k] = best;
    w[k] = p[best];
    p[best] = -1.0f;  // taken (probabilities are >= 0)
  }
  if (norm) {
    float t = 0.0f;
    for (int64_t k = 0; k < K; ++k) t += w[k];
    for (int64_t k = 0; k < K; ++k) w[k] = w[k] / t;
  }
}

}  // namespace ms

extern "C" {
int ms_attention(const int64_t* a, const void* const* p);
int ms_rmsnorm(const int64_t* a, const void* const* p);
int ms_attn_block(int path, const int64_t* a, const int64_t* specs, const void* const* sptrs, const void* const* p);
}

extern "C" {

// q8 mode's activation quantizer (q8.h): x [n, in] float32 as blocks of `type` (1 Q8_K, 2 Q8_0, an affine type:
// 3 (4-bit) or 4 (8-bit) | group << 4) into out
// [n, stride] bytes (row t: int8 codes [in], float32 scales, then int16 16-sums or int32 block sums); the
// stride, or -1 for a bad type or width. out nullptr: the stride only.
int64_t ms_q8_quantize(int type, const float* x, int64_t n, int64_t in, void* out) {
  if (n < 0 || in <= 0) return -1;
  if (ms::q8_affine(type)) {  // affine: the weights' group in the type (q8.h), whole 64-value chunks
    const int64_t g = ms::q8_group(type);
    if ((g != 32 && (g < 64 || g % 64)) || in % 64 || in % g) return -1;
  } else if ((type != ms::Q8_KB && type != ms::Q8_0B) || in % (type == ms::Q8_KB ? 256 : 32)) {
    return -1;
  }
  const int64_t stride = ms::q8_stride(type, in);
  if (out == nullptr) return stride;
  ms::Q8Rows q;
  ms::q8_quantize(type, x, in, n, in, q);
  if (n > 0) std::memcpy(out, q.data.data(), size_t(n * stride));
  return stride;
}

// Bit mask of the compiled paths: 1 portable, 2 AVX2, 4 AVX-512.
int ms_paths(void) { return 1 | (MS_AVX2 ? 2 : 0) | (MS_AVX512 ? 4 : 0); }

// Row i of the ggml type-traits table (traits.h): out [6] = type code, weights per block, bytes per block,
// weights per decoded sub-block, q8 mode's activation block (0 none, 1 Q8_K, 2 Q8_0), the decoder's format
// group (1 g, 2 x); *name its name. Returns the number of rows, or -1 for an i that names none (out and name
// may be nullptr: the count only).
int ms_ggml_traits(int i, int64_t* out, const char** name) {
  const ms::GgmlTraits* t = ms::ggml_traits(i);
  if (t == nullptr) return out == nullptr && name == nullptr ? int(ms::G_COUNT) : -1;
  if (out != nullptr) {
    const int64_t fields[6] = {t->type, t->block, t->type_size, t->group, t->q8,
                               t->rows.fn[0] == ms::ROWS_X.fn[0] ? 2 : 1};
    std::memcpy(out, fields, sizeof(fields));
  }
  if (name != nullptr) *name = t->name;
  return int(ms::G_COUNT);
}

// y [n, out] (float32) = rot(x) [n, in] (float32) W^T + bias. 0, or -1 when `path` is not compiled.
int ms_linear(int path, const int64_t* spec, const void* const* ptrs, const float* x, int64_t n, float* y) {
  ms::Lin L = ms::make_lin(spec, ptrs);
  ms::RowsFn fn = ms::rows_fn(path, L);
  if (fn == nullptr) return -1;
  ms::run_full(path, fn, L, x, n, y, L.out);
  return 0;
}

// out [n, in] = H_B(signs * x) (turboquant's input rotation) for the linear's rotation fields.
int ms_rotate(const int64_t* spec, const void* const* ptrs, const float* x, int64_t n, float* out) {
  ms::Lin L = ms::make_lin(spec, ptrs);
  if (L.rot_b <= 0) return -1;
  ms::rotate(L, x, n, out);
  return 0;
}

// One gated expert: y [n, H] = down(act(gate x, up x)) for x [n, H], all float32; specs and ptrs of gate,
// up, down in that order. act 0: SwiGLU, silu(g) * u; 1: SiTU-GLU (Kimi K3), beta tanh(g / beta)
// sigmoid(g) * (linear_beta tanh(u / linear_beta), or u when linear_beta is NaN), params {beta,
// linear_beta}; 2: gpt-oss's clamped SwiGLU, (clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g') with
// g' = min(g, limit), params {alpha, limit}. The intermediate [n, I] stays float32; sigmoid is
// 1 / (1 + exp_c(-z)).
int ms_expert(int path, const int64_t* specs, const void* const* ptrs, const float* x, int64_t n, float* y, int act,
              const float* params) {
  ms::Lin G = ms::make_lin(specs, ptrs), U = ms::make_lin(specs + ms::SPEC, ptrs + ms::PTRS),
          D = ms::make_lin(specs + 2 * ms::SPEC, ptrs + 2 * ms::PTRS);
  ms::RowsFn fg = ms::rows_fn(path, G), fu = ms::rows_fn(path, U), fd = ms::rows_fn(path, D);
  if (fg == nullptr || fu == nullptr || fd == nullptr || act < 0 || act > 2) return -1;
  (void)G, (void)U;
  (void)D;
  std::vector<float> g, u;
  ms::expert_rows(path, specs, ptrs, x, n, y, act, params, g, u);
  return 0;
}

// A MoE layer's experts on the tokens routed to them, each slot's output weighted and rounded as the
// expert pipeline does (moestream/pipeline.py compute_slots): expert e (specs and ptrs at e * 3 * SPEC and
// e * 3 * PTRS, as ms_expert) computes the rows x[s / K] for its slots s = rows[starts[e]], ...,
// rows[starts[e + 1] - 1] (slot s = token * K + k); its output y (float32) becomes
// out[s] = round_o(round_p(round_x(y) * w[s])) with round_x to x_dt (the expert's output dtype), round_p to
// prod_dt (the product's promoted dtype) and round_o to out_dt; out [T * K, H_out] in out_dt. x [T, H_in] and
// w [T * K] float32. Experts run on threads (whole experts when there are several per thread, else each
// expert's rows split): an output's bits are the same as ms_expert's on that expert and row alone. In q8 mode
// (q8.h) x is quantized once for the layer and each expert's gate and up read their tokens' rows of it.
// 0, or -1 when a path is not compiled or an argument is bad.
int ms_moe(int path, int64_t n_e, const int64_t* specs, const void* const* ptrs, const int64_t* rows,
           const int64_t* starts, const float* x, int64_t K, int64_t h_in, int64_t h_out, const float* w, int act,
           const float* params, int x_dt, int prod_dt, int out_dt, void* out) {
  return ms::moe_core(path, n_e, specs, ptrs, rows, starts, x, K, h_in, h_out, w, act, params, x_dt, prod_dt, out_dt,
                      out);
}

}  // extern "C"

namespace ms {
int moe_core(int path, int64_t n_e, const int64_t* specs, const void* const* ptrs, const int64_t* rows,
             const int64_t* starts, const float* x, int64_t K, int64_t h_in, int64_t h_out, const float* w, int act,
             const float* params, int x_dt, int prod_dt, int out_dt, void* out) {
  if (n_e < 0 || K < 1 || act < 0 || act > 2) return -1;
  for (int64_t e = 0; e < n_e; ++e)
    for (int j = 0; j < 3; ++j) {
      ms::Lin L = ms::make_lin(specs + (3 * e + j) * ms::SPEC, ptrs + (3 * e + j) * ms::PTRS);
      if (ms::rows_fn(path, L) == nullptr) return -1;
    }
  uint8_t* o = static_cast<uint8_t*>(out);
  // q8 mode: the layer's input quantized once (token-major) for every expert whose gate and up take that type
  int qt = ms::Q8_NONE;
  for (int64_t e = 0; e < n_e && qt == ms::Q8_NONE; ++e) {
    const ms::Lin G = ms::make_lin(specs + 3 * e * ms::SPEC, ptrs + 3 * e * ms::PTRS);
    const ms::Lin U = ms::make_lin(specs + (3 * e + 1) * ms::SPEC, ptrs + (3 * e + 1) * ms::PTRS);
    if (ms::q8_type_of(G) == ms::q8_type_of(U)) qt = ms::q8_type_of(G);
  }
  ms::Q8Rows xq_all;  // the call's tokens only (a read expert's call: its own), in order of first use
  std::vector<int64_t> at;  // token -> its row of xq_all
  if (qt != ms::Q8_NONE) {
    int64_t T = 0;
    for (int64_t i = 0; i < starts[n_e]; ++i) T = std::max(T, rows[i] / K + 1);
    at.assign(size_t(T), -1);
    std::vector<float> used;
    int64_t m = 0;
    for (int64_t i = 0; i < starts[n_e]; ++i) {
      const int64_t t = rows[i] / K;
      if (at[size_t(t)] >= 0) continue;
      at[size_t(t)] = m++;
      used.insert(used.end(), x + t * h_in, x + (t + 1) * h_in);
    }
    ms::q8_quantize(qt, used.data(), h_in, m, h_in, xq_all);
  }
  auto one = [&](int64_t e, std::vector<float>& xe, std::vector<float>& ye, std::vector<float>& g,
                 std::vector<float>& u, ms::Q8Rows& xq) {
    const int64_t a = starts[e], n = starts[e + 1] - a;
    if (n <= 0) return;
    if (xe.size() < size_t(n * h_in)) xe.resize(size_t(n * h_in));
    if (ye.size() < size_t(n * h_out)) ye.resize(size_t(n * h_out));
    for (int64_t i = 0; i < n; ++i) std::memcpy(xe.data() + i * h_in, x + (rows[a + i] / K) * h_in, size_t(h_in) * 4);
    const ms::Lin G = ms::make_lin(specs + 3 * e * ms::SPEC, ptrs + 3 * e * ms::PTRS);
    const ms::Lin U = ms::make_lin(specs + (3 * e + 1) * ms::SPEC, ptrs + (3 * e + 1) * ms::PTRS);
    const bool shared = qt != ms::Q8_NONE && ms::q8_type_of(G) == qt && ms::q8_type_of(U) == qt;
    if (shared) {  // this expert's tokens' rows of the layer's quantization
      xq.type = qt, xq.in = h_in, xq.n = n, xq.stride = xq_all.stride;
      if (xq.data.size() < size_t(n * xq.stride)) xq.data.resize(size_t(n * xq.stride));
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(xq.row(i), xq_all.row(at[size_t(rows[a + i] / K)]), size_t(xq.stride));
    }
    ms::expert_rows(path, specs + 3 * e * ms::SPEC, ptrs + 3 * e * ms::PTRS, xe.data(), n, ye.data(), act, params,
                    g, u, shared ? &xq : nullptr);
    if (x_dt == prod_dt && x_dt == out_dt) {  // one dtype (a model's own): no switch per value
      ms::by_dt(x_dt, [&](auto D) {
        constexpr int DT = decltype(D)::value;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t s = rows[a + i];
          const float ws = w[s];
          const float* yr = ye.data() + i * h_out;
          for (int64_t h = 0; h < h_out; ++h) ms::st_dt(o, DT, s * h_out + h, ms::round_to(yr[h], DT) * ws);
        }
      });
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = rows[a + i];
      const float ws = w[s];
      for (int64_t h = 0; h < h_out; ++h) {
        const float v = ms::round_to(ms::round_to(ye[size_t(i * h_out + h)], x_dt) * ws, prod_dt);
        ms::st_dt(o, out_dt, s * h_out + h, v);
      }
    }
  };
  int threads = 1;
#ifdef _OPENMP
  if (!omp_in_parallel()) threads = omp_get_max_threads();
#endif
  if (threads > 1 && n_e >= 2 * threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> xe, ye, g, u;
      ms::Q8Rows xq;
#pragma omp for schedule(dynamic, 1)
      for (int64_t e = 0; e < n_e; ++e) one(e, xe, ye, g, u, xq);
    }
#endif
  } else {
    std::vector<float> xe, ye, g, u;
    ms::Q8Rows xq;
    for (int64_t e = 0; e < n_e; ++e) one(e, xe, ye, g, u, xq);
  }
  return 0;
}
}  // namespace ms

extern "C" {

// The attention block of one sequence's T tokens, as transformers' Qwen3MoeAttention and moestream.models.layers
// .Attention compute it op by op (the same roundings, so the same bits): q, k, v = x W^T (each rounded to the
// model dtype dt), per-head RMSNorm of q and k (weight * round(x r), rounded; if has_norm), rotary on their first
// `rot` dims (round(round(x cos) + round(rotate_half(x) sin)) in dt), k and v stored in the cache at positions
// start..start+T-1, attention over positions 0..start+T-1 (ms_attention), its output rounded to dt, then o =
// out W_o^T rounded to dt.
// a: 0 T, 1 Hq, 2 Hkv, 3 D, 4 rot, 5 dt, 6 start, 7 window (0: none), 8 cache head stride, 9 cache position
//    stride (elements), 10 scale (float32 bits), 11 norm eps (float32 bits), 12 has_norm
// specs/ptrs: q, k, v, o (4 x SPEC, 4 x PTRS); p: x [T, H] (dt), q_norm w [D] (dt), k_norm w, cos [T, rot] (dt),
//    sin, k cache, v cache (dt), out [T, H] (dt). 0, or -1 when a path is not compiled or an argument is bad.
int ms_attn_block(int path, const int64_t* a, const int64_t* specs, const void* const* sptrs, const void* const* p) {
  const int64_t T = a[0], Hq = a[1], Hkv = a[2], D = a[3], rot = a[4], start = a[6], window = a[7];
  const int dt = int(a[5]);
  if (T < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || rot < 0 || rot > D || rot % 2 || dt < 0 || dt > 2) return -1;
  ms::Lin Lq = ms::make_lin(specs, sptrs), Lk = ms::make_lin(specs + ms::SPEC, sptrs + ms::PTRS),
          Lv = ms::make_lin(specs + 2 * ms::SPEC, sptrs + 2 * ms::PTRS),
          Lo = ms::make_lin(specs + 3 * ms::SPEC, sptrs + 3 * ms::PTRS);
  ms::RowsFn fq = ms::rows_fn(path, Lq), fk = ms::rows_fn(path, Lk), fv = ms::rows_fn(path, Lv), fo = ms::rows_fn(path, Lo);
  if (!fq || !fk || !fv || !fo || Lq.out != Hq * D || Lk.out != Hkv * D || Lv.out != Hkv * D || Lo.in != Hq * D ||
      Lq.in != Lk.in || Lq.in != Lv.in || Lo.out != Lq.in)
    return -1;
  const int64_t H = Lq.in;
  const float scale = ms::f32_bits(a[10]), eps = ms::f32_bits(a[11]);
  const uint8_t *x = ms::in_arg<uint8_t>(p[0]), *qw = ms::in_arg<uint8_t>(p[1]), *kw = ms::in_arg<uint8_t>(p[2]),
                *cosp = ms::in_arg<uint8_t>(p[3]), *sinp = ms::in_arg<uint8_t>(p[4]);
  uint8_t *kc = ms::out_arg<uint8_t>(p[5]), *vc = ms::out_arg<uint8_t>(p[6]), *out = ms::out_arg<uint8_t>(p[7]);
  std::vector<float> xf(size_t(T * H)), q(size_t(T * Hq * D)), k(size_t(T * Hkv * D)), v(size_t(T * Hkv * D));
  for (int64_t i = 0; i < T * H; ++i) xf[size_t(i)] = ms::ld_dt(x, dt, i);
  {
    const ms::Lin ls[3] = {Lq, Lk, Lv};
    const ms::RowsFn fs[3] = {fq, fk, fv};
    float* const ys[3] = {q.data(), k.data(), v.data()};
    const int64_t lds[3] = {Hq * D, Hkv * D, Hkv * D};
    ms::run_many(path, ls, fs, 3, xf.data(), T, ys, lds);
  }
  for (auto* buf : {&q, &k, &v})
    for (float& f : *buf) f = ms::round_to(f, dt);
  const int64_t half = rot / 2;
  // per head: norm, then rotary (q [T, Hq, D] and k [T, Hkv, D] laid out token-major)
  auto head = [&](float* h, const uint8_t* w, int64_t t) {
    if (a[12]) {
      const float r = 1.0f / std::sqrt(ms::sum_squares16(h, D) / float(D) + eps);
      for (int64_t i = 0; i < D; ++i) h[i] = ms::round_to(ms::ld_dt(w, dt, i) * ms::round_to(h[i] * r, dt), dt);
    }
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = h[i], x2 = h[i + half];
      const float c1 = ms::ld_dt(cosp, dt, t * rot + i), s1 = ms::ld_dt(sinp, dt, t * rot + i);
      const float c2 = ms::ld_dt(cosp, dt, t * rot + i + half), s2 = ms::ld_dt(sinp, dt, t * rot + i + half);
      h[i] = ms::round_to(ms::round_to(x1 * c1, dt) + ms::round_to(-x2 * s1, dt), dt);
      h[i + half] = ms::round_to(ms::round_to(x2 * c2, dt) + ms::round_to(x1 * s2, dt), dt);
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hh = 0; hh < Hq; ++hh) head(q.data() + (t * Hq + hh) * D, qw, t);
    for (int64_t hh = 0; hh < Hkv; ++hh) head(k.data() + (t * Hkv + hh) * D, kw, t);
  }
  const int64_t hs = a[8], ps = a[9];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hh = 0; hh < Hkv; ++hh)
      for (int64_t i = 0; i < D; ++i) {
        const int64_t at = hh * hs + (start + t) * ps + i;
        ms::st_dt(kc, dt, at, k[size_t((t * Hkv + hh) * D + i)]);
        ms::st_dt(vc, dt, at, v[size_t((t * Hkv + hh) * D + i)]);
      }
  std::vector<float> att(size_t(T * Hq * D));
  const int64_t aa[22] = {T, Hq, Hkv, D, 0, D, dt, start, window, start + T, hs, ps, 0, 0, hs, ps, a[10],
                          Hq * D, D, Hq * D, D, 0};
  const void* ap[7] = {q.data(), kc, nullptr, vc, nullptr, att.data(), nullptr};
  if (ms_attention(aa, ap)) return -1;
  for (float& f : att) f = ms::round_to(f, dt);
  std::vector<float> o(size_t(T * H));
  ms::run_full(path, fo, Lo, att.data(), T, o.data(), H);
  for (int64_t i = 0; i < T * H; ++i) ms::st_dt(out, dt, i, o[size_t(i)]);
  return 0;
}

}  // extern "C"

extern "C" {

// Softmax top-k routing (ms::route_softmax_row per token), the weights rounded to out_dt.
// a: 0 T, 1 E, 2 K, 3 norm (0/1), 4 logits dtype, 5 logits row stride (elements), 6 out dtype;
// p: logits [T, E], weights out [T, K] (out dtype), idx out [T, K] int64. 0, or -1 for a bad argument.
int ms_route_softmax(const int64_t* a, const void* const* p) {
  const int64_t T = a[0], E = a[1], K = a[2], ls = a[5];
  const int ldt = int(a[4]), odt = int(a[6]);
  if (T < 0 || E < 1 || K < 1 || K > E || ls < E || ldt < 0 || ldt > 2 || odt < 0 || odt > 2) return -1;
  const uint8_t* l = ms::in_arg<uint8_t>(p[0]);
  uint8_t* w = ms::out_arg<uint8_t>(p[1]);
  int64_t* idx = ms::out_arg<int64_t>(p[2]);
  std::vector<float> lf(static_cast<size_t>(E)), pr(static_cast<size_t>(E)), wk(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < E; ++j) lf[size_t(j)] = ms::ld_dt(l, ldt, t * ls + j);
    ms::route_softmax_row(lf.data(), E, K, a[3] != 0, wk.data(), idx + t * K, pr.data());
    for (int64_t k = 0; k < K; ++k) ms::st_dt(w, odt, t * K + k, wk[size_t(k)]);
  }
  return 0;
}

// One pre-norm decoder layer of a sequence's T tokens whose feed-forward block is softmax-routed gated experts
// (Qwen3-MoE's and the families like it; moestream.models.layers.DecoderLayer with Attention and StreamedMoE),
// with the operations and roundings of that op-by-op path, so the same bits:
//   x1 = rmsnorm(h, w1); h1 = h + attn(x1) (ms_attn_block); x2 = rmsnorm(h1, w2); logits = round(x2 Wg^T);
//   (weights, idx) = ms_route_softmax(logits); slots = ms_moe(x2, the routed experts); h_out = h1 + the slots of each
//   token summed k = 0..K-1 in order (each sum and the residual rounded to dt: pipeline.sum_slots, then the add).
// The experts come from `table` ([2E]: expert e's 3 x SPEC fields and 3 x PTRS pointers as ms_moe takes them,
// null where the caller's cache does not hold it). When a routed expert is missing the layer stops after routing
// and returns 1: h_out then holds h1, x2 its norm and weights/idx the routing, for the caller to fetch and go on.
// a: 0 T, 1 H, 2 dt (h, the norms' weights, the cache), 3 eps of the norms (float32 bits), 4 E, 5 K, 6 norm_topk,
//    7 act (as ms_expert); aa/aspecs/asptrs: ms_attn_block's a, specs and ptrs; ap: its p (x and out unused);
//    gspec/gptrs: the router's linear (SPEC, PTRS); params: float[2] of the activation;
// io: 0 h [T, H], 1 w1 [H], 2 w2 [H], 3 h_out [T, H], 4 x2 [T, H], 5 weights [T, K] (dt), 6 idx [T, K] int64,
//     7 used [2 T K] int64 (the experts in order of first use, then their slot counts), 8 info [2] int64 (the
//     experts used, the CPU nanoseconds of the expert part). 0, 1, or -1 for a bad argument or path.
int ms_decoder_layer(int path, const int64_t* a, const int64_t* aa, const int64_t* aspecs, const void* const* asptrs,
                     const void* const* ap, const int64_t* gspec, const void* const* gptrs, const void* const* table,
                     const float* params, void* const* io) {
  const int64_t T = a[0], H = a[1], E = a[4], K = a[5];
  const int dt = int(a[2]), act = int(a[7]);
  if (T < 1 || H < 1 || E < 1 || K < 1 || K > E || dt < 0 || dt > 2 || act < 0 || act > 2 || aa[0] != T) return -1;
  const ms::Lin G = ms::make_lin(gspec, gptrs);
  const ms::RowsFn fg = ms::rows_fn(path, G);
  if (fg == nullptr || G.in != H || G.out != E) return -1;
  const uint8_t* h = ms::in_arg<uint8_t>(io[0]);
  uint8_t *ho = ms::out_arg<uint8_t>(io[3]), *x2 = ms::out_arg<uint8_t>(io[4]), *wo = ms::out_arg<uint8_t>(io[5]);
  int64_t *idx = ms::out_arg<int64_t>(io[6]), *used = ms::out_arg<int64_t>(io[7]), *info = ms::out_arg<int64_t>(io[8]);
  const size_t es = dt == ms::F32 ? 4 : 2;
  std::vector<uint8_t> x1(size_t(T * H) * es), att(size_t(T * H) * es);
  const int64_t na[9] = {T, H, dt, dt, dt, 0, H, H, a[3]};
  const void* n1[3] = {h, io[1], x1.data()};
  if (ms_rmsnorm(na, n1)) return -1;
  const void* app[8] = {x1.data(), ap[1], ap[2], ap[3], ap[4], ap[5], ap[6], att.data()};
  if (ms_attn_block(path, aa, aspecs, asptrs, app)) return -1;
  ms::by_dt(dt, [&](auto D) { ms::add_rows_t<decltype(D)::value>(h, att.data(), ho, T, H); });
  const void* n2[3] = {ho, io[2], x2};
  if (ms_rmsnorm(na, n2)) return -1;
  std::vector<float> x2f(size_t(T * H)), logits(size_t(T * E));
  ms::by_dt(dt, [&](auto D) { ms::widen_t<decltype(D)::value>(x2, x2f.data(), T * H); });
  ms::run_full(path, fg, G, x2f.data(), T, logits.data(), E);
  std::vector<float> pr(static_cast<size_t>(E)), wf(size_t(T * K));
  for (int64_t t = 0; t < T; ++t) {
    float* l = logits.data() + t * E;
    for (int64_t j = 0; j < E; ++j) l[j] = ms::round_to(l[j], dt);
    ms::route_softmax_row(l, E, K, a[6] != 0, wf.data() + t * K, idx + t * K, pr.data());
    for (int64_t k = 0; k < K; ++k) {
      wf[size_t(t * K + k)] = ms::round_to(wf[size_t(t * K + k)], dt);
      ms::st_dt(wo, dt, t * K + k, wf[size_t(t * K + k)]);
    }
  }
  // the experts in order of first use, each one's slots ascending (as the pipeline groups them)
  std::vector<int64_t> order, first(size_t(E), -1), count(size_t(E), 0);
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = idx[s];
    if (e < 0 || e >= E) return -1;
    if (first[size_t(e)] < 0) {
      first[size_t(e)] = int64_t(order.size());
      order.push_back(e);
    }
    ++count[size_t(e)];
  }
  const int64_t n_e = int64_t(order.size());
  info[0] = n_e;
  info[1] = 0;
  for (int64_t i = 0; i < n_e; ++i) {
    used[i] = order[size_t(i)];
    used[n_e + i] = count[size_t(order[size_t(i)])];
  }
  for (int64_t e : order)
    if (table[2 * e] == nullptr || table[2 * e + 1] == nullptr) return 1;
  std::vector<int64_t> specs(size_t(n_e * 3 * ms::SPEC)), starts(size_t(n_e + 1), 0), rows(size_t(T * K));
  std::vector<const void*> ptrs(size_t(n_e * 3 * ms::PTRS));
  for (int64_t i = 0; i < n_e; ++i) {
    const int64_t e = order[size_t(i)];
    std::memcpy(specs.data() + i * 3 * ms::SPEC, table[2 * e], sizeof(int64_t) * 3 * ms::SPEC);
    std::memcpy(ptrs.data() + i * 3 * ms::PTRS, table[2 * e + 1], sizeof(void*) * 3 * ms::PTRS);
    starts[size_t(i + 1)] = starts[size_t(i)] + count[size_t(e)];
  }
  std::vector<int64_t> at(starts.begin(), starts.end() - 1);
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t i = first[size_t(idx[s])];
    rows[size_t(at[size_t(i)]++)] = s;
  }
  for (int64_t i = 0; i < n_e; ++i) {  // every expert's linears chain from H to H
    const int64_t* sp = specs.data() + 3 * i * ms::SPEC;
    if (sp[5] != H || sp[ms::SPEC + 5] != H || sp[2 * ms::SPEC + 4] != H || sp[4] != sp[ms::SPEC + 4] ||
        sp[4] != sp[2 * ms::SPEC + 5])
      return -1;
  }
  std::vector<uint8_t> slots(size_t(T * K * H) * es);
  timespec c0{}, c1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  if (ms::moe_core(path, n_e, specs.data(), ptrs.data(), rows.data(), starts.data(), x2f.data(), K, H, H, wf.data(),
                   act, params, dt, dt, dt, slots.data()))
    return -1;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
  info[1] = int64_t(c1.tv_sec - c0.tv_sec) * 1000000000 + (c1.tv_nsec - c0.tv_nsec);
  ms::by_dt(dt, [&](auto D) { ms::sum_slots_add_t<decltype(D)::value>(slots.data(), ho, T, K, H); });
  return 0;
}

}  // extern "C"

extern "C" {

// Decoder layers 0..n-1 one after another, each exactly as ms_decoder_layer (one call each, without a return to
// the caller between them). l: n x 10 pointers, layer j's ms_decoder_layer arguments a, aa, aspecs, asptrs, ap,
// gspec, gptrs, table, params, io (the caller chains them: layer j + 1's io[0] is layer j's io[3]). Returns the
// layers computed whole; at the first layer whose experts are not all held it stops with *stopped = 1 (that
// layer's io as ms_decoder_layer's return 1 leaves it: the caller goes on from its routing), else *stopped = 0.
// -1 for a bad argument.
int64_t ms_decoder_stack(int path, int64_t n, const void* const* l, int64_t* stopped) {
  *stopped = 0;
  for (int64_t j = 0; j < n; ++j) {
    const void* const* p = l + 10 * j;
    const int rc = ms_decoder_layer(path, static_cast<const int64_t*>(p[0]), static_cast<const int64_t*>(p[1]),
                                    static_cast<const int64_t*>(p[2]), static_cast<const void* const*>(p[3]),
                                    static_cast<const void* const*>(p[4]), static_cast<const int64_t*>(p[5]),
                                    static_cast<const void* const*>(p[6]), static_cast<const void* const*>(p[7]),
                                    static_cast<const float*>(p[8]), static_cast<void* const*>(p[9]));
    if (rc < 0) return -1;
    if (rc == 1) {
      *stopped = 1;
      return j;
    }
  }
  return n;
}

}  // extern "C"
