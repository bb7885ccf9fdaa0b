// GGUF blocks multiplied as stored (weight_format "gguf"; see formats.py): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
// and Q6_K regrouped by tiles of 16 rows, Q2_K and Q3_K kept whole; TYPES below is the one table of them.
//
// Regrouped types: each block holds 32 weights of one row: Q8_0 a float16 scale d and 32 int8 q (w = q * d), Q4_0
// d and 32 nibbles (w = d * (q - 8)), Q4_1 d, a float16 offset m and 32 nibbles (w = d * q + m), Q5_0 and Q5_1
// as Q4_0 and Q4_1 with a fifth bit of each weight in 32 bits (w = d * (q - 16), d * q + m); a nibble byte j
// holds weights j (low) and j + 16 (high). kernels.py's pack_gguf regroups the blocks of REGROUPED_TILE (16) rows
// into one record (tile, block), laid out so that one 64-byte register holds 4 columns of all 16 rows, row r in
// bytes 4r..4r+3 (VNNI's 32-bit lanes): the 16 scales d, [the 16 offsets m,] [the fifth bits: for each group g of
// columns 4g..4g+3, 64 bits, bit 4r + t the bit of row r's column 4g + t,] then the quants: Q4_0's and the other
// nibble types' 4 x 64 bytes, chunk k holding row r's nibble bytes 4k..4k+3 (columns 4k.. in the low nibbles,
// 16 + 4k.. in the high), Q8_0's 8 x 64 bytes, chunk g holding row r's quants 4g..4g+3 as q + 128 (unsigned, as
// VNNI's first operand must be). Each thread reads one sequential stream, as matvec_int8 does. The K-quants: see
// below.
//
// gguf_matvec computes in the activations' dtype:
//   float32: each weight dequantized exactly as gguf.quants.dequantize does (float32 products, no fused
//            multiply-add), then multiplied with x and summed in float32.
//   bfloat16: llama.cpp's arithmetic: x quantized to int8 with float32 scales (per 256 values as llama.cpp's
//            Q8_K for the K-quants, per 32 for the others), the sub-block dot products summed in integers
//            (AVX512-VNNI), scaled and summed in float32. A row's numbers never depend on the other rows.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using lmstack::REGROUPED_TILE;
using lmstack::TASK_WEIGHTS;
using lmstack::TILE;
using lmstack::transpose16;
constexpr int64_t PREFETCH = 4096;  // bytes ahead of the record being read
constexpr int64_t ONE_ROW_PREFETCH = 8192;    // in a decode: the 4- and 5-bit 32-weight records (dot_q8_tile)
constexpr int64_t K_ONE_ROW_PREFETCH = 6144;  // in a decode: the K-quant records (dot_k_tile)
constexpr int F32_ROWS = 4;         // float32 rows of x that share each dequantized weight: 16 sums
constexpr int MAX_ROWS = 16;        // rows of x that share each unpacked block of weights: 16 accumulators

enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };  // ggml's type ids

constexpr bool has_offset(int64_t type) { return type == Q4_1 || type == Q5_1; }  // w = d * q + m
constexpr bool has_high_bits(int64_t type) { return type == Q5_0 || type == Q5_1; }
constexpr int zero_point(int64_t type) { return type == Q8_0 ? 128 : type == Q5_0 ? 16 : 8; }  // w = d * (q - z)

// where a (tile, block) record's offsets m, high bits (Q5_0, Q5_1) and quants start, and its bytes
constexpr int64_t offsets_at = 2 * REGROUPED_TILE;
constexpr int64_t high_at(int64_t type) { return (has_offset(type) ? 2 : 1) * 2 * REGROUPED_TILE; }
constexpr int64_t quants_at(int64_t type) { return high_at(type) + (has_high_bits(type) ? 64 : 0); }
constexpr int64_t record_bytes(int64_t type) { return quants_at(type) + REGROUPED_TILE * (type == Q8_0 ? 32 : 16); }

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m512 scales16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// The record's weights as unsigned bytes q (w = d * (q - z), or d * q + m), w[g] holding columns 4g..4g+3 of the
// 16 rows (row r in bytes 4r..4r+3)
template <int64_t T>
inline void unpack_weights(const uint8_t* rec, __m512i* w) {
  constexpr int64_t QA = quants_at(T);
  if constexpr (T == Q8_0) {
    for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(rec + QA + 64 * g);
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
      const __m512i v = _mm512_loadu_si512(rec + QA + 64 * k);
      w[k] = _mm512_and_si512(v, nib), w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    if constexpr (has_high_bits(T)) {
      for (int g = 0; g < 8; g++) {
        uint64_t bits;
        std::memcpy(&bits, rec + high_at(T) + 8 * g, 8);
        w[g] = _mm512_mask_add_epi8(w[g], _cvtu64_mask64(bits), w[g], _mm512_set1_epi8(16));
      }
    }
  }
}

// Weights from their unsigned quants q (int32 lanes, fifth bit included) and the row's d and m, exactly as
// gguf.quants.dequantize computes them. d * q + m in one fused step rounds once where gguf rounds the product and
// then the sum: the same value, since d * q is exact in float32 (a float16 d's 11 significant bits times 5 bits).
template <int64_t T>
inline __m512 weights_of(__m512i q, __m512 d, __m512 m) {
  if constexpr (T == Q8_0) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(128))), d);
  if constexpr (has_offset(T)) return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(zero_point(T)))));
}

// ---- float32 activations: weights dequantized exactly --------------------------------------------

// f.template operator()<MR>(i) for the rows i..i + MR - 1 of a pass of `rows`, F32_ROWS at a time
template <class F>
void by_f32_rows(int64_t rows, const F& f) {
  for (int64_t i = 0; i < rows; i += F32_ROWS)
    switch (std::min<int64_t>(F32_ROWS, rows - i)) {
      case 1: f.template operator()<1>(i); break;
      case 2: f.template operator()<2>(i); break;
      case 3: f.template operator()<3>(i); break;
      default: f.template operator()<F32_ROWS>(i);
    }
}

// byte t of each int32 lane of w, zero-extended: one in-lane shuffle (a shift and a mask took two, 1.1x the fp32
// K-quant decode's time)
inline __m512i byte_of(__m512i w, int t) {
  const auto at = [t](int lane) { return int32_t(0x80808000u | uint32_t(4 * lane + t)); };  // 0x80: a zero byte
  return _mm512_shuffle_epi8(w, _mm512_set4_epi32(at(3), at(2), at(1), at(0)));
}

// dot products of MR float32 rows of x (KB * 32 each, K apart) with the 16 rows of one regrouped tile: each
// column's 16 weights dequantized as gguf.quants.dequantize gives them, once for the MR rows, times each row's value,
// in four float32 sums a row by column mod 4 (the same sums whatever MR: a row's bits do not depend on the rows
// beside it)
template <int64_t T, int MR>
void dot_f32_rows(const float* x, int64_t K, const uint8_t* rec, int64_t KB, float (*out)[REGROUPED_TILE]) {
  constexpr int64_t R = record_bytes(T);
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < 4; t++) acc[m][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; b++, rec += R) {
    for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
    const __m512 d = scales16(rec), m = has_offset(T) ? scales16(rec + offsets_at) : _mm512_setzero_ps();
    __m512i w[8];
    unpack_weights<T>(rec, w);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++)
      for (int t = 0; t < 4; t++) {
        const __m512i q = byte_of(w[g], t);
        const __m512 weight = weights_of<T>(q, d, m);
        for (int r = 0; r < MR; r++)
          acc[r][t] = _mm512_fmadd_ps(weight, _mm512_set1_ps(x[r * K + b * 32 + 4 * g + t]), acc[r][t]);
      }
  }
  for (int r = 0; r < MR; r++)
    _mm512_storeu_ps(out[r], _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// ---- bfloat16 activations: x quantized per block to int8, integer dot products -----------------

// Rows of x quantized by blocks of 32 as llama.cpp's quantize_row_q8_0 does, with float32 scales: q = round(x / d),
// d = amax / 127. Block-major (block b of row m at q[(b * M + m) * 32], its terms at [b * M + m]), so that the rows
// of a pass lie at fixed distances from one pointer. Per block, besides d: the term of the weights' zero point z,
// -z * sum(q) (Q8_0, Q4_0, Q5_0), or the factor of their offset m, d * sum(q) (Q4_1, Q5_1).
struct XBlocks {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> zero;
  std::vector<float> offset;
};

inline __m512 widened(const c10::BFloat16* p) {  // 16 bfloat16 values as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int64_t T>
XBlocks quantize_rows(const c10::BFloat16* x, int64_t M, int64_t KB) {
  XBlocks xb;
  xb.q.resize(M * KB * 32), xb.d.resize(M * KB);
  if constexpr (has_offset(T))
    xb.offset.resize(M * KB);
  else
    xb.zero.resize(M * KB);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < KB; b++) {
      const c10::BFloat16* xp = x + (m * KB + b) * 32;
      const int64_t at = b * M + m;
      const __m512 lo = widened(xp), hi = widened(xp + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(amax ? 127.0f / amax : 0.0f);
      const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128((__m128i*)(xb.q.data() + at * 32), _mm512_cvtsepi32_epi8(ql));
      _mm_storeu_si128((__m128i*)(xb.q.data() + at * 32 + 16), _mm512_cvtsepi32_epi8(qh));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
      xb.d[at] = d;
      if constexpr (has_offset(T))
        xb.offset[at] = d * float(sum);
      else
        xb.zero[at] = -zero_point(T) * sum;
    }
  return xb;
}

// acc + the dot products of 4-byte groups: w's unsigned bytes times x's 4 int8, broadcast from memory (one
// instruction: compilers load and broadcast apart)
inline __m512i dot_broadcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t*)x), "v"(w));
  return acc;
}

