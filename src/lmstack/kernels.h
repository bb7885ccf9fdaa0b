// What lmstack's kernel sources share (kernels.cpp, kernels_gguf.cpp, kernels_int4.cpp, kernels_gemm.cpp,
// kernels_prefill_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace lmstack {

constexpr int64_t TILE = 8;                // rows of w per tile: kernels.py's TILE
constexpr int64_t REGROUPED_TILE = 16;     // rows of w per record of Q8_0, Q4_0, ...: kernels.py's REGROUPED_TILE
constexpr int64_t TASK_WEIGHTS = 1 << 15;  // fewer weights than this per thread: not worth a thread

// 16 float32 values v into out at element `at`: out float32, or bfloat16 (rounded to nearest even)
inline void store16(void* out, bool bf16, int64_t at, __m512 v) {
  if (bf16)
    _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_storeu_ps((float*)out + at, v);
}

// e^x for float32 lanes: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial (about 1 ulp); past float32's
// range (x > 88.72) inf, as expf gives it
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts, for exact reduction
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
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

// v[i] (16 dwords each) transposed: v[j] lane i = v[i] lane j before
inline void transpose16(__m512i* v) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // u[4i + j]'s 128-bit lane L: column 4L + j of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; j++) {
    const __m512i even0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i odd0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i even1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i odd1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    v[j] = _mm512_shuffle_i32x4(even0, even1, _MM_SHUFFLE(2, 0, 2, 0));
    v[8 + j] = _mm512_shuffle_i32x4(even0, even1, _MM_SHUFFLE(3, 1, 3, 1));
    v[4 + j] = _mm512_shuffle_i32x4(odd0, odd1, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + j] = _mm512_shuffle_i32x4(odd0, odd1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// A weight matrix as gemm_bf16 reads it: pairs(n0, k0, kc, out) writes rows n0..n0 + GEMM_PANEL - 1 (zeros past the
// last row), columns k0..k0 + kc - 1, as out[p * GEMM_PANEL + n] = the 32 bits of row n0 + n's bfloat16 columns
// k0 + 2p and k0 + 2p + 1 (what AVX512-BF16's dot product pairs), for p < kc / 2 rounded up to a multiple of 16
constexpr int64_t GEMM_PANEL = 32;
using WeightPairs = std::function<void(int64_t n0, int64_t k0, int64_t kc, uint32_t* out)>;

// y = x @ w.T + bias for many rows of bfloat16 x (a prefill), w (N rows, x.size(-1) columns) read through `pairs`
// a panel at a time, columns in blocks of a multiple of `granule` (kernels_gemm.cpp)
at::Tensor gemm_bf16(const at::Tensor& x, int64_t N, int64_t granule, const std::optional<at::Tensor>& bias,
                     const WeightPairs& pairs);

// y = x @ w.T + bias for many rows of float32 x and bias, w read through `columns` as through gemm_bf16's pairs but
// a column a word: out[k * GEMM_PANEL + n] = row n0 + n's float32 column k0 + k (kernels_gemm.cpp)
at::Tensor gemm_f32(const at::Tensor& x, int64_t N, int64_t granule, const std::optional<at::Tensor>& bias,
                    const WeightPairs& columns);

// GEMM_PANEL float32 rows (row n at rows + n * stride; zeros from row `count` on) as gemm_f32's columns, kc of them
// read and rounded up to a multiple of 16
void columns_of_rows(const float* rows, int64_t stride, int64_t count, int64_t kc, uint32_t* out);

// w is an (N, K) bfloat16 or int8 (`dtype`) matrix tiled by kernels.tile_int8: (ceil(N / TILE), ceil(K / 32), TILE,
// 32), contiguous, on the CPU; `op` names the caller in the error
inline void check_tiled(const at::Tensor& w, at::ScalarType dtype, int64_t N, int64_t K, const char* op) {
  TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.device().is_cpu() && w.dim() == 4 &&
                  w.size(0) == (N + TILE - 1) / TILE && w.size(1) == (K + 31) / 32 && w.size(2) == TILE &&
                  w.size(3) == 32,
              op, ": w must be ", dtype == at::kChar ? "int8" : "bfloat16", " tiled as (", (N + TILE - 1) / TILE,
              ", ", (K + 31) / 32, ", ", TILE, ", 32), got ", w.sizes());
}

}  // namespace lmstack
