// The portable path: plain C++ (see kernels.h).
#include "engine.h"

namespace ms {

bool rows_portable(const Lin& L, const float* x, int64_t n, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  rows_by_kind<ArchP, DecP>(L, x, n, r0, r1, y, ldy);
  return true;
}

}  // namespace ms