// dot products of MR rows m0.. of quantized x (M rows, KB blocks) with the 16 rows of one tile: each block of
// weights is unpacked once for the MR rows, and one VNNI dot product multiplies 4 columns of x with 4 columns of
// the 16 rows. Per row of x and block the same steps whatever MR is: the block's integer sum, converted once,
// times d * d_x, added in block order (row i's sums in out[i]). One pass over the tile prefetches ONE_ROW_PREFETCH
// bytes ahead of each record (a decode 1.01-1.05x against 4 KiB), but for Q8_0, whose records stream faster on the
// hardware prefetcher alone (1.02-1.06x; the 4- and 5-bit types, with more to unpack a byte, 0.97x without); one of
// several passes steps `ahead` (the next tile's prefetch) once a record.
template <int64_t T, int MR>
void dot_q8_tile(const XBlocks& x, int64_t M, int64_t m0, const uint8_t* rec, int64_t KB,
                 float (*out)[REGROUPED_TILE], lmstack::Prefetch* ahead) {
  constexpr int64_t R = record_bytes(T);
  __m512 acc[MR];
  for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
  const int8_t* xq = x.q.data() + m0 * 32;
  const float* xd = x.d.data() + m0;
  const int32_t* zero = has_offset(T) ? nullptr : x.zero.data() + m0;
  const float* offset = has_offset(T) ? x.offset.data() + m0 : nullptr;
  for (int64_t b = 0; b < KB; b++, rec += R, xq += M * 32, xd += M) {
    if (ahead)
      ahead->step();
    else if constexpr (T != Q8_0)
      for (int64_t line = 0; line < R; line += 64)
        _mm_prefetch((const char*)(rec + ONE_ROW_PREFETCH + line), _MM_HINT_T0);
    const __m512 d = scales16(rec), m = has_offset(T) ? scales16(rec + offsets_at) : _mm512_setzero_ps();
    __m512i w[8];
    unpack_weights<T>(rec, w);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      __m512i dot = has_offset(T) ? _mm512_setzero_si512() : _mm512_set1_epi32(zero[b * M + i]);
      for (int g = 0; g < 8; g++) dot = dot_broadcast(dot, w[g], xq + 32 * i + 4 * g);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xd[i])), acc[i]);
      if constexpr (has_offset(T)) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(offset[b * M + i]), acc[i]);
    }
  }
  for (int i = 0; i < MR; i++) _mm512_storeu_ps(out[i], acc[i]);
}

// dot_q8_tile for `rows` <= MR rows
template <int64_t T, int MR>
void dot_q8_rows(int64_t rows, const XBlocks& x, int64_t M, int64_t m0, const uint8_t* rec, int64_t KB,
                 float (*out)[REGROUPED_TILE], lmstack::Prefetch* ahead) {
  if (rows == MR)
    dot_q8_tile<T, MR>(x, M, m0, rec, KB, out, ahead);
  else if constexpr (MR > 1)
    dot_q8_rows<T, MR - 1>(rows, x, M, m0, rec, KB, out, ahead);
}

// ---- the K-quants ----------------------------------------------------------------------------------
//
// Q2_K and Q3_K: pack_gguf keeps each block as the file stores it and puts the TILE rows' blocks of one column block
// side by side: record (tile, block) = TILE whole blocks. Q4_K, Q5_K, Q6_K are regrouped (below), and their rows'
// blocks put back together where one is dequantized. Each type below says where its fields lie; a whole block goes
// through three steps: its quants unpacked to unsigned bytes in the order of the weights (`unpack`:
// value = byte - OFFSET), its integer sub-block scales and mins (`scales`), its float16 d and dmin. A weight is
// (d * scale) * (byte - OFFSET) - dmin * min in float32, as gguf.quants.dequantize computes it.

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 32 bytes broadcast to both halves of a register, shifted right (per 16-bit lane) by lo bits in the low half and
// hi bits in the high half, masked to `mask`: one 64-byte chunk of bit fields packed 32 bytes apart
inline __m512i fields(const uint8_t* p, int lo, int hi, uint8_t mask) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
  const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(mask));
}

// 128 bytes of nibbles where weight 64c + 32s + l is nibble s of byte 32c + l, as the bytes of weights 64c..64c+63
// in q[c]: each 64-byte load holds two chunks' nibbles
inline void nibbles_by_32(const uint8_t* p, __m512i* q) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int h = 0; h < 2; h++) {
    const __m512i v = _mm512_loadu_si512(p + 64 * h);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    q[2 * h] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
    q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
  }
}

// Q4_K and Q5_K's twelve bytes of 6-bit scales and mins for eight sub-blocks of 32, in each 128-bit lane of v, as
// bytes: the scales, then the mins. Sub-block j < 4 in the low 6 bits of byte j (mins: j + 4), j >= 4 in the low
// (mins: high) nibble of byte j + 4 and the top two bits of byte j - 4 (mins: j)
inline __m512i scales_mins_6bit(__m512i v) {
  // byte j of sixteen: the byte holding its low bits (the high nibble for the mins of j >= 4), then its top two
  __m512i low = _mm512_shuffle_epi8(
      v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
  low = _mm512_mask_blend_epi8(0xF000F000F000F000, low, _mm512_srli_epi16(low, 4));
  const __m512i top = _mm512_shuffle_epi8(
      v, _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
  const __m512i mask =
      _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m512i high = _mm512_and_si512(_mm512_srli_epi16(top, 2), _mm512_set1_epi8(0x30));
  return _mm512_or_si512(_mm512_and_si512(low, mask), high);
}
// one block's, as sixteen 16-bit lanes
inline __m256i scales_mins_6bit(const uint8_t* s) {  // reads 16 bytes: a block holds more after its scales
  const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)s));
  return _mm256_cvtepu8_epi16(_mm512_castsi512_si128(scales_mins_6bit(v)));
}
// the eight scales (half 0) or mins (half 1) of them, zeros past: one computation shared by both calls
template <int HALF>
inline __m256i scales_6bit(const uint8_t* s) {
  return _mm256_zextsi128_si256(_mm256_extracti128_si256(scales_mins_6bit(s), HALF));
}

// GFNI's affine byte map as a bit mover: the matrix (one a 64-bit lane) that puts bit `from + i` of each byte at bit
// `to + i` (i < count) and clears the others
constexpr uint64_t move_bits(int from, int to, int count) {
  uint64_t m = 0;
  for (int i = 0; i < count; i++) m |= uint64_t(1) << (from + i) << 8 * (7 - (to + i));
  return m;
}
// the low nibble of each byte of v (its other bits ignored) beside `high`, whose bits below 4 are ignored and above
// the nibble's own are clear: one ternary logic op, (mask ? v : high)
inline __m512i nibble_with(__m512i v, __m512i high) {
  return _mm512_ternarylogic_epi32(v, high, _mm512_set1_epi8(15), 0xE4);
}
// Q5_K's fifth bits brought to bit 4, for each register of unpack: its low half's group's bit, its high half's
struct FifthBits {
  alignas(64) uint64_t at[4][8];
  constexpr FifthBits() : at() {
    for (int c = 0; c < 4; c++)
      for (int i = 0; i < 8; i++) at[c][i] = move_bits(2 * c + i / 4, 4, 1);
  }
};
constexpr FifthBits FIFTH_BITS{};
inline __m512i lanes(const uint64_t* m) { return _mm512_load_si512(m); }

// Q6_K's two high bits brought to bits 4, 5: of weights 32t + l at bits 2t, for t = 0, 1 (register 0: low half,
// high half) and t = 2, 3 (register 1)
struct HighBits {
  alignas(64) uint64_t at[2][8];
  constexpr HighBits() : at() {
    for (int s = 0; s < 2; s++)
      for (int i = 0; i < 8; i++) at[s][i] = move_bits(2 * (2 * s + i / 4), 4, 2);
  }
};
constexpr HighBits HIGH_BITS{};

struct Q2_K {  // 16 bytes of 4-bit scale and min per 16 weights, 64 bytes of 2-bit quants, d, dmin
  static constexpr int64_t ID = 10, QK = 256, BYTES = 84, SUB = 16, OFFSET = 0, D_AT = 80;
  static constexpr bool MINS = true;
  static void unpack(const uint8_t* b, __m512i* q) {  // weight 128h + 32s + l: bits 2s of byte 32h + l
    for (int c = 0; c < 4; c++) q[c] = fields(b + 16 + 32 * (c / 2), 4 * (c % 2), 4 * (c % 2) + 2, 3);
  }
  static __m256i scales(const uint8_t* b) {
    return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i*)b), _mm_set1_epi8(15)));
  }
  static __m256i mins(const uint8_t* b) {
    const __m128i v = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)b), 4);
    return _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(15)));
  }
  static float d(const uint8_t* b) { return half_at(b + D_AT); }
  static float dmin(const uint8_t* b) { return half_at(b + D_AT + 2); }
};

