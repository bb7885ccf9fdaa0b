// GGUF's Q8_0, Q4_0 and Q4_1 blocks multiplied as stored (weight_format "gguf"; see formats.py).
//
// Each block holds 32 weights of one row: Q8_0 a float16 scale d and 32 int8 q (w = q * d), Q4_0 d and
// 32 nibbles (w = d * (q - 8)), Q4_1 d, a float16 offset m and 32 nibbles (w = d * q + m); a nibble byte j
// holds weights j (low) and j + 16 (high). kernels.py's pack_gguf regroups the blocks of TILE rows:
// record (tile, block) = the TILE scales d, [the TILE offsets m,] the TILE rows' quants, so that each thread
// reads one sequential stream, as matvec_int8 does. Q8_0's quants are stored as q + 128 (unsigned, as VNNI's
// first operand must be) and by halves, each 64 bytes holding one half (weights 0..15 or 16..31) of four rows,
// the shape of four rows' nibble bytes: both types then meet x the same way.
//
// gguf_matvec computes in the activations' dtype:
//   float32: each weight dequantized exactly as gguf.quants.dequantize does (float32 products, no fused
//            multiply-add), then multiplied with x and summed in float32.
//   bfloat16: llama.cpp's arithmetic: each 32-block of x quantized to int8 with a float32 scale, the
//            block dot products summed in int32 (AVX512-VNNI), scaled and summed in float32.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using lmstack::TASK_WEIGHTS;
using lmstack::TILE;
constexpr int64_t PREFETCH = 4096;  // bytes ahead of the record being read
constexpr int64_t MAX_ROWS = 4;  // rows of x that share each unpacked block of weights

enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

// bytes of one (tile, block) record, and where its quants start
constexpr int64_t record_bytes(int64_t type) {
  return type == Q8_0 ? 16 + TILE * 32 : type == Q4_1 ? 32 + TILE * 16 : 16 + TILE * 16;
}
constexpr int64_t quants_at(int64_t type) { return type == Q4_1 ? 32 : 16; }

// the 16 bytes of row r's quants in a record that hold weights 0..15 (half 0) or 16..31 (half 1): for Q4_0 and
// Q4_1 the row's nibble bytes (both halves), for Q8_0 the half's bytes
template <int64_t T>
inline const uint8_t* row_quants(const uint8_t* rec, int64_t r, int half) {
  if constexpr (T == Q8_0) return rec + quants_at(T) + (r / 4) * 128 + half * 64 + (r % 4) * 16;
  return rec + quants_at(T) + r * 16;
}

inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// ---- float32 activations: weights dequantized exactly --------------------------------------------

// the 16 weights of one row's block, half 0 (weights 0..15) or 1 (16..31), at quants q = row_quants(.., half),
// as float32
template <int64_t T>
inline __m512 dequant16(const uint8_t* q, int half, __m512 d, __m512 m) {
  if constexpr (T == Q8_0) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))), d);
  } else {
    __m128i v = _mm_loadu_si128((const __m128i*)q);
    if (half) v = _mm_srli_epi16(v, 4);
    __m512i n = _mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(0x0F)));
    if constexpr (T == Q4_0) return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8))));
    return _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(n)), m);
  }
}

