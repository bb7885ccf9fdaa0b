// lmstack's CPU kernels for decoding, on x86 CPUs with AVX512-BF16 (see kernels.py for when they run).
//
// matvec_*: y = x @ w.T (+ bias) for a few rows of x. Decoding reads every weight once per token, so
// these make one pass over w, TILE rows at a time (each load of x serves TILE dot products), and split
// the tiles over PyTorch's threads. Sums are float32; each output is rounded once, after scale and bias.
// int8 weights are stored tile by tile (tile_int8 in kernels.py), so that each thread reads one
// sequential stream, prefetched ahead: rows of a few hundred bytes read row-wise leave the hardware
// prefetcher idle.
// rms_norm, rope_into_cache, decode_attention and silu_mul (float32 or bfloat16): what eager PyTorch
// spends a dozen small operators on, in one call, rounding to bfloat16 where the reference does.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using lmstack::exp_ps;
using lmstack::Prefetch;
using lmstack::check_tiled;
using lmstack::TASK_WEIGHTS;
using lmstack::TILE;
constexpr int64_t BF16_AHEAD = 4096;       // bytes of a bfloat16 stream prefetched ahead (dot_bf16_tile, dot_bf16)

inline __m512 bf16_to_float(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// round to nearest even, as c10::BFloat16 does (but flushing denormals to zero)
inline __m512 round_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

// lanes 0..n-1 of 16 (none for n <= 0)
inline __mmask16 first(int64_t n) { return n <= 0 ? 0 : (__mmask16)((1u << std::min<int64_t>(n, 16)) - 1); }
inline __mmask8 first8(int64_t n) { return n <= 0 ? 0 : (__mmask8)((1u << std::min<int64_t>(n, 8)) - 1); }

// the four sums of a[0..3]; a tile's cost is mostly its loads, so its reduction must stay cheap
inline __m128 sum4(const __m512* a) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half =
      _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// out[0..ROWS) = sums of acc; ROWS is 1 or a multiple of 4
template <int ROWS>
inline void store_sums(const __m512* acc, float* out) {
  if constexpr (ROWS == 1)
    out[0] = _mm512_reduce_add_ps(acc[0]);
  else
    for (int r = 0; r < ROWS; r += 4) _mm_storeu_ps(out + r, sum4(acc + r));
}

// dot products of one bf16 row x with ROWS bf16 rows of w (row stride K), a row at a time: rows as they are stored
// are then one sequential stream, prefetched BF16_AHEAD bytes ahead as dot_bf16_tile prefetches the tiles, and read
// as fast (the 1.7B model's matvecs, two threads on an AMD EPYC: 1.04x faster than ROWS rows side by side with the
// next ROWS prefetched, 1.06-1.09x in dot_bf16_f32; as fast as the tiles)
template <int ROWS>
__attribute__((always_inline)) inline void dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float* out) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; r++) {
    const uint16_t* row = w + r * K;
    acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      _mm_prefetch((const char*)(row + k) + BF16_AHEAD, _MM_HINT_T0);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)_mm512_loadu_si512(x + k));
    }
    if (k < K) {
      const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, row + k),
                                (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
  }
  store_sums<ROWS>(acc, out);
}

inline __m512 int8_to_float(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

constexpr int64_t INT8_PREFETCH = 4096;  // bytes ahead of the int8 tile being read

// dot products of one float32 row x (K32 * 32 long) with the TILE rows of one int8 tile
// (K32 blocks of TILE x 32 weights); two accumulators per row hide the latency
__attribute__((always_inline)) inline void dot_int8_tile(const float* x, const int8_t* tile, int64_t K32, float* out) {
  __m512 even[TILE], odd[TILE];
  for (int r = 0; r < TILE; r++) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K32; k++, tile += TILE * 32) {
    for (int64_t line = 0; line < TILE * 32; line += 64)
      _mm_prefetch((const char*)(tile + INT8_PREFETCH + line), _MM_HINT_T0);
    const __m512 x0 = _mm512_loadu_ps(x + k * 32), x1 = _mm512_loadu_ps(x + k * 32 + 16);
    for (int r = 0; r < TILE; r++) {
      even[r] = _mm512_fmadd_ps(int8_to_float(_mm_loadu_si128((const __m128i*)(tile + r * 32))), x0, even[r]);
      odd[r] = _mm512_fmadd_ps(int8_to_float(_mm_loadu_si128((const __m128i*)(tile + r * 32 + 16))), x1, odd[r]);
    }
  }
  for (int r = 0; r < TILE; r++) even[r] = _mm512_add_ps(even[r], odd[r]);
  store_sums<TILE>(even, out);
}

// The TILE-row tiles of w split over PyTorch's threads: rows(n0, n1) computes outputs n0..n1-1.
template <typename Rows>
void split_rows(int64_t N, int64_t K, const Rows& rows) {
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, std::max<int64_t>(1, TASK_WEIGHTS / (TILE * K)),
                   [&](int64_t begin, int64_t end) { rows(begin * TILE, std::min(N, end * TILE)); });
}

// y[m][n..n+rows) = bf16(sums[m] + bias[n..]) for m < M, rounded to nearest even as c10::BFloat16 rounds; a row
// holding a NaN or a subnormal value (which the vector rounding would flush) is converted one value at a time
inline void store_rows_bf16(const float (*sums)[TILE], int64_t M, const c10::BFloat16* bias, int64_t n, int64_t rows,
                            c10::BFloat16* y, int64_t N) {
  const __mmask8 mask = first8(rows);
  const __m256 b = bias ? _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(mask, bias + n)), 16))
                        : _mm256_setzero_ps();
  for (int64_t m = 0; m < M; m++) {
    const __m256 v = bias ? _mm256_add_ps(_mm256_loadu_ps(sums[m]), b) : _mm256_loadu_ps(sums[m]);
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    const __mmask8 odd = _mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q) |
                         (_mm256_cmp_ps_mask(magnitude, _mm256_set1_ps(FLT_MIN), _CMP_LT_OQ) &
                          _mm256_cmp_ps_mask(magnitude, _mm256_setzero_ps(), _CMP_NEQ_OQ));
    if (odd & mask)
      for (int64_t r = 0; r < rows; r++)
        y[m * N + n + r] = c10::BFloat16(bias ? sums[m][r] + float(bias[n + r]) : sums[m][r]);
    else
      _mm_mask_storeu_epi16(y + m * N + n, mask, (__m128i)_mm256_cvtneps_pbh(v));
  }
}

// Where the many-row kernel finds a tile's weights: row r's block k (32 weights) at r * row + k * block from the
// tile's start, the next tile `tile` on (tiled: row 32, block TILE * 32, tile TILE * K32 * 32; rows of w as they
// are: row K, block 32, tile TILE * K)
struct Strides {
  int64_t row, block, tile;
};

// One pass of the many-row kernel: MR rows of x (row stride K) against four rows of a tile (`rows`: where the first
// starts) over blocks k0..k1-1 of K32. Each output is one accumulator, summed over the blocks in order and reduced
// by sum4, as dot_bf16_tile and dot_bf16 sum it (so a row's results never depend on how many rows share the call):
// between passes over consecutive blocks it waits in `partial` (row m's four at partial[m * TILE]), and the pass
// that reaches the last block (k1 == K32) writes the sums to out[m * TILE + 0..3].
template <int MR>
__attribute__((always_inline)) inline void pass_bf16(const uint16_t* x, int64_t K, const uint16_t* rows, Strides at,
                                                     int64_t k0, int64_t k1, int64_t K32, __m512* partial, float* out,
                                                     Prefetch& pf) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < 4; r++) acc[m][r] = k0 == 0 ? _mm512_setzero_ps() : partial[m * TILE + r];
  for (int64_t k = k0; k < k1; k++) {
    pf.step();
    const __mmask32 mask = k * 32 + 32 <= K ? ~0u : (__mmask32)((1ull << (K - k * 32)) - 1);
    __m512bh xv[MR];
    for (int m = 0; m < MR; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k * 32);
    const uint16_t* block = rows + k * at.block;
    for (int r = 0; r < 4; r++) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, block + r * at.row);
      for (int m = 0; m < MR; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
    }
  }
  if (k1 == K32)
    for (int m = 0; m < MR; m++) _mm_storeu_ps(out + m * TILE, sum4(acc[m]));
  else
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < 4; r++) partial[m * TILE + r] = acc[m][r];
}

