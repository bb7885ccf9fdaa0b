// GGUF blocks put in the order kernels_gguf.cpp reads them (kernels.py's pack_gguf, which describes the layout;
// its PyTorch version is the reference): the file's rows written straight into the packed buffer, a chunk of rows
// at a time. PyTorch's pad, reshape and cat copies of the same regrouping took most of a 1.7B model's load.
// The tiles of a chunk are split over PyTorch's threads: writing them is also the first touch of the packed
// buffer's pages, whose faults (zeroing a fresh page each) cost about as much as the copying.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace {

using lmstack::REGROUPED_TILE;
using lmstack::TILE;

constexpr int64_t PACK_TASK_BYTES = 256 << 10;  // packed bytes a thread takes at a time

// Row r of a (tile, block) record from one block of the file, src (or a padding row of zeros: src null), for a
// type kept whole (SCALES 0: the TILE rows' blocks side by side) or regrouped (REGROUPED_TILE rows): its SCALES
// float16 fields of the rows (at byte `scales_at` of a block), field by field, [FIFTH: the fifth bits, for each
// group g of 4 columns 64 bits, bit 4r + t the bit of row r's column 4g + t,] then the block's other bytes, the
// quants (`quants` of them, in the block's order), in 64-byte chunks, row r's 4 bytes at 4r of each: chunk k holds
// bytes 4k..4k+3 (Q8_0's as q + 128)
template <int SCALES, bool FIFTH, bool Q8>
inline void put(uint8_t* rec, int64_t r, const uint8_t* src, int64_t block, int64_t scales_at, int64_t quants) {
  static const uint8_t zeros[256] = {};
  if (!src) src = zeros;
  if constexpr (SCALES == 0) {
    std::memcpy(rec + r * block, src, block);
  } else {
    for (int f = 0; f < SCALES; f++) std::memcpy(rec + f * 2 * REGROUPED_TILE + r * 2, src + scales_at + f * 2, 2);
    uint8_t* at = rec + SCALES * 2 * REGROUPED_TILE;
    const uint8_t* q = src + (scales_at ? 0 : 2 * SCALES);
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
    for (int64_t g = 0; g < quants / 4; g++) {
      uint32_t four;
      std::memcpy(&four, q + 4 * g, 4);
      if constexpr (Q8) four ^= 0x80808080u;
      std::memcpy(at + 64 * g + 4 * r, &four, 4);
    }
  }
}

template <int SCALES, bool FIFTH, bool Q8>
void pack(const uint8_t* in, int64_t row, int64_t rows, int64_t n, int64_t KB, int64_t block, int64_t scales_at,
          int64_t quants, uint8_t* out) {
  constexpr int64_t T = SCALES ? REGROUPED_TILE : TILE;
  const int64_t R = T * block;
  const int64_t last = row + rows == n ? (n + T - 1) / T * T : row + rows;  // with the padding rows
  at::parallel_for(row / T, (last + T - 1) / T, std::max<int64_t>(1, PACK_TASK_BYTES / (R * KB)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t r0 = std::max(row, t * T), r1 = std::min(last, (t + 1) * T);
      for (int64_t b = 0; b < KB; b++)
        for (int64_t g = r0; g < r1; g++)
          put<SCALES, FIFTH, Q8>(out + (t * KB + b) * R, g % T,
                                 g < row + rows ? in + (g - row) * KB * block + b * block : nullptr, block,
                                 scales_at, quants);
    }
  });
}

// raw (rows, KB * block) uint8: rows row..row + rows - 1 of an n-row tensor, packed into their records of out
// (ceil(n / tile), KB, tile * block), tile TILE or (regrouped) REGROUPED_TILE; the one that reaches row n - 1 also
// writes the padding rows after it. A regrouped block's `scales` float16 fields lie at its start or (scales_at > 0)
// its end.
void pack_gguf_into(const at::Tensor& raw, at::Tensor& out, int64_t row, int64_t n, int64_t block, bool regrouped,
                    int64_t scales, int64_t scales_at, bool fifth_bits, bool q8_halves) {
  const int64_t quants = block - 2 * scales - (fifth_bits ? 4 : 0);
  const bool q8_0 = scales == 1 && !fifth_bits && quants == 32;
  TORCH_CHECK(regrouped ? (q8_halves ? q8_0 && scales_at == 0
                                     : (scales == 1 || scales == 2) && quants > 0 && quants % 4 == 0 &&
                                           (scales_at == 0 || (!fifth_bits && scales_at == block - 2 * scales)))
                        : block > 0 && block <= 256,
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
    pack<0, false, false>(in, row, rows, n, KB, block, 0, 0, dst);
  else if (q8_halves)
    pack<1, false, true>(in, row, rows, n, KB, block, 0, quants, dst);
  else if (scales == 1)
    (fifth_bits ? pack<1, true, false> : pack<1, false, false>)(in, row, rows, n, KB, block, scales_at, quants, dst);
  else
    (fifth_bits ? pack<2, true, false> : pack<2, false, false>)(in, row, rows, n, KB, block, scales_at, quants, dst);
}

// The first block of raw (rows, blocks * block bytes) whose float16 at byte `at` is inf or nan (its exponent bits
// all set), as row * blocks + block; -1 where there is none. NumPy's strided copy and compare took longer than
// the packing.
int64_t first_nonfinite_float16(const at::Tensor& raw, int64_t block, int64_t at) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && block > 0 && at >= 0 && at + 2 <= block &&
                  raw.numel() % block == 0,
              "first_nonfinite_float16: raw must be contiguous uint8 whole blocks, with the field inside a block");
  const uint8_t* p = raw.data_ptr<uint8_t>() + at;
  const int64_t count = raw.numel() / block;
  for (int64_t i = 0; i < count; i++) {
    uint16_t h;
    std::memcpy(&h, p + i * block, 2);
    if ((h & 0x7C00) == 0x7C00) return i;
  }
  return -1;
}

// out (contiguous) filled from file descriptor fd at offset, its parts read by PyTorch's threads at once: one
// pread copies from the page cache on one core, a fifth of a 1.7B model's load. The bytes read (fewer where the
// file ends first), or -errno.
int64_t pread_parallel(int64_t fd, int64_t offset, at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && offset >= 0, "pread_parallel: out must be contiguous, offset not negative");
  constexpr int64_t PART = 256 << 10;
  uint8_t* p = static_cast<uint8_t*>(out.data_ptr());
  const int64_t n = out.nbytes();
  std::atomic<int64_t> read_to{n};
  std::atomic<int> error{0};
  at::parallel_for(0, (n + PART - 1) / PART, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; part++) {
      for (int64_t at = part * PART, stop = std::min(n, at + PART); at < stop;) {
        const ssize_t got = pread(int(fd), p + at, size_t(stop - at), off_t(offset + at));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return void(error = errno);
        if (got == 0) {  // the end of the file: what lies before `at` was read
          for (int64_t seen = read_to; at < seen && !read_to.compare_exchange_weak(seen, at);) {
          }
          break;
        }
        at += got;
      }
    }
  });
  return error ? -int64_t(error) : int64_t(read_to);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("pread_parallel(int fd, int offset, Tensor(a!) out) -> int", pread_parallel);
  m.def("first_nonfinite_float16(Tensor raw, int block, int at) -> int", first_nonfinite_float16);
  m.def("pack_gguf_into(Tensor raw, Tensor(a!) out, int row, int n, int block, bool regrouped, int scales, "
        "int scales_at, bool fifth_bits, bool q8_halves) -> ()",
        pack_gguf_into);
}
