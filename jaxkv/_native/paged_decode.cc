// Paged decode attention for XLA:CPU, an XLA FFI custom call.
//
// One query token per row (decode). Row t reads the keys [lo_t, hi_t) of its
// page table through a typed pool's element strides, one KV head at a time:
// the G query heads of that KV head share each key and value as it is read,
// and scores, softmax and the weighted sum of values are folded page by page
// (online softmax), so nothing but the output is written. Work items (row,
// KV head) are claimed from an atomic counter by the calling thread and by
// tasks on XLA's intra-op thread pool; the calling thread waits only for
// items that were claimed, so a task that starts late finds no work and
// touches no buffer.
//
// Pages are float32, bfloat16, or 8-bit (int8, float8_e4m3fn, float8_e5m2)
// read as they are stored: an 8-bit key's score is (q . k) times its scale,
// an 8-bit value's weight times its own, with the scales per token and head
// read from their own place in the pool (vLLM's int8/fp8_per_token_head) or
// one per tensor (fp8_per_tensor: K's folded into `scale` by the caller,
// V's on the output).
//
// Semantics equal jaxkv's XLA path (jaxkv/_attention.py): scores are
// q.k * scale, then cap * tanh(s / cap) when a soft cap is set; a row with no
// visible key is zero; a visible key on a page id outside [0, num_blocks), or
// a layer slot outside the pool, makes that KV head's outputs NaN (the XLA
// gather fills such pages with NaN).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Params {
  const float* q;          // (T, H, D)
  const char* base;        // element 0 of the view's layer slot
  const int32_t* table;    // (T, cols)
  const int32_t* bounds;   // (T, 2): [lo, hi)
  float* out;              // (T, H, Dv)
  int64_t num_rows, num_heads, head_dim, head_dim_v, cols;
  int64_t block_stride, token_stride, head_stride, v_offset;
  int64_t num_blocks, block_size, kv_heads;
  float scale, soft_cap;
  float v_scale = 1.0f;    // per tensor: times every output
  int kind = 0;            // the page dtype: Kind
  bool bad_slot;
  // Per token and head: K's scale of (block b, token j, head h) at
  // token_scales[b * s_block_stride + j * s_token_stride + h * s_head_stride],
  // V's s_v_offset floats after it (nullptr: no such scales).
  const float* token_scales = nullptr;
  int64_t s_block_stride = 0, s_token_stride = 0, s_head_stride = 0,
          s_v_offset = 0;
};

enum Kind { kF32 = 0, kBF16 = 1, kI8 = 2, kE4M3 = 3, kE5M2 = 4 };

// 8-bit elements, told apart by type: pointer arithmetic steps one byte.
struct I8 {
  int8_t bits;
};
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};

// The 256 values of an 8-bit float format with `e` exponent and `m`
// mantissa bits (bias 2^(e-1) - 1, subnormals at exponent 0). `fn`: no
// infinities, only the all-ones pattern is NaN (float8_e4m3fn); otherwise
// IEEE's top exponent (float8_e5m2: Inf and NaN).
struct Fp8Table {
  float v[256];
  Fp8Table(int e, int m, bool fn, float unit = 1.0f) {
    const int bias = (1 << (e - 1)) - 1, top = (1 << e) - 1;
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, ex = (b >> m) & top, man = b & ((1 << m) - 1);
      float x;
      if (fn && ex == top && man == (1 << m) - 1) {
        x = std::numeric_limits<float>::quiet_NaN();
      } else if (!fn && ex == top) {
        x = man ? std::numeric_limits<float>::quiet_NaN()
                : std::numeric_limits<float>::infinity();
      } else if (ex == 0) {
        x = std::ldexp(static_cast<float>(man), 1 - bias - m);
      } else {
        x = std::ldexp(static_cast<float>((1 << m) + man), ex - bias - m);
      }
      v[b] = (sign ? -x : x) * unit;
    }
  }
};
const Fp8Table kE4M3Values(4, 3, true, 1.0f / 256);  // in units of 2^-8
const Fp8Table kE5M2Values(5, 2, false);

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load(const I8* p, int64_t i) { return p[i].bits; }
inline float load(const E4M3* p, int64_t i) { return kE4M3Values.v[p[i].bits]; }
inline float load(const E5M2* p, int64_t i) { return kE5M2Values.v[p[i].bits]; }

