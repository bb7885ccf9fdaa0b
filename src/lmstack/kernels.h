// What lmstack's kernel sources share (kernels.cpp, kernels_gguf.cpp, kernels_int4.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace lmstack {

constexpr int64_t TILE = 8;                // rows of w per tile: kernels.py's TILE
constexpr int64_t TASK_WEIGHTS = 1 << 15;  // fewer weights than this per thread: not worth a thread

// 16 float32 values v into out at element `at`: out float32, or bfloat16 (rounded to nearest even)
inline void store16(void* out, bool bf16, int64_t at, __m512 v) {
  if (bf16)
    _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_storeu_ps((float*)out + at, v);
}

// The software prefetch of a stretch of a weight stream, spread evenly between the loads that use other data (the
// many-row kernels: the next tile, while the rows of x pass over this one): each step() moves `bytes` on and fetches
// the cache lines up to there, until the stretch is done.
struct Prefetch {
  const char *next, *at, *end;
  int64_t bytes;
  Prefetch(const void* start, int64_t length, int64_t bytes)
      : next((const char*)start), at((const char*)start), end((const char*)start + length), bytes(bytes) {}
  __attribute__((always_inline)) void step() {
    at += bytes;
    for (; next < at && next < end; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

}  // namespace lmstack
