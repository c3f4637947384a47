// The avx512 path's ggml's legacy and k-quant blocks (see kernels.h).
#include "arch_avx512.h"

namespace ms {

bool rows_avx512_g(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                   int64_t ldy) {
#if MS_AVX512
  rows_g<Arch5>(L, x, ldx, n, r0, r1, y, ldy);
  return true;
#else
  (void)L, (void)x, (void)ldx, (void)n, (void)r0, (void)r1, (void)y, (void)ldy;
  return false;
#endif
}

}  // namespace ms