// Eight lanes; GCC lowers these to whatever vectors the target has.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename E>
inline v8 load8(const E* p) {
  v8 x;
  for (int i = 0; i < 8; ++i) x[i] = load(p, i);
  return x;
}
// Eight 8-bit elements as floats. GCC scalarizes a generic byte-to-float
// vector conversion (eight cvtsi2ss), so with AVX2 and F16C: int8 through
// sign extension; e5m2 is the top byte of a float16 (Inf and NaN
// included), converted by vcvtph2ps; e4m3fn's magnitude bits, shifted into
// a float16's, are the value times 2^-8 (subnormals too, which vcvtph2ps
// converts exactly whatever the MXCSR's denormal flags): e4m3 pages are
// read in units of 2^-8 everywhere (its table too) and the 2^8 is folded
// into the score scale and the output (exact: a power of two), and its one
// NaN pattern is set apart. Elsewhere one table lookup a lane.
#if defined(__AVX2__) && defined(__F16C__)
inline v8 as_v8(__m256 x) {
  v8 y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}
inline __m128i load_bytes(const void* p) {
  return _mm_loadl_epi64(static_cast<const __m128i*>(p));
}
inline v8 load8(const I8* p) {
  return as_v8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes(p))));
}
inline v8 load8(const E5M2* p) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(load_bytes(p)), 8);
  return as_v8(_mm256_cvtph_ps(h));
}
inline v8 load8(const E4M3* p) {
  // (b + (b & 0x80)) << 7: the magnitude's bits at a float16's 13..7, the
  // sign carried to bit 15; the NaN pattern (0x7F or 0xFF) as float16 NaN.
  const __m128i w = _mm_cvtepu8_epi16(load_bytes(p));
  const __m128i sign = _mm_and_si128(w, _mm_set1_epi16(0x80));
  __m128i h = _mm_slli_epi16(_mm_add_epi16(w, sign), 7);
  const __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(w, _mm_set1_epi16(0x80)),
                                      _mm_set1_epi16(0xFF));
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
  return as_v8(_mm256_cvtph_ps(h));
}
#endif
inline float sum8(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
// The sum of the lanes in the order Sum8x8 adds them (pairs, then pairs of
// pairs), so a key scored alone gets the bits it gets scored with another.
inline float sum8_pairs(v8 x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// Lane i of the result is sum8_pairs(x[i]): eight dot products finished with
// seven pairwise adds of vectors instead of eight horizontal sums.
inline v8 Sum8x8(const v8* x) {
  typedef int32_t i8 __attribute__((vector_size(32)));
  const i8 even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i) {
    t[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], even) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], odd);
  }
  for (int i = 0; i < 2; ++i) {
    u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], even) +
           __builtin_shuffle(t[2 * i], t[2 * i + 1], odd);
  }
  const i8 lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  return __builtin_shuffle(u[0], u[1], lo) + __builtin_shuffle(u[0], u[1], hi);
}

// Keeps a loaded vector in a register. Without it GCC folds the load into
// every multiply-add that uses the value (a memory operand each), so a
// value used G times is loaded G times and the loop waits on its loads:
// pinning the values made the whole kernel faster in the C++ harness
// (benchmarks/README.md).
inline void InRegister(v8& x) {
#if defined(__x86_64__) && defined(__AVX__)
  __asm__("" : "+v"(x));
#else
  (void)x;
#endif
}

// exp on eight lanes (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in
// r, times 2^n); relative error under 2e-7 on [-87, 88]. Below -87.3 it is 0
// (the weight of a key far under the running max), NaN stays NaN.
inline v8 exp8(v8 x) {
  typedef int32_t i8 __attribute__((vector_size(32)));
  const v8 hi = v8{} + 88.3762626647949f, lo = v8{} - 87.3365447504f;
  const i8 nan = x != x;
  const i8 under = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v8 n = x * 1.44269504088896341f + 0.5f;
  // floor(n): truncate, minus one where that rounded up.
  v8 t = __builtin_convertvector(__builtin_convertvector(n, i8), v8);
  n = t > n ? t - 1.0f : t;
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v8 z = x * x;
  v8 y = v8{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  i8 e = (__builtin_convertvector(n, i8) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &e, sizeof scale);
  y = y * scale;
  y = under ? v8{} : y;
  return nan ? x : y;
}

// s[j] *= scale for j < n (a multiple of 8); returns the max of those that
// are not NaN (-inf for none). A NaN score needs no max to reach the output:
// its weight exp(NaN - max) is NaN, and so are the sums it enters.
inline float ScaleAndMax8(float* s, int64_t n, float scale) {
  v8 top = v8{} - std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; j += 8) {
    const v8 x = load8(s + j) * scale;
    std::memcpy(s + j, &x, sizeof x);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, top[i]);
  return m;
}