struct Q3_K {  // 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales (- 32) per 16 weights, d
  static constexpr int64_t ID = 11, QK = 256, BYTES = 110, SUB = 16, OFFSET = 4, D_AT = 108;
  static constexpr bool MINS = false;
  static void unpack(const uint8_t* b, __m512i* q) {  // q = low 2 bits + 4 * high bit: value q - 4
    for (int c = 0; c < 4; c++) {
      const __m512i low = fields(b + 32 + 32 * (c / 2), 4 * (c % 2), 4 * (c % 2) + 2, 3);
      q[c] = _mm512_or_si512(low, _mm512_slli_epi16(fields(b, 2 * c, 2 * c + 1, 1), 2));
    }
  }
  static __m256i scales(const uint8_t* b) {  // sub-block j: low 4 bits in nibble j / 8 of byte 96 + j % 8, high 2
    const uint64_t low8 = uint64_t(u32_at(b + 96)) | uint64_t(u32_at(b + 100)) << 32;  // in bits 2 (j / 4) of
    const uint32_t h = u32_at(b + 104), m = 0x03030303;                                // byte 104 + j % 4
    const __m128i low = _mm_and_si128(_mm_set_epi64x(int64_t(low8 >> 4), int64_t(low8)), _mm_set1_epi8(15));
    const __m128i high = _mm_slli_epi16(_mm_setr_epi32(h & m, (h >> 2) & m, (h >> 4) & m, (h >> 6) & m), 4);
    return _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(low, high)), _mm256_set1_epi16(32));
  }
  static __m256i mins(const uint8_t*) { return _mm256_setzero_si256(); }
  static float d(const uint8_t* b) { return half_at(b + D_AT); }
  static float dmin(const uint8_t*) { return 0.0f; }
};

// Regrouped K-quants (Q4_K, ...): pack_gguf regroups their blocks as the 32-weight types' (see above): record
// (tile, super-block) = the 16 rows' float16 d [and dmin], 16 lanes each, then the rest of each row's block in the
// file's order (ROWS_AT on), 4 bytes of each row in each 64-byte chunk: chunk k holds bytes 4k..4k+3 of the rest, row
// r's at 4r (int32 lane r). A chunk of quants thus holds 4 columns (or 8 nibbles) of the 16 rows, and one VNNI dot
// product with x's 4 values broadcast multiplies 4 columns of all 16 rows. Each type says where its fields lie:
// `part(rec, p, w)` unpacks part p of its quants into REGS registers of unsigned bytes (value = byte - OFFSET),
// `column(p, i)` is the first of the 4 columns register i holds (SUB / 4 registers in a row: one sub-block),
// `scale(rec, j)` is sub-block j's integer scale, `pair(rec, q)` the int16 pair of integers that multiplies the
// pair q of x's sums of sub-blocks (the mins, or Q6_K's scales for its offset), and
// `add` the float step of one super-block, each in int32 or float32 lanes of the 16 rows.
inline __m512i chunk(const uint8_t* rec, int64_t at, int k) { return _mm512_loadu_si512(rec + at + 64 * k); }
inline __m512i bits_of(__m512i v, int from, int count) {  // bits from..from + count - 1 of each int32 lane
  return _mm512_and_si512(_mm512_srli_epi32(v, from), _mm512_set1_epi32((1 << count) - 1));
}
// Q4_K and Q5_K's 6-bit scale (mins: MIN) of sub-block j from the rest's chunks 0, 1, 2 (bytes 0..11 of a row's
// block after d and dmin): j < 4 in the low 6 bits of byte j (mins: j + 4), j >= 4 in the low (mins: high) nibble
// of byte j + 4 and the top two bits of byte j - 4 (mins: j)
template <bool MIN>
inline __m512i scale_6bit(const uint8_t* rest, int j) {
  if (j < 4) return bits_of(chunk(rest, 0, MIN), 8 * j, 6);
  const __m512i high = _mm512_slli_epi32(bits_of(chunk(rest, 0, MIN), 8 * (j - 4) + 6, 2), 4);
  return _mm512_or_si512(bits_of(chunk(rest, 0, 2), 8 * (j - 4) + 4 * MIN, 4), high);
}

// What Q4_K and Q5_K share: a block's d, dmin and 12 bytes of 6-bit scales and mins per 32 weights, before the
// quants. Regrouped: d, dmin, then the rest, which starts with their scales and mins (chunks 0..2); part p of the
// quants: columns 64p.. (sub-block 2p) in w[0..7], 64p + 32.. (2p + 1) in w[8..15]
struct MinsRows {
  static constexpr int64_t QK = 256, SUB = 32, OFFSET = 0, D_AT = 0, SCALES_AT = 4;
  static constexpr bool MINS = true;
  static __m256i scales(const uint8_t* b) { return scales_6bit<0>(b + SCALES_AT); }
  static __m256i mins(const uint8_t* b) { return scales_6bit<1>(b + SCALES_AT); }
  static float d(const uint8_t* b) { return half_at(b + D_AT); }
  static float dmin(const uint8_t* b) { return half_at(b + D_AT + 2); }
  static constexpr int64_t ROWS_AT = 4 * REGROUPED_TILE;
  static constexpr int PARTS = 4, REGS = 16, PAIRS = 4;
  static constexpr int column(int p, int i) { return 64 * p + 32 * (i / 8) + 4 * (i % 8); }
  static __m512i scale(const uint8_t* rec, int j) { return scale_6bit<false>(rec + ROWS_AT, j); }
  static __m512i pair(const uint8_t* rec, int q) {  // (min 2q, min 2q + 1)
    const uint8_t* rest = rec + ROWS_AT;
    return _mm512_or_si512(scale_6bit<true>(rest, 2 * q), _mm512_slli_epi32(scale_6bit<true>(rest, 2 * q + 1), 16));
  }
  // acc + one row of x's terms: d * d_x * (sum_j sc_j * dot_j) - dmin * d_x * (sum_j mn_j * sum(x_j))
  static __m512 add(const uint8_t* rec, __m512 acc, __m512i isum, __m512i pair_sums, float xd) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scales16(rec), _mm512_set1_ps(xd)), acc);
    const __m512 dmin = scales16(rec + 2 * REGROUPED_TILE);
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(pair_sums), _mm512_mul_ps(dmin, _mm512_set1_ps(xd)), acc);
  }
  // sub-block j's float32 factors: scale (d * sc) and min (dmin * mn), for `weights`
  static void factors(const uint8_t* rec, int j, __m512& scale_f, __m512& min_f) {
    scale_f = _mm512_mul_ps(scales16(rec), _mm512_cvtepi32_ps(scale(rec, j)));
    min_f = _mm512_mul_ps(scales16(rec + 2 * REGROUPED_TILE), _mm512_cvtepi32_ps(scale_6bit<true>(rec + ROWS_AT, j)));
  }
  // as gguf.quants.dequantize: (d * sc) * q - dmin * mn, fused: (d * sc) * q is exact in float32 (11 significant
  // bits of the float16 d, 6 of sc, 5 of q), so rounding once gives what rounding the product and the difference gives
  static __m512 weights(__m512 scale_f, __m512 min_f, __m512i q) {
    return _mm512_fmsub_ps(scale_f, _mm512_cvtepi32_ps(q), min_f);
  }
};

struct Q4_K : MinsRows {  // MinsRows' fields, then 128 bytes of nibbles
  static constexpr int64_t ID = 12, BYTES = 144;
  static void unpack(const uint8_t* b, __m512i* q) { nibbles_by_32(b + 16, q); }
  // regrouped: the nibbles in chunks 3..34: weight 64c + l (l < 32) the low nibble of byte 32c + l, 64c + 32 + l
  // its high nibble
  __attribute__((always_inline)) static void part(const uint8_t* rec, int p, __m512i* w) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int g = 0; g < 8; g++) {
      const __m512i v = chunk(rec, ROWS_AT, 3 + 8 * p + g);
      w[g] = _mm512_and_si512(v, low), w[8 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
};

struct Q5_K : MinsRows {  // Q4_K with 32 bytes of high bits (weight 32j + l: bit j of byte l) before the nibbles
  static constexpr int64_t ID = 13, BYTES = 176;
  static void unpack(const uint8_t* b, __m512i* q) {  // the fifth bit of weight 64c + l (l < 64): bit 2c + l / 32
    nibbles_by_32(b + 48, q);                           // of byte 16 + l % 32
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16)));
    for (int c = 0; c < 4; c++)
      q[c] = _mm512_or_si512(q[c], _mm512_gf2p8affine_epi64_epi8(high, lanes(FIFTH_BITS.at[c]), 0));
  }
  // regrouped: the high bits in chunks 3..10, the nibbles in 11..42 (as Q4_K's); part p's fifth bits: bit 2p (low
  // nibbles) and 2p + 1 (high) of chunk 3 + g
  __attribute__((always_inline)) static void part(const uint8_t* rec, int p, __m512i* w) {
    const __m512i low_bit = _mm512_set1_epi64(move_bits(2 * p, 4, 1));
    const __m512i high_bit = _mm512_set1_epi64(move_bits(2 * p + 1, 4, 1));
    for (int g = 0; g < 8; g++) {
      const __m512i v = chunk(rec, ROWS_AT, 11 + 8 * p + g), high = chunk(rec, ROWS_AT, 3 + g);
      w[g] = nibble_with(v, _mm512_gf2p8affine_epi64_epi8(high, low_bit, 0));
      w[8 + g] = nibble_with(_mm512_srli_epi16(v, 4), _mm512_gf2p8affine_epi64_epi8(high, high_bit, 0));
    }
  }
};

