// Many rows of bfloat16 (or float32) x times weights as lmstack stores them (a prefill): y = x @ w.T + bias, one
// GEMM that reads the stored weights once, with no dense copy of the matrix. Handing F.linear a plain matrix costs a
// copy of every weight first (untiling the bfloat16 tiles, dequantizing GGUF blocks), a third of the GEMM's time at
// 512 rows.
//
// Each thread takes panels of GEMM_PANEL output columns. A panel's weights come a block of columns at a time from
// the caller (WeightPairs: transposed from the tiles, or dequantized from blocks, into a buffer that stays in cache),
// interleaved in pairs of columns as AVX512-BF16's dot product takes them, and meet every row of x: MR rows x 32
// columns of float32 sums in registers, each step one pair of x's columns broadcast against 32 columns' pairs of
// weights. Sums are float32, carried across column blocks, rounded to bfloat16 once at the end. In float32 a step
// is one column of x broadcast against 32 columns of weights, and each block of columns has a sum of its own.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

using lmstack::GEMM_PANEL;
using lmstack::TILE;
constexpr int64_t MR = 12;        // rows of x per register block: 24 accumulators
constexpr int64_t KC = 1024;      // columns of w per block at most: a panel's pairs (64 KiB) stay in L2
constexpr int64_t F32_KC = 256;   // in float32: the columns of one sum of products, added to the others after
constexpr int64_t X_AHEAD = 1024;  // x's values (4 bytes each) prefetched ahead of the register block's reads
constexpr int64_t MC = 43 * MR;   // rows of x per pass over a panel (whole register blocks): their sums stay in L2

struct Free {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], Free> aligned(int64_t n) {
  return std::unique_ptr<T[], Free>(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)));
}

// out[p * GEMM_PANEL + i] = the 32 bits of row i's columns 2p, 2p + 1 for 16 rows (row i at at[i]; columns past
// `mask` read as zeros) and 32 columns: a 16 x 16 transpose of 32-bit values
inline void transpose_pairs(const uint16_t* const* at, __mmask32 mask, uint32_t* out) {
  __m512i v[16];
  for (int i = 0; i < 16; i++) v[i] = _mm512_maskz_loadu_epi16(mask, at[i]);
  lmstack::transpose16(v);
  for (int p = 0; p < 16; p++) _mm512_store_si512(out + p * GEMM_PANEL, v[p]);
}

// sums[R x 32] (+)= R rows of x, as pairs[p][r] (MR a step), times the panel's P pairs. In float32 (F32: x's and the
// panel's words are float32 values, one column a step) the block's products are summed apart and then added to
// sums, a sum per block of columns, as a float32 BLAS blocks them: one sum over all of K drifts twice as far from
// the exact product
template <int R, bool F32>
void block(const uint32_t* x, const uint32_t* pairs, int64_t P, float* sums, bool first) {
  __m512 acc[R][2];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++)
      acc[r][h] = first || F32 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * GEMM_PANEL + 16 * h);
  for (int64_t p = 0; p < P; p++, x += MR) {
    _mm_prefetch((const char*)(x + X_AHEAD), _MM_HINT_T0);
    const __m512i w0 = _mm512_load_si512(pairs + p * GEMM_PANEL), w1 = _mm512_load_si512(pairs + p * GEMM_PANEL + 16);
    for (int r = 0; r < R; r++) {
      const __m512i a = _mm512_set1_epi32(int32_t(x[r]));
      if constexpr (F32) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(w0), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(w1), acc[r][1]);
      } else {
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)w1);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) {
      float* at = sums + r * GEMM_PANEL + 16 * h;
      _mm512_storeu_ps(at, F32 && !first ? _mm512_add_ps(_mm512_loadu_ps(at), acc[r][h]) : acc[r][h]);
    }
}

template <bool F32, int R = MR>
void block_of(int64_t rows, const uint32_t* x, const uint32_t* pairs, int64_t P, float* sums, bool first) {
  if constexpr (R > 1)
    if (rows < R) return block_of<F32, R - 1>(rows, x, pairs, P, sums, first);
  block<R, F32>(x, pairs, P, sums, first);
}

