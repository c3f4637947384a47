// One translation unit of the kernels (see kernels.h): the rows function of one path and one format group,
// chosen by -DMS_PATH=<0 portable | 1 avx2 | 2 avx512> and -DMS_GROUP=<0 q | 1 g | 2 x> (native.py compiles
// this file once per pair, so the build uses every core).
#if MS_PATH == 2
#include "arch_avx512.h"
#define MS_ON MS_AVX512
#define MS_A Arch5
#define MS_D Dec5
#elif MS_PATH == 1
#include "arch_avx2.h"
#define MS_ON MS_AVX2
#define MS_A Arch2
#define MS_D Dec2
#else
#include "arch_portable.h"
#define MS_ON 1
#define MS_A ArchP
#define MS_D DecP
#endif

#define MS_CAT3(a, b, c) a##b##c
#define MS_FN(p, g) MS_CAT3(rows_, p, g)
#if MS_PATH == 2
#define MS_PATH_NAME avx512_
#elif MS_PATH == 1
#define MS_PATH_NAME avx2_
#else
#define MS_PATH_NAME portable_
#endif
#if MS_GROUP == 2
#define MS_GROUP_NAME x
#elif MS_GROUP == 1
#define MS_GROUP_NAME g
#else
#define MS_GROUP_NAME q
#endif

namespace ms {

bool MS_FN(MS_PATH_NAME, MS_GROUP_NAME)(const Lin& L, const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t r1,
                                         float* y, int64_t ldy) {
#if MS_ON
#if MS_GROUP == 2
  rows_x<MS_A>(L, x, ldx, n, r0, r1, y, ldy);
#elif MS_GROUP == 1
  rows_g<MS_A>(L, x, ldx, n, r0, r1, y, ldy);
#else
  rows_q<MS_A, MS_D>(L, x, ldx, n, r0, r1, y, ldy);
#endif
  return true;
#else
  (void)L, (void)x, (void)ldx, (void)n, (void)r0, (void)r1, (void)y, (void)ldy;
  return false;
#endif
}

}  // namespace ms