struct Q6_K {  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales per 16 weights, d: w = d*sc*(q - 32)
  static constexpr int64_t ID = 14, QK = 256, BYTES = 210, SUB = 16, OFFSET = 32, D_AT = 208;
  static constexpr bool MINS = false;
  static void unpack(const uint8_t* b, __m512i* q) {  // weight 128h + 64s + l (l < 64): nibble s of byte 64h + l;
    for (int h = 0; h < 2; h++) {                    // its high bits: weight 128h + 32t + l: bits 2t of 128 + 32h + l
      const __m512i v = _mm512_loadu_si512(b + 64 * h);  // brought to bits 4, 5
      const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
      q[2 * h] = nibble_with(v, _mm512_gf2p8affine_epi64_epi8(high, lanes(HIGH_BITS.at[0]), 0));
      q[2 * h + 1] =
          nibble_with(_mm512_srli_epi16(v, 4), _mm512_gf2p8affine_epi64_epi8(high, lanes(HIGH_BITS.at[1]), 0));
    }
  }
  static __m256i scales(const uint8_t* b) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192))); }
  static __m256i mins(const uint8_t*) { return _mm256_setzero_si256(); }
  static float d(const uint8_t* b) { return half_at(b + D_AT); }
  static float dmin(const uint8_t*) { return 0.0f; }
  // regrouped: d, then the rest = the low nibbles (chunks 0..31), the high bits (32..47), the scales (48..51)
  static constexpr int64_t ROWS_AT = 2 * REGROUPED_TILE;
  static constexpr int PARTS = 4, REGS = 16, PAIRS = 8;
  // part p = 2h + s: w[g] columns 128h + 32s + 4g (the low nibbles of chunk 16h + 8s + g, high bits 2s of chunk
  // 32 + 8h + g), w[8 + g] columns 128h + 64 + 32s + 4g (its high nibbles, high bits 2s + 4)
  __attribute__((always_inline)) static void part(const uint8_t* rec, int p, __m512i* w) {
    const int h = p / 2, s = p % 2;
    const __m512i low_bits = _mm512_set1_epi64(move_bits(2 * s, 4, 2));
    const __m512i high_bits = _mm512_set1_epi64(move_bits(2 * s + 4, 4, 2));
    for (int g = 0; g < 8; g++) {
      const __m512i v = chunk(rec, ROWS_AT, 16 * h + 8 * s + g), high = chunk(rec, ROWS_AT, 32 + 8 * h + g);
      w[g] = nibble_with(v, _mm512_gf2p8affine_epi64_epi8(high, low_bits, 0));
      w[8 + g] = nibble_with(_mm512_srli_epi16(v, 4), _mm512_gf2p8affine_epi64_epi8(high, high_bits, 0));
    }
  }
  static constexpr int column(int p, int i) { return 128 * (p / 2) + 32 * (p % 2) + 64 * (i / 8) + 4 * (i % 8); }
  static __m512i scale(const uint8_t* rec, int j) {  // int8 sc_j: byte j % 4 of chunk 48 + j / 4
    return _mm512_srai_epi32(_mm512_slli_epi32(chunk(rec, ROWS_AT, 48 + j / 4), 24 - 8 * (j % 4)), 24);
  }
  // pair 2c: (sc_4c, sc_4c+2), pair 2c + 1: (sc_4c+1, sc_4c+3), the int16 halves of chunk 48 + c's lanes; x's sums
  // in that order (sum_slot)
  static __m512i pair(const uint8_t* rec, int q) {
    const __m512i v = chunk(rec, ROWS_AT, 48 + q / 2);
    return q % 2 ? _mm512_srai_epi16(v, 8) : _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
  }
  static constexpr int sum_slot(int j) { return j % 4 == 1 ? j + 1 : j % 4 == 2 ? j - 1 : j; }
  // acc + one row of x's terms: d * d_x * (sum_j sc_j * dot_j - 32 * sum_j sc_j * sum(x_j))
  static __m512 add(const uint8_t* rec, __m512 acc, __m512i isum, __m512i pair_sums, float xd) {
    const __m512i exact = _mm512_sub_epi32(isum, _mm512_slli_epi32(pair_sums, 5));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(scales16(rec), _mm512_set1_ps(xd)), acc);
  }
  static void factors(const uint8_t* rec, int j, __m512& scale_f, __m512& min_f) {
    scale_f = _mm512_mul_ps(scales16(rec), _mm512_cvtepi32_ps(scale(rec, j))), min_f = _mm512_setzero_ps();
  }
  static __m512 weights(__m512 scale_f, __m512, __m512i q) {  // as gguf.quants.dequantize: (d * sc) * (q - 32)
    return _mm512_mul_ps(scale_f, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(OFFSET))));
  }
};

// one row's block, unpacked once for every row of x it meets
template <class T>
struct Unpacked {
  __m512i q[4];  // 64 weights each
  __m256i sc, mn;  // 16 lanes of int16 scales and mins, one a sub-block, zeros past the last
  float d, dmin;
  explicit Unpacked(const uint8_t* b) : sc(T::scales(b)), mn(T::mins(b)), d(T::d(b)), dmin(T::dmin(b)) {
    T::unpack(b, q);
  }
};

// the block's QK weights as float32, each exactly as gguf.quants.dequantize gives it
template <class T>
inline void dequant_block(const uint8_t* b, float* out) {
  const Unpacked<T> u(b);
  alignas(64) uint8_t bytes[256];
  alignas(32) int16_t sc[16], mn[16];
  for (int c = 0; c < 4; c++) _mm512_store_si512(bytes + 64 * c, u.q[c]);
  _mm256_store_si256((__m256i*)sc, u.sc), _mm256_store_si256((__m256i*)mn, u.mn);
  for (int g = 0; g < T::QK / 16; g++) {
    const int j = g * 16 / T::SUB;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(bytes + 16 * g)));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(T::OFFSET)));
    __m512 w = _mm512_mul_ps(_mm512_set1_ps(u.d * float(sc[j])), v);
    if constexpr (T::MINS) w = _mm512_sub_ps(w, _mm512_set1_ps(u.dmin * float(mn[j])));
    _mm512_storeu_ps(out + 16 * g, w);
  }
}

// the block's QK weights as dequant_block gives them, rounded to bfloat16 as store16 rounds (a prefill's GEMM
// takes them): with 32-weight sub-blocks (Q4_K, Q5_K) each sub-block's 32 possible weights computed once, as
// dequant_block computes them, rounded in one op and looked up by quant in one 16-bit permute; else each weight
// computed, 32 rounded in one op
template <class T>
inline void dequant_block_bf16(const uint8_t* b, uint16_t* out) {
  const Unpacked<T> u(b);
  alignas(64) float scale[16], min[16];
  _mm512_store_ps(scale, _mm512_mul_ps(_mm512_set1_ps(u.d), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(u.sc))));
  _mm512_store_ps(min, _mm512_mul_ps(_mm512_set1_ps(u.dmin), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(u.mn))));
  if constexpr (T::SUB == 32) {
    const __m512 iota = _mm512_sub_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                      _mm512_set1_ps(T::OFFSET));
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      const __m512 s = _mm512_set1_ps(scale[j]), m = _mm512_set1_ps(min[j]);
      __m512 low = _mm512_mul_ps(s, iota), high = _mm512_mul_ps(s, _mm512_add_ps(iota, _mm512_set1_ps(16)));
      if constexpr (T::MINS) low = _mm512_sub_ps(low, m), high = _mm512_sub_ps(high, m);
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(high, low);
      const __m256i q = j % 2 ? _mm512_extracti64x4_epi64(u.q[j / 2], 1) : _mm512_castsi512_si256(u.q[j / 2]);
      _mm512_storeu_si512(out + 32 * j, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
    }
  } else {
    alignas(64) uint8_t bytes[256];
    for (int c = 0; c < 4; c++) _mm512_store_si512(bytes + 64 * c, u.q[c]);
#pragma GCC unroll 8
    for (int g = 0; g < T::QK; g += 32) {
      __m512 w[2];
      for (int h = 0; h < 2; h++) {
        const int i = g + 16 * h, j = i / T::SUB;
        const __m512i q = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(bytes + i)));
        w[h] = _mm512_mul_ps(_mm512_set1_ps(scale[j]),
                             _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(T::OFFSET))));
        if constexpr (T::MINS) w[h] = _mm512_sub_ps(w[h], _mm512_set1_ps(min[j]));
      }
      _mm512_storeu_si512(out + g, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
    }
  }
}

// for each register c of DotBlock's quants, the index of the sub-block of each pair of quants (2i, 2i + 1): which of
// the 16-bit scales multiplies that pair's 16-bit product sum
template <class T>
struct PairSubBlocks {
  alignas(64) int16_t lanes[4][32];
  constexpr PairSubBlocks() : lanes() {
    for (int c = 0; c < 4; c++)
      for (int i = 0; i < 32; i++) lanes[c][i] = int16_t((64 * c + 2 * i) / T::SUB);
  }
};
template <class T>
constexpr PairSubBlocks<T> PAIR_SUB_BLOCKS{};

// one row's block as the integer dot products take it, prepared once for every row of x it meets
template <class T>
struct DotBlock {
  __m512i q[4];  // 64 quants each
  __m512i pairs[4];  // the 16-bit scale of each pair of quants in q
  __m256i sc, mn;  // 16 lanes of int16 scales and mins, one a sub-block, zeros past the last
  __m512 scale;  // with mins: d in lanes 0..7, -dmin in 8..15; else d in every lane
  // with PAIR_SUB_BLOCKS' lanes in `index`
  DotBlock(const uint8_t* b, const __m512i* index) : sc(T::scales(b)), mn(T::mins(b)) {
    T::unpack(b, q);
    for (int c = 0; c < 4; c++) pairs[c] = _mm512_permutexvar_epi16(index[c], _mm512_castsi256_si512(sc));
    scale = float_scales(b);
  }
  static __m512 float_scales(const uint8_t* b) {
    if constexpr (T::MINS) {  // dmin follows d
      const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int(u32_at(b + T::D_AT)))));
      const __m512 spread = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                                  both);
      return _mm512_mask_sub_ps(spread, 0xFF00, _mm512_setzero_ps(), spread);
    } else {
      return _mm512_set1_ps(T::d(b));
    }
  }
};