constexpr int64_t GROUP_ROWS = 16;    // rows of x that share each pass over a tile's chunk
constexpr int64_t CHUNK_BLOCKS = 16;  // blocks of 32 columns a chunk (at least): TILE x 512 weights, 8 KiB
constexpr int64_t MANY_ROWS_AHEAD = 16 << 10;  // tiled weights prefetched this far ahead (whole chunks)

// y[:, n..n+rows) = x @ w.T + bias for many bf16 rows of x (M x K) and the TILE rows of one tile of w (K32 blocks of 32
// columns, all TILE rows readable: fewer than TILE outputs only from a zero-padded tile). The rows of x take the tile
// GROUP_ROWS at a time, in chunks of about CHUNK_BLOCKS blocks (one chunk of a K of up to 1024): each chunk is read in
// one pass per four rows of x and half tile from the L1, which holds the chunk, its rows of x and the partial sums; and
// while they compute, the weights MANY_ROWS_AHEAD on are prefetched (tiled: the chunk that many bytes on, in this tile
// or the next; rows of w as they are: the next tile), spread evenly over the passes, so that the memory streams the
// weights during the arithmetic rather than between it (16 rows, one thread: 1.5x the time of one row on the 135M
// model's layers, against 2.1x reading the tile once per four rows). Chunks, not tiles: the next tile's 32 KiB,
// arriving long before their use, pushed the chunk in use out of the L1 (4-8 rows at 1.7B: 1.05-1.45x, 16 rows
// 1.0-1.05x). Two 8 KiB chunks on rather than one: 16 rows at 1.7B 1.05-1.09x (two threads, AMD EPYC), while the
// 135M model's 9 KiB chunks (576 columns) keep one (two cost 2-4%).
void many_rows_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* tile, int64_t K32, Strides at,
                    const c10::BFloat16* bias, int64_t n, int64_t rows, c10::BFloat16* y, int64_t N) {
  float sums[GROUP_ROWS][TILE];
  __m512 partial[GROUP_ROWS * TILE];
  const int64_t chunks = std::max<int64_t>(1, K32 / CHUNK_BLOCKS), chunk = (K32 + chunks - 1) / chunks;
  const int64_t passes = (M + 3) / 4 * 2;  // over each block of the tile
  const bool in_order = at.block == TILE * 32;  // tiled: the weights in the order the passes read them
  const int64_t ahead = std::max<int64_t>(1, MANY_ROWS_AHEAD / (chunk * at.block * 2));
  Prefetch pf(tile + (in_order ? ahead * chunk * at.block : at.tile), at.tile * 2, (TILE + passes - 1) / passes * 64);
  for (int64_t g = 0; g < M; g += GROUP_ROWS) {
    const int64_t group = std::min(GROUP_ROWS, M - g);
    for (int64_t k0 = 0; k0 < K32; k0 += chunk) {
      const int64_t k1 = std::min(K32, k0 + chunk);
      for (int64_t m = 0; m < group; m += 4) {
        const uint16_t* xm = x + (g + m) * K;
        for (int64_t h = 0; h < TILE; h += 4) {
          __m512* part = partial + m * TILE + h;
          const uint16_t* half = tile + h * at.row;
          float* out = sums[m] + h;
          switch (std::min<int64_t>(4, group - m)) {
            case 1: pass_bf16<1>(xm, K, half, at, k0, k1, K32, part, out, pf); break;
            case 2: pass_bf16<2>(xm, K, half, at, k0, k1, K32, part, out, pf); break;
            case 3: pass_bf16<3>(xm, K, half, at, k0, k1, K32, part, out, pf); break;
            default: pass_bf16<4>(xm, K, half, at, k0, k1, K32, part, out, pf);
          }
        }
      }
    }
    store_rows_bf16(sums, group, bias, n, rows, y + g * N, N);
  }
}

// y[:, n0:n1] = x @ w[n0:n1].T + bias for bf16 x (M x K), w and bias
void rows_bf16(const uint16_t* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, const c10::BFloat16* bias,
               c10::BFloat16* y, int64_t n0, int64_t n1) {
  float sums[GROUP_ROWS][TILE];
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    if (M > 1 && rows == TILE) {
      many_rows_bf16(x, M, K, w + n * K, (K + 31) / 32, {K, 32, TILE * K}, bias, n, rows, y, N);
      continue;
    }
    for (int64_t m = 0; m < M; m += GROUP_ROWS) {
      const int64_t group = std::min(GROUP_ROWS, M - m);
      for (int64_t i = 0; i < group; i++) {
        const uint16_t* xi = x + (m + i) * K;
        if (rows == TILE)
          dot_bf16<TILE>(xi, w + n * K, K, sums[i]);
        else
          for (int64_t r = 0; r < rows; r++) dot_bf16<1>(xi, w + (n + r) * K, K, sums[i] + r);
      }
      store_rows_bf16(sums, group, bias, n, rows, y + m * N, N);
    }
  }
}

// y[:, n0:n1] = (x @ w[n0:n1].T) * scales + bias for float32 x (M x K32 * 32, zero-padded), tiled int8 w,
// y and bias of type T
template <typename T>
void rows_int8(const float* x, int64_t M, const int8_t* w, int64_t N, int64_t K32, const float* scales, const T* bias,
               T* y, int64_t n0, int64_t n1) {
  float sums[TILE];
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    for (int64_t m = 0; m < M; m++) {
      dot_int8_tile(x + m * K32 * 32, w + n * K32 * 32, K32, sums);
      for (int64_t r = 0; r < rows; r++) {
        const float scaled = sums[r] * scales[n + r];
        y[m * N + n + r] = T(bias ? scaled + float(bias[n + r]) : scaled);
      }
    }
  }
}

// dot products of one float64 row x with ROWS float32 rows of w (row stride K), summed in float64: each product
// is exact and the sum nearly so, so each result is rounded about once (more accurately than a float32 GEMM,
// at the same memory traffic); prefetching as dot_bf16 does
template <int ROWS>
__attribute__((always_inline)) inline void dot_f64(const double* x, const float* w, int64_t K, double* out) {
  __m512d acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_pd();
  const char* next_tile = (const char*)(w + ROWS * K);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16, next_tile += ROWS * 64) {
    if constexpr (ROWS > 1)
      for (int r = 0; r < ROWS; r++) _mm_prefetch(next_tile + r * 64, _MM_HINT_T0);
    const __m512d x0 = _mm512_loadu_pd(x + k), x1 = _mm512_loadu_pd(x + k + 8);
    for (int r = 0; r < ROWS; r++) {
      acc[r] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(w + r * K + k)), x0, acc[r]);
      acc[r] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(w + r * K + k + 8)), x1, acc[r]);
    }
  }
  for (; k < K; k += 8) {
    const __mmask8 m = (__mmask8)((1u << std::min<int64_t>(K - k, 8)) - 1);
    const __m512d xv = _mm512_maskz_loadu_pd(m, x + k);
    for (int r = 0; r < ROWS; r++)
      acc[r] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, w + r * K + k)), xv, acc[r]);
  }
  for (int r = 0; r < ROWS; r++) out[r] = _mm512_reduce_add_pd(acc[r]);
}