// x (M rows of P 32-bit words: bfloat16 pairs, or float32 values) -> for each MR rows, out[p][r] = row r's word p
// (zeros past M): the rows a register block reads, in the order it reads them (rows apart would share an L1 set)
void interleave_rows(const uint32_t* x, int64_t M, int64_t P, uint32_t* out) {
  at::parallel_for(0, (M + MR - 1) / MR, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      uint32_t* o = out + b * P * MR;
      for (int64_t r = 0; r < MR; r++) {
        const int64_t m = b * MR + r;
        for (int64_t p = 0; p < P; p++) o[p * MR + r] = m < M ? x[m * P + p] : 0;
      }
    }
  });
}

}  // namespace

namespace lmstack {

void columns_of_rows(const float* rows, int64_t stride, int64_t count, int64_t kc, uint32_t* out) {
  for (int64_t k = 0; k < kc; k += 16) {
    const __mmask16 mask = kc - k >= 16 ? 0xffff : (__mmask16)((1u << (kc - k)) - 1);
    for (int64_t half = 0; half < GEMM_PANEL; half += 16) {
      __m512i v[16];
      for (int64_t i = 0; i < 16; i++)
        v[i] = half + i < count ? _mm512_maskz_loadu_epi32(mask, rows + (half + i) * stride + k)
                                : _mm512_setzero_si512();
      transpose16(v);
      for (int j = 0; j < 16; j++) _mm512_store_si512(out + (k + j) * GEMM_PANEL + half, v[j]);
    }
  }
}

// y = x @ w.T + bias: x and bias bfloat16 (the columns' pairs in a word), or float32 (F32: a column a word, a block
// of columns at most F32_KC, the output float32)
template <bool F32>
at::Tensor gemm(const at::Tensor& x_, int64_t N, int64_t granule, const std::optional<at::Tensor>& bias,
                const WeightPairs& weight_pairs) {
  const at::Tensor x = x_.contiguous();
  const auto dtype = F32 ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu() && x.scalar_type() == dtype, "gemm: x must be a ", dtype,
              " CPU tensor");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, per_word = F32 ? 1 : 2;
  TORCH_CHECK(K % per_word == 0 && granule % per_word == 0, "gemm_bf16: x's columns (", K, ") must be even");
  std::vector<float> bias_f(N, 0.f);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype, "gemm: bias must be a ",
                dtype, " vector of ", N);
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + N, bias_f.begin());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t kc_max = F32 ? F32_KC : KC, blocks = (K + kc_max - 1) / kc_max;
  const int64_t step = std::min(K, ((K + blocks - 1) / blocks + granule - 1) / granule * granule);
  const int64_t P = K / per_word;
  auto xp = aligned<uint32_t>((M + MR - 1) / MR * MR * P);
  interleave_rows(static_cast<const uint32_t*>(x.data_ptr()), M, P, xp.get());
  at::parallel_for(0, (N + GEMM_PANEL - 1) / GEMM_PANEL, 1, [&](int64_t p0, int64_t p1) {
    auto pairs = aligned<uint32_t>(GEMM_PANEL * ((step + 31) / 32 * 32) / per_word);
    auto sums = aligned<float>(std::min(M, MC) * GEMM_PANEL);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * GEMM_PANEL, width = std::min(GEMM_PANEL, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += step) {
          const int64_t kc = std::min(step, K - k0);
          weight_pairs(n0, k0, kc, pairs.get());
          for (int64_t m = 0; m < mc; m += MR)
            block_of<F32>(std::min(MR, mc - m), xp.get() + (m0 + m) * P + k0 / per_word * MR, pairs.get(),
                          kc / per_word, sums.get() + m * GEMM_PANEL, k0 == 0);
        }
        const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(width, 16)) - 1);
        const __mmask16 hi = (__mmask16)(width > 16 ? (1u << (width - 16)) - 1 : 0);
        const __m512 b0 = _mm512_maskz_loadu_ps(lo, bias_f.data() + n0);
        const __m512 b1 = _mm512_maskz_loadu_ps(hi, bias_f.data() + n0 + 16);
        for (int64_t m = 0; m < mc; m++) {
          const float* s = sums.get() + m * GEMM_PANEL;
          const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(s), b0), v1 = _mm512_add_ps(_mm512_loadu_ps(s + 16), b1);
          if constexpr (F32) {
            float* out = static_cast<float*>(y.data_ptr()) + (m0 + m) * N + n0;
            _mm512_mask_storeu_ps(out, lo, v0), _mm512_mask_storeu_ps(out + 16, hi, v1);
          } else {
            uint16_t* out = static_cast<uint16_t*>(y.data_ptr()) + (m0 + m) * N + n0;
            _mm256_mask_storeu_epi16(out, lo, (__m256i)_mm512_cvtneps_pbh(v0));
            _mm256_mask_storeu_epi16(out + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
          }
        }
      }
    }
  });
  return y;
}