// dot products of one float32 row x (KB * 32) with the TILE rows of one tile (KB records from rec)
template <int64_t T>
void dot_f32_tile(const float* x, const uint8_t* rec, int64_t KB, float* out) {
  constexpr int64_t R = record_bytes(T);
  __m512 even[TILE], odd[TILE];
  for (int r = 0; r < TILE; r++) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; b++, rec += R) {
    for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
    const __m512 d = _mm512_castps256_ps512(halves(rec));
    const __m512 m = T == Q4_1 ? _mm512_castps256_ps512(halves(rec + 16)) : _mm512_setzero_ps();
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < TILE; r++) {
      const uint8_t* q = row_quants<T>(rec, r, 0);
      const __m512i lane = _mm512_set1_epi32(r);
      const __m512 dr = _mm512_permutexvar_ps(lane, d), mr = _mm512_permutexvar_ps(lane, m);
      if constexpr (T == Q8_0) {
        even[r] = _mm512_fmadd_ps(dequant16<T>(q, 0, dr, mr), x0, even[r]);
        odd[r] = _mm512_fmadd_ps(dequant16<T>(row_quants<T>(rec, r, 1), 1, dr, mr), x1, odd[r]);
      } else {  // the row's 16 possible weights, each computed as dequant16 computes it, looked up by nibble
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 table = T == Q4_0 ? _mm512_mul_ps(dr, _mm512_sub_ps(iota, _mm512_set1_ps(8)))
                                       : _mm512_add_ps(_mm512_mul_ps(dr, iota), mr);
        const __m128i v = _mm_loadu_si128((const __m128i*)q), low = _mm_set1_epi8(0x0F);
        const __m512i n0 = _mm512_cvtepu8_epi32(_mm_and_si128(v, low));
        const __m512i n1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low));
        even[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(n0, table), x0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(n1, table), x1, odd[r]);
      }
    }
  }
  for (int r = 0; r < TILE; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

// ---- bfloat16 activations: x quantized per block to int8, integer dot products -----------------

struct XBlocks {  // one row of x: KB blocks of 32 int8, their scales and sums
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
};

// x's row quantized as llama.cpp's quantize_row_q8_0, with a float32 scale: q = round(x / d), d = amax / 127
void quantize_row(const c10::BFloat16* x, int64_t KB, int8_t* q, float* d, int32_t* sum) {
  for (int64_t b = 0; b < KB; b++) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + b * 32))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + b * 32 + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    d[b] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax ? 127.0f / amax : 0.0f);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i*)(q + b * 32), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i*)(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qh));
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
  }
}

// dot products of MR quantized rows of x (row stride K = KB * 32) with the TILE rows of one tile: each block of
// weights is unpacked once for the MR rows; each row's sums are the same whatever MR is (out[i][r], row i)
template <int64_t T, int MR>
void dot_q8_tile(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* rec, int64_t KB,
                 float (*out)[TILE]) {
  constexpr int64_t R = record_bytes(T), QA = quants_at(T);
  const int64_t K = KB * 32;
  alignas(64) float lanes[16];
  // two registers of four rows each (lanes 4j..4j+3: row 4 * reg + j); each row's weights 0..15 (low nibbles,
  // Q8_0's first halves) meet x[0..15], weights 16..31 (high nibbles, second halves) x[16..31]
  __m512 acc[MR][2];
  __m256 offsets[MR];  // Q4_1: sum over blocks of m * d_x * sum(x_q)
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps(), offsets[i] = _mm256_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i quad[2] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                           _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4)};
  for (int64_t b = 0; b < KB; b++, rec += R) {
    for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
    const __m256 d = halves(rec), m = T == Q4_1 ? halves(rec + 16) : _mm256_setzero_ps();
    __m512i lo[2], hi[2];
    for (int j = 0; j < 2; j++) {
      if constexpr (T == Q8_0) {
        lo[j] = _mm512_loadu_si512(rec + QA + j * 128), hi[j] = _mm512_loadu_si512(rec + QA + j * 128 + 64);
      } else {
        const __m512i v = _mm512_loadu_si512(rec + QA + j * 64);
        lo[j] = _mm512_and_si512(v, nib), hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    }
    for (int i = 0; i < MR; i++) {
      const int8_t* xb = xq + i * K + b * 32;
      const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xb));
      const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xb + 16)));
      const int32_t sum = xs[i * KB + b];
      const __m512i corr = T == Q4_1 ? _mm512_setzero_si512()  // the offset m is summed apart
                                     : _mm512_maskz_set1_epi32(0x1111, (T == Q8_0 ? -128 : -8) * sum);
      const __m256 xdb = _mm256_set1_ps(xd[i * KB + b]);
      const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(d, xdb));
      if constexpr (T == Q4_1)
        offsets[i] = _mm256_fmadd_ps(m, _mm256_mul_ps(xdb, _mm256_set1_ps(float(sum))), offsets[i]);
      for (int j = 0; j < 2; j++) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, lo[j], xlo), hi[j], xhi);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(quad[j], scale), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; i++) {
    alignas(32) float offs[TILE];
    _mm256_store_ps(offs, offsets[i]);
    for (int j = 0; j < 2; j++) {
      _mm512_store_ps(lanes, acc[i][j]);
      for (int h = 0; h < 4; h++) {
        float sum = 0;
        for (int l = 0; l < 4; l++) sum += lanes[4 * h + l];
        out[i][4 * j + h] = sum + offs[4 * j + h];
      }
    }
  }
}

