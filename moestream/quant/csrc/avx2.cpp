// The AVX2 path (see kernels.h).
#include "avx2.h"

namespace ms {

bool rows_avx2(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy) {
#if MS_AVX2
  rows_by_kind<Arch2, Dec2>(L, x, n, r0, r1, y, ldy);
  return true;
#else
  (void)L, (void)x, (void)n, (void)r0, (void)r1, (void)y, (void)ldy;
  return false;
#endif
}

}  // namespace ms
