// moestream's CPU kernels: y = x W^T with W as stored (quantized or float, read straight from the
// bytes the expert store read: no repacking), the gated expert as one call, and the rest of a token's
// arithmetic (attention over the KV cache, RMSNorm, activations: ops.cpp).
//
// Built for the machine it runs on (moestream/quant/native.py: -march=native, the build cached per
// CPU). Three paths, each split into translation units by format group so a build uses every core (unit.cpp
// compiled once per pair):
//   portable: plain C++ over 16-lane arrays (arch_portable.h),
//   avx2:     AVX2 + FMA + F16C, a 16-lane vector as two 8-lane halves (arch_avx2.h),
//   avx512:   AVX-512 F/BW/VL/VBMI, 16 lanes (arch_avx512.h);
// groups q: affine, fp8, mxfp4, codebooks and float weights; g: ggml's legacy and k-quant blocks; x: ggml's
// MXFP4, IQ1-IQ3 and TQ blocks. capi.cpp holds the C entry points (ctypes) and splits output rows over
// OpenMP threads. q8.cpp (q8.h): the opt-in q8 activation mode of ggml weights (llama.cpp's 8-bit activation
// blocks and integer dot products), all three paths in one unit, with a fixed reduction of its own.
//
// One reduction, every path (so every path and every machine gives the same bits):
//   - each weight is dequantized in float32 by fixed operations (affine: fma(q, scale, bias); fp8,
//     mxfp4, codebooks: value * scale; ggml: ggml's dequantize_row_* operations; float: exact);
//   - per (output row, token) one 16-lane accumulator: the row's weight vector v (weights 16v..16v+15)
//     goes in by lane-wise fma(w, x, acc), v = 0, 1, ... in order (a last partial vector of a float
//     weight has zeros in its missing lanes, as has x);
//   - the 16 lanes are summed by one tree: (i, i+8), then (i, i+4), (i, i+2), (i, i+1).
// Threads split the output rows, never a reduction; the row and token blocking only decides which rows
// and tokens share a pass over the weights. So an output depends only on its row of W and its token's x:
// the same bits for any thread count, any number of tokens beside it, any address of the operands, on
// every path. Weights stored input-major (x @ W, kind FLOAT_T) are reduced per output by one fma chain over
// the inputs in order, again the same on every path.
#pragma once

#include <cstdint>

namespace ms {

enum Kind : int { AFFINE = 0, FP8 = 1, MXFP4 = 2, CODEBOOK = 3, GGML = 4, FLOAT = 5, FLOAT_T = 6 };
// ggml block types of GGML linears (Lin::bits holds one; moestream/quant/ggml.py names the layouts)
enum GgmlType : int { G_Q4_0 = 0, G_Q4_1 = 1, G_Q5_0 = 2, G_Q5_1 = 3, G_Q8_0 = 4, G_Q2_K = 5, G_Q3_K = 6,
                      G_Q4_K = 7, G_Q5_K = 8, G_Q6_K = 9, G_IQ4_NL = 10, G_IQ4_XS = 11, G_MXFP4 = 12,
                      G_IQ2_XXS = 13, G_IQ2_XS = 14, G_IQ2_S = 15, G_IQ3_XXS = 16, G_IQ3_S = 17, G_IQ1_S = 18,
                      G_IQ1_M = 19, G_TQ1_0 = 20, G_TQ2_0 = 21, G_COUNT = 22 };
enum Path : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
enum Dt : int { F32 = 0, BF16 = 1, F16 = 2 };
enum Pack : int { STREAM = 0, TEN3 = 1, TRITS = 2 };

// One linear [out, in] as stored, and how its rows map to stored rows.
struct Lin {
  int kind = AFFINE;
  int bits = 4;         // affine code width; codebook code width (ternary: 2); ggml: its GgmlType; float: its Dt
  int64_t group = 64;   // inputs sharing one scale (fp8: the block's columns; ggml: a sub-block of 16 or 32)
  int64_t bn = 1;       // fp8: the block's rows
  int64_t out = 0, in = 0;
  const uint8_t* w = nullptr;
  int64_t row_bytes = 0;  // bytes of one stored row (FLOAT_T: of one stored input row)
  const uint8_t* s = nullptr;  // scales; ggml codebook types (IQ1-IQ3): the grid, from the gguf package
  int s_dt = BF16;
  int64_t s_row = 0;  // scale elements per stored row (fp8: per block row)
  const uint8_t* b = nullptr;
  int b_dt = BF16;
  float lut[16] = {0};  // codebook values (codebook kind), e2m1 values (mxfp4)
  int64_t row0 = 0, row_step = 1;  // row r is stored row row0 + r * row_step (FLOAT_T: column)
  int pack = 0;         // codebook packing (Pack)
  int act = 0;          // ggml: the activation mode (q8.h ActMode: float, or llama.cpp's 8-bit blocks)
  // input rotation (turboquant): x -> H_B(signs * x), MLX's blockwise Hadamard; rot_b 0: none
  int64_t rot_b = 0, rot_m = 1;
  float rot_scale = 1.0f;
  bool rot_half = false;  // the rotated input rounded to fp16 (turboquant's QJL term)
  const float* signs = nullptr;  // [in], +-1
  const float* hm = nullptr;     // H_m [m, m] (m > 1), row-major
  const float* out_bias = nullptr;  // [out], added to the product
  int64_t stored(int64_t r) const { return row0 + r * row_step; }
  int64_t in16() const { return (in + 15) / 16 * 16; }
};

constexpr int RB = 4;  // output rows per task unit (and per decoded block of the many-token path)

// Output rows [r0, r1) (r0 a multiple of RB) of y [n, ldy] for n tokens x [n, ldx] (float32; ldx >= in16,
// lanes in..in16 zero), on one path, one function per format group. The group functions return false
// when their path is not compiled into this build.
using RowsFn = bool (*)(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_portable_q(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_portable_g(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_portable_x(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx2_q(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx2_g(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx2_x(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx512_q(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx512_g(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
bool rows_avx512_x(const Lin&, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

// The canonical float32 exp (engine.h exp_c): range reduction and a polynomial in fma, the same bits on
// every path and machine; ops.cpp and the experts' activations use it.
float exp_canonical(float x);

}  // namespace ms