// dot products of one float32 row x with ROWS bfloat16 rows of w, the weights widened exactly to float32 and
// summed in float32 (the float64 sum of dot_f64 would make this compute-bound); two accumulators per row. TILED:
// w is one tile of tile_int8's (blocks of ROWS x 32, zero-padded), one stream prefetched BF16_AHEAD bytes ahead, as
// dot_bf16_tile reads it; else rows of stride K, a row at a time, as dot_bf16 reads them
template <int ROWS, bool TILED = false>
__attribute__((always_inline)) inline void dot_bf16_f32(const float* x, const uint16_t* w, int64_t K, float* out) {
  const auto at = [&](int r, int64_t k) { return TILED ? w + k / 32 * ROWS * 32 + r * 32 + k % 32 : w + r * K + k; };
  __m512 even[ROWS], odd[ROWS];
  for (int r = 0; r < ROWS; r++) even[r] = odd[r] = _mm512_setzero_ps();
  // blocks of 32 columns: a tile's, all ROWS rows at each (r0 = 0, r1 = ROWS), or a row's, one row after another
  const auto blocks = [&](int r0, int r1, const char* ahead) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, ahead += (r1 - r0) * 64) {
      for (int line = 0; line < r1 - r0; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
      for (int r = r0; r < r1; r++) {
        even[r] = _mm512_fmadd_ps(bf16_to_float(_mm256_loadu_si256((const __m256i*)at(r, k))), x0, even[r]);
        odd[r] = _mm512_fmadd_ps(bf16_to_float(_mm256_loadu_si256((const __m256i*)at(r, k + 16))), x1, odd[r]);
      }
    }
    for (; k < K; k += 16) {
      const __mmask16 m = first(K - k);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
      for (int r = r0; r < r1; r++)
        even[r] = _mm512_fmadd_ps(bf16_to_float(_mm256_maskz_loadu_epi16(m, at(r, k))), xv, even[r]);
    }
  };
  if constexpr (TILED)
    blocks(0, ROWS, (const char*)w + BF16_AHEAD);
  else
    for (int r = 0; r < ROWS; r++) blocks(r, r + 1, (const char*)at(r, 0) + BF16_AHEAD);
  for (int r = 0; r < ROWS; r++) even[r] = _mm512_add_ps(even[r], odd[r]);
  store_sums<ROWS>(even, out);
}

// y[:, n0:n1] = x @ w[n0:n1].T + bias for float32 x (M x K; with float32 w, its float64 copy xd), float32 or
// bfloat16 w, float32 bias and y
template <typename W>
void rows_f32(const float* x, const double* xd, int64_t M, const W* w, int64_t N, int64_t K, const float* bias,
              float* y, int64_t n0, int64_t n1) {
  std::conditional_t<std::is_same_v<W, float>, double, float> sums[TILE];  // the bias is added to these
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    for (int64_t m = 0; m < M; m++) {
      const auto dot = [&]<int ROWS>(int64_t r) {
        if constexpr (std::is_same_v<W, float>)
          dot_f64<ROWS>(xd + m * K, w + (n + r) * K, K, sums + r);
        else
          dot_bf16_f32<ROWS>(x + m * K, w + (n + r) * K, K, sums + r);
      };
      if (rows == TILE)
        dot.template operator()<TILE>(0);
      else
        for (int64_t r = 0; r < rows; r++) dot.template operator()<1>(r);
      for (int64_t r = 0; r < rows; r++) y[m * N + n + r] = float(bias ? sums[r] + bias[n + r] : sums[r]);
    }
  }
}

// rows_f32 for bfloat16 w tiled by tile_int8 (K32 blocks of 32 columns a tile): every tile whole, its padding
// rows' sums not stored
void rows_f32_tiled(const float* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, int64_t K32,
                    const float* bias, float* y, int64_t n0, int64_t n1) {
  float sums[TILE];
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    for (int64_t m = 0; m < M; m++) {
      dot_bf16_f32<TILE, true>(x + m * K, w + n * K32 * 32, K, sums);
      for (int64_t r = 0; r < rows; r++) y[m * N + n + r] = bias ? sums[r] + bias[n + r] : sums[r];
    }
  }
}

// x's shape with n in place of its last dimension
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

at::Tensor matvec_bf16(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "matvec: x must be a CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "matvec: w must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.size(-1) == w.size(1), "matvec: x has ", x.size(-1), " columns, w has ", w.size(1));
  if (bias.has_value())
    TORCH_CHECK(
        bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == w.size(0) && bias->scalar_type() == at::kBFloat16,
        "matvec: bias must be a contiguous bfloat16 vector of ", w.size(0));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "matvec_bf16: x and w must be bfloat16");
  const int64_t N = w.size(0), K = w.size(1), M = K ? x.numel() / K : 0;
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = bias.has_value() ? static_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
  auto* yp = static_cast<c10::BFloat16*>(y.data_ptr());
  split_rows(N, K, [&](int64_t n0, int64_t n1) { rows_bf16(xp, M, wp, N, K, bp, yp, n0, n1); });
  return y;
}


// dot products of one bf16 row x (K <= K32 * 32 long) with the TILE rows of one bf16 tile (K32 blocks of TILE x 32
// weights, zero-padded). The tiles are one sequential stream, which the hardware prefetcher follows: it reads
// 1.2-1.6x faster than TILE rows side by side. Prefetching BF16_AHEAD bytes ahead in software as well keeps one
// thread's stream fuller (1.12x one thread's decode on a Xeon reading the weights from its L3; the same with two
// threads).
__attribute__((always_inline)) inline void dot_bf16_tile(const uint16_t* x, int64_t K, const uint16_t* tile,
                                                         int64_t K32, float* out) {
  __m512 acc[TILE];
  for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
  const uint16_t* block = tile;
  for (int64_t k = 0; k < K32; k++, block += TILE * 32) {
    for (int line = 0; line < TILE; line++) _mm_prefetch((const char*)block + BF16_AHEAD + 64 * line, _MM_HINT_T0);
    const __mmask32 mask = k * 32 + 32 <= K ? ~0u : (__mmask32)((1ull << (K - k * 32)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k * 32);
    for (int r = 0; r < TILE; r++)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(block + r * 32), xv);
  }
  for (int r = 0; r < TILE; r += 4) _mm_storeu_ps(out + r, sum4(acc + r));
}

constexpr int64_t BLOCK_ROWS = 6;              // rows of x a register block of panels_bf16 holds: 6 x 4 accumulators
constexpr int64_t PANEL_MIN_ROWS = 64;         // rows of x from which panels_bf16 takes the tiled weights
constexpr int64_t PANEL_BYTES = 512 << 10;     // weights of a panel: they stay in the L2 while every row of x passes
constexpr int64_t X_CHUNK_BYTES = 24 << 10;    // a register block's x per chunk of columns: stays in the L1

// x (M x K) as panels_bf16 reads it: its rows BLOCK_ROWS at a time, each group's blocks of 32 columns in order and
// within a block its rows side by side (zero past K and past M), so that a register block's x is one sequential
// stretch; rows K apart (4 KiB at K 2048) would share one set of the L1
at::Tensor pack_rows_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t K32) {
  const int64_t groups = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
  at::Tensor packed = at::empty({groups * K32 * BLOCK_ROWS * 32}, at::kBFloat16);
  auto* out = static_cast<uint16_t*>(packed.data_ptr());
  const int64_t grain = std::max<int64_t>(1, TASK_WEIGHTS / (BLOCK_ROWS * K32 * 32));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t i = 0; i < BLOCK_ROWS; i++) {
        const int64_t m = g * BLOCK_ROWS + i;
        for (int64_t k = 0; k < K32; k++) {
          const __mmask32 mask = m >= M ? 0 : k * 32 + 32 <= K ? ~0u : (__mmask32)((1ull << (K - k * 32)) - 1);
          _mm512_storeu_si512(out + ((g * K32 + k) * BLOCK_ROWS + i) * 32,
                              _mm512_maskz_loadu_epi16(mask, x + (mask ? m * K + k * 32 : 0)));
        }
      }
  });
  return packed;
}