// f(r, DotBlock) for the TILE rows' blocks of one record
template <class T, class F>
inline void for_each_block(const uint8_t* rec, const F& f) {
  __m512i index[4];
  for (int c = 0; c < 4; c++) index[c] = _mm512_load_si512(PAIR_SUB_BLOCKS<T>.lanes[c]);
#pragma GCC unroll 8
  for (int r = 0; r < TILE; r++) f(r, DotBlock<T>(rec + r * T::BYTES, index));
}

// x's rows quantized for the K-quants' integer dot products as llama.cpp's Q8_K: per 256 values, the value of
// largest magnitude, max, gives iscale = -127 / max, q = min(127, rint(iscale * x)), d = 1 / iscale; |q| <= 127.
// Block-major (row m's block b at b * M + m): the rows that one block of weights meets lie together, not a row's
// length apart (rows 8 KiB apart share the L1's sets)
struct XQuant {
  std::vector<int8_t> q;       // per block of 256
  std::vector<float> d;       // per block of 256
  std::vector<int16_t> sums;  // per block, 16 slots: the sums of q over each sub-block of SUB values (sum_slot),
                              // then zeros
};

// where x's sum over sub-block j lies among a block's 16 (the order of T::pair's, where the type says)
template <class T>
constexpr int sum_slot(int j) {
  if constexpr (requires { T::sum_slot(0); })
    return j < T::QK / T::SUB ? T::sum_slot(j) : j;
  else
    return j;
}

template <class T>
void quantize_x(const c10::BFloat16* x, int64_t K, int8_t* q, float* d, int16_t* sums, int64_t M) {
  constexpr int64_t QK = 256, SUB = T::SUB;
  alignas(64) float v[256];
  alignas(64) int32_t sums16[16];
  for (int64_t b = 0; b < K / QK; b++, x += QK, q += QK * M, sums += 16 * M) {  // M: rows of x
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < QK; i += 16) {
      const __m512 f = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + i))), 16));
      _mm512_store_ps(v + i, f);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(f));
    }
    const float a = _mm512_reduce_max_ps(amax);
    int64_t first = 0;
    while (first < QK - 1 && std::fabs(v[first]) != a) first++;  // llama.cpp keeps the first such value
    const float iscale = a ? -127.0f / v[first] : 0.0f;
    d[b * M] = a ? 1 / iscale : 0.0f;
    for (int64_t i = 0; i < QK; i += 16) {
      __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(v + i), _mm512_set1_ps(iscale)));
      qi = _mm512_min_epi32(qi, _mm512_set1_epi32(127));
      _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(qi));
      sums16[i / 16] = _mm512_reduce_add_epi32(qi);
    }
    for (int64_t j = 0; j < 16; j++) {
      int32_t s = 0;
      for (int64_t i = j * SUB / 16; i < (j + 1) * SUB / 16 && j < QK / SUB; i++) s += sums16[i];
      sums[sum_slot<T>(j)] = int16_t(s);  // |s| <= 127 * 32
    }
  }
}

// acc (16 float32 lanes) += one K-quant row's block times one row of quantized x (xq: the block's 256 values, xd
// its scale, xs its sums per sub-block), as llama.cpp's vec_dot for the type: the sub-block dot products of the
// unsigned quants (byte pairs summed to 16 bits, times the 16-bit scales, summed to 32), less OFFSET * sc_j *
// sum(x_j), exact in int32, times d * d_x; less dmin * d_x * sum_j min_j * sum(x_j), the mins' integer sums in the
// upper eight lanes beside the scales' folded to eight
template <class T>
inline __m512 dot_superblock(const DotBlock<T>& u, const int8_t* xq, float xd, const int16_t* xs, __m512 acc) {
  const __m256i xsums = _mm256_loadu_si256((const __m256i*)xs);
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 4; c++)
    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u.q[c], _mm512_loadu_si512(xq + 64 * c)), u.pairs[c]);
  if constexpr (T::OFFSET != 0) {
    static_assert((T::OFFSET & (T::OFFSET - 1)) == 0, "OFFSET is a power of two: a shift multiplies by it");
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(u.sc, xsums), std::countr_zero(uint64_t(T::OFFSET)));
    isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(offset));
  }
  if constexpr (T::MINS) {
    const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
    isum = _mm512_inserti64x4(_mm512_castsi256_si512(folded), _mm256_madd_epi16(u.mn, xsums), 1);
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(u.scale, _mm512_set1_ps(xd)), acc);
}

// rows of x (M, K) times the TILE rows of one tile (its KB records from rec): sums[m * TILE + r]; acc: room for
// M * TILE * 16 float32 partial sums. Each row's sums run in one order whatever M is.
template <class T>
void whole_tile(const at::Tensor& x, const XQuant& xq, const uint8_t* rec, float* sums, float* acc) {
  const int64_t K = x.size(-1), M = x.numel() / K, KB = K / T::QK, R = TILE * T::BYTES;
  const int8_t* xquants = xq.q.data();
  const float* xscales = xq.d.data();
  const int16_t* xsums = xq.sums.data();
  if (x.scalar_type() != at::kFloat && M == 1) {  // a decode's one row of x: the partial sums stay in registers
    __m512 part[TILE];
    for (int r = 0; r < TILE; r++) part[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; b++, rec += R) {
      for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
      for_each_block<T>(rec, [&](int r, const DotBlock<T>& u) {
        part[r] = dot_superblock<T>(u, xquants + b * 256, xscales[b], xsums + b * 16, part[r]);
      });
    }
    for (int r = 0; r < TILE; r++) sums[r] = _mm512_reduce_add_ps(part[r]);
    return;
  }
  std::fill(acc, acc + M * TILE * 16, 0.0f);
  if (x.scalar_type() != at::kFloat) {
    for (int64_t b = 0; b < KB; b++, rec += R) {
      for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
      for_each_block<T>(rec, [&](int r, const DotBlock<T>& u) {
        for (int64_t m = 0; m < M; m++) {
          float* a = acc + (m * TILE + r) * 16;
          const int64_t xb = b * M + m;
          _mm512_storeu_ps(a, dot_superblock<T>(u, xquants + xb * 256, xscales[xb], xsums + xb * 16,
                                                _mm512_loadu_ps(a)));
        }
      });
    }
  } else {
    const float* xf = static_cast<const float*>(x.data_ptr());
    alignas(64) float w[T::QK];
    for (int64_t b = 0; b < KB; b++, rec += R) {
      for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
      for (int r = 0; r < TILE; r++) {
        // the block's weights, each row of x's products with them summed in four chains, added to its sums
        dequant_block<T>(rec + r * T::BYTES, w);
        for (int64_t m = 0; m < M; m++) {
          const float* xb = xf + m * K + b * T::QK;
          __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
          for (int i = 0; i < T::QK; i += 16)
            part[i / 16 % 4] = _mm512_fmadd_ps(_mm512_load_ps(w + i), _mm512_loadu_ps(xb + i), part[i / 16 % 4]);
          float* a = acc + (m * TILE + r) * 16;
          _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(_mm512_add_ps(part[0], part[1]),
                                                                              _mm512_add_ps(part[2], part[3]))));
        }
      }
    }
  }
  for (int64_t i = 0; i < M * TILE; i++) sums[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + i * 16));
}

// f(t0, t1) over the tiles [0, tiles): each thread walks its own contiguous share, one stream the hardware prefetcher
// follows, a chunk at a time; a thread done with its share takes the back half of what is left of another's, so
// that one slowed by memory or another process holds no other at the barrier. A share's bounds lie in one atomic
// word (first tile left, in the low half; end, in the high half): the owner and a taker never claim the same tile.
template <class F>
void shared_tiles(int64_t tiles, int64_t grain, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain);
  if (threads <= 1) return f(0, tiles);
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds;
  };
  std::vector<Share> shares(threads);
  for (int64_t i = 0; i < threads; i++)
    shares[i].bounds.store(uint64_t(i * tiles / threads) | uint64_t((i + 1) * tiles / threads) << 32,
                           std::memory_order_relaxed);
  // [t0, t1) claimed from share i, from its front (owner) or its back; false where it is empty
  auto claim = [&](int64_t i, bool owner, int64_t& t0, int64_t& t1) {
    uint64_t b = shares[i].bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = int64_t(b & 0xffffffffu), hi = int64_t(b >> 32), left = hi - lo;
      if (left <= 0) return false;
      const int64_t size = owner ? std::max<int64_t>(1, left / 4) : (left + 1) / 2;
      t0 = owner ? lo : hi - size, t1 = t0 + size;
      const uint64_t next = owner ? uint64_t(t1) | uint64_t(hi) << 32 : uint64_t(lo) | uint64_t(t0) << 32;
      if (shares[i].bounds.compare_exchange_weak(b, next, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0, t0, t1; i < i1; i++) {
      while (claim(i, true, t0, t1)) f(t0, t1);
      for (int64_t j = (i + 1) % threads; j != i; j = (j + 1) % threads)
        while (claim(j, false, t0, t1)) f(t0, t1);
    }
  });
}

// ---- regrouped K-quants' kernels ---------------------------------------------------------------------