at::Tensor gemm_bf16(const at::Tensor& x, int64_t N, int64_t granule, const std::optional<at::Tensor>& bias,
                     const WeightPairs& pairs) {
  return gemm<false>(x, N, granule, bias, pairs);
}

at::Tensor gemm_f32(const at::Tensor& x, int64_t N, int64_t granule, const std::optional<at::Tensor>& bias,
                    const WeightPairs& columns) {
  return gemm<true>(x, N, granule, bias, columns);
}

}  // namespace lmstack

namespace {

// The 16 rows n..n+15 of w, tiled as kernels.tile_int8 stores it ((N / TILE, K32, TILE, 32) bfloat16 or int8,
// zero-padded), at columns k..k+31 (32 values apart within a tile; zeros past N)
template <class T>
inline void tile_rows(const T* w, int64_t N, int64_t K32, int64_t n, int64_t k, const T** at) {
  static const T zeros[32] = {};
  for (int64_t i = 0; i < 16; i++)
    at[i] = n + i < N ? w + ((n + i) / TILE * K32 + k / 32) * TILE * 32 + (n + i) % TILE * 32 : zeros;
}

// columns[c * GEMM_PANEL] for c < 32 = 16 rows' bfloat16 columns k..k+31 (row i's at at[i]; those past `mask` read as
// zeros) widened exactly, as gemm_f32 takes them: each pair of columns transposed into one word per row, whose high
// half is the odd column's float32 and whose low half, shifted up, the even's
inline void widened_columns(const uint16_t* const* at, __mmask32 mask, uint32_t* columns) {
  __m512i v[16];
  for (int i = 0; i < 16; i++) v[i] = _mm512_maskz_loadu_epi16(mask, at[i]);
  lmstack::transpose16(v);
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int p = 0; p < 16; p++) {
    _mm512_store_si512(columns + 2 * p * GEMM_PANEL, _mm512_slli_epi32(v[p], 16));
    _mm512_store_si512(columns + (2 * p + 1) * GEMM_PANEL, _mm512_and_si512(v[p], high));
  }
}

// y = x @ w.T + bias for many rows of x, w tiled as kernels.tile_int8 stores it: bfloat16 x meets the tiles' pairs of
// columns, float32 x (F32) their columns widened exactly
template <bool F32>
at::Tensor gemm_tiled(const at::Tensor& x, const at::Tensor& w, int64_t N, const std::optional<at::Tensor>& bias) {
  lmstack::check_tiled(w, at::kBFloat16, N, x.size(-1), F32 ? "gemm_f32_tiled" : "gemm_bf16_tiled");
  const int64_t K32 = w.size(1);
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  return (F32 ? lmstack::gemm_f32 : lmstack::gemm_bf16)(x, N, 32, bias, [&](int64_t n0, int64_t k0, int64_t kc,
                                                                          uint32_t* out) {
    const uint16_t* at[16];
    for (int64_t k = k0; k < k0 + kc; k += 32)
      for (int64_t half = 0; half < GEMM_PANEL; half += 16) {
        tile_rows(wp, N, K32, n0 + half, k, at);
        if constexpr (F32)
          widened_columns(at, ~0u, out + (k - k0) * GEMM_PANEL + half);
        else
          transpose_pairs(at, ~0u, out + (k - k0) / 2 * GEMM_PANEL + half);
      }
  });
}

