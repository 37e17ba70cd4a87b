// KV-cache write for XLA:CPU, an XLA FFI custom call that updates the pool in
// place (its output aliases the pool operand; donated, nothing is copied).
//
// Token t with slot s = slots[t] writes its K row of every KV head at block
// s / block_size, token s % block_size of the view, and its V row v_offset
// elements after it, as raw bytes (the caller casts K/V to the view's dtype
// first, so a word, typed or bits pool is just bytes here). Semantics equal
// jaxkv's XLA path (jaxkv/kv/_ops.py, write_kv): a negative slot or one
// past the view's blocks writes nothing, a layer slot outside the pool
// writes nothing, and of two tokens with one slot the later wins.
//
// It runs on the calling thread: a step's writes are a few hundred KB, and a
// hand-off to XLA's thread pool costs more than the copy on a small machine.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvWrite(ffi::AnyBuffer pool, ffi::AnyBuffer key, ffi::AnyBuffer value,
                   ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> slot,
                   ffi::Result<ffi::AnyBuffer> out, int64_t block_stride,
                   int64_t token_stride, int64_t head_stride, int64_t v_offset,
                   int64_t byte_offset, int64_t slot_bytes,
                   int64_t element_bytes, int64_t extent_bytes,
                   int64_t num_blocks, int64_t block_size) {
  auto kd = key.dimensions();
  auto vd = value.dimensions();
  const int64_t num_tokens = slots.element_count();
  if (kd.size() != 3 || vd.size() != 3 || kd[0] != num_tokens ||
      vd[0] != num_tokens || kd[1] != vd[1] || block_size <= 0 ||
      element_bytes <= 0 ||
      key.size_bytes() != static_cast<size_t>(num_tokens * kd[1] * kd[2] *
                                              element_bytes) ||
      value.size_bytes() != static_cast<size_t>(num_tokens * vd[1] * vd[2] *
                                                element_bytes)) {
    return ffi::Error::InvalidArgument(
        "jaxkv_kv_write: inconsistent operand shapes");
  }
  const int64_t pool_bytes = static_cast<int64_t>(pool.size_bytes());
  if (out->size_bytes() != pool.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "jaxkv_kv_write: the output is not the pool's size");
  }
  // Every element the view addresses must lie in the pool (jaxkv checks the
  // view against the pools before tracing; this guards the raw writes).
  if (byte_offset < 0 || extent_bytes < 0 ||
      byte_offset + (slot_bytes > extent_bytes ? slot_bytes : extent_bytes) >
          pool_bytes) {
    return ffi::Error::InvalidArgument(
        "jaxkv_kv_write: the view addresses bytes past the pool");
  }
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) {
    // Not aliased (the pool was not donated): XLA gave a fresh output.
    std::memcpy(dst, pool.untyped_data(), pool_bytes);
  }
  const int64_t s = *slot.typed_data();
  // Slots as a count, not s * slot_bytes: a slot near 2^31 times a slot of
  // gigabytes would pass int64.
  if (slot_bytes > 0 && (s < 0 || s >= (pool_bytes - byte_offset) / slot_bytes)) {
    return ffi::Error::Success();  // a layer slot outside the pool: no write
  }
  char* base = dst + byte_offset + (slot_bytes > 0 ? s * slot_bytes : 0);
  const int64_t heads = kd[1];
  const int64_t k_row = kd[2] * element_bytes, v_row = vd[2] * element_bytes;
  const char* k = static_cast<const char*>(key.untyped_data());
  const char* v = static_cast<const char*>(value.untyped_data());
  const int32_t* ids = slots.typed_data();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t x = ids[t];
    if (x < 0 || x / block_size >= num_blocks) continue;
    const int64_t at = (x / block_size) * block_stride + (x % block_size) * token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      char* row = base + (at + h * head_stride) * element_bytes;
      std::memcpy(row, k + (t * heads + h) * k_row, k_row);
      std::memcpy(row + v_offset * element_bytes, v + (t * heads + h) * v_row, v_row);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvKvWrite, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_stride")
                                  .Attr<int64_t>("token_stride")
                                  .Attr<int64_t>("head_stride")
                                  .Attr<int64_t>("v_offset")
                                  .Attr<int64_t>("byte_offset")
                                  .Attr<int64_t>("slot_bytes")
                                  .Attr<int64_t>("element_bytes")
                                  .Attr<int64_t>("extent_bytes")
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("block_size"));