// s[g * stride + i] = q_g . k_i for the G query heads of one KV head and
// M = 1 or 2 consecutive keys (k_i at k + i * token_stride): each query load
// serves both keys, each key load all G heads, so two keys at a time are
// bound by the multiply-adds, not the loads (measured in the C++ harness,
// benchmarks/README.md). One accumulator per key and head, summed
// over D in the same order for M = 1 and 2: a key's score does not depend
// on whether it was paired.
template <int G, int M, typename E>
inline void ScoreKeys(const float* q, const E* k, int64_t token_stride,
                      int64_t D, float* s, int64_t stride) {
  static_assert(M == 1 || M == 2, "one or two keys");
  v8 a[M * G];
  for (int i = 0; i < M * G; ++i) a[i] = v8{};
  for (int64_t d = 0; d < D; d += 8) {
    v8 k0 = load8(k + d), k1 = M == 2 ? load8(k + token_stride + d) : v8{};
    InRegister(k0);
    if (M == 2) InRegister(k1);
    for (int g = 0; g < G; ++g) {
      v8 qg = load8(q + g * D + d);
      if (M == 2) InRegister(qg);
      a[g] += qg * k0;
      if (M == 2) a[G + g] += qg * k1;
    }
  }
  if constexpr (M * G == 8) {
    const v8 r = Sum8x8(a);
    for (int i = 0; i < M; ++i) {
      for (int g = 0; g < G; ++g) s[g * stride + i] = r[i * G + g];
    }
  } else {
    for (int i = 0; i < M; ++i) {
      for (int g = 0; g < G; ++g) s[g * stride + i] = sum8_pairs(a[i * G + g]);
    }
  }
}

// Scores of M keys against the G query heads of one KV head (see ScoreKeys);
// G = 8 as two halves of 4 (eight accumulators each); group sizes without
// a fixed variant, and head dims that are not a multiple of 8, one scalar
// dot product at a time.
template <int M, typename E>
inline void Scores(const float* q, const E* k, int64_t token_stride, int64_t G,
                   int64_t D, float* s, int64_t stride) {
  if (D % 8 == 0) {
    switch (G) {
      case 1: return ScoreKeys<1, M>(q, k, token_stride, D, s, stride);
      case 2: return ScoreKeys<2, M>(q, k, token_stride, D, s, stride);
      case 4: return ScoreKeys<4, M>(q, k, token_stride, D, s, stride);
      case 8:
        ScoreKeys<4, M>(q, k, token_stride, D, s, stride);
        return ScoreKeys<4, M>(q + 4 * D, k, token_stride, D, s + 4 * stride,
                               stride);
      default: break;
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        dot += q[g * D + d] * load(k + i * token_stride, d);
      }
      s[g * stride + i] = dot;
    }
  }
}

#ifdef JAXKV_NO_PREFETCH
constexpr bool kPrefetch = false;
#else
constexpr bool kPrefetch = true;
#endif

// The cache lines of the next page's keys (or values) of KV heads [h0, h1),
// asked for into L2 (prefetcht1) a few at a time, so that they arrive while
// the current page is worked on: `Step()` asks for 1/steps of them, once per
// key scored or value chunk summed, and `Rest()` for what is left. Into L2,
// not L1: L2 tracks more misses in flight, and a page's 32 KiB would evict
// the current page from a 32 KiB L1D. One range of bytes per head, merged
// when heads' ranges touch (keys of a token side by side); a layout with
// heads outermost is one range per head, not a sweep over every page
// between them.
//
// Measured in the C++ harness over this file (benchmarks/README.md): asking
// for lines into L2 beat L1, and spreading them over the keys and value
// chunks beat asking for one token's lines per key scored.
struct Lines {
  const char* p = nullptr;    // next line to ask for
  const char* end = nullptr;  // end of the current head's range
  int64_t ranges_left = 0;    // heads' ranges after the current one
  int64_t head_bytes = 0;     // from one head's range to the next
  int64_t span = 0;           // bytes of one head's range
  int64_t per_step = 0;