// y = x @ w.T + bias for many rows of x and an (N, K) w as it is: float32 x (F32) with a float32 or bfloat16 w (widened
// exactly), bfloat16 x with a bfloat16 w
template <bool F32>
at::Tensor gemm_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kBFloat16 || (F32 && w.scalar_type() == at::kFloat)) &&
                  w.size(1) == x.size(-1),
              F32 ? "gemm_f32_rows: w must be a contiguous float32 or bfloat16" : "gemm_bf16_rows: w must be a "
              "contiguous bfloat16", " CPU matrix of ", x.size(-1), " columns");
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    return lmstack::gemm_f32(x, N, 16, bias, [&](int64_t n0, int64_t k0, int64_t kc, uint32_t* out) {
      lmstack::columns_of_rows(wp + n0 * K + k0, K, N - n0, kc, out);
    });
  }
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  static const uint16_t zeros[32] = {};
  return (F32 ? lmstack::gemm_f32 : lmstack::gemm_bf16)(x, N, 32, bias, [&](int64_t n0, int64_t k0, int64_t kc,
                                                                          uint32_t* out) {
    const uint16_t* at[16];
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~0u : (__mmask32)((1u << (K - k)) - 1);
      for (int64_t half = 0; half < GEMM_PANEL; half += 16) {
        for (int64_t i = 0; i < 16; i++) at[i] = n0 + half + i < N ? wp + (n0 + half + i) * K + k : zeros;
        if constexpr (F32)
          widened_columns(at, mask, out + (k - k0) * GEMM_PANEL + half);
        else
          transpose_pairs(at, mask, out + (k - k0) / 2 * GEMM_PANEL + half);
      }
    }
  });
}

// y = (x @ w.T) * scales + bias for many rows of float32 x, w int8 tiled as kernels.tile_int8 stores it (matvec_int8's
// weights) and widened exactly: a row's block of 32 columns is 8 words of 4, transposed across 16 rows and
// sign-extended a byte at a time
at::Tensor gemm_f32_int8_tiled(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "gemm_f32_int8_tiled: scales must be a contiguous float32 vector");
  const int64_t N = scales.size(0), K32 = (x.size(-1) + 31) / 32;
  lmstack::check_tiled(w, at::kChar, N, x.size(-1), "gemm_f32_int8_tiled");
  const auto* wp = static_cast<const int8_t*>(w.data_ptr());
  at::Tensor y = lmstack::gemm_f32(x, N, 32, std::nullopt, [&](int64_t n0, int64_t k0, int64_t kc, uint32_t* out) {
    for (int64_t k = k0; k < k0 + kc; k += 32)
      for (int64_t half = 0; half < GEMM_PANEL; half += 16) {
        const int8_t* at[16];
        tile_rows(wp, N, K32, n0 + half, k, at);
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)at[i]));
        lmstack::transpose16(v);
        uint32_t* columns = out + (k - k0) * GEMM_PANEL + half;
        for (int p = 0; p < 8; p++)
          for (int j = 0; j < 4; j++)
            _mm512_store_ps((float*)(columns + (4 * p + j) * GEMM_PANEL),
                            _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v[p], 24 - 8 * j), 24)));
      }
  });
  y.mul_(scales);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("gemm_bf16_tiled(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", gemm_tiled<false>);
  m.def("gemm_f32_tiled(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", gemm_tiled<true>);
  m.def("gemm_f32_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor", gemm_rows<true>);
  m.def("gemm_bf16_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor", gemm_rows<false>);
  m.def("gemm_f32_int8_tiled(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor", gemm_f32_int8_tiled);
}