// One register block of panels_bf16: MR rows of packed x (block k of row m at x + (k * BLOCK_ROWS + m) * 32) against
// four rows of a tile (`rows`: where the first starts) over blocks k0..k1-1 of K32, each output one accumulator
// summed over the blocks in order and reduced by sum4, as in pass_bf16 (the zeros past K add nothing): between
// chunks it waits in `partial` (row m's four at partial[m * 4]); the last chunk writes out[m * TILE + 0..3].
template <int MR>
__attribute__((always_inline)) inline void block_bf16(const uint16_t* x, const uint16_t* rows, int64_t k0, int64_t k1,
                                                      int64_t K32, __m512* partial, float* out) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < 4; r++) acc[m][r] = k0 == 0 ? _mm512_setzero_ps() : partial[m * 4 + r];
  for (int64_t k = k0; k < k1; k++) {
    const uint16_t* block = rows + k * TILE * 32;
    __m512bh wv[4];
    for (int r = 0; r < 4; r++) wv[r] = (__m512bh)_mm512_loadu_si512(block + r * 32);
    for (int m = 0; m < MR; m++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (k * BLOCK_ROWS + m) * 32);
      for (int r = 0; r < 4; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  if (k1 == K32)
    for (int m = 0; m < MR; m++) _mm_storeu_ps(out + m * TILE, sum4(acc[m]));
  else
    for (int m = 0; m < MR; m++)
      for (int r = 0; r < 4; r++) partial[m * 4 + r] = acc[m][r];
}

// y[:, n0:n1] = x @ w[n0:n1].T + bias for many rows of x (packed by pack_rows_bf16) and tiled w (N x K32 * 32):
// the tiles a panel at a time (PANEL_BYTES), over which every register block of x passes in chunks of columns
// (X_CHUNK_BYTES): a register block's chunk stays in the L1 while it meets every tile of the panel, whose weights come
// from the L2, and x is read from the L2 or L3 once per panel rather than once per tile (181 rows of 8192 columns
// fill 3 MB); each panel is read from memory once, and the next one is prefetched meanwhile, spread over the passes.
void panels_bf16(const uint16_t* x, int64_t M, const uint16_t* w, int64_t N, int64_t K32, const c10::BFloat16* bias,
                 c10::BFloat16* y, int64_t n0, int64_t n1) {
  const int64_t tile_size = TILE * K32 * 32, first = n0 / TILE, last = (n1 + TILE - 1) / TILE;
  const int64_t per_panel = std::max<int64_t>(1, PANEL_BYTES / (tile_size * 2));
  const int64_t chunks = (BLOCK_ROWS * K32 * 64 + X_CHUNK_BYTES - 1) / X_CHUNK_BYTES;
  const int64_t chunk = (K32 + chunks - 1) / chunks, groups = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
  std::vector<__m512> partial(chunks > 1 ? per_panel * TILE * BLOCK_ROWS : 0);
  std::vector<float> sums(per_panel * BLOCK_ROWS * TILE);  // tile t's row m at (t * BLOCK_ROWS + m) * TILE
  for (int64_t t0 = first; t0 < last; t0 += per_panel) {
    const int64_t t1 = std::min(last, t0 + per_panel), passes = groups * chunks * (t1 - t0) * 2;
    const uint16_t* panel = w + t0 * tile_size;
    Prefetch pf(panel + (t1 - t0) * tile_size, (std::min(last, t1 + per_panel) - t1) * tile_size * 2,
                ((t1 - t0) * tile_size * 2 + passes - 1) / passes);
    for (int64_t m0 = 0; m0 < M; m0 += BLOCK_ROWS) {
      const uint16_t* xm = x + m0 * K32 * 32;
      const int64_t rows_x = std::min(BLOCK_ROWS, M - m0);
      for (int64_t k0 = 0; k0 < K32; k0 += chunk) {
        const int64_t k1 = std::min(K32, k0 + chunk);
        for (int64_t t = 0; t < t1 - t0; t++)
          for (int64_t h = 0; h < TILE; h += 4) {
            pf.step();
            const uint16_t* rows = panel + t * tile_size + h * 32;
            __m512* part = partial.data() + (t * TILE + h) * BLOCK_ROWS;
            float* out = sums.data() + t * BLOCK_ROWS * TILE + h;
            switch (rows_x) {
              case 1: block_bf16<1>(xm, rows, k0, k1, K32, part, out); break;
              case 2: block_bf16<2>(xm, rows, k0, k1, K32, part, out); break;
              case 3: block_bf16<3>(xm, rows, k0, k1, K32, part, out); break;
              case 4: block_bf16<4>(xm, rows, k0, k1, K32, part, out); break;
              case 5: block_bf16<5>(xm, rows, k0, k1, K32, part, out); break;
              default: block_bf16<BLOCK_ROWS>(xm, rows, k0, k1, K32, part, out);
            }
          }
      }
      for (int64_t t = t0; t < t1; t++)
        store_rows_bf16(reinterpret_cast<const float(*)[TILE]>(sums.data() + (t - t0) * BLOCK_ROWS * TILE), rows_x,
                        bias, t * TILE, std::min(TILE, N - t * TILE), y + m0 * N, N);
    }
  }
}

// y[:, n0:n1] = x @ w[n0:n1].T + bias for bf16 x (M x K), tiled w (N x K32 * 32, padded) and bias.
// One row of x reads each tile once (dot_bf16_tile); more rows go through many_rows_bf16 (from PANEL_MIN_ROWS rows
// matvec_bf16_tiled takes panels_bf16 instead).
void rows_bf16_tiled(const uint16_t* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, int64_t K32,
                     const c10::BFloat16* bias, c10::BFloat16* y, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += TILE) {
    const uint16_t* tile = w + n * K32 * 32;
    const int64_t rows = std::min(TILE, n1 - n);
    if (M > 1) {
      many_rows_bf16(x, M, K, tile, K32, {32, TILE * 32, TILE * K32 * 32}, bias, n, rows, y, N);
      continue;
    }
    float sums[1][TILE];
    dot_bf16_tile(x, K, tile, K32, sums[0]);
    store_rows_bf16(sums, 1, bias, n, rows, y, N);
  }
}

// x, contiguous, after checking it is a CPU tensor of `dtype` (float32 or bfloat16), w the bfloat16 tiles of N outputs
// for its columns and bias a contiguous vector of N in `dtype`; `op` names the caller in the errors
at::Tensor tiled_operands(const at::Tensor& x_, const at::Tensor& w, int64_t N, const std::optional<at::Tensor>& bias,
                          at::ScalarType dtype, const char* op) {
  const at::Tensor x = x_.contiguous();
  const char* name = dtype == at::kFloat ? "float32" : "bfloat16";
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu() && x.scalar_type() == dtype, op, ": x must be a ", name,
              " CPU tensor");
  check_tiled(w, at::kBFloat16, N, x.size(-1), op);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N && bias->scalar_type() == dtype, op,
                ": bias must be a contiguous ", name, " vector of ", N);
  return x;
}

at::Tensor matvec_bf16_tiled(const at::Tensor& x_, const at::Tensor& w, int64_t N,
                             const std::optional<at::Tensor>& bias) {
  const at::Tensor x = tiled_operands(x_, w, N, bias, at::kBFloat16, "matvec_bf16");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = bias.has_value() ? static_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
  auto* yp = static_cast<c10::BFloat16*>(y.data_ptr());
  const int64_t K32 = w.size(1);
  if (M >= PANEL_MIN_ROWS) {
    const at::Tensor packed = pack_rows_bf16(xp, M, K, K32);
    const auto* pp = static_cast<const uint16_t*>(packed.data_ptr());
    split_rows(N, K32 * 32, [&](int64_t n0, int64_t n1) { panels_bf16(pp, M, wp, N, K32, bp, yp, n0, n1); });
    return y;
  }
  split_rows(N, K32 * 32, [&](int64_t n0, int64_t n1) { rows_bf16_tiled(xp, M, wp, N, K, K32, bp, yp, n0, n1); });
  return y;
}

// float32 x (M, K) with float32 or bfloat16 w (N, K), bfloat16 weights widened exactly to float32
at::Tensor matvec_f32(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "matvec_f32: x must be a float32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "matvec_f32: w must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(-1) == w.size(1), "matvec_f32: x has ", x.size(-1), " columns, w has ", w.size(1));
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == w.size(0) &&
                    bias->scalar_type() == at::kFloat,
                "matvec_f32: bias must be a contiguous float32 vector of ", w.size(0));
  const int64_t N = w.size(0), K = w.size(1), M = K ? x.numel() / K : 0;
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  const auto* xp = static_cast<const float*>(x.data_ptr());
  const float* bp = bias.has_value() ? static_cast<const float*>(bias->data_ptr()) : nullptr;
  auto* yp = static_cast<float*>(y.data_ptr());
  if (w.scalar_type() == at::kFloat) {
    const auto* wp = static_cast<const float*>(w.data_ptr());
    const std::vector<double> xd(xp, xp + M * K);
    split_rows(N, K, [&](int64_t n0, int64_t n1) { rows_f32(xp, xd.data(), M, wp, N, K, bp, yp, n0, n1); });
  } else {
    const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
    split_rows(N, K, [&](int64_t n0, int64_t n1) { rows_f32(xp, nullptr, M, wp, N, K, bp, yp, n0, n1); });
  }
  return y;
}

