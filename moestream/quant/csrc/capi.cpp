// The C entry points of moestream's CPU kernels (called through ctypes from moestream/quant/native.py,
// which checks every shape first): a linear, the gated expert, the compiled paths. Output rows are split
// over OpenMP threads (the runtime PyTorch loaded, so torch.set_num_threads applies), never a reduction.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ms {

// spec: kind, bits, group, bn, out, in, row0, row_step, pack, row_bytes, s_row, s_dt, b_dt,
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
  L.pack = int(spec[8]);
  L.row_bytes = spec[9];
  L.s_row = spec[10];
  L.s_dt = int(spec[11]);
  L.b_dt = int(spec[12]);
  L.rot_b = spec[13];
  L.rot_m = spec[14];
  const uint32_t scale_bits = uint32_t(uint64_t(spec[15]) & 0xffffffffu);
  std::memcpy(&L.rot_scale, &scale_bits, 4);
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
static RowsFn rows_fn(int path, const Lin& L) {
  const int grp = L.kind != GGML ? 0 : (L.bits >= G_MXFP4 ? 2 : 1);
  static const RowsFn table[3][3] = {
      {rows_portable_q, rows_portable_g, rows_portable_x},
      {rows_avx2_q, rows_avx2_g, rows_avx2_x},
      {rows_avx512_q, rows_avx512_g, rows_avx512_x},
  };
  if (path < 0 || path > 2) return nullptr;
  if (path == AVX512 && !MS_AVX512) return nullptr;
  if (path == AVX2 && !MS_AVX2) return nullptr;
  return table[path][grp];
}

// y [n, ldy] columns 0..L.out-1 for x [n, ldx]: blocks of output rows (columns for FLOAT_T) split over
// threads in contiguous chunks.
static void run_linear(RowsFn fn, const Lin& L, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
  const int64_t unit = L.kind == FLOAT_T ? 32 : RB;
  const int64_t blocks = (L.out + unit - 1) / unit;
  // at least ~64K weight-token products per thread, so small linears stay on one
  const int64_t work = std::max<int64_t>(1, unit * L.in * std::max<int64_t>(1, std::min<int64_t>(n, 8)));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / work);
  int threads = 1;
#ifdef _OPENMP
  if (!omp_in_parallel()) threads = int(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, blocks / grain)));
#endif
  if (threads <= 1) {
    fn(L, x, ldx, n, 0, L.out, y, ldy);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (blocks + nt - 1) / nt, b0 = t * per, b1 = std::min(blocks, b0 + per);
    if (b0 < b1) fn(L, x, ldx, n, b0 * unit, std::min(L.out, b1 * unit), y, ldy);
  }
#endif
}

// The whole linear: rotation of the input (turboquant), the zero-padded copy of an input whose width is
// not a multiple of 16, the product, the output bias.
static void run_full(RowsFn fn, const Lin& L, const float* x, int64_t n, float* y, int64_t ldy) {
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
                        int act, const float* params, std::vector<float>& g, std::vector<float>& u) {
  Lin G = make_lin(specs, ptrs), U = make_lin(specs + SPEC, ptrs + PTRS), D = make_lin(specs + 2 * SPEC, ptrs + 2 * PTRS);
  const int64_t I = G.out;
  if (g.size() < size_t(n * I)) g.resize(size_t(n * I));
  if (u.size() < size_t(n * I)) u.resize(size_t(n * I));
  run_full(rows_fn(path, G), G, x, n, g.data(), I);
  run_full(rows_fn(path, U), U, x, n, u.data(), I);
  activate(act, params, g.data(), u.data(), n * I);
  run_full(rows_fn(path, D), D, g.data(), n, y, D.out);
}

// value v rounded to dtype dt (the cast a torch .to(dt) makes), as float32
static inline float round_to(float v, int dt) {
  if (dt == BF16) return bf16_to_float(to_bf16(v));
  if (dt == F16) return c10_half_round(v);
  return v;
}

}  // namespace ms

extern "C" {

// Bit mask of the compiled paths: 1 portable, 2 AVX2, 4 AVX-512.
int ms_paths(void) { return 1 | (MS_AVX2 ? 2 : 0) | (MS_AVX512 ? 4 : 0); }

// y [n, out] (float32) = rot(x) [n, in] (float32) W^T + bias. 0, or -1 when `path` is not compiled.
int ms_linear(int path, const int64_t* spec, const void* const* ptrs, const float* x, int64_t n, float* y) {
  ms::Lin L = ms::make_lin(spec, ptrs);
  ms::RowsFn fn = ms::rows_fn(path, L);
  if (fn == nullptr) return -1;
  ms::run_full(fn, L, x, n, y, L.out);
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
// expert's rows split): an output's bits are the same as ms_expert's on that expert and row alone.
// 0, or -1 when a path is not compiled or an argument is bad.
int ms_moe(int path, int64_t n_e, const int64_t* specs, const void* const* ptrs, const int64_t* rows,
           const int64_t* starts, const float* x, int64_t K, int64_t h_in, int64_t h_out, const float* w, int act,
           const float* params, int x_dt, int prod_dt, int out_dt, void* out) {
  if (n_e < 0 || K < 1 || act < 0 || act > 2) return -1;
  for (int64_t e = 0; e < n_e; ++e)
    for (int j = 0; j < 3; ++j) {
      ms::Lin L = ms::make_lin(specs + (3 * e + j) * ms::SPEC, ptrs + (3 * e + j) * ms::PTRS);
      if (ms::rows_fn(path, L) == nullptr) return -1;
    }
  uint8_t* o = static_cast<uint8_t*>(out);
  auto one = [&](int64_t e, std::vector<float>& xe, std::vector<float>& ye, std::vector<float>& g,
                 std::vector<float>& u) {
    const int64_t a = starts[e], n = starts[e + 1] - a;
    if (n <= 0) return;
    if (xe.size() < size_t(n * h_in)) xe.resize(size_t(n * h_in));
    if (ye.size() < size_t(n * h_out)) ye.resize(size_t(n * h_out));
    for (int64_t i = 0; i < n; ++i) std::memcpy(xe.data() + i * h_in, x + (rows[a + i] / K) * h_in, size_t(h_in) * 4);
    ms::expert_rows(path, specs + 3 * e * ms::SPEC, ptrs + 3 * e * ms::PTRS, xe.data(), n, ye.data(), act, params,
                    g, u);
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
#pragma omp for schedule(dynamic, 1)
      for (int64_t e = 0; e < n_e; ++e) one(e, xe, ye, g, u);
    }
#endif
  } else {
    std::vector<float> xe, ye, g, u;
    for (int64_t e = 0; e < n_e; ++e) one(e, xe, ye, g, u);
  }
  return 0;
}

}  // extern "C"
