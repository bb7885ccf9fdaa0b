// weight_format "int4" (formats.py's Int4Linear) dequantized for a prefill: PyTorch's int4 CPU kernel reads its
// packed weights once per row of x, so many rows go faster as one bfloat16 GEMM on the weights dequantized.
//
// The packed layout is PyTorch's (torch._convert_weight_to_int4pack_for_cpu, (N, K / 2) uint8): for N a multiple
// of 64, blocks of 64 rows, each K columns of 32 bytes, byte j holding rows j (low nibble) and j + 32 (high);
// otherwise K columns of N / 2 bytes, byte j holding rows 2j (low) and 2j + 1 (high). It is no public contract:
// Int4Linear checks the values against PyTorch's own kernel before using them, and keeps that kernel otherwise.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>

namespace {

constexpr int64_t GROUP = 32;  // formats.py's INT4_GROUP: one scale and zero per 32 columns of a row
constexpr int64_t BLOCK = 64;  // rows per block of the packed layout

// scales_zeros, (K / GROUP, N, 2), checked (`op` names the caller) and split: float32 scales and zeros, each
// (K / GROUP, N)
std::pair<at::Tensor, at::Tensor> scales_and_zeros(const at::Tensor& scales_zeros, int64_t N, int64_t K,
                                                   const char* op) {
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(0) == K / GROUP && scales_zeros.size(1) == N &&
                  scales_zeros.size(2) == 2,
              op, ": scales_zeros must be (", K / GROUP, ", ", N, ", 2)");
  return {scales_zeros.select(2, 0).to(at::kFloat).contiguous(), scales_zeros.select(2, 1).to(at::kFloat).contiguous()};
}

// 16 rows' weights in one column of a 64-row block, (q - 8) * scale + zero: q the low (half 0) or high (half 1)
// nibbles of the column's 16 bytes at `bytes`, s and z the rows' scales and zeros
inline __m512 block_weights(const uint8_t* bytes, int64_t half, const float* s, const float* z) {
  const __m128i v = _mm_loadu_si128((const __m128i*)bytes);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4 * half), _mm_set1_epi8(0x0F)));
  const __m512 centered = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8)));
  return _mm512_add_ps(_mm512_mul_ps(centered, _mm512_loadu_ps(s)), _mm512_loadu_ps(z));
}

// The transposed weights wt[k, n] = (q[n, k] - 8) * scale[k / GROUP, n] + zero[k / GROUP, n], (K, N) in dtype
// (float32, or those values rounded to bfloat16): a 64-row block's column k is 32 bytes, 64 consecutive outputs
at::Tensor int4pack_dequantize_t(const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t N, int64_t K,
                                 at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() * 2 == N * K &&
                  K % GROUP == 0 && N % 2 == 0,
              "int4pack_dequantize_t: packed must be (", N, ", ", K / 2, ") uint8");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int4pack_dequantize_t: dtype float32 or bfloat16");
  const auto [scales, zeros] = scales_and_zeros(scales_zeros, N, K, "int4pack_dequantize_t");
  const float *sp = scales.data_ptr<float>(), *zp = zeros.data_ptr<float>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  at::Tensor out = at::empty({K, N}, packed.options().dtype(dtype));
  const bool bf16 = dtype == at::kBFloat16;
  void* op = out.data_ptr();
  at::parallel_for(0, K, std::max<int64_t>(1, lmstack::TASK_WEIGHTS / N), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; k++) {
      const float *s = sp + (k / GROUP) * N, *z = zp + (k / GROUP) * N;
      if (N % BLOCK) {  // pairs of rows, one byte a pair
        for (int64_t n = 0; n < N; n++) {
          const float w = float(int((p[k * (N / 2) + n / 2] >> (4 * (n % 2))) & 15) - 8) * s[n] + z[n];
          if (bf16)
            static_cast<c10::BFloat16*>(op)[k * N + n] = c10::BFloat16(w);
          else
            static_cast<float*>(op)[k * N + n] = w;
        }
        continue;
      }
      for (int64_t b = 0; b < N / BLOCK; b++) {
        const uint8_t* column = p + b * (BLOCK / 2) * K + k * (BLOCK / 2);
        for (int64_t h = 0; h < 2; h++)  // bytes 16h..16h+15: rows 16h.. (low nibbles) and 32 + 16h.. (high)
          for (int64_t half = 0; half < 2; half++) {
            const int64_t n = b * BLOCK + half * (BLOCK / 2) + 16 * h;
            lmstack::store16(op, bf16, k * N + n, block_weights(column + 16 * h, half, s + n, z + n));
          }
      }
    }
  });
  return out;
}

// y = x @ w.T + bias for many rows of float32 x (a prefill in the fp32 profile), N a multiple of 64: the GEMM of
// kernels_gemm.cpp on the weights dequantized as int4pack_dequantize_t's float32, a panel at a time into its
// columns (a panel of 32 rows is one half of a 64-row block: the low or high nibbles of each column's 32 bytes)
at::Tensor gemm_f32_int4pack(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                             int64_t N, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() * 2 == N * K &&
                  K % GROUP == 0 && N % BLOCK == 0,
              "gemm_f32_int4pack: packed must be (", N, ", ", K / 2, ") uint8, N a multiple of ", BLOCK);
  static_assert(lmstack::GEMM_PANEL * 2 == BLOCK);
  const auto [scales, zeros] = scales_and_zeros(scales_zeros, N, K, "gemm_f32_int4pack");
  const float *sp = scales.data_ptr<float>(), *zp = zeros.data_ptr<float>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  return lmstack::gemm_f32(x, N, GROUP, bias, [&](int64_t n0, int64_t k0, int64_t kc, uint32_t* out) {
    const int64_t b = n0 / BLOCK, half = n0 % BLOCK / (BLOCK / 2);
    for (int64_t k = k0; k < k0 + kc; k++) {
      const uint8_t* column = p + b * (BLOCK / 2) * K + k * (BLOCK / 2);
      const float *s = sp + (k / GROUP) * N + n0, *z = zp + (k / GROUP) * N + n0;
      for (int64_t h = 0; h < 2; h++)
        _mm512_store_ps((float*)(out + (k - k0) * lmstack::GEMM_PANEL + 16 * h),
                        block_weights(column + 16 * h, half, s + 16 * h, z + 16 * h));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("int4pack_dequantize_t(Tensor packed, Tensor scales_zeros, int n, int k, ScalarType dtype) -> Tensor",
        int4pack_dequantize_t);
  m.def("gemm_f32_int4pack(Tensor x, Tensor packed, Tensor scales_zeros, int n, Tensor? bias) -> Tensor",
        gemm_f32_int4pack);
}