template <typename F>
void with_gguf_type(int64_t type, const F& f) {
  if (type == Q8_0) return f.template operator()<Q8_0>();
  if (type == Q4_0) return f.template operator()<Q4_0>();
  TORCH_CHECK(type == Q4_1, "gguf kernels: type ", type, " has no kernel (Q8_0, Q4_0, Q4_1 have)");
  return f.template operator()<Q4_1>();
}

void check_packed(const at::Tensor& w, int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() && w.dim() == 3,
              "gguf kernels: w must be a contiguous 3-D uint8 CPU tensor");
  TORCH_CHECK(K % 32 == 0 && w.size(0) == (N + TILE - 1) / TILE && w.size(1) == K / 32 &&
                  w.size(2) == record_bytes(type),
              "gguf kernels: w must be packed as (", (N + TILE - 1) / TILE, ", ", K / 32, ", ", record_bytes(type),
              "), got ", w.sizes());
}

// y = x @ w.T + bias for packed GGUF blocks w of `type` (N rows, K = x.size(-1) columns); x float32 or bfloat16,
// bias and y in x's dtype
at::Tensor gguf_matvec(const at::Tensor& x_, const at::Tensor& w, int64_t type, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "gguf_matvec: x must be a CPU tensor");
  const int64_t K = x.size(-1), KB = K / 32, M = K ? x.numel() / K : 0;
  check_packed(w, type, N, K);
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 || x.scalar_type() == at::kBFloat16, "gguf_matvec: x must be float32 or bfloat16");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N &&
                    bias->scalar_type() == x.scalar_type(),
                "gguf_matvec: bias must be a contiguous vector of ", N, " ", x.scalar_type());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  XBlocks xb;
  if (!f32) {
    xb.q.resize(M * K), xb.d.resize(M * KB), xb.sum.resize(M * KB);
    const auto* xp = static_cast<const c10::BFloat16*>(x.data_ptr());
    for (int64_t m = 0; m < M; m++)
      quantize_row(xp + m * K, KB, xb.q.data() + m * K, xb.d.data() + m * KB, xb.sum.data() + m * KB);
  }
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t R = record_bytes(type), tiles = (N + TILE - 1) / TILE;
  with_gguf_type(type, [&]<int64_t T>() {
    at::parallel_for(0, tiles, std::max<int64_t>(1, TASK_WEIGHTS / (TILE * std::max<int64_t>(K, 1))),
                     [&](int64_t t0, int64_t t1) {
      float sums[MAX_ROWS][TILE];
      for (int64_t t = t0; t < t1; t++) {
        const uint8_t* rec = wp + t * KB * R;
        const int64_t n = t * TILE, rows = std::min(TILE, N - n);
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
          const int64_t block = std::min(MAX_ROWS, M - m0);
          if (f32) {
            for (int64_t i = 0; i < block; i++)
              dot_f32_tile<T>(static_cast<const float*>(x.data_ptr()) + (m0 + i) * K, rec, KB, sums[i]);
          } else {
            const int8_t* q = xb.q.data() + m0 * K;
            const float* d = xb.d.data() + m0 * KB;
            const int32_t* s = xb.sum.data() + m0 * KB;
            if (block == MAX_ROWS)
              dot_q8_tile<T, MAX_ROWS>(q, d, s, rec, KB, sums);
            else
              for (int64_t i = 0; i < block; i++)
                dot_q8_tile<T, 1>(q + i * K, d + i * KB, s + i * KB, rec, KB, sums + i);
          }
          for (int64_t i = 0; i < block; i++) {
            const int64_t m = m0 + i;
            if (f32) {
              float* yp = static_cast<float*>(y.data_ptr()) + m * N + n;
              const float* bp = bias.has_value() ? static_cast<const float*>(bias->data_ptr()) + n : nullptr;
              for (int64_t r = 0; r < rows; r++) yp[r] = bp ? sums[i][r] + bp[r] : sums[i][r];
            } else {
              auto* yp = static_cast<c10::BFloat16*>(y.data_ptr()) + m * N + n;
              const auto* bp = bias.has_value() ? static_cast<const c10::BFloat16*>(bias->data_ptr()) + n : nullptr;
              for (int64_t r = 0; r < rows; r++) yp[r] = c10::BFloat16(bp ? sums[i][r] + float(bp[r]) : sums[i][r]);
            }
          }
        }
      }
    });
  });
  return y;
}