  Lines() = default;
  Lines(const char* first, int64_t heads, int64_t head_bytes_, int64_t span_,
        int64_t steps)
      : head_bytes(head_bytes_), span(span_) {
    if (heads > 1 && head_bytes <= span) {
      span += (heads - 1) * head_bytes;
      heads = 1;
    }
    const char* start = reinterpret_cast<const char*>(
        reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
    span += first - start;
    p = start;
    end = start + span;
    ranges_left = heads - 1;
    const int64_t lines = heads * ((span + 63) / 64);
    per_step = (lines + steps - 1) / std::max<int64_t>(1, steps);
  }
  void Issue(int64_t count) {
    while (count > 0) {
      if (p >= end) {
        if (ranges_left == 0) return;
        --ranges_left;
        p = end - span + head_bytes;
        end = p + span;
      }
      const int64_t m = std::min<int64_t>(count, (end - p + 63) / 64);
      for (int64_t i = 0; i < m; ++i) __builtin_prefetch(p + 64 * i, 0, 2);
      p += 64 * m;
      count -= m;
    }
  }
  void Step() { Issue(per_step); }
  void Rest() { Issue(std::numeric_limits<int64_t>::max()); }
};

// acc[g] += sum_j w[g * stride + j] * v_j for the n values of one page (v_j
// at v + j * token_stride): blocks of 16 lanes of the G numerators stay in
// registers while the page's values stream past.
template <int G, typename E>
inline void AccumulateFixed(const E* v, int64_t token_stride, const float* w,
                            int64_t stride, int64_t n, int64_t Dv, float* acc,
                            Lines& ahead) {
  for (int64_t d = 0; d < Dv; d += 16) {
    ahead.Step();
    v8 a[G], b[G];
    for (int g = 0; g < G; ++g) {
      a[g] = load8(acc + g * Dv + d);
      b[g] = load8(acc + g * Dv + d + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const E* vj = v + j * token_stride + d;
      v8 v0 = load8(vj), v1 = load8(vj + 8);
      InRegister(v0);
      InRegister(v1);
      for (int g = 0; g < G; ++g) {
        const float wg = w[g * stride + j];
        a[g] += wg * v0;
        b[g] += wg * v1;
      }
    }
    for (int g = 0; g < G; ++g) {
      std::memcpy(acc + g * Dv + d, &a[g], sizeof a[g]);
      std::memcpy(acc + g * Dv + d + 8, &b[g], sizeof b[g]);
    }
  }
}

// acc[g] += sum_j w[g * stride + j] * v_j for the n values of one page (v_j
// at v + j * token_stride): blocks of 16 lanes of the G numerators stay in
// registers while the page's values stream past.
template <typename E>
inline void AccumulateValues(const E* v, int64_t token_stride, const float* w,
                             int64_t stride, int64_t n, int64_t G, int64_t Dv,
                             float* acc, Lines& ahead) {
  const auto fixed = [&](auto g) {
    AccumulateFixed<decltype(g)::value>(v, token_stride, w, stride, n, Dv, acc,
                                        ahead);
  };
  if (Dv % 16 == 0) {
    switch (G) {
      case 1: return fixed(std::integral_constant<int, 1>{});
      case 2: return fixed(std::integral_constant<int, 2>{});
      case 4: return fixed(std::integral_constant<int, 4>{});
      case 8: return fixed(std::integral_constant<int, 8>{});
      default: break;
    }
  }
  ahead.Rest();
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < Dv; ++d) {
        acc[g * Dv + d] += w[g * stride + j] * load(v + j * token_stride, d);
      }
    }
  }
}

// rows[g * stride + j] *= scales[j * scale_stride] for G rows and n < stride
// keys: the scales (strided by the heads beside them) gathered into `col`
// once, then eight keys at a time.
inline void ScaleRows(float* rows, int64_t stride, int64_t G, int64_t n,
                      const float* scales, int64_t scale_stride, float* col) {
  for (int64_t j = 0; j < n; ++j) col[j] = scales[j * scale_stride];
  const int64_t n8 = n - n % 8;
  for (int64_t g = 0; g < G; ++g) {
    float* r = rows + g * stride;
    for (int64_t j = 0; j < n8; j += 8) {
      const v8 x = load8(r + j) * load8(col + j);
      std::memcpy(r + j, &x, sizeof x);
    }
    for (int64_t j = n8; j < n; ++j) r[j] *= col[j];
  }
}

