// The C entry points of moestream's CPU kernels (called through ctypes from
// moestream/quant/native.py, which checks every shape first): a linear, the fused SwiGLU
// expert, and the compiled paths. Output rows are split over OpenMP threads (the runtime
// PyTorch loaded, so torch.set_num_threads applies), never the reduction.
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ms {

// spec: kind, bits, group, bn, out, in, row0, row_step, tq3, row_bytes, s_row, s_dt, b_dt
// ptrs: weight, scales, biases, value table (16 float32)
constexpr int SPEC = 16, PTRS = 4;

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
  L.tq3 = spec[8] != 0;
  L.row_bytes = spec[9];
  L.s_row = spec[10];
  L.s_dt = int(spec[11]);
  L.b_dt = int(spec[12]);
  L.w = static_cast<const uint8_t*>(ptrs[0]);
  L.s = static_cast<const uint8_t*>(ptrs[1]);
  L.b = static_cast<const uint8_t*>(ptrs[2]);
  if (ptrs[3] != nullptr) std::memcpy(L.lut, ptrs[3], sizeof(L.lut));
  return L;
}

using RowsFn = bool (*)(const Lin&, const float*, int64_t, int64_t, int64_t, float*, int64_t);

static RowsFn rows_fn(int path) {
  switch (path) {
    case AVX512: return MS_AVX512 ? rows_avx512 : nullptr;
    case AVX2: return MS_AVX2 ? rows_avx2 : nullptr;
    case PORTABLE: return rows_portable;
    default: return nullptr;
  }
}

// y [n, ldy] columns 0..L.out-1 for x [n, L.in]: row blocks of RB split over threads.
static void run_linear(RowsFn fn, const Lin& L, const float* x, int64_t n, float* y, int64_t ldy) {
  const int64_t blocks = (L.out + RB - 1) / RB;
  // at least ~64K weights per thread, so small linears stay on one
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, RB * L.in));
  int threads = 1;
#ifdef _OPENMP
  if (!omp_in_parallel()) threads = int(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, blocks / grain)));
#endif
  if (threads <= 1) {
    fn(L, x, n, 0, L.out, y, ldy);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    // contiguous chunks of row blocks, one per thread
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (blocks + nt - 1) / nt, b0 = t * per, b1 = std::min(blocks, b0 + per);
    if (b0 < b1) fn(L, x, n, b0 * RB, std::min(L.out, b1 * RB), y, ldy);
  }
#endif
}

}  // namespace ms

extern "C" {

// Bit mask of the compiled paths: 1 portable, 2 AVX2, 4 AVX-512.
int ms_paths(void) { return 1 | (MS_AVX2 ? 2 : 0) | (MS_AVX512 ? 4 : 0); }

// y [n, out] (float32) = x [n, in] (float32) W^T. 0, or -1 when `path` is not compiled.
int ms_linear(int path, const int64_t* spec, const void* const* ptrs, const float* x, int64_t n, float* y) {
  ms::RowsFn fn = ms::rows_fn(path);
  if (fn == nullptr) return -1;
  ms::Lin L = ms::make_lin(spec, ptrs);
  ms::run_linear(fn, L, x, n, y, L.out);
  return 0;
}

// One gated expert: y [n, H] = down(act(gate x, up x)) for x [n, H], all float32; specs and ptrs
// of gate, up, down in that order. act 0: SwiGLU, silu(g) * u; 1: SiTU-GLU (Kimi K3),
// beta tanh(g / beta) sigmoid(g) * (linear_beta tanh(u / linear_beta), or u when
// linear_beta is NaN) with params = {beta, linear_beta}. The intermediate [n, I] stays float32.
int ms_expert(int path, const int64_t* specs, const void* const* ptrs, const float* x, int64_t n, float* y, int act,
              const float* params) {
  ms::RowsFn fn = ms::rows_fn(path);
  if (fn == nullptr || act < 0 || act > 1) return -1;
  ms::Lin G = ms::make_lin(specs, ptrs), U = ms::make_lin(specs + ms::SPEC, ptrs + ms::PTRS),
          D = ms::make_lin(specs + 2 * ms::SPEC, ptrs + 2 * ms::PTRS);
  const int64_t I = G.out;
  std::vector<float> g(size_t(n * I)), u(size_t(n * I));
  ms::run_linear(fn, G, x, n, g.data(), I);
  ms::run_linear(fn, U, x, n, u.data(), I);
  if (act == 0) {
    for (int64_t i = 0; i < n * I; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  } else {
    const float beta = params[0], lb = params[1];
    for (int64_t i = 0; i < n * I; ++i) {
      const float a = beta * std::tanh(g[i] / beta) * (1.0f / (1.0f + std::exp(-g[i])));
      g[i] = a * (std::isnan(lb) ? u[i] : lb * std::tanh(u[i] / lb));
    }
  }
  ms::run_linear(fn, D, g.data(), n, y, D.out);
  return 0;
}

}  // extern "C"