// acc + the dot products of int16 pairs: w's pairs times x's 2 int16, broadcast from memory
inline __m512i dot_pairs_broadcast(__m512i acc, __m512i w, const int16_t* x) {
  asm("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t*)x), "v"(w));
  return acc;
}

// dot products of rows m0..m0 + rows - 1 of quantized x (M rows, block-major) with the 16 rows of one regrouped
// K-quant tile (KB records from rec), as llama.cpp's vec_dot for the type: per row of x and super-block, each
// sub-block's VNNI dot products of the unsigned quants into a fresh int32 lane sum per weight row, times that row's
// sub-block scale, summed in int32; the pairs' term (mins times x's sub-block sums, or Q6_K's offset) in int32 by
// vpdpwssd; then one float step per super-block (T::add) into out[i]'s 16 lanes. Each part of a record is unpacked
// once for all the rows, and each row's steps are the same whatever the rows beside it (ONE: a decode's one row,
// compiled apart so that its sums stay in registers). Prefetch as dot_q8_tile, K_ONE_ROW_PREFETCH bytes ahead
// where one pass reads the tile (a decode 1.02-1.05x against 4 KiB; 3 KiB 0.96x, 8 KiB 0.98-0.99x).
template <class T, bool ONE>
void dot_k_tile(const XQuant& x, int64_t M, int64_t m0, int64_t rows_, const uint8_t* rec, int64_t KB,
                float (*out)[REGROUPED_TILE], lmstack::Prefetch* ahead) {
  constexpr int64_t R = REGROUPED_TILE * T::BYTES;
  constexpr int G = T::SUB / 4, SUBS = T::REGS / G;  // registers of a sub-block, sub-blocks of a part
  constexpr int CHAINS = SUBS < 4 ? 2 : 1;  // dot product chains a sub-block: 4 or more in flight
  const int64_t rows = ONE ? 1 : rows_;
  alignas(64) int32_t isum[MAX_ROWS][REGROUPED_TILE];
  for (int64_t i = 0; i < rows; i++) _mm512_storeu_ps(out[i], _mm512_setzero_ps());
  for (int64_t b = 0; b < KB; b++, rec += R) {
    if (ahead)
      ahead->step();
    else  // a loop: unrolled, the compiler spreads the prefetches among the loads, which streamed slower
      for (int64_t line = 0; line < R; line += 64)
        _mm_prefetch((const char*)(rec + K_ONE_ROW_PREFETCH + line), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < T::PARTS; p++) {
      __m512i w[T::REGS], sc[SUBS];
      T::part(rec, p, w);
      for (int s = 0; s < SUBS; s++) sc[s] = T::scale(rec, T::column(p, G * s) / T::SUB);
      for (int64_t i = 0; i < rows; i++) {
        const int8_t* xq = x.q.data() + (b * M + m0 + i) * 256;
        // each sub-block's dot products in CHAINS chains, the sub-blocks' chains interleaved
        __m512i dot[SUBS][CHAINS];
#pragma GCC unroll 16
        for (int g = 0; g < G; g++)
          for (int s = 0; s < SUBS; s++) {
            const __m512i prior = g < CHAINS ? _mm512_setzero_si512() : dot[s][g % CHAINS];
            dot[s][g % CHAINS] = dot_broadcast(prior, w[G * s + g], xq + T::column(p, G * s + g));
          }
        __m512i sum = p ? _mm512_load_si512(isum[i]) : _mm512_setzero_si512();
        for (int s = 0; s < SUBS; s++) {
          const __m512i whole = CHAINS == 2 ? _mm512_add_epi32(dot[s][0], dot[s][CHAINS - 1]) : dot[s][0];
          sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(whole, sc[s]));
        }
        _mm512_store_si512(isum[i], sum);
      }
    }
    __m512i pairs[T::PAIRS];
    for (int q = 0; q < T::PAIRS; q++) pairs[q] = T::pair(rec, q);
    for (int64_t i = 0; i < rows; i++) {
      const int64_t xb = b * M + m0 + i;
      __m512i pair_sums = _mm512_setzero_si512();
      for (int q = 0; q < T::PAIRS; q++)
        pair_sums = dot_pairs_broadcast(pair_sums, pairs[q], x.sums.data() + xb * 16 + 2 * q);
      const __m512 acc = T::add(rec, _mm512_loadu_ps(out[i]), _mm512_load_si512(isum[i]), pair_sums, x.d[xb]);
      _mm512_storeu_ps(out[i], acc);
    }
  }
}

// Part p of a regrouped K-quant record: its quants in w (T::part) and each of its sub-blocks' float32 factors
// (T::factors), as the float32 dot products and the GEMM's pairs take them
template <class T>
inline void part_with_factors(const uint8_t* rec, int p, __m512i* w, __m512* scale_f, __m512* min_f) {
  constexpr int G = T::SUB / 4, SUBS = T::REGS / G;
  T::part(rec, p, w);
  for (int s = 0; s < SUBS; s++) T::factors(rec, T::column(p, G * s) / T::SUB, scale_f[s], min_f[s]);
}

// dot products of MR float32 rows of x (KB * 256 each, K apart) with the 16 rows of one regrouped K-quant tile: each
// column's 16 weights as gguf.quants.dequantize gives them (T::weights), computed once for the MR rows, times each
// row's value, in four float32 sums a row by column mod 4 (the same sums whatever MR: a row's bits do not depend on
// the rows beside it)
template <class T, int MR>
void dot_k_f32_rows(const float* x, int64_t K, const uint8_t* rec, int64_t KB, float (*out)[REGROUPED_TILE]) {
  constexpr int64_t R = REGROUPED_TILE * T::BYTES;
  constexpr int G = T::SUB / 4, SUBS = T::REGS / G;
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < 4; t++) acc[m][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; b++, rec += R, x += 256) {
    for (int64_t line = 0; line < R; line += 64) _mm_prefetch((const char*)(rec + PREFETCH + line), _MM_HINT_T0);
    for (int p = 0; p < T::PARTS; p++) {
      __m512i w[T::REGS];
      __m512 scale_f[SUBS], min_f[SUBS];
      part_with_factors<T>(rec, p, w, scale_f, min_f);
#pragma GCC unroll 16
      for (int i = 0; i < T::REGS; i++)
        for (int t = 0; t < 4; t++) {
          const __m512i q = byte_of(w[i], t);
          const __m512 weight = T::weights(scale_f[i / G], min_f[i / G], q);
          for (int m = 0; m < MR; m++)
            acc[m][t] = _mm512_fmadd_ps(weight, _mm512_set1_ps(x[m * K + T::column(p, i) + t]), acc[m][t]);
        }
    }
  }
  for (int m = 0; m < MR; m++)
    _mm512_storeu_ps(out[m], _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

// A regrouped K-quant record's float16 fields a row (d, dmin), where the rest of a block starts (after them, or
// before them where they end the block) and its 4-byte words
template <class T>
constexpr int64_t FIELDS = T::ROWS_AT / (2 * REGROUPED_TILE);
template <class T>
constexpr int64_t REST_AT = T::D_AT ? 0 : 2 * FIELDS<T>;
template <class T>
constexpr int64_t REST_WORDS = (T::BYTES - 2 * FIELDS<T>) / 4;

// Row r's float16 fields of a regrouped K-quant record put where its block keeps them
template <class T>
void fields_of_row(const uint8_t* rec, int64_t r, uint8_t* block) {
  for (int64_t f = 0; f < FIELDS<T>; f++)
    std::memcpy(block + T::D_AT + 2 * f, rec + f * 2 * REGROUPED_TILE + 2 * r, 2);
}

// Row r's block of a regrouped K-quant record, as the file stores it: its 4 bytes of 16 chunks in one gather
template <class T>
void block_of_row(const uint8_t* rec, int64_t r, uint8_t* block) {
  constexpr int64_t words = REST_WORDS<T>;
  fields_of_row<T>(rec, r, block);
  uint8_t* rest = block + REST_AT<T>;
  const __m512i at = _mm512_add_epi32(_mm512_set_epi32(960, 896, 832, 768, 704, 640, 576, 512, 448, 384, 320, 256,
                                                       192, 128, 64, 0),
                                      _mm512_set1_epi32(int(4 * r)));
  for (int64_t k = 0; k < words; k += 16) {
    const __mmask16 lanes = words - k >= 16 ? 0xFFFF : __mmask16((1u << (words - k)) - 1);
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, at, rec + T::ROWS_AT + 64 * k, 1);
    _mm512_mask_storeu_epi32(rest + 4 * k, lanes, v);
  }
}

// The 16 rows' blocks of a regrouped K-quant record, as the file stores them: the chunks transposed 16 at a time
template <class T>
void blocks_of_record(const uint8_t* rec, uint8_t (*blocks)[256]) {
  constexpr int64_t words = REST_WORDS<T>, rest = REST_AT<T>;
  for (int64_t r = 0; r < REGROUPED_TILE; r++) fields_of_row<T>(rec, r, blocks[r]);
  for (int k = 0; k < words; k += 16) {
    __m512i v[16];
    for (int j = 0; j < 16; j++) v[j] = k + j < words ? chunk(rec, T::ROWS_AT, k + j) : _mm512_setzero_si512();
    transpose16(v);
    const __mmask16 lanes = words - k >= 16 ? 0xFFFF : __mmask16((1u << (words - k)) - 1);
    for (int r = 0; r < REGROUPED_TILE; r++) _mm512_mask_storeu_epi32(blocks[r] + rest + 4 * k, lanes, v[r]);
  }
}

