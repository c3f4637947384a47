// The portable path's affine, fp8, mxfp4, codebook and float weights (see kernels.h).
#include "arch_portable.h"

namespace ms {

bool rows_portable_q(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1, float* y,
                   int64_t ldy) {
#if 1
  rows_q<ArchP, DecP>(L, x, ldx, n, r0, r1, y, ldy);
  return true;
#else
  (void)L, (void)x, (void)ldx, (void)n, (void)r0, (void)r1, (void)y, (void)ldy;
  return false;
#endif
}

}  // namespace ms
