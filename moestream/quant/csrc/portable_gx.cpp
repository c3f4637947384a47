// The portable path's MXFP4, IQ1-IQ3 and TQ ggml types (see kernels.h): a translation unit of their own so
// that the build compiles them beside portable.cpp.
#include "engine.h"

namespace ms {

void rows_portable_gx(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  rows_ggml_x<ArchP>(L, x, n, r0, r1, y, ldy);
}

}  // namespace ms