// The first `rows` rows of a regrouped K-quant record dequantized as a kept block is (to float32, or rounded to
// bfloat16): row r's weights at element at + r * stride of out, the record's 16 blocks put back together at once
template <class T>
void dequant_record(const uint8_t* rec, int64_t rows, void* out, bool bf16, int64_t at, int64_t stride) {
  alignas(64) uint8_t blocks[REGROUPED_TILE][256];
  blocks_of_record<T>(rec, blocks);
  for (int64_t r = 0; r < rows; r++)
    if (bf16)
      dequant_block_bf16<T>(blocks[r], static_cast<uint16_t*>(out) + at + r * stride);
    else
      dequant_block<T>(blocks[r], static_cast<float*>(out) + at + r * stride);
}

// Row n's blocks b0..b1-1 of a regrouped K-quant matrix, dequantized as whole_row dequantizes a kept block
template <class T>
void regrouped_k_row(const uint8_t* wp, int64_t KB, int64_t R, int64_t n, int64_t b0, int64_t b1, void* out,
                     bool bf16, int64_t at) {
  const uint8_t* rec = wp + ((n / REGROUPED_TILE) * KB + b0) * R;
  alignas(64) uint8_t block[256];
  for (int64_t b = b0; b < b1; b++, rec += R) {
    block_of_row<T>(rec, n % REGROUPED_TILE, block);
    const int64_t to = at + (b - b0) * T::QK;
    if (bf16)
      dequant_block_bf16<T>(block, static_cast<uint16_t*>(out) + to);
    else
      dequant_block<T>(block, static_cast<float*>(out) + to);
  }
}

// ---- the table of types ------------------------------------------------------------------------

struct TypeInfo {  // ggml's id, its name, weights per block, rows of a tile, bytes of one (tile, block) record
  int64_t id;
  const char* name;
  int64_t values, rows, record;
};
constexpr TypeInfo regrouped(int64_t id, const char* name) { return {id, name, 32, REGROUPED_TILE, record_bytes(id)}; }
template <class T>
constexpr TypeInfo regrouped_k(const char* name) {
  return {T::ID, name, T::QK, REGROUPED_TILE, REGROUPED_TILE * T::BYTES};
}
template <class T>
constexpr TypeInfo kept_whole(const char* name) { return {T::ID, name, T::QK, TILE, TILE * T::BYTES}; }
constexpr TypeInfo TYPES[] = {
    regrouped(Q8_0, "Q8_0"),  regrouped(Q4_0, "Q4_0"),  regrouped(Q4_1, "Q4_1"),  regrouped(Q5_0, "Q5_0"),
    regrouped(Q5_1, "Q5_1"),  kept_whole<Q2_K>("Q2_K"), kept_whole<Q3_K>("Q3_K"), regrouped_k<Q4_K>("Q4_K"),
    regrouped_k<Q5_K>("Q5_K"), regrouped_k<Q6_K>("Q6_K")};

const TypeInfo& type_info(int64_t type) {
  for (const TypeInfo& t : TYPES)
    if (t.id == type) return t;
  TORCH_CHECK(false, "gguf kernels: ggml type ", type, " has no kernel");
}

// f on the type's kernels: regrouped.operator()<id> for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, regrouped_k.operator()<struct>
// for Q4_K, Q5_K and Q6_K, whole.operator()<struct> for Q2_K and Q3_K
template <typename Regrouped, typename RegroupedK, typename Whole>
void with_gguf_type(int64_t type, const Regrouped& regrouped, const RegroupedK& regrouped_k, const Whole& whole) {
  switch (type) {
    case Q8_0: return regrouped.template operator()<Q8_0>();
    case Q4_0: return regrouped.template operator()<Q4_0>();
    case Q4_1: return regrouped.template operator()<Q4_1>();
    case Q5_0: return regrouped.template operator()<Q5_0>();
    case Q5_1: return regrouped.template operator()<Q5_1>();
    case Q2_K::ID: return whole.template operator()<Q2_K>();
    case Q3_K::ID: return whole.template operator()<Q3_K>();
    case Q4_K::ID: return regrouped_k.template operator()<Q4_K>();
    case Q5_K::ID: return regrouped_k.template operator()<Q5_K>();
    case Q6_K::ID: return regrouped_k.template operator()<Q6_K>();
  }
  type_info(type);  // refuses it by id
}

const TypeInfo& check_packed(const at::Tensor& w, int64_t type, int64_t N, int64_t K) {
  const TypeInfo& t = type_info(type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() && w.dim() == 3,
              "gguf kernels: w must be a contiguous 3-D uint8 CPU tensor");
  TORCH_CHECK(K % t.values == 0, "gguf kernels: ", t.name, " w's rows must be whole blocks of ", t.values,
              " columns, got ", K);
  const int64_t tiles = (N + t.rows - 1) / t.rows;
  TORCH_CHECK(w.size(0) == tiles && w.size(1) == K / t.values && w.size(2) == t.record,
              "gguf kernels: ", t.name, " w of ", N, " rows and ", K, " columns must be packed as (", tiles, ", ",
              K / t.values, ", ", t.record, "), got ", w.sizes());
  return t;
}

// y = x @ w.T + bias for packed GGUF blocks w of `type` (N rows, K = x.size(-1) columns); x float32 or bfloat16,
// bias and y in x's dtype
at::Tensor gguf_matvec(const at::Tensor& x_, const at::Tensor& w, int64_t type, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "gguf_matvec: x must be a CPU tensor");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  const TypeInfo& info = check_packed(w, type, N, K);
  const int64_t QK = info.values, KB = K / QK, R = w.size(2), tiles = w.size(0);
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 || x.scalar_type() == at::kBFloat16, "gguf_matvec: x must be float32 or bfloat16");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N &&
                    bias->scalar_type() == x.scalar_type(),
                "gguf_matvec: bias must be a contiguous vector of ", N, " ", x.scalar_type());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t grain = std::max<int64_t>(1, TASK_WEIGHTS / (info.rows * std::max<int64_t>(K, 1)));
  // row m's sums for the `rows` rows of w from n, plus the bias, into y
  auto emit = [&](int64_t m, int64_t n, int64_t rows, const float* sums) {
    if (f32) {
      float* yp = static_cast<float*>(y.data_ptr()) + m * N + n;
      const float* bp = bias.has_value() ? static_cast<const float*>(bias->data_ptr()) + n : nullptr;
      for (int64_t r = 0; r < rows; r++) yp[r] = bp ? sums[r] + bp[r] : sums[r];
    } else {
      auto* yp = static_cast<c10::BFloat16*>(y.data_ptr()) + m * N + n;
      const auto* bp = bias.has_value() ? static_cast<const c10::BFloat16*>(bias->data_ptr()) + n : nullptr;
      for (int64_t r = 0; r < rows; r++) yp[r] = c10::BFloat16(bp ? sums[r] + float(bp[r]) : sums[r]);
    }
  };
  const auto* xbf = f32 ? nullptr : static_cast<const c10::BFloat16*>(x.data_ptr());
  // the tiles of a regrouped type (REGROUPED_TILE rows each), handed out by share(tiles, grain, f): each tile's rows
  // of x in passes of MAX_ROWS, dot(m0, rows, record, sums, ahead) a pass's products (the next tile prefetched
  // across the passes where there are many rows)
  auto in_passes = [&](const auto& share, const auto& dot) {
    const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
    share(tiles, grain, [&](int64_t t0, int64_t t1) {
      float sums[MAX_ROWS][REGROUPED_TILE];
      for (int64_t t = t0; t < t1; t++) {
        const uint8_t* rec = wp + t * KB * R;
        const int64_t n = t * REGROUPED_TILE, rows = std::min(REGROUPED_TILE, N - n);
        lmstack::Prefetch next(rec + KB * R, KB * R, (R + passes - 1) / passes);
        lmstack::Prefetch* ahead = M > 1 ? &next : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
          const int64_t block = std::min<int64_t>(MAX_ROWS, M - m0);
          dot(m0, block, rec, sums, ahead);
          for (int64_t i = 0; i < block; i++) emit(m0 + i, n, rows, sums[i]);
        }
      }
    });
  };
  const auto* xf = f32 ? static_cast<const float*>(x.data_ptr()) : nullptr;
  auto regrouped = [&]<int64_t T>() {
    const XBlocks xb = f32 ? XBlocks() : quantize_rows<T>(xbf, M, KB);
    auto equal_shares = [](int64_t n, int64_t g, const auto& f) { at::parallel_for(0, n, g, f); };
    in_passes(equal_shares, [&](int64_t m0, int64_t block, const uint8_t* rec, float (*sums)[REGROUPED_TILE],
                                lmstack::Prefetch* ahead) {
      if (f32)
        by_f32_rows(block, [&]<int MR>(int64_t i) { dot_f32_rows<T, MR>(xf + (m0 + i) * K, K, rec, KB, sums + i); });
      else
        dot_q8_rows<T, MAX_ROWS>(block, xb, M, m0, rec, KB, sums, ahead);
    });
  };
  // x quantized as llama.cpp's Q8_K for the K-quants, block-major (none for float32 x)
  auto quantized = [&]<class T>() {
    XQuant xq;
    if (!f32) {
      xq.q.resize(M * K), xq.d.resize(M * KB), xq.sums.resize(M * KB * 16);
      for (int64_t m = 0; m < M; m++)
        quantize_x<T>(xbf + m * K, K, xq.q.data() + m * 256, xq.d.data() + m, xq.sums.data() + m * 16, M);
    }
    return xq;
  };
  auto regrouped_k = [&]<class T>() {
    const XQuant xq = quantized.template operator()<T>();
    auto shared = [](int64_t n, int64_t g, const auto& f) { shared_tiles(n, g, f); };
    in_passes(shared, [&](int64_t m0, int64_t block, const uint8_t* rec, float (*sums)[REGROUPED_TILE],
                          lmstack::Prefetch* ahead) {
      if (f32)
        by_f32_rows(block, [&]<int MR>(int64_t i) { dot_k_f32_rows<T, MR>(xf + (m0 + i) * K, K, rec, KB, sums + i); });
      else
        (block == 1 ? dot_k_tile<T, true> : dot_k_tile<T, false>)(xq, M, m0, block, rec, KB, sums, ahead);
    });
  };
  auto whole = [&]<class T>() {
    const XQuant xq = quantized.template operator()<T>();
    shared_tiles(tiles, grain, [&](int64_t t0, int64_t t1) {
      std::vector<float> sums(M * TILE);
      std::vector<float> acc(M * TILE * 16);
      for (int64_t t = t0; t < t1; t++) {
        const int64_t n = t * TILE, rows = std::min(TILE, N - n);
        whole_tile<T>(x, xq, wp + t * KB * R, sums.data(), acc.data());
        for (int64_t m = 0; m < M; m++) emit(m, n, rows, sums.data() + m * TILE);
      }
    });
  };
  with_gguf_type(type, regrouped, regrouped_k, whole);
  return y;
}

