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

}  // namespace lmstack