// float32 x (M, K) with bfloat16 w tiled by tile_int8 as (ceil(N / TILE), ceil(K / 32), TILE, 32), widened exactly
// to float32: what matvec_f32 computes from the same weights untiled, read as one stream
at::Tensor matvec_f32_tiled(const at::Tensor& x_, const at::Tensor& w, int64_t N,
                            const std::optional<at::Tensor>& bias) {
  const at::Tensor x = tiled_operands(x_, w, N, bias, at::kFloat, "matvec_f32_tiled");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  const auto* xp = static_cast<const float*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  const float* bp = bias.has_value() ? static_cast<const float*>(bias->data_ptr()) : nullptr;
  auto* yp = static_cast<float*>(y.data_ptr());
  const int64_t K32 = w.size(1);
  split_rows(N, K32 * 32, [&](int64_t n0, int64_t n1) { rows_f32_tiled(xp, M, wp, N, K, K32, bp, yp, n0, n1); });
  return y;
}

template <typename T>
void matvec_int8_as(const at::Tensor& x, const at::Tensor& w, const float* scales, const T* bias, at::Tensor& y) {
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, N = y.size(-1), K32 = w.size(1);
  const T* xp = static_cast<const T*>(x.data_ptr());
  std::vector<float> xf(M * K32 * 32, 0.0f);  // float32 copies of the few rows of x, zero-padded as w is
  for (int64_t m = 0; m < M; m++) std::copy(xp + m * K, xp + (m + 1) * K, xf.begin() + m * K32 * 32);
  const auto* wp = static_cast<const int8_t*>(w.data_ptr());
  T* yp = static_cast<T*>(y.data_ptr());
  split_rows(N, K32 * 32,
             [&](int64_t n0, int64_t n1) { rows_int8<T>(xf.data(), M, wp, N, K32, scales, bias, yp, n0, n1); });
}

// int8 weights tiled as (ceil(N / TILE), ceil(K / 32), TILE, 32), zero-padded, with a float32 scale per
// output row; x (M, K) in bfloat16 or float32 (y and bias in x's dtype)
at::Tensor matvec_int8(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "matvec_int8: x must be a CPU tensor");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "matvec_int8: scales must be a contiguous float32 vector");
  const int64_t N = scales.size(0), K = x.size(-1);
  check_tiled(w, at::kChar, N, K, "matvec_int8");
  if (bias.has_value())
    TORCH_CHECK(
        bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
        "matvec_int8: bias must be a contiguous vector of ", N, " ", x.scalar_type());
  at::Tensor y = at::empty(out_shape(x, N), x.options());
  const auto* sp = static_cast<const float*>(scales.data_ptr());
  if (x.scalar_type() == at::kBFloat16) {
    const auto* bp = bias.has_value() ? static_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
    matvec_int8_as<c10::BFloat16>(x, w, sp, bp, y);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "matvec_int8: x must be bfloat16 or float32");
    const auto* bp = bias.has_value() ? static_cast<const float*>(bias->data_ptr()) : nullptr;
    matvec_int8_as<float>(x, w, sp, bp, y);
  }
  return y;
}

// Activations are float32 or bfloat16: T. load/store move 16 lanes (the first `m`) as float32, and
// rounded<T> rounds a float32 result to T, where the reference's arithmetic in T rounds.
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) { return bf16_to_float(_mm256_maskz_loadu_epi16(m, p)); }
inline void store(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(c10::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
template <typename T>
inline __m512 rounded(__m512 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_bf16(v);
}

// Calls f.template operator()<T>() with T the C++ type of a float32 or bfloat16 tensor.
template <typename F>
auto with_type(const at::Tensor& t, const char* name, const F& f) {
  if (t.scalar_type() == at::kFloat) return f.template operator()<float>();
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16, got ", t.scalar_type());
  return f.template operator()<c10::BFloat16>();
}

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && t.scalar_type() == dtype && t.device().is_cpu(), name,
              " must be a contiguous ", dim, "-D ", dtype, " CPU tensor");
}

// y = w * rounded(x * rsqrt(mean(x^2) + eps)) for every row of x (the reference's order)
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "rms_norm: x must be a CPU tensor");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  check_cpu(w, x.scalar_type(), "rms_norm: weight", 1);
  TORCH_CHECK(w.size(0) == D, "rms_norm: weight has ", w.size(0), " entries for rows of ", D);
  at::Tensor y = at::empty(x.sizes(), x.options());
  with_type(x, "rms_norm: x", [&]<typename T>() {
    const T *xp = static_cast<const T*>(x.data_ptr()), *wp = static_cast<const T*>(w.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    at::parallel_for(
        0, rows, std::max<int64_t>(1, TASK_WEIGHTS / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; i++) {
            const T* row = xp + i * D;
            if constexpr (std::is_same_v<T, float>) {  // the sum and x * scale in float64: rounded once, to float32
              __m512d squares = _mm512_setzero_pd();
              for (int64_t d = 0; d < D; d += 8) {
                const __m512d v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(first8(D - d), row + d));
                squares = _mm512_fmadd_pd(v, v, squares);
              }
              const __m512d scale = _mm512_set1_pd(1.0 / std::sqrt(_mm512_reduce_add_pd(squares) / D + eps));
              for (int64_t d = 0; d < D; d += 8) {
                const __mmask8 m = first8(D - d);
                const __m512d v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, row + d));
                const __m256 normed = _mm512_cvtpd_ps(_mm512_mul_pd(v, scale));
                _mm256_mask_storeu_ps(yp + i * D + d, m, _mm256_mul_ps(_mm256_maskz_loadu_ps(m, wp + d), normed));
              }
              continue;
            }
            __m512 squares = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
              const __m512 v = load(row + d, first(D - d));
              squares = _mm512_fmadd_ps(v, v, squares);
            }
            const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / D + float(eps)));
            for (int64_t d = 0; d < D; d += 16) {
              const __mmask16 m = first(D - d);
              store(yp + i * D + d, m,
                    _mm512_mul_ps(load(wp + d, m), rounded<T>(_mm512_mul_ps(load(row + d, m), scale))));
            }
          }
        });
  });
  return y;
}

// the half-split rotation of one head, rounded as the reference's x * cos + rotate_half(x) * sin in T
template <typename T>
void rotate(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; d++) {
    const float turned = d < half ? -float(x[d + half]) : float(x[d - half]);
    out[d] = T(float(T(float(x[d]) * float(cos[d]))) + float(T(turned * float(sin[d]))));
  }
}

// L new tokens per row: rotate their q and k heads, write k and v into the caches at slots
// start..start+L-1, return the rotated q heads. qkv (B, L, H + 2 KV, D); cos, sin (B, L, 1, D);
// caches (B, KV, T, D); returns (B, L, H, D).
at::Tensor rope_into_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, int64_t start) {
  const at::ScalarType dtype = qkv.scalar_type();
  check_cpu(qkv, dtype, "rope_into_cache: qkv", 4);
  check_cpu(cos, dtype, "rope_into_cache: cos", 4);
  check_cpu(sin, dtype, "rope_into_cache: sin", 4);
  check_cpu(k_cache, dtype, "rope_into_cache: k_cache", 4);
  check_cpu(v_cache, dtype, "rope_into_cache: v_cache", 4);
  const int64_t B = qkv.size(0), L = qkv.size(1), D = qkv.size(3), KV = k_cache.size(1), T = k_cache.size(2);
  const int64_t H = qkv.size(2) - 2 * KV, heads = H + 2 * KV;
  TORCH_CHECK(H > 0 && D % 2 == 0, "rope_into_cache: qkv ", qkv.sizes(), " does not fit caches ", k_cache.sizes());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B && k_cache.size(3) == D,
              "rope_into_cache: caches ", k_cache.sizes(), " and ", v_cache.sizes(), " do not fit qkv ", qkv.sizes());
  TORCH_CHECK(
      cos.sizes() == sin.sizes() && cos.size(0) == B && cos.size(1) == L && cos.size(2) == 1 && cos.size(3) == D,
      "rope_into_cache: cos/sin ", cos.sizes(), " do not fit qkv ", qkv.sizes());
  TORCH_CHECK(start >= 0 && start + L <= T, "rope_into_cache: slots ", start, "..", start + L, " outside a cache of ",
              T);
  at::Tensor q = at::empty({B, L, H, D}, qkv.options());
  with_type(qkv, "rope_into_cache: qkv", [&]<typename E>() {
    const E* x = static_cast<const E*>(qkv.data_ptr());
    const E *cp = static_cast<const E*>(cos.data_ptr()), *sp = static_cast<const E*>(sin.data_ptr());
    E *qp = static_cast<E*>(q.data_ptr()), *kc = static_cast<E*>(k_cache.data_ptr());
    E* vc = static_cast<E*>(v_cache.data_ptr());
    at::parallel_for(0, B * L, std::max<int64_t>(1, TASK_WEIGHTS / (heads * D)), [&](int64_t begin, int64_t end) {
      for (int64_t bl = begin; bl < end; bl++) {
        const int64_t b = bl / L, slot = start + bl % L;
        const E* token = x + bl * heads * D;
        for (int64_t h = 0; h < H; h++) rotate(token + h * D, cp + bl * D, sp + bl * D, D, qp + (bl * H + h) * D);
        for (int64_t g = 0; g < KV; g++) {
          const int64_t at = ((b * KV + g) * T + slot) * D;
          rotate(token + (H + g) * D, cp + bl * D, sp + bl * D, D, kc + at);
          std::copy(token + (H + KV + g) * D, token + (H + KV + g + 1) * D, vc + at);
        }
      }
    });
  });
  return q;
}