// Q5_0 and Q5_1's fifth bits of row r's weights 0..15 (half 0) or 16..31 (half 1), bit j the bit of weight
// 16 * half + j
template <int64_t T>
inline uint16_t row_high(const uint8_t* rec, int64_t r, int half) {
  uint16_t bits = 0;
  for (int k = 0; k < 4; k++) {
    uint64_t group;
    std::memcpy(&group, rec + high_at(T) + 8 * (4 * half + k), 8);
    bits |= uint16_t((group >> (4 * r)) & 0xF) << (4 * k);
  }
  return bits;
}

// Row n's blocks b0..b1-1 of a packed matrix (KB blocks a row, R bytes a tile's block), dequantized into out from
// element `at` on, as float32 or bfloat16: for a 32-weight type, regrouped (Q8_0, Q4_0, ...), and for a K-quant
// whose blocks stay whole (Q2_K, Q3_K)
template <int64_t T>
void regrouped_row(const uint8_t* wp, int64_t KB, int64_t R, int64_t n, int64_t b0, int64_t b1, void* out,
                   bool bf16, int64_t at) {
  const int64_t r = n % REGROUPED_TILE;
  const uint8_t* rec = wp + ((n / REGROUPED_TILE) * KB + b0) * R;
  for (int64_t b = b0; b < b1; b++, rec += R) {
    const __m512 d = _mm512_set1_ps(half_at(rec + 2 * r));
    const __m512 m = has_offset(T) ? _mm512_set1_ps(half_at(rec + offsets_at + 2 * r)) : _mm512_setzero_ps();
    for (int half = 0; half < 2; half++) {
      // the row's 16 bytes in the file's order: Q8_0's quants 16 * half.. (as q + 128), the others' nibble bytes
      const uint8_t* q = rec + quants_at(T) + 4 * r + (T == Q8_0 ? 256 * half : 0);
      __m128i v = _mm_setr_epi32(int(u32_at(q)), int(u32_at(q + 64)), int(u32_at(q + 128)), int(u32_at(q + 192)));
      if constexpr (T != Q8_0) v = _mm_and_si128(half ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
      __m512i quants = _mm512_cvtepu8_epi32(v);
      if constexpr (has_high_bits(T))
        quants = _mm512_or_si512(quants, _mm512_maskz_set1_epi32(row_high<T>(rec, r, half), 16));
      lmstack::store16(out, bf16, at + (b - b0) * 32 + 16 * half, weights_of<T>(quants, d, m));
    }
  }
}

template <class T>
void whole_row(const uint8_t* wp, int64_t KB, int64_t R, int64_t n, int64_t b0, int64_t b1, void* out, bool bf16,
               int64_t at) {
  const uint8_t* block = wp + ((n / TILE) * KB + b0) * R + (n % TILE) * T::BYTES;
  for (int64_t b = b0; b < b1; b++, block += R) {
    const int64_t to = at + (b - b0) * T::QK;
    if (bf16)
      dequant_block_bf16<T>(block, static_cast<uint16_t*>(out) + to);
    else
      dequant_block<T>(block, static_cast<float*>(out) + to);
  }
}

// Rows `rows` (int64, any shape; None: every row) of packed blocks w dequantized to float32, exactly as
// gguf.quants.dequantize gives them, or those values rounded to bfloat16: shape rows.shape + (K,)
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t N, int64_t K,
                           const std::optional<at::Tensor>& rows_, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_dequantize: dtype must be float32 or bfloat16");
  const int64_t QK = check_packed(w, type, N, K).values, KB = K / QK, R = w.size(2);
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
  const int64_t count = out.numel() / std::max<int64_t>(K, 1);
  const int64_t* rp = rows_.has_value() ? rows.data_ptr<int64_t>() : nullptr;
  if (rp)
    for (int64_t i = 0; i < count; i++) TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "gguf_dequantize: row ", rp[i], " of ", N);
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const bool bf16 = dtype == at::kBFloat16;
  void* op = out.data_ptr();
  const int64_t grain = std::max<int64_t>(1, TASK_WEIGHTS / std::max<int64_t>(K, 1));
  auto regrouped = [&]<int64_t T>() {
    at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) regrouped_row<T>(wp, KB, R, rp ? rp[i] : i, 0, KB, op, bf16, i * K);
    });
  };
  auto regrouped_k = [&]<class T>() {
    if (rp) {
      at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) regrouped_k_row<T>(wp, KB, R, rp[i], 0, KB, op, bf16, i * K);
      });
      return;
    }
    // every row: each record's 16 blocks put back together at once, then dequantized as a kept block
    at::parallel_for(0, w.size(0), std::max<int64_t>(1, grain / REGROUPED_TILE), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < KB; b++)
          dequant_record<T>(wp + (t * KB + b) * R, std::min(N - t * REGROUPED_TILE, REGROUPED_TILE), op, bf16,
                            t * REGROUPED_TILE * K + b * QK, K);
    });
  };
  auto whole = [&]<class T>() {
    at::parallel_for(0, count, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) whole_row<T>(wp, KB, R, rp ? rp[i] : i, 0, KB, op, bf16, i * K);
    });
  };
  with_gguf_type(type, regrouped, regrouped_k, whole);
  return out;
}

// y = x @ w.T + bias for many rows of float32 x (a prefill in the fp32 profile): a panel of rows and a block of
// columns at a time dequantized exactly as gguf_dequantize gives them, into a buffer that stays in cache, for
// kernels_gemm.cpp's GEMM; the weights are read once, never widened to a whole dense matrix. A regrouped K-quant
// panel is two tiles, each record's 16 rows dequantized at once; the others a row at a time.
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t N,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_gemm: x must be float32 (bfloat16 rows take gguf_matvec)");
  const int64_t K = x.size(-1), QK = check_packed(w, type, N, K).values, KB = K / QK, R = w.size(2);
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  constexpr int64_t PANEL = lmstack::GEMM_PANEL;
  at::Tensor y;
  // the panel's rows below N, fill(n0, b0, b1, rows) writing each row's blocks b0..b1 - 1 at rows + i * kc (the
  // GEMM's columns take zeros past N)
  auto panels = [&](const auto& fill) {
    y = lmstack::gemm_f32(x, N, QK, bias, [&](int64_t n0, int64_t k0, int64_t kc, uint32_t* out) {
      thread_local std::vector<float> rows;
      rows.resize(PANEL * kc);
      fill(n0, k0 / QK, (k0 + kc) / QK, rows.data());
      lmstack::columns_of_rows(rows.data(), kc, std::min(PANEL, N - n0), kc, out);
    });
  };
  auto by_rows = [&](const auto& row) {  // a row at a time
    panels([&](int64_t n0, int64_t b0, int64_t b1, float* rows) {
      const int64_t kc = (b1 - b0) * QK;
      for (int64_t i = 0; i < std::min(PANEL, N - n0); i++) row(n0 + i, b0, b1, rows + i * kc);
    });
  };
  auto regrouped = [&]<int64_t T>() {
    by_rows([&](int64_t n, int64_t b0, int64_t b1, float* o) {
      regrouped_row<T>(wp, KB, R, n, b0, b1, o, false, 0);
    });
  };
  auto regrouped_k = [&]<class T>() {  // a record's 16 rows at once (dequant_record)
    panels([&](int64_t n0, int64_t b0, int64_t b1, float* rows) {
      const int64_t kc = (b1 - b0) * QK;
      for (int64_t i = 0; i < PANEL && n0 + i < N; i += REGROUPED_TILE)
        for (int64_t b = b0; b < b1; b++)
          dequant_record<T>(wp + ((n0 + i) / REGROUPED_TILE * KB + b) * R, REGROUPED_TILE, rows, false,
                            i * kc + (b - b0) * QK, kc);
    });
  };
  auto whole = [&]<class T>() {
    by_rows([&](int64_t n, int64_t b0, int64_t b1, float* o) {
      whole_row<T>(wp, KB, R, n, b0, b1, o, false, 0);
    });
  };
  with_gguf_type(type, regrouped, regrouped_k, whole);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("gguf_matvec(Tensor x, Tensor w, int type, int n, Tensor? bias) -> Tensor", gguf_matvec);
  m.def("gguf_dequantize(Tensor w, int type, int n, int k, Tensor? rows, ScalarType dtype) -> Tensor",
        gguf_dequantize);
  m.def("gguf_gemm(Tensor x, Tensor w, int type, int n, Tensor? bias) -> Tensor", gguf_gemm);
}
