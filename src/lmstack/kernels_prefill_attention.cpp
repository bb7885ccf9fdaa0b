// Causal attention of a prefill's many queries in bfloat16. PyTorch's flash attention for CPU runs at about a tenth
// of the bfloat16 GEMM's rate on AVX512-BF16 without AMX (42% of a SmolLM2-135M prefill of 512 tokens), so here
// both of its products are AVX512-BF16 dot products, laid out as kernels_gemm.cpp lays out a GEMM: each kv head's
// keys and values once in pairs (keys: dims 2p, 2p + 1 of 16 keys a vector; values: keys 2j, 2j + 1 of 16 dims a
// vector), then each task takes R query rows of one q head: their scores against every key they see (bfloat16
// products summed in float32, then scaled), one float32 softmax over the whole row (max, exp, sum: no rescaling),
// the probabilities rounded to bfloat16 (as PyTorch's kernel rounds them for its second product) times the values,
// summed in float32, times 1 / the sum, rounded once. A query's numbers depend on its own row and keys alone.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

using lmstack::exp_ps;
constexpr int64_t R = 8;     // query rows per task: R x 32 float32 sums in registers
constexpr int64_t KEYS = 32;  // keys per block of the keys' pairs

// keys (n rows of D bfloat16 at k, zeros past `count`) -> out: per block of KEYS keys, out[p * KEYS + i] = the 32
// bits of key i's dims 2p, 2p + 1
void key_pairs(const uint32_t* k, int64_t count, int64_t n, int64_t D, uint32_t* out) {
  at::parallel_for(0, n / KEYS, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t i = 0; i < KEYS; i++) {
        const int64_t key = b * KEYS + i;
        for (int64_t p = 0; p < D / 2; p++) out[(b * D / 2 + p) * KEYS + i] = key < count ? k[key * D / 2 + p] : 0;
      }
  });
}

// values (n rows of D bfloat16 at v, zeros past `count`) -> out[j * D + d] = the 32 bits of values 2j, 2j + 1 at d
void value_pairs(const uint16_t* v, int64_t count, int64_t n, int64_t D, uint32_t* out) {
  at::parallel_for(0, n / 2, KEYS, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
      for (int64_t d = 0; d < D; d++) {
        const uint32_t low = 2 * j < count ? v[2 * j * D + d] : 0;
        const uint32_t high = 2 * j + 1 < count ? v[(2 * j + 1) * D + d] : 0;
        out[j * D + d] = low | high << 16;
      }
  });
}

// s[r * n + key] = scale * (row r of q, D / 2 pairs every `stride`) . key, for n keys (whole blocks)
template <int ROWS>
void scores(const uint32_t* q, int64_t stride, const uint32_t* kp, int64_t n, int64_t D, float scale, float* s) {
  for (int64_t b = 0; b < n / KEYS; b++) {
    const uint32_t* keys = kp + b * D / 2 * KEYS;
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * KEYS);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + p * KEYS + 16);
      for (int r = 0; r < ROWS; r++) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(q[r * stride + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, k1);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < ROWS; r++)
      for (int h = 0; h < 2; h++) _mm512_storeu_ps(s + r * n + b * KEYS + 16 * h, _mm512_mul_ps(acc[r][h], sc));
  }
}

