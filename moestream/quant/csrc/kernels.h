// moestream's CPU kernels: y = x W^T with W in its stored quantized form, read straight from
// the bytes the expert store read (no repacking), and the SwiGLU expert as one call.
//
// Built for the machine it runs on (moestream/quant/native.py: -march=native, the build
// cached per CPU-flag set). Three paths, one translation unit each:
//   portable.cpp: plain C++ over fixed 16-lane arrays (auto-vectorized where the compiler can;
//                 portable_gx.cpp holds its MXFP4, IQ1-IQ3 and TQ ggml types, to compile in parallel),
//   avx2.cpp:     AVX2 + FMA + F16C (8 lanes), compiled when the compiler targets them,
//   avx512.cpp:   AVX-512 F/BW/VL/VBMI (16 lanes), compiled when the compiler targets all four.
// capi.cpp holds the C entry points (ctypes, from native.py) and splits the output rows over threads.
//
// Arithmetic (every path): each weight is dequantized in a float32 register (affine:
// fma(q, scale, bias); fp8, mxfp4, codebooks: value * scale, one rounding; ggml blocks: one
// sub-block at a time with the float operations of ggml's dequantize_row_*) and multiplied
// into float32 accumulators with FMA (portable: multiply, then add). Per (output row,
// token): the row's W-wide weight vectors v = 0, 1, ... go to accumulator v % 2, in order;
// the two are added and reduced horizontally in a fixed order. Activations are never
// quantized. Threads split the output rows, never the reduction; the row and token
// blocking only changes which rows and tokens share a pass over the weights, not the
// arithmetic of any one output. So an output depends only on its row of W, its token's x
// and the path: the same bits every run, with any thread count, for any number of tokens
// beside it.
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

enum Kind : int { AFFINE = 0, FP8 = 1, MXFP4 = 2, CODEBOOK = 3, GGML = 4 };
// ggml block types of GGML linears (Lin::bits holds one; moestream/quant/ggml.py names the layouts)
enum GgmlType : int { G_Q4_0 = 0, G_Q4_1 = 1, G_Q5_0 = 2, G_Q5_1 = 3, G_Q8_0 = 4, G_Q2_K = 5, G_Q3_K = 6,
                      G_Q4_K = 7, G_Q5_K = 8, G_Q6_K = 9, G_IQ4_NL = 10, G_IQ4_XS = 11, G_MXFP4 = 12,
                      G_IQ2_XXS = 13, G_IQ2_XS = 14, G_IQ2_S = 15, G_IQ3_XXS = 16, G_IQ3_S = 17, G_IQ1_S = 18,
                      G_IQ1_M = 19, G_TQ1_0 = 20, G_TQ2_0 = 21 };
enum Path : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
enum Dt : int { F32 = 0, BF16 = 1, F16 = 2 };

// One quantized linear [out, in] as stored, and how its rows map to stored rows.
struct Lin {
  int kind = AFFINE;
  int bits = 4;         // affine code width; codebook code width (ternary: transcoded to 2); ggml: its GgmlType
  int64_t group = 64;   // inputs sharing one scale (fp8: the block's columns; ggml: a sub-block of 16 or 32)
  int64_t bn = 1;       // fp8: the block's rows
  int64_t out = 0, in = 0;
  const uint8_t* w = nullptr;
  int64_t row_bytes = 0;  // bytes of one stored row
  const uint8_t* s = nullptr;  // scales; ggml codebook types (IQ1-IQ3): the grid, from the gguf package
  int s_dt = BF16;
  int64_t s_row = 0;  // scale elements per stored row (fp8: per block row)
  const uint8_t* b = nullptr;
  int b_dt = BF16;
  float lut[16] = {0};  // codebook values (codebook kind), e2m1 values (mxfp4)
  int64_t row0 = 0, row_step = 1;  // row r is stored row row0 + r * row_step
  int pack = 0;         // codebook packing: 0 a bit stream, 1 ten 3-bit codes per uint32 word, 2 base-3
                        // trits, 20 per uint32 word (turboquant)
  // input rotation (turboquant): x -> H_B(signs * x), MLX's blockwise Hadamard; rot_b 0: none
  int64_t rot_b = 0, rot_m = 1;
  float rot_scale = 1.0f;
  bool rot_half = false;  // the rotated input rounded to fp16 (turboquant's QJL term)
  const float* signs = nullptr;  // [in], +-1
  const float* hm = nullptr;     // H_m [m, m] (m > 1), row-major
  const float* out_bias = nullptr;  // [out], added to the product
  int64_t stored(int64_t r) const { return row0 + r * row_step; }
};

enum Pack : int { STREAM = 0, TEN3 = 1, TRITS = 2 };

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


constexpr int RB = 4;  // output rows per task unit

// Output rows [r0, r1) (r0 a multiple of RB) of y [n, ldy] for n tokens x [n, L.in] (float32,
// contiguous), on one path. False when that path is not compiled into this build.
bool rows_portable(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy);
bool rows_avx2(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy);
bool rows_avx512(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy);
// the portable path's MXFP4, IQ1-IQ3 and TQ linears (portable_gx.cpp; called by rows_portable)
void rows_portable_gx(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy);

}  // namespace ms
