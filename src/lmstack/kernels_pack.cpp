// GGUF blocks put in the order kernels_gguf.cpp reads them (kernels.py's pack_gguf, which describes the layout;
// its PyTorch version is the reference): the file's rows written straight into the packed buffer, a chunk of rows
// at a time. PyTorch's pad, reshape and cat copies of the same regrouping took most of a 1.7B model's load.
#include "kernels.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

using lmstack::REGROUPED_TILE;
using lmstack::TILE;

// Row r of a (tile, block) record from one block of the file, src (or a padding row of zeros: src null), for a
// type kept whole (SCALES 0: the TILE rows' blocks side by side) or regrouped (REGROUPED_TILE rows): its SCALES
// float16 fields of the rows, field by field, [FIFTH: the fifth bits, for each group g of 4 columns 64 bits, bit
// 4r + t the bit of row r's column 4g + t,] then the quants in 64-byte chunks, row r's 4 bytes at 4r of each:
// the nibble bytes 4k..4k+3 in chunk k, Q8's quants 4g..4g+3 (as q + 128) in chunk g
template <int SCALES, bool FIFTH, bool Q8>
inline void put(uint8_t* rec, int64_t r, const uint8_t* src, int64_t block) {
  static const uint8_t zeros[256] = {};
  if (!src) src = zeros;
  if constexpr (SCALES == 0) {
    std::memcpy(rec + r * block, src, block);
  } else {
    for (int f = 0; f < SCALES; f++) std::memcpy(rec + f * 2 * REGROUPED_TILE + r * 2, src + f * 2, 2);
    uint8_t* at = rec + SCALES * 2 * REGROUPED_TILE;
    const uint8_t* q = src + 2 * SCALES;
    if constexpr (FIFTH) {
      uint32_t bits;
      std::memcpy(&bits, q, 4);
      const int shift = 4 * (r % 2);
      for (int g = 0; g < 8; g++) {
        uint8_t& byte = at[8 * g + r / 2];
        byte = uint8_t((byte & ~(0x0F << shift)) | ((bits >> (4 * g)) & 0x0F) << shift);
      }
      at += 64, q += 4;
    }
    for (int g = 0; g < (Q8 ? 8 : 4); g++) {
      uint32_t four;
      std::memcpy(&four, q + 4 * g, 4);
      if constexpr (Q8) four ^= 0x80808080u;
      std::memcpy(at + 64 * g + 4 * r, &four, 4);
    }
  }
}

template <int SCALES, bool FIFTH, bool Q8>
void pack(const uint8_t* in, int64_t row, int64_t rows, int64_t n, int64_t KB, int64_t block, uint8_t* out) {
  constexpr int64_t T = SCALES ? REGROUPED_TILE : TILE;
  const int64_t R = T * block;
  const int64_t last = row + rows == n ? (n + T - 1) / T * T : row + rows;  // with the padding rows
  for (int64_t t = row / T; t * T < last; t++) {
    const int64_t r0 = std::max(row, t * T), r1 = std::min(last, (t + 1) * T);
    for (int64_t b = 0; b < KB; b++)
      for (int64_t g = r0; g < r1; g++)
        put<SCALES, FIFTH, Q8>(out + (t * KB + b) * R, g % T,
                               g < row + rows ? in + (g - row) * KB * block + b * block : nullptr, block);
  }
}

// raw (rows, KB * block) uint8: rows row..row + rows - 1 of an n-row tensor, packed into their records of out
// (ceil(n / tile), KB, tile * block), tile TILE or (regrouped) REGROUPED_TILE; the one that reaches row n - 1 also
// writes the padding rows after it
void pack_gguf_into(const at::Tensor& raw, at::Tensor& out, int64_t row, int64_t n, int64_t block, bool regrouped,
                    int64_t scales, bool fifth_bits, bool q8_halves) {
  const int64_t quants = block - 2 * scales - (fifth_bits ? 4 : 0);
  const bool q8_0 = scales == 1 && !fifth_bits && quants == 32;
  TORCH_CHECK(regrouped ? (q8_halves ? q8_0 : (scales == 1 || scales == 2) && quants == 16) : block > 0 && block <= 256,
              "pack_gguf: no such block layout");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 && raw.size(1) % block == 0,
              "pack_gguf: raw must be contiguous (rows, blocks * ", block, ") uint8");
  const int64_t rows = raw.size(0), KB = raw.size(1) / block;
  TORCH_CHECK(row >= 0 && row + rows <= n, "pack_gguf: rows ", row, "..", row + rows, " of ", n);
  const int64_t tile = regrouped ? REGROUPED_TILE : TILE, tiles = (n + tile - 1) / tile;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 3 && out.size(0) == tiles &&
                  out.size(1) == KB && out.size(2) == tile * block,
              "pack_gguf: out must be contiguous (", tiles, ", ", KB, ", ", tile * block, ") uint8, got ", out.sizes());
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (!regrouped)
    pack<0, false, false>(in, row, rows, n, KB, block, dst);
  else if (q8_halves)
    pack<1, false, true>(in, row, rows, n, KB, block, dst);
  else if (scales == 1)
    (fifth_bits ? pack<1, true, false> : pack<1, false, false>)(in, row, rows, n, KB, block, dst);
  else
    (fifth_bits ? pack<2, true, false> : pack<2, false, false>)(in, row, rows, n, KB, block, dst);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("pack_gguf_into(Tensor raw, Tensor(a!) out, int row, int n, int block, bool regrouped, int scales, "
        "bool fifth_bits, bool q8_halves) -> ()",
        pack_gguf_into);
}