// Rows `rows` (int64, any shape; None: every row) of packed blocks w dequantized to float32, exactly as
// gguf.quants.dequantize gives them, or those values rounded to bfloat16: shape rows.shape + (K,)
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t N, int64_t K,
                           const std::optional<at::Tensor>& rows_, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_dequantize: dtype must be float32 or bfloat16");
  check_packed(w, type, N, K);
  at::Tensor rows;
  std::vector<int64_t> shape;
  if (rows_.has_value()) {
    rows = rows_->contiguous();
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.device().is_cpu(), "gguf_dequantize: rows must be int64");
    shape.assign(rows.sizes().begin(), rows.sizes().end());
  } else {
    shape.push_back(N);
  }
  shape.push_back(K);
  at::Tensor out = at::empty(shape, w.options().dtype(dtype));
  const int64_t count = out.numel() / std::max<int64_t>(K, 1), KB = K / 32, R = record_bytes(type);
  const int64_t* rp = rows_.has_value() ? rows.data_ptr<int64_t>() : nullptr;
  if (rp)
    for (int64_t i = 0; i < count; i++) TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "gguf_dequantize: row ", rp[i], " of ", N);
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const bool bf16 = dtype == at::kBFloat16;
  void* op = out.data_ptr();
  with_gguf_type(type, [&]<int64_t T>() {
    const int64_t grain = std::max<int64_t>(1, TASK_WEIGHTS / std::max<int64_t>(K, 1));
    at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {
        const int64_t n = rp ? rp[i] : i, r = n % TILE;
        const uint8_t* rec = wp + (n / TILE) * KB * R;
        for (int64_t b = 0; b < KB; b++, rec += R) {
          alignas(32) float d[TILE], m[TILE] = {};
          _mm256_store_ps(d, halves(rec));
          if constexpr (T == Q4_1) _mm256_store_ps(m, halves(rec + 16));
          const __m512 dr = _mm512_set1_ps(d[r]), mr = _mm512_set1_ps(m[r]);
          lmstack::store16(op, bf16, i * K + b * 32, dequant16<T>(row_quants<T>(rec, r, 0), 0, dr, mr));
          lmstack::store16(op, bf16, i * K + b * 32 + 16, dequant16<T>(row_quants<T>(rec, r, 1), 1, dr, mr));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("gguf_matvec(Tensor x, Tensor w, int type, int n, Tensor? bias) -> Tensor", gguf_matvec);
  m.def("gguf_dequantize(Tensor w, int type, int n, int k, Tensor? rows, ScalarType dtype) -> Tensor",
        gguf_dequantize);
}