// out (ROWS rows, D dims every `stride`) = bfloat16 of (the rows' probabilities p (n bfloat16 each, as pairs) x
// values vp) * inverse[r]
template <int ROWS>
void weighted_values(const uint32_t* p, int64_t n, const uint32_t* vp, int64_t D, const float* inverse,
                     uint16_t* out, int64_t stride) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n / 2; j++) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + j * D + d0);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + j * D + d0 + 16);
      for (int r = 0; r < ROWS; r++) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(p[r * n / 2 + j]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, v1);
      }
    }
    for (int r = 0; r < ROWS; r++) {
      const __m512 inv = _mm512_set1_ps(inverse[r]);
      const __m512 lo = _mm512_mul_ps(acc[r][0], inv), hi = _mm512_mul_ps(acc[r][1], inv);
      _mm512_storeu_si512(out + r * stride + d0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// ROWS query rows (the first at position `first`, q rows of D bfloat16 every `stride` elements) over the keys up
// to their own positions: y rows (every `stride` elements); s and p: room for ROWS x n float32 and bfloat16
template <int ROWS>
void attend_rows(const uint16_t* q, int64_t stride, int64_t first, const uint32_t* kp, const uint32_t* vp, int64_t D,
                 float scale, float* s, uint16_t* p, uint16_t* y) {
  const int64_t n = (first + ROWS + KEYS - 1) / KEYS * KEYS;  // the keys the last row sees, whole blocks
  scores<ROWS>(reinterpret_cast<const uint32_t*>(q), stride / 2, kp, n, D, scale, s);
  float inverse[ROWS];
  for (int r = 0; r < ROWS; r++) {
    float* row = s + r * n;
    const int64_t seen = first + r + 1;  // keys 0..first + r
    auto valid = [&](int64_t key) {  // of the 16 keys from key, those the row sees
      return (__mmask16)(seen - key >= 16 ? 0xFFFF : seen > key ? (1u << (seen - key)) - 1 : 0);
    };
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t key = 0; key < seen; key += 16)
      top = _mm512_mask_max_ps(top, valid(key), top, _mm512_loadu_ps(row + key));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t key = 0; key < n; key += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; h++) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(row + key + 16 * h), most);
        e[h] = _mm512_maskz_mov_ps(valid(key + 16 * h), exp_ps(x));
        sums = _mm512_add_ps(sums, e[h]);
      }
      _mm512_storeu_si512(p + r * n + key, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    inverse[r] = 1.0f / _mm512_reduce_add_ps(sums);
  }
  weighted_values<ROWS>(reinterpret_cast<const uint32_t*>(p), n, vp, D, inverse, y, stride);
}

template <int ROWS = R>
void attend_block(int64_t rows, const uint16_t* q, int64_t stride, int64_t first, const uint32_t* kp,
                  const uint32_t* vp, int64_t D, float scale, float* s, uint16_t* p, uint16_t* y) {
  if constexpr (ROWS > 1)
    if (rows < ROWS) return attend_block<ROWS - 1>(rows, q, stride, first, kp, vp, D, scale, s, p, y);
  attend_rows<ROWS>(q, stride, first, kp, vp, D, scale, s, p, y);
}

// q (B, L, H, D) bfloat16, the rotated queries of positions start..start + L - 1, each attending causally to
// slots 0..its position of its kv head's k_cache, v_cache (B, KV, T, D), scores scaled by `scale` (0: 1/sqrt(D)).
// Returns (B, L, H * D).
at::Tensor prefill_attention(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                             double scale_) {
  const at::Tensor q = q_.contiguous();
  for (const at::Tensor* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == at::kBFloat16,
                "prefill_attention: q and the caches must be contiguous 4-D bfloat16 CPU tensors");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), KV = k_cache.size(1), T = k_cache.size(2);
  TORCH_CHECK(KV > 0 && H % KV == 0 && D % 32 == 0 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.size(3) == D,
              "prefill_attention: q ", q.sizes(), " does not fit caches ", k_cache.sizes(),
              " (head dim a multiple of 32)");
  TORCH_CHECK(start >= 0 && start + L <= T, "prefill_attention: positions ", start, "..", start + L,
              " outside a cache of ", T);
  const float scale = scale_ == 0.0 ? 1.0f / std::sqrt(float(D)) : float(scale_);
  at::Tensor y = at::empty({B, L, H * D}, q.options());
  const int64_t G = H / KV, n = (start + L + KEYS - 1) / KEYS * KEYS, blocks = (L + R - 1) / R, tasks = G * blocks;
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  std::vector<uint32_t> keys(n * D / 2), values(n * D / 2);
  uint32_t *kp = keys.data(), *vp = values.data();
  for (int64_t b = 0; b < B; b++)
    for (int64_t g = 0; g < KV; g++) {
      const int64_t at = (b * KV + g) * T * D;
      key_pairs(static_cast<const uint32_t*>(k_cache.data_ptr()) + at / 2, start + L, n, D, kp);
      value_pairs(static_cast<const uint16_t*>(v_cache.data_ptr()) + at, start + L, n, D, vp);
      std::atomic<int64_t> next{0};  // tasks handed out longest first: the last rows see the most keys
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
        std::vector<float> s(R * n);
        std::vector<uint16_t> p(R * n);
        for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
          const int64_t i0 = (blocks - 1 - t / G) * R, h = g * G + t % G;
          const int64_t offset = ((b * L + i0) * H + h) * D;
          attend_block(std::min(R, L - i0), qp + offset, H * D, start + i0, kp, vp, D, scale, s.data(), p.data(),
                       yp + offset);
        }
      });
    }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, int start, float scale=0.0) -> Tensor",
        prefill_attention);
}