// rope_into_cache for tokens of many sequences in one row: qkv (1, T, H + 2 KV, D), cos and sin (1, T, 1, D);
// token t's k and v go to pool slot slots[t] (block * block_size + offset) of pools (n_blocks, KV, block_size, D).
// Returns the rotated q heads (1, T, H, D).
at::Tensor rope_into_pages(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slots) {
  const at::ScalarType dtype = qkv.scalar_type();
  check_cpu(qkv, dtype, "rope_into_pages: qkv", 4);
  check_cpu(cos, dtype, "rope_into_pages: cos", 4);
  check_cpu(sin, dtype, "rope_into_pages: sin", 4);
  check_cpu(k_pool, dtype, "rope_into_pages: k_pool", 4);
  check_cpu(v_pool, dtype, "rope_into_pages: v_pool", 4);
  check_cpu(slots, at::kLong, "rope_into_pages: slots", 1);
  const int64_t T = qkv.size(1), D = qkv.size(3), KV = k_pool.size(1), size = k_pool.size(2);
  const int64_t H = qkv.size(2) - 2 * KV, heads = H + 2 * KV, n_slots = k_pool.size(0) * size;
  TORCH_CHECK(qkv.size(0) == 1 && H > 0 && D % 2 == 0 && k_pool.sizes() == v_pool.sizes() && k_pool.size(3) == D,
              "rope_into_pages: qkv ", qkv.sizes(), " does not fit pools ", k_pool.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == 1 && cos.size(1) == T && cos.size(2) == 1 &&
                  cos.size(3) == D && slots.size(0) == T,
              "rope_into_pages: cos/sin ", cos.sizes(), " or slots ", slots.sizes(), " do not fit qkv ", qkv.sizes());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < n_slots, "rope_into_pages: slot ", sp[t], " outside a pool of ", n_slots);
  at::Tensor q = at::empty({1, T, H, D}, qkv.options());
  with_type(qkv, "rope_into_pages: qkv", [&]<typename E>() {
    const E* x = static_cast<const E*>(qkv.data_ptr());
    const E *cp = static_cast<const E*>(cos.data_ptr()), *snp = static_cast<const E*>(sin.data_ptr());
    E *qp = static_cast<E*>(q.data_ptr()), *kc = static_cast<E*>(k_pool.data_ptr());
    E* vc = static_cast<E*>(v_pool.data_ptr());
    at::parallel_for(0, T, std::max<int64_t>(1, TASK_WEIGHTS / (heads * D)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++) {
        const E* token = x + t * heads * D;
        const int64_t block = sp[t] / size, offset = sp[t] % size;
        for (int64_t h = 0; h < H; h++) rotate(token + h * D, cp + t * D, snp + t * D, D, qp + (t * H + h) * D);
        for (int64_t g = 0; g < KV; g++) {
          const int64_t at = ((block * KV + g) * size + offset) * D;
          rotate(token + (H + g) * D, cp + t * D, snp + t * D, D, kc + at);
          std::copy(token + (H + KV + g) * D, token + (H + KV + g + 1) * D, vc + at);
        }
      }
    });
  });
  return q;
}

// e^x for float64 lanes, to about 1e-15: what float32 results round from once
inline __m512d exp_pd(__m512d x) {
  x = _mm512_max_pd(_mm512_min_pd(x, _mm512_set1_pd(700.0)), _mm512_set1_pd(-700.0));
  const __m512d n =
      _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)), _MM_FROUND_TO_NEAREST_INT);
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);  // ln 2 in two parts (fdlibm)
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
  __m512d p = _mm512_set1_pd(1.0 / 39916800);  // 1 / 11!
  for (const double c : {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24,
                         1.0 / 6, 0.5, 1.0, 1.0})
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
  return _mm512_scalef_pd(p, n);
}

// Attention of one query per (row, q head) splits each kv head's keys into CHUNK-key chunks at fixed positions
// (multiples of CHUNK): a task computes, for the q heads of one GQA group together, each head's partial softmax
// over one chunk (max m, sum l of e^(score - m), sum o of e^(score - m) v), reading each key and value once for
// the whole group; the partials are then merged in chunk order. Long contexts so spread over every thread,
// and a result depends only on its query, its keys and CHUNK: never on the thread count or on the batch.
constexpr int64_t CHUNK = 256;  // keys per partial softmax
constexpr int64_t HEADS = 4;    // q heads of a group that share one pass over the keys (their sums fill registers)

// The next chunk's key and value rows, prefetched while this chunk's arithmetic runs: its keys a few at a time as
// this chunk's scores are computed (keys_upto), its values as this chunk's values are summed (values_upto)
template <typename E>
struct RowsAhead {
  const E* const* k;
  const E* const* v;
  int64_t n, D, keys = 0, values = 0;  // n rows of D values; the rows of each prefetched so far
  void keys_upto(int64_t s) { fetch(k, keys, s); }
  void values_upto(int64_t s) { fetch(v, values, s); }
  void all() { keys_upto(n), values_upto(n); }

 private:
  void fetch(const E* const* rows, int64_t& done, int64_t upto) {
    for (upto = std::min(upto, n); done < upto; done++)
      for (int64_t b = 0; b < D * int64_t(sizeof(E)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[done]) + b, _MM_HINT_T0);
  }
};

// scores[g][0..n) = (q_g . k[i]) * scale for G q heads: bfloat16 q and k multiplied exactly and summed in float32
// (dpbf16), float32 ones with float32 FMAs on the pre-scaled qs; four keys at a time, one reduction for four
// (and the next chunk's keys prefetched along, where `ahead`)
template <int G, typename E>
void chunk_scores(const E* q, const float* qs, float scale, int64_t D, const E* const* k, int64_t n,
                  float (*scores)[CHUNK], RowsAhead<E>* ahead) {
  constexpr bool BF16 = std::is_same_v<E, c10::BFloat16>;
  constexpr int64_t STEP = BF16 ? 32 : 16;  // lanes of D per vector
  const auto dot = [&]<int J>(int64_t s) {
    __m512 acc[G][J];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < J; j++) acc[g][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += STEP) {
      if constexpr (BF16) {
        const __mmask32 m = D - d >= 32 ? ~0u : (__mmask32)((1u << (D - d)) - 1);
        __m512bh kv[J];
        for (int j = 0; j < J; j++) kv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, k[s + j] + d);
        for (int g = 0; g < G; g++) {
          const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + g * D + d);
          for (int j = 0; j < J; j++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv, kv[j]);
        }
      } else {
        const __mmask16 m = first(D - d);
        __m512 kv[J];
        for (int j = 0; j < J; j++) kv[j] = load(k[s + j] + d, m);
        for (int g = 0; g < G; g++) {
          const __m512 qv = load(qs + g * D + d, m);
          for (int j = 0; j < J; j++) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
        }
      }
    }
    for (int g = 0; g < G; g++) {
      if constexpr (J == 4) {
        __m128 sums = sum4(acc[g]);
        if constexpr (BF16) sums = _mm_mul_ps(sums, _mm_set1_ps(scale));
        _mm_storeu_ps(scores[g] + s, sums);
      } else {
        scores[g][s] = _mm512_reduce_add_ps(acc[g][0]) * (BF16 ? scale : 1.0f);
      }
    }
  };
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) {
    if (ahead) ahead->keys_upto(s + 4);
    dot.template operator()<4>(s);
  }
  for (; s < n; s++) dot.template operator()<1>(s);
}

