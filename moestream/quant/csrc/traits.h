// The ggml block types' traits, one row per type (ggml's type_traits_cpu is the model): its name, weights
// and bytes per block, the sub-block the decoders dequantize at a time (Lin::group), its decoder (the rows
// function of its format group, per path) and its dot product in q8 mode (the activation block its integer
// dot takes, q8.h; Q8_NONE: float activations only). The kernels read block sizes and dispatch from here.
// moestream/quant/registry.py declares the same per type (its GgmlFormat entries); native.py checks the two
// agree when it loads the library (ms_ggml_traits, capi.cpp) and tests/test_format_registry.py asserts it.
#pragma once

#include <cstdint>

#include "kernels.h"
#include "q8.h"

namespace ms {

struct RowsByPath {
  RowsFn fn[3];  // by Path: portable, avx2, avx512
};
constexpr RowsByPath ROWS_G{{rows_portable_g, rows_avx2_g, rows_avx512_g}};  // legacy and k-quant blocks
constexpr RowsByPath ROWS_X{{rows_portable_x, rows_avx2_x, rows_avx512_x}};  // MXFP4, IQ1-IQ3, TQ blocks

struct GgmlTraits {
  const char* name;
  int type;           // GgmlType (the row's index)
  int64_t block;      // weights per block
  int64_t type_size;  // bytes per block
  int64_t group;      // weights per decoded sub-block (Lin::group)
  int q8;             // q8 mode's activation block (Q8Type)
  RowsByPath rows;    // the decoder
};

inline constexpr GgmlTraits GGML_TRAITS[G_COUNT] = {
    {"Q4_0", G_Q4_0, 32, 18, 32, Q8_0B, ROWS_G},
    {"Q4_1", G_Q4_1, 32, 20, 32, Q8_NONE, ROWS_G},
    {"Q5_0", G_Q5_0, 32, 22, 32, Q8_0B, ROWS_G},
    {"Q5_1", G_Q5_1, 32, 24, 32, Q8_NONE, ROWS_G},
    {"Q8_0", G_Q8_0, 32, 34, 32, Q8_0B, ROWS_G},
    {"Q2_K", G_Q2_K, 256, 84, 16, Q8_NONE, ROWS_G},
    {"Q3_K", G_Q3_K, 256, 110, 16, Q8_NONE, ROWS_G},
    {"Q4_K", G_Q4_K, 256, 144, 32, Q8_KB, ROWS_G},
    {"Q5_K", G_Q5_K, 256, 176, 32, Q8_KB, ROWS_G},
    {"Q6_K", G_Q6_K, 256, 210, 16, Q8_KB, ROWS_G},
    {"IQ4_NL", G_IQ4_NL, 32, 18, 32, Q8_0B, ROWS_G},
    {"IQ4_XS", G_IQ4_XS, 256, 136, 32, Q8_NONE, ROWS_G},
    {"MXFP4", G_MXFP4, 32, 17, 32, Q8_NONE, ROWS_X},
    {"IQ2_XXS", G_IQ2_XXS, 256, 66, 32, Q8_NONE, ROWS_X},
    {"IQ2_XS", G_IQ2_XS, 256, 74, 16, Q8_NONE, ROWS_X},
    {"IQ2_S", G_IQ2_S, 256, 82, 16, Q8_NONE, ROWS_X},
    {"IQ3_XXS", G_IQ3_XXS, 256, 98, 32, Q8_NONE, ROWS_X},
    {"IQ3_S", G_IQ3_S, 256, 110, 32, Q8_NONE, ROWS_X},
    {"IQ1_S", G_IQ1_S, 256, 50, 32, Q8_NONE, ROWS_X},
    {"IQ1_M", G_IQ1_M, 256, 56, 16, Q8_NONE, ROWS_X},
    {"TQ1_0", G_TQ1_0, 256, 54, 32, Q8_NONE, ROWS_X},
    {"TQ2_0", G_TQ2_0, 256, 66, 32, Q8_NONE, ROWS_X},
};

constexpr bool traits_in_order() {
  for (int i = 0; i < G_COUNT; ++i)
    if (GGML_TRAITS[i].type != i || GGML_TRAITS[i].block % GGML_TRAITS[i].group) return false;
  return true;
}
static_assert(traits_in_order(), "GGML_TRAITS: row i is GgmlType i, its sub-blocks divide its blocks");

// the row of GgmlType t, or nullptr for a code that names no type
inline const GgmlTraits* ggml_traits(int t) { return t >= 0 && t < G_COUNT ? &GGML_TRAITS[t] : nullptr; }

// bytes of one block of GgmlType T
template <int T>
constexpr int64_t block_bytes() {
  return GGML_TRAITS[T].type_size;
}

}  // namespace ms
