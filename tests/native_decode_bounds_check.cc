// The native paged decode (jaxkv/_native/paged_decode.cc), one row at a time
// on a pool and a block table of exactly their bytes, built with
// AddressSanitizer by tests/test_native_decode.py: page ids outside the pool
// and key ranges past the table or before 0 must read no byte outside them
// (ASan aborts on the first one); bad visible pages give NaN. Prints OK.
// Built with -DGUARD_PAGES instead (no ASan, the fast suite), each buffer
// ends where an inaccessible page begins: a read past one faults.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "paged_decode.cc"

#ifdef GUARD_PAGES
#include <sys/mman.h>
#include <unistd.h>

// `bytes` ending exactly at an inaccessible page (released at exit).
static void* Alloc(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t span = (bytes + page - 1) / page * page;
  char* base = static_cast<char*>(mmap(nullptr, span + page, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED || mprotect(base + span, page, PROT_NONE) != 0) std::abort();
  return base + span - bytes;
}
static void Free(void*) {}
#else
static void* Alloc(size_t bytes) { return std::malloc(bytes); }
static void Free(void* p) { std::free(p); }
#endif

int main() {
  constexpr int64_t kBlocks = 3, kTokens = 4, kHeads = 2, kGroup = 2, kDim = 16;
  constexpr int64_t kCols = 2, kRows = 7;
  constexpr int64_t kTokenStride = 2 * kHeads * kDim;
  const int64_t pool_elems = kBlocks * kTokens * kTokenStride;
  float* pool = static_cast<float*>(Alloc(pool_elems * sizeof(float)));
  for (int64_t i = 0; i < pool_elems; ++i) pool[i] = 0.01f * static_cast<float>(i % 97);
  const int32_t big = 2147483647;
  // Row r's table row and key range [lo, hi).
  int32_t* table = static_cast<int32_t*>(Alloc(kRows * kCols * sizeof(int32_t)));
  int32_t* bounds = static_cast<int32_t*>(Alloc(kRows * 2 * sizeof(int32_t)));
  const int32_t rows[kRows][4] = {
      {1, 2, 0, 8},           // valid: two pages
      {-1, 2, 0, 3},          // a negative page id, visible: NaN
      {kBlocks, 1, 0, 2},     // one past the pool: NaN
      {big, 1, 0, 2},         // int32's end: NaN
      {-big - 1, 1, 0, 2},    // int32's start: NaN
      {1, 2, -100, 3},        // a range from before 0: keys 0..2 of page 1
      // Keys past the table's columns: NaN. The last row, so that a read
      // past its columns (the next page's prefetch included) leaves the
      // table's heap block and AddressSanitizer sees it.
      {1, 2, 0, 1000},
  };
  for (int64_t r = 0; r < kRows; ++r) {
    table[r * kCols] = rows[r][0];
    table[r * kCols + 1] = rows[r][1];
    bounds[2 * r] = rows[r][2];
    bounds[2 * r + 1] = rows[r][3];
  }
  std::vector<float> q(kRows * kHeads * kGroup * kDim, 0.1f);
  std::vector<float> out(kRows * kHeads * kGroup * kDim, 0.0f);
  Params P{};
  P.q = q.data();
  P.base = reinterpret_cast<const char*>(pool);
  P.table = table;
  P.bounds = bounds;
  P.out = out.data();
  P.num_rows = kRows;
  P.num_heads = kHeads * kGroup;
  P.head_dim = P.head_dim_v = kDim;
  P.cols = kCols;
  P.block_stride = kTokens * kTokenStride;
  P.token_stride = kTokenStride;
  P.head_stride = kDim;
  P.v_offset = kHeads * kDim;
  P.num_blocks = kBlocks;
  P.block_size = kTokens;
  P.kv_heads = kHeads;
  P.scale = 0.25f;
  std::vector<float> scratch;
  for (int64_t t = 0; t < kRows; ++t) Attend<float>(P, t, 0, kHeads, scratch);
  const int64_t per_row = kHeads * kGroup * kDim;
  auto row_is = [&](int64_t t, bool nan) {
    for (int64_t i = 0; i < per_row; ++i) {
      if (std::isnan(out[t * per_row + i]) != nan) return false;
    }
    return true;
  };
  bool ok = row_is(0, false) && row_is(5, false) && row_is(6, true);
  for (int64_t t = 1; t <= 4; ++t) ok = ok && row_is(t, true);
  Free(pool);
  Free(table);
  Free(bounds);
  std::printf(ok ? "OK\n" : "wrong NaN pattern\n");
  return ok ? 0 : 1;
}