// out[g][0..D) = sum over i of p[g][i] * v[i] for G heads, 64 of D at a time held in registers. bfloat16 v is
// widened by shifts: a 32-bit lane's low half becomes an even d, its high half the odd d after it. The next
// chunk's values are prefetched along, where `ahead`.
template <int G, typename E>
void chunk_values(const float (*p)[CHUNK], int64_t D, const E* const* v, int64_t n, float* out, int64_t stride,
                  RowsAhead<E>* ahead) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s++) {
      if (ahead && d0 == 0) ahead->values_upto(s + 1);
      __m512 vv[4];
      if constexpr (std::is_same_v<E, c10::BFloat16>) {
        for (int h = 0; h < 2; h++) {
          const int64_t left = D - d0 - 32 * h;
          const __mmask32 m = left >= 32 ? ~0u : left <= 0 ? 0u : (__mmask32)((1u << left) - 1);
          const __m512i x = _mm512_maskz_loadu_epi16(m, v[s] + d0 + 32 * h);
          vv[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
          vv[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xffff0000)));
        }
      } else {
        for (int c = 0; c < 4; c++) vv[c] = load(v[s] + d0 + 16 * c, first(D - d0 - 16 * c));
      }
      for (int g = 0; g < G; g++) {
        const __m512 w = _mm512_set1_ps(p[g][s]);
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; g++) {
      float* o = out + g * stride + d0;
      if constexpr (std::is_same_v<E, c10::BFloat16>) {  // even and odd d back in order
        const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
        for (int h = 0; h < 2; h++) {
          store(o + 32 * h, first(D - d0 - 32 * h), _mm512_permutex2var_ps(acc[g][2 * h], low, acc[g][2 * h + 1]));
          store(o + 32 * h + 16, first(D - d0 - 32 * h - 16),
                _mm512_permutex2var_ps(acc[g][2 * h], high, acc[g][2 * h + 1]));
        }
      } else {
        for (int c = 0; c < 4; c++) store(o + 16 * c, first(D - d0 - 16 * c), acc[g][c]);
      }
    }
  }
}

// the partial softmax of G q heads over n keys and values at k[i], v[i] (q: raw rows of D; qs: the same
// times scale, in float32): writes m[g * stride], l[g * stride] and o[g * stride + 2 .. + 2 + D) for g < G,
// prefetching the next chunk's rows along where `ahead`
template <int G, typename E>
void attend_chunk(const E* q, const float* qs, float scale, int64_t D, const E* const* k, const E* const* v,
                  int64_t n, float* part, int64_t stride, RowsAhead<E>* ahead) {
  float scores[G][CHUNK];
  chunk_scores<G>(q, qs, scale, D, k, n, scores, ahead);
  for (int g = 0; g < G; g++) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < n; s += 16)
      top = _mm512_mask_max_ps(top, first(n - s), top, _mm512_loadu_ps(scores[g] + s));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s += 16) {
      const __mmask16 m = first(n - s);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores[g] + s), most)));
      _mm512_mask_storeu_ps(scores[g] + s, m, e);
      sums = _mm512_add_ps(sums, e);
    }
    part[g * stride] = _mm512_cvtss_f32(most);
    part[g * stride + 1] = _mm512_reduce_add_ps(sums);
  }
  chunk_values<G>(scores, D, v, n, part + 2, stride, ahead);
}

// Attention for P (query, kv head) pairs of `group` q heads each: pair p's q heads are rows p * group.. of q
// (D wide), its output rows the same of y; it attends over keys span(p) = [lo, hi), whose k and v rows
// rows(p, s, n, k, v) points to (keys s..s+n-1, all in one chunk). Scores are scaled by `scale_` (0: 1/sqrt(D)).
template <typename E, typename Span, typename Rows>
void attend(const E* q, E* y, int64_t P, int64_t group, int64_t D, const Span& span, const Rows& rows,
            double scale_) {
  const int64_t stride = D + 2, WAVE = 1 << 20;  // floats of partials held at once
  const float scale = scale_ == 0.0 ? 1.0f / std::sqrt(float(D)) : float(scale_);
  for (int64_t p0 = 0; p0 < P;) {  // pairs in waves, so that their partials stay a few MB
    std::vector<int64_t> start{0};  // pair p0 + i's chunks are start[i]..start[i + 1]-1
    int64_t keys = 0, p1 = p0;
    for (; p1 < P && (p1 == p0 || start.back() * group * stride < WAVE); p1++) {
      const auto [lo, hi] = span(p1);
      start.push_back(start.back() + (hi - 1) / CHUNK - lo / CHUNK + 1);
      keys += hi - lo;
    }
    const int64_t n = start.back();
    std::vector<float> parts(n * group * stride);
    // a short context is done faster by one thread than split
    const int64_t grain = std::max<int64_t>(1, TASK_WEIGHTS / 2 * n / std::max<int64_t>(1, keys * D * group));
    // chunk i's pair, its key count, and its key and value rows into k, v
    const auto chunk = [&](int64_t i, const E** k, const E** v) {
      const int64_t p = p0 + (std::upper_bound(start.begin(), start.end(), i) - start.begin()) - 1;
      const auto [lo, hi] = span(p);
      const int64_t c = lo / CHUNK + i - start[p - p0], s0 = std::max(lo, c * CHUNK);
      const int64_t len = std::min(hi, (c + 1) * CHUNK) - s0;
      rows(p, s0, len, k, v);
      return std::pair<int64_t, int64_t>(p, len);
    };
    // a chunk's rows lie in blocks scattered over the pool, which the hardware prefetcher does not follow: they are
    // prefetched a chunk ahead (short contexts, as in decoding, are bound by these reads), spread over the chunk
    // before it (RowsAhead): issued all at once, they held that chunk's loads behind the core's few outstanding
    // misses (bench/attention.py: 16 sequences at the 1.7B model's shapes 1.27-1.40x slower, one of 4001 keys 1.9x)
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> query(group * D);  // float32 q times scale (bfloat16 q is scaled after its dot products)
      const E *rows_a[2][CHUNK], *rows_b[2][CHUNK];
      const E **k = rows_a[0], **v = rows_a[1], **next_k = rows_b[0], **next_v = rows_b[1];
      auto [next_p, next_len] = chunk(begin, next_k, next_v);
      RowsAhead<E>{next_k, next_v, next_len, D}.all();
      int64_t p = -1;
      for (int64_t i = begin; i < end; i++) {
        std::swap(k, next_k), std::swap(v, next_v);
        const int64_t len = next_len;
        if (p != next_p) {
          p = next_p;
          if constexpr (std::is_same_v<E, float>)
            for (int64_t j = 0; j < group * D; j++) query[j] = q[p * group * D + j] * scale;
        }
        if (i + 1 < end) std::tie(next_p, next_len) = chunk(i + 1, next_k, next_v);
        RowsAhead<E> ahead{next_k, next_v, i + 1 < end ? next_len : 0, D};
        float* part = parts.data() + i * group * stride;
        for (int64_t g = 0; g < group; g += HEADS) {
          const E* qe = q + (p * group + g) * D;
          const float* qs = query.data() + g * D;
          float* out = part + g * stride;
          switch (std::min(HEADS, group - g)) {
            case 1: attend_chunk<1>(qe, qs, scale, D, k, v, len, out, stride, g ? nullptr : &ahead); break;
            case 2: attend_chunk<2>(qe, qs, scale, D, k, v, len, out, stride, g ? nullptr : &ahead); break;
            case 3: attend_chunk<3>(qe, qs, scale, D, k, v, len, out, stride, g ? nullptr : &ahead); break;
            default: attend_chunk<4>(qe, qs, scale, D, k, v, len, out, stride, g ? nullptr : &ahead);
          }
        }
        ahead.all();
      }
    });
    // merge each head's partials in chunk order: weights e^(m_c - max m)
    at::parallel_for(0, (p1 - p0) * group, std::max<int64_t>(1, TASK_WEIGHTS / std::max<int64_t>(1, n * D)),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> out(D);
      for (int64_t ph = begin; ph < end; ph++) {
        const int64_t i = ph / group, h = ph % group;
        const float* first_part = parts.data() + (start[i] * group + h) * stride;
        const int64_t count = start[i + 1] - start[i], step = group * stride;
        float most = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < count; c++) most = std::max(most, first_part[c * step]);
        std::fill(out.begin(), out.end(), 0.0f);
        for (int64_t c = 0; c < count; c++) {
          const float* part = first_part + c * step;
          const float w = count == 1 ? 1.0f : std::exp(part[0] - most);
          total += w * part[1];
          for (int64_t d = 0; d < D; d++) out[d] += w * part[2 + d];
        }
        E* row = y + ((p0 + i) * group + h) * D;
        for (int64_t d = 0; d < D; d++) row[d] = E(out[d] / total);
      }
    });
    p0 = p1;
  }
}

