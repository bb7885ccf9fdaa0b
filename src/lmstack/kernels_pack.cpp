// GGUF blocks put in the order kernels_gguf.cpp reads them (kernels.py's pack_gguf, which describes the layout;
// its PyTorch version is the reference): the file's rows written straight into the packed buffer, a chunk of rows
// at a time. PyTorch's pad, reshape and cat copies of the same regrouping took most of a 1.7B model's load.
#include "kernels.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

using lmstack::TILE;

// The layout of one block type in a record of TILE rows (kernels.py's BlockType): whole blocks side by side, or
// regrouped: the `scales` float16 fields of the TILE rows, field by field, [the fifth bits: for each four rows,
// their 16 bits of weights 0..15, then of 16..31,] then the rows' quants (`q8_halves`: Q8_0's, stored as q + 128
// and by halves, 64 bytes holding weights 0..15 or 16..31 of four rows).
struct Layout {
  int64_t block;
  bool regrouped;
  int64_t scales;
  bool fifth_bits, q8_halves;

  // row r of a record from one block of the file (src), or a padding row of zeros (src null)
  void put(uint8_t* rec, int64_t r, const uint8_t* src) const {
    static const uint8_t zeros[256] = {};
    if (!src) src = zeros;
    if (!regrouped) {
      std::memcpy(rec + r * block, src, block);
      return;
    }
    for (int64_t f = 0; f < scales; f++) std::memcpy(rec + f * 2 * TILE + r * 2, src + f * 2, 2);
    uint8_t* at = rec + scales * 2 * TILE;
    const uint8_t* q = src + 2 * scales;
    if (fifth_bits) {
      for (int h = 0; h < 2; h++) std::memcpy(at + ((r / 4 * 2 + h) * 4 + r % 4) * 2, q + h * 2, 2);
      at += 32, q += 4;
    }
    const int64_t quants = block - (q - src);
    if (!q8_halves) {
      std::memcpy(at + r * quants, q, quants);
      return;
    }
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < 16; j++) at[((r / 4 * 2 + h) * 4 + r % 4) * 16 + j] = q[h * 16 + j] ^ 0x80;
  }
};

// raw (rows, KB * block) uint8: rows row..row + rows - 1 of an n-row tensor, packed into their records of out
// (ceil(n / TILE), KB, TILE * block); the one that reaches row n - 1 also writes the padding rows after it
void pack_gguf_into(const at::Tensor& raw, at::Tensor& out, int64_t row, int64_t n, int64_t block, bool regrouped,
                    int64_t scales, bool fifth_bits, bool q8_halves) {
  const Layout layout{block, regrouped, scales, fifth_bits, q8_halves};
  const int64_t head = 2 * scales + (fifth_bits ? 4 : 0);
  TORCH_CHECK(block > 0 && block <= 256 && (!regrouped || (head < block && (!q8_halves || block - head == 32))),
              "pack_gguf: no such block layout");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 && raw.size(1) % block == 0,
              "pack_gguf: raw must be contiguous (rows, blocks * ", block, ") uint8");
  const int64_t rows = raw.size(0), KB = raw.size(1) / block, R = TILE * block;
  TORCH_CHECK(row >= 0 && row + rows <= n, "pack_gguf: rows ", row, "..", row + rows, " of ", n);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == (n + TILE - 1) / TILE && out.size(1) == KB && out.size(2) == R,
              "pack_gguf: out must be contiguous (", (n + TILE - 1) / TILE, ", ", KB, ", ", R, ") uint8, got ",
              out.sizes());
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t last = row + rows == n ? (n + TILE - 1) / TILE * TILE : row + rows;  // with the padding rows
  for (int64_t t = row / TILE; t * TILE < last; t++) {
    const int64_t r0 = std::max(row, t * TILE), r1 = std::min(last, (t + 1) * TILE);
    for (int64_t b = 0; b < KB; b++)
      for (int64_t g = r0; g < r1; g++)
        layout.put(dst + (t * KB + b) * R, g % TILE, g < row + rows ? in + (g - row) * KB * block + b * block : nullptr);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("pack_gguf_into(Tensor raw, Tensor(a!) out, int row, int n, int block, bool regrouped, int scales, "
        "bool fifth_bits, bool q8_halves) -> ()",
        pack_gguf_into);
}