// Row t, KV heads [h0, h1): each page is read once for all those heads (on
// a block-outermost layout their keys share cache lines), folded into the
// running max, denominator and numerator of each query head.
template <typename E>
void Attend(const Params& P, int64_t t, int64_t h0, int64_t h1,
            std::vector<float>& scratch) {
  const int64_t G = P.num_heads / P.kv_heads;
  const int64_t QH = (h1 - h0) * G;  // query heads of this item
  const int64_t D = P.head_dim, Dv = P.head_dim_v, bs = P.block_size;
  float* out = P.out + (t * P.num_heads + h0 * G) * Dv;
  // Keys before 0 do not exist (jaxkv never sends them; never read before
  // the table's row).
  const int32_t lo = std::max<int32_t>(0, P.bounds[2 * t]), hi = P.bounds[2 * t + 1];
  std::fill(out, out + QH * Dv, 0.0f);
  if (hi <= lo) return;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (P.bad_slot) {
    std::fill(out, out + QH * Dv, nan);
    return;
  }
  scratch.resize(static_cast<size_t>(QH * (Dv + bs + 2) + bs));
  float* acc = scratch.data();       // (QH, Dv)
  float* s = acc + QH * Dv;          // (QH, bs) scores of one page
  float* top = s + QH * bs;          // (QH,)
  float* denom = top + QH;           // (QH,)
  float* col = denom + QH;           // (bs,) one head's scales of a page
  const float* q = P.q + (t * P.num_heads + h0 * G) * D;  // (QH, D)
  std::fill(acc, acc + QH * Dv, 0.0f);
  std::fill(top, top + QH, -std::numeric_limits<float>::infinity());
  std::fill(denom, denom + QH, 0.0f);
  const E* base = reinterpret_cast<const E*>(P.base);
  const int32_t* row_table = P.table + t * P.cols;
  for (int64_t c = lo / bs; c * bs < hi; ++c) {
    const int64_t id = c < P.cols ? row_table[c] : -1;
    if (id < 0 || id >= P.num_blocks) {
      std::fill(out, out + QH * Dv, nan);
      return;
    }
    const int64_t j0 = std::max<int64_t>(lo, c * bs);
    const int64_t j1 = std::min<int64_t>(hi, (c + 1) * bs);
    const int64_t n = j1 - j0;
    const E* page = base + id * P.block_stride + (j0 - c * bs) * P.token_stride;
    // Pages are scattered over the pool: ask for the next one's lines while
    // this one is worked on.
    Lines keys, values;
    if (kPrefetch && (c + 1) * bs < hi && c + 1 < P.cols) {
      const int64_t next = row_table[c + 1];
      if (next >= 0 && next < P.num_blocks) {
        const int64_t es = sizeof(E);
        const char* k = reinterpret_cast<const char*>(
            base + next * P.block_stride + h0 * P.head_stride);
        const int64_t heads = h1 - h0, hb = P.head_stride * es;
        keys = Lines(k, heads, hb, ((bs - 1) * P.token_stride + D) * es, bs);
        values = Lines(k + P.v_offset * es, heads, hb,
                       ((bs - 1) * P.token_stride + Dv) * es,
                       heads * std::max<int64_t>(1, Dv / 16));
      }
    }
    // Two keys at a time (each query load serves both), then the odd one.
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      keys.Step();
      keys.Step();
      const E* key = page + j * P.token_stride;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t g0 = (h - h0) * G;
        Scores<2>(q + g0 * D, key + h * P.head_stride, P.token_stride, G, D,
                  s + g0 * bs + j, bs);
      }
    }
    if (j < n) {
      const E* key = page + j * P.token_stride;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t g0 = (h - h0) * G;
        Scores<1>(q + g0 * D, key + h * P.head_stride, P.token_stride, G, D,
                  s + g0 * bs + j, bs);
      }
    }
    keys.Rest();
    // Per token and head 8-bit pages: each key's score times its K scale.
    const float* page_scales =
        P.token_scales
            ? P.token_scales + id * P.s_block_stride +
                  (j0 - c * bs) * P.s_token_stride
            : nullptr;
    if (page_scales) {
      for (int64_t h = h0; h < h1; ++h) {
        ScaleRows(s + (h - h0) * G * bs, bs, G, n,
                  page_scales + h * P.s_head_stride, P.s_token_stride, col);
      }
    }
    for (int64_t g = 0; g < QH; ++g) {
      float* sg = s + g * bs;
      float m = top[g];
      int64_t j0 = 0;
      if (P.soft_cap <= 0.0f) {
        // Eight scores at a time: scaled, stored, and folded into the max.
        j0 = n - n % 8;
        m = std::max(m, ScaleAndMax8(sg, j0, P.scale));
      }
      for (int64_t j = j0; j < n; ++j) {
        float sc = sg[j] * P.scale;
        if (P.soft_cap > 0.0f) sc = P.soft_cap * std::tanh(sc / P.soft_cap);
        sg[j] = sc;
        m = std::isnan(sc) || std::isnan(m) ? sc + m : std::max(m, sc);
      }
      const float safe = std::isfinite(m) ? m : 0.0f;
      const float rescale =
          std::isfinite(top[g]) ? std::exp(top[g] - safe) : 0.0f;
      float sum = 0.0f;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        const v8 w = exp8(load8(sg + j) - safe);
        std::memcpy(sg + j, &w, sizeof w);
        sum += sum8(w);
      }
      for (; j < n; ++j) {
        sg[j] = std::exp(sg[j] - safe);
        sum += sg[j];
      }
      denom[g] = denom[g] * rescale + sum;
      top[g] = m;
      if (rescale != 1.0f) {
        float* ag = acc + g * Dv;
        for (int64_t d = 0; d < Dv; ++d) ag[d] *= rescale;
      }
    }
    for (int64_t h = h0; h < h1; ++h) {
      const E* value = page + P.v_offset + h * P.head_stride;
      const int64_t g0 = (h - h0) * G;
      if (page_scales) {
        // The weights (their sum is in denom) times each value's V scale.
        ScaleRows(s + g0 * bs, bs, G, n,
                  page_scales + P.s_v_offset + h * P.s_head_stride,
                  P.s_token_stride, col);
      }
      AccumulateValues(value, P.token_stride, s + g0 * bs, bs, n, G, Dv,
                       acc + g0 * Dv, values);
    }
    values.Rest();
  }
  for (int64_t g = 0; g < QH; ++g) {
    const float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 1.0f;
    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = acc[g * Dv + d] * inv;
    if (P.v_scale != 1.0f) {
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] *= P.v_scale;
    }
  }
}