// One query per row, no mask: each q head (B, 1, H, D) attends over slots 0..length-1 of its kv head
// (grouped-query order) with a float32 softmax, scores scaled by `scale` (0: 1/sqrt(D)). Returns (B, 1, H * D).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t length,
                            double scale) {
  check_cpu(q, q.scalar_type(), "decode_attention: q", 4);
  check_cpu(k_cache, q.scalar_type(), "decode_attention: k_cache", 4);
  check_cpu(v_cache, q.scalar_type(), "decode_attention: v_cache", 4);
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3), KV = k_cache.size(1), T = k_cache.size(2);
  TORCH_CHECK(q.size(1) == 1 && KV > 0 && H % KV == 0 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.size(3) == D,
              "decode_attention: q ", q.sizes(), " does not fit caches ", k_cache.sizes());
  TORCH_CHECK(length > 0 && length <= T, "decode_attention: length ", length, " outside a cache of ", T);
  at::Tensor y = at::empty({B, 1, H * D}, q.options());
  with_type(q, "decode_attention: q", [&]<typename E>() {
    const E *kc = static_cast<const E*>(k_cache.data_ptr()), *vc = static_cast<const E*>(v_cache.data_ptr());
    const auto span = [&](int64_t) { return std::pair<int64_t, int64_t>(0, length); };
    const auto rows = [&](int64_t p, int64_t s, int64_t n, const E** k, const E** v) {
      for (int64_t i = 0; i < n; i++) k[i] = kc + (p * T + s + i) * D, v[i] = vc + (p * T + s + i) * D;
    };
    attend(static_cast<const E*>(q.data_ptr()), static_cast<E*>(y.data_ptr()), B * KV, H / KV, D, span, rows, scale);
  });
  return y;
}

// Tokens of many sequences, each reading its own keys through a block table: token t, of sequence seqs[t] at
// position positions[t] = p, attends with each q head to its kv head's keys at positions max(0, p - window + 1)..p
// (window 0: from 0), scores scaled by `scale` (0: 1/sqrt(D)). Pools (n_blocks, KV, block_size, D); tables
// (S, max_blocks) int64; q (T, H, D) -> (T, H * D).
// A token's numbers depend on its position, window and keys only: the same whatever else is in the batch.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& seqs, const at::Tensor& positions,
                           int64_t window, double scale) {
  check_cpu(q, q.scalar_type(), "paged_attention: q", 3);
  check_cpu(k_pool, q.scalar_type(), "paged_attention: k_pool", 4);
  check_cpu(v_pool, q.scalar_type(), "paged_attention: v_pool", 4);
  check_cpu(tables, at::kLong, "paged_attention: tables", 2);
  check_cpu(seqs, at::kLong, "paged_attention: seqs", 1);
  check_cpu(positions, at::kLong, "paged_attention: positions", 1);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), n_blocks = k_pool.size(0), KV = k_pool.size(1);
  const int64_t size = k_pool.size(2), S = tables.size(0), width = tables.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0 && k_pool.sizes() == v_pool.sizes() && k_pool.size(3) == D,
              "paged_attention: q ", q.sizes(), " does not fit pools ", k_pool.sizes());
  TORCH_CHECK(seqs.size(0) == T && positions.size(0) == T, "paged_attention: seqs and positions need ", T, " entries");
  const int64_t *tp = tables.data_ptr<int64_t>(), *sp = seqs.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S && pp[t] >= 0 && pp[t] < width * size, "paged_attention: token ", t,
                " (sequence ", sp[t], ", position ", pp[t], ") outside tables ", tables.sizes());
  for (int64_t i = 0; i < S * width; i++)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < n_blocks, "paged_attention: block ", tp[i], " outside a pool of ", n_blocks);
  at::Tensor y = at::empty({T, H * D}, q.options());
  with_type(q, "paged_attention: q", [&]<typename E>() {
    const E *kc = static_cast<const E*>(k_pool.data_ptr()), *vc = static_cast<const E*>(v_pool.data_ptr());
    const auto span = [&](int64_t p) {  // pair p: token p / KV, kv head p % KV
      const int64_t at = pp[p / KV];
      return std::pair<int64_t, int64_t>(window > 0 ? std::max<int64_t>(0, at - window + 1) : 0, at + 1);
    };
    const auto rows = [&](int64_t p, int64_t s, int64_t n, const E** k, const E** v) {
      const int64_t* table = tp + sp[p / KV] * width;
      for (int64_t i = 0, block = s / size, offset = s % size; i < n; i++) {
        const int64_t at = ((table[block] * KV + p % KV) * size + offset) * D;
        k[i] = kc + at, v[i] = vc + at;
        if (++offset == size) block++, offset = 0;
      }
    };
    attend(static_cast<const E*>(q.data_ptr()), static_cast<E*>(y.data_ptr()), T * KV, H / KV, D, span, rows, scale);
  });
  return y;
}

// rounded(silu(gate)) * up for x = [gate | up] along the last dimension, rounded as the reference rounds
at::Tensor silu_mul(const at::Tensor& x_) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_mul: x must be a CPU tensor of even width");
  const int64_t F = x.size(-1) / 2, rows = F ? x.numel() / (2 * F) : 0;
  at::Tensor y = at::empty(out_shape(x, F), x.options());
  with_type(x, "silu_mul: x", [&]<typename T>() {
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    at::parallel_for(
        0, rows, std::max<int64_t>(1, TASK_WEIGHTS / std::max<int64_t>(F, 1)), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; i++) {
            const T *gate = xp + i * 2 * F, *up = gate + F;
            if constexpr (std::is_same_v<T, float>) {  // silu in float64, rounded once to float32
              for (int64_t f = 0; f < F; f += 8) {
                const __mmask8 m = first8(F - f);
                const __m512d g = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, gate + f));
                const __m512d e = exp_pd(_mm512_sub_pd(_mm512_setzero_pd(), g));
                const __m256 silu = _mm512_cvtpd_ps(_mm512_div_pd(g, _mm512_add_pd(_mm512_set1_pd(1.0), e)));
                _mm256_mask_storeu_ps(yp + i * F + f, m, _mm256_mul_ps(silu, _mm256_maskz_loadu_ps(m, up + f)));
              }
              continue;
            }
            for (int64_t f = 0; f < F; f += 16) {
              const __mmask16 m = first(F - f);
              const __m512 g = load(gate + f, m);
              const __m512 silu =
                  _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
              store(yp + i * F + f, m, _mm512_mul_ps(rounded<T>(silu), load(up + f, m)));
            }
          }
        });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(lmstack, m) {
  m.def("matvec_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", matvec_bf16);
  m.def("matvec_bf16_tiled(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", matvec_bf16_tiled);
  m.def("matvec_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor", matvec_f32);
  m.def("matvec_f32_tiled(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", matvec_f32_tiled);
  m.def("matvec_int8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor", matvec_int8);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", rms_norm);
  m.def(
      "rope_into_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int start) -> "
      "Tensor",
      rope_into_cache);
  m.def(
      "rope_into_pages(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots) -> "
      "Tensor",
      rope_into_pages);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, int length, float scale=0.0) -> Tensor",
        decode_attention);
  m.def("silu_mul(Tensor x) -> Tensor", silu_mul);
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor seqs, Tensor positions, "
      "int window, float scale=0.0) -> Tensor",
      paged_attention);
}
