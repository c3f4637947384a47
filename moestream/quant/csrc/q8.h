// llama.cpp's numerics, opt-in (--activations q8, moestream/options.py): the input row of a ggml linear
// quantized to 8 bits per block as ggml's CPU backend does for the weight type's vec_dot_type, then integer
// dot products per block, the block scales applied in float32.
//
//   Q4_K, Q5_K, Q6_K weights -> Q8_K activations: blocks of 256, a float32 scale d = max / -127 (max the
//     value of largest magnitude, the first one on ties), q = round_half_even(x * (-127 / max)) clamped to
//     127, and the sums of each 16 codes (ggml-quants.c quantize_row_q8_K_ref);
//   Q8_0, Q4_0, Q5_0, IQ4_NL weights -> Q8_0 activations: blocks of 32, d = fp16(amax / 127), q = round_half_even(x * (127 /
//     amax)) (ggml-cpu/arch/x86/quants.c quantize_row_q8_0, the x86 form llama.cpp runs here; gguf-py's
//     quantizer divides by d and rounds half away from zero, which differs on a few ties).
//
//   MLX affine 4- and 8-bit weights -> Q8_A4 / Q8_A8 activations (moestream's own: llama.cpp reads no MLX
//     format): blocks of 32, a float32 scale d = amax / 127, q = round_half_even(x * (127 / amax)); the
//     reduction is q8.cpp's affine section (scale products and bias products in two 16-lane accumulators).
//
// One reduction, every path (portable, AVX2, AVX-512; so the same bits on each, for any row count, thread
// count or address): per (output row, token) a 16-lane float32 accumulator; lane l of a 64-value chunk
// holds the exact integer sum of values 4l..4l+3 (weight code x activation code, times the sub-block scale
// for the K-quants: AVX-512 dpbusd / maddubs+madd, AVX2 maddubs+madd, portable loops give the same
// integers). K-quants: a block's four chunks are summed per lane as integers, then
// acc[l] = fma(float(isum[l]), d_w * d_x, acc[l]) and, in an 8-lane accumulator over the blocks in order,
// m[i] = fma(float(offset[i]), dm_w * d_x, m[i]) with the block's integer offsets, lane i from the
// activation's 16-sums 2i and 2i+1 (Q4_K/Q5_K: min of sub-block i x its 32-sum; Q6_K: 32 x the scales x
// 16-sums, the codes being stored + 32); the 32-blocks (signed codes: Q8_0's int8, Q4_0's nibble - 8, Q5_0's
// 5 bits - 16, IQ4_NL's table values): acc[l] = fma(float(isum[l]), d_w * d_x, acc[l]) per chunk
// (lanes 0-7 the chunk's first block, 8-15 its second). The output is tree16(acc) - tree8(m), the trees
// (i, i+8), (i, i+4), (i, i+2), (i, i+1) of kernels.h and its last three steps.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace ms {

enum ActMode : int { ACT_FLOAT = 0, ACT_Q8 = 1 };
enum Q8Type : int { Q8_NONE = 0, Q8_KB = 1, Q8_0B = 2, Q8_A4 = 3, Q8_A8 = 4 };
// The affine types carry their weights' group: type = Q8_A4 or Q8_A8 | group << 4 (an activation row is
// quantized for one group size: its per-group sums below).
inline int q8_base(int type) { return type & 15; }
inline int64_t q8_group(int type) { return type >> 4; }
inline bool q8_affine(int type) { return q8_base(type) == Q8_A4 || q8_base(type) == Q8_A8; }

// The activation type a linear in q8 mode takes: Q8_KB, Q8_0B, an affine type, or Q8_NONE (float mode, or a
// type q8 mode does not cover: computed with float activations).
int q8_type_of(const Lin& L);

// n rows of `in` activations quantized: row t at data + t * stride: int8 codes [in], float32 scales [in / B],
// then int16 16-sums [in / 16] (Q8_KB) or int32 block sums [in / 32] (Q8_0B). Affine types (in a multiple of
// 64, blocks of 32, float32 scale d = amax / 127, codes round_half_even(x * (127 / amax))): int8 codes [in],
// per 64-value chunk (Q8_A4: its even values, then its odd ones, the order of a byte's two nibbles), then
// float32 [in / 64][16] each chunk's lane scales (lane l's block: Q8_A4 2c + (l / 4) % 2, Q8_A8 2c + l / 8),
// then float32 [ceil(in / group / 16) * 16] each group's sum of d x (block sum of codes), zero-padded.
struct Q8Rows {
  int type = Q8_NONE;
  int64_t in = 0, stride = 0, n = 0;
  std::vector<uint8_t> data;
  const uint8_t* row(int64_t t) const { return data.data() + t * stride; }
  uint8_t* row(int64_t t) { return data.data() + t * stride; }
};

int64_t q8_stride(int type, int64_t in);
// x [n, ldx] float32 -> out (resized); in a multiple of 256 (Q8_KB), 32 (Q8_0B) or 64 (affine)
void q8_quantize(int type, const float* x, int64_t ldx, int64_t n, int64_t in, Q8Rows& out);
// rows [r0, r1) of y [n, ldy] = W x for the quantized rows xa (xa.type == q8_type_of(L)); false when `path`
// is not compiled
bool q8_rows(int path, const Lin& L, const Q8Rows& xa, int64_t r0, int64_t r1, float* y, int64_t ldy);

}  // namespace ms
