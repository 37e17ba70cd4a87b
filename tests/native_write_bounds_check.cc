// The native KV write (jaxkv/_native/kv_write.cc) called directly on a pool
// of exactly three layer slots, built with AddressSanitizer by
// tests/test_native_write.py: bad layer slots and token slots must write no
// byte outside the pool (ASan aborts on the first one), good ones must land.
// Prints OK.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kv_write.cc"

namespace {

struct Buf {
  std::vector<int64_t> dims;
  XLA_FFI_Buffer raw{};
  Buf(void* data, XLA_FFI_DataType dtype, std::vector<int64_t> d) : dims(d) {
    raw.struct_size = sizeof raw;
    raw.dtype = dtype;
    raw.data = data;
    raw.rank = static_cast<int64_t>(dims.size());
    raw.dims = dims.data();
  }
};

// A stacked f32 pool: 3 slots of (blocks 4, tokens 2, kv 2, heads 2, dim 8).
constexpr int64_t kSlots = 3, kBlocks = 4, kTokens = 2, kHeads = 2, kDim = 8;
constexpr int64_t kSlotElems = kBlocks * kTokens * 2 * kHeads * kDim;

bool Write(float* pool, int32_t layer, std::vector<int32_t> slots, float value) {
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<float> k(n * kHeads * kDim, value), v(n * kHeads * kDim, -value);
  Buf p(pool, XLA_FFI_DataType_F32, {kSlots, kSlotElems});
  Buf kb(k.data(), XLA_FFI_DataType_F32, {n, kHeads, kDim});
  Buf vb(v.data(), XLA_FFI_DataType_F32, {n, kHeads, kDim});
  Buf sb(slots.data(), XLA_FFI_DataType_S32, {n});
  Buf lb(&layer, XLA_FFI_DataType_S32, {});
  ffi::Error err = KvWrite(
      ffi::AnyBuffer(&p.raw), ffi::AnyBuffer(&kb.raw), ffi::AnyBuffer(&vb.raw),
      ffi::Buffer<ffi::S32>(&sb.raw), ffi::Buffer<ffi::S32>(&lb.raw),
      ffi::Result<ffi::AnyBuffer>(ffi::AnyBuffer(&p.raw)),
      /*block_stride=*/kTokens * 2 * kHeads * kDim,
      /*token_stride=*/2 * kHeads * kDim, /*head_stride=*/kDim,
      /*v_offset=*/kHeads * kDim, /*byte_offset=*/0,
      /*slot_bytes=*/kSlotElems * 4, /*element_bytes=*/4,
      /*extent_bytes=*/kSlotElems * 4, /*num_blocks=*/kBlocks,
      /*block_size=*/kTokens);
  return err.success();
}

}  // namespace

int main() {
  // Exactly the pool's bytes on the heap: ASan poisons what lies around them.
  float* pool = static_cast<float*>(std::calloc(kSlots * kSlotElems, sizeof(float)));
  const int32_t int32_max = 2147483647;
  bool ok = true;
  for (int32_t layer : {-1, -2, 3, 4, int32_max, -int32_max - 1}) {
    ok = ok && Write(pool, layer, {0, 7, 3}, 1.0f);
  }
  for (int64_t i = 0; i < kSlots * kSlotElems; ++i) {
    if (pool[i] != 0.0f) {
      std::printf("a bad layer slot wrote element %lld\n", static_cast<long long>(i));
      return 1;
    }
  }
  // Token slots: padding, past the view's blocks, far past, at int32's end.
  ok = ok && Write(pool, 2, {-1, 8, 9, 1000, int32_max, -int32_max - 1}, 2.0f);
  for (int64_t i = 0; i < kSlots * kSlotElems; ++i) {
    if (pool[i] != 0.0f) {
      std::printf("a bad token slot wrote element %lld\n", static_cast<long long>(i));
      return 1;
    }
  }
  // The last token of the last block of the last slot lands where it belongs.
  ok = ok && Write(pool, 2, {kBlocks * kTokens - 1}, 3.0f);
  const int64_t at = 2 * kSlotElems + (kBlocks - 1) * kTokens * 2 * kHeads * kDim +
                     (kTokens - 1) * 2 * kHeads * kDim;
  const bool landed = pool[at] == 3.0f && pool[at + kHeads * kDim] == -3.0f &&
                      pool[kSlots * kSlotElems - 1] == -3.0f;
  std::free(pool);
  if (!ok || !landed) {
    std::printf("failed: calls ok %d, last slot landed %d\n", ok, landed);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