struct Work {
  Params params;
  int64_t total = 0;
  int64_t split = 1;  // items per row: KV heads are split this many ways
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    std::vector<float> scratch;
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= total) return;
      const int64_t t = i / split, part = i % split;
      const int64_t h0 = part * params.kv_heads / split;
      const int64_t h1 = (part + 1) * params.kv_heads / split;
      switch (params.kind) {
        case kBF16: Attend<uint16_t>(params, t, h0, h1, scratch); break;
        case kI8: Attend<I8>(params, t, h0, h1, scratch); break;
        case kE4M3: Attend<E4M3>(params, t, h0, h1, scratch); break;
        case kE5M2: Attend<E5M2>(params, t, h0, h1, scratch); break;
        default: Attend<float>(params, t, h0, h1, scratch); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedDecode(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer pool,
                       ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> bounds,
                       ffi::Buffer<ffi::S32> slot,
                       ffi::ResultBuffer<ffi::F32> out, int64_t block_stride,
                       int64_t token_stride, int64_t head_stride,
                       int64_t v_offset, int64_t byte_offset,
                       int64_t slot_bytes, int64_t element_bytes,
                       int64_t extent_bytes,
                       int64_t num_blocks, int64_t block_size,
                       int64_t kv_heads, int64_t head_dim_v, float scale,
                       float soft_cap, int64_t element_kind, float v_scale,
                       int64_t scale_byte_offset, int64_t scale_extent_bytes,
                       int64_t scale_block_stride, int64_t scale_token_stride,
                       int64_t scale_head_stride, int64_t scale_v_offset,
                       ffi::ThreadPool threads) {
  auto qd = q.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 3 || td.size() != 2 || td[0] != qd[0] ||
      bounds.element_count() != 2 * qd[0] || kv_heads <= 0 ||
      qd[1] % kv_heads != 0 || block_size <= 0) {
    return ffi::Error::InvalidArgument(
        "jaxkv_paged_decode: inconsistent operand shapes");
  }
  static const int64_t kBytes[] = {4, 2, 1, 1, 1};
  if (element_kind < 0 || element_kind > kE5M2 ||
      element_bytes != kBytes[element_kind]) {
    return ffi::Error::InvalidArgument(
        "jaxkv_paged_decode: element_kind must be 0 (float32), 1 (bfloat16), "
        "2 (int8), 3 (float8_e4m3fn) or 4 (float8_e5m2), with element_bytes "
        "4, 2, 1, 1, 1");
  }
  auto work = std::make_shared<Work>();
  Params& P = work->params;
  P.q = q.typed_data();
  P.table = table.typed_data();
  P.bounds = bounds.typed_data();
  P.out = out->typed_data();
  P.num_rows = qd[0];
  P.num_heads = qd[1];
  P.head_dim = qd[2];
  P.head_dim_v = head_dim_v;
  P.cols = td[1];
  P.block_stride = block_stride;
  P.token_stride = token_stride;
  P.head_stride = head_stride;
  P.v_offset = v_offset;
  P.num_blocks = num_blocks;
  P.block_size = block_size;
  P.kv_heads = kv_heads;
  P.scale = scale;
  P.soft_cap = soft_cap;
  P.kind = static_cast<int>(element_kind);
  P.v_scale = v_scale;
  if (P.kind == kE4M3) {  // its pages are read in units of 2^-8
    P.scale *= 256.0f;
    P.v_scale *= 256.0f;
  }
  // The pool's bytes are read in place, whatever its array type (typed
  // elements, their bits, or carrier words): element 0 of the view is at
  // byte_offset plus the layer slot's bytes (slot_bytes 0: a word pool).
  const int64_t s = *slot.typed_data();
  const int64_t pool_bytes = static_cast<int64_t>(pool.size_bytes());
  // Every element the view addresses must lie in the pool (jaxkv checks the
  // view against the pools before tracing; this guards the raw reads).
  if (byte_offset < 0 || extent_bytes < 0 ||
      byte_offset + std::max<int64_t>(slot_bytes, extent_bytes) > pool_bytes) {
    return ffi::Error::InvalidArgument(
        "jaxkv_paged_decode: the view addresses bytes past the pool");
  }
  // Slots as a count, not s * slot_bytes: a slot near 2^31 times a slot of
  // gigabytes would pass int64.
  P.bad_slot = slot_bytes > 0 &&
               (s < 0 || s >= (pool_bytes - byte_offset) / slot_bytes);
  P.base = static_cast<const char*>(pool.untyped_data()) + byte_offset +
           (P.bad_slot ? 0 : s * slot_bytes);
  // Scales per token and head (a word pool's own bytes: no layer slot).
  if (scale_byte_offset >= 0) {
    if (scale_byte_offset % 4 || scale_extent_bytes < 0 ||
        scale_byte_offset + scale_extent_bytes > pool_bytes) {
      return ffi::Error::InvalidArgument(
          "jaxkv_paged_decode: the scales lie past the pool or are not 4-byte "
          "aligned");
    }
    P.token_scales = reinterpret_cast<const float*>(
        static_cast<const char*>(pool.untyped_data()) + scale_byte_offset);
    P.s_block_stride = scale_block_stride;
    P.s_token_stride = scale_token_stride;
    P.s_head_stride = scale_head_stride;
    P.s_v_offset = scale_v_offset;
  }
  // Whole rows (every KV head of a page read at once) unless there are too
  // few rows to keep the threads busy.
  const int64_t num_threads = std::max<int64_t>(1, threads.num_threads());
  work->split = P.num_rows >= 4 * num_threads ? 1 : kv_heads;
  work->total = P.num_rows * work->split;
  const int64_t helpers = std::min<int64_t>(num_threads - 1, work->total - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    threads.Schedule([work] { work->Run(); });
  }
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->total) {
    std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_stride")
                                  .Attr<int64_t>("token_stride")
                                  .Attr<int64_t>("head_stride")
                                  .Attr<int64_t>("v_offset")
                                  .Attr<int64_t>("byte_offset")
                                  .Attr<int64_t>("slot_bytes")
                                  .Attr<int64_t>("element_bytes")
                                  .Attr<int64_t>("extent_bytes")
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("head_dim_v")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("element_kind")
                                  .Attr<float>("v_scale")
                                  .Attr<int64_t>("scale_byte_offset")
                                  .Attr<int64_t>("scale_extent_bytes")
                                  .Attr<int64_t>("scale_block_stride")
                                  .Attr<int64_t>("scale_token_stride")
                                  .Attr<int64_t>("scale_head_stride")
                                  .Attr<int64_t>("scale_v_offset")
                                  .Ctx<ffi::ThreadPool>());
