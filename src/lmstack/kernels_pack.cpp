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
#include <tuple>
#include <vector>

namespace {

using lmstack::REGROUPED_TILE;
using lmstack::TILE;
using lmstack::transpose16;

constexpr int64_t PACK_TASK_BYTES = 256 << 10;  // packed bytes a thread takes at a time

// Whether p[0..n) holds an inf or a nan (exponent bits EXPONENT all set); split over PyTorch's threads where
// `parallel`
template <typename Bits, Bits EXPONENT>
bool any_nonfinite_bits(const Bits* p, int64_t n, bool parallel = true) {
  std::atomic<bool> found{false};
  const auto scan = [&](int64_t begin, int64_t end) {
    constexpr int64_t CHUNK = 1 << 12;
    for (int64_t at = begin; at < end && !found.load(std::memory_order_relaxed); at += CHUNK) {
      Bits all_set = 0;
      for (int64_t i = at, stop = std::min(end, at + CHUNK); i < stop; i++)
        all_set |= Bits((p[i] & EXPONENT) == EXPONENT);
      if (all_set) found = true;
    }
  };
  parallel ? at::parallel_for(0, n, 1 << 16, scan) : scan(0, n);
  return found;
}

// Row r of a (tile, block) record from one block of the file, src (or a padding row of zeros: src null), for a
// type kept whole (SCALES 0: the TILE rows' blocks side by side) or regrouped (REGROUPED_TILE rows): its SCALES
// float16 fields of the rows (at byte `scales_at` of a block), field by field, [FIFTH: the fifth bits, for each
// group g of 4 columns 64 bits, bit 4r + t the bit of row r's column 4g + t,] then the block's other bytes, the
// quants (`quants` of them, in the block's order), in 64-byte chunks, row r's 4 bytes at 4r of each: chunk k holds
// bytes 4k..4k+3 (Q8_0's as q + 128); quants 0: the fields alone
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

// The quants of a regrouped record's 16 rows at once (row r's at q[r]; `quants` bytes, a multiple of 4), where
// put puts each row's: a 16 x 16 transpose of 32-bit values per 64 bytes of the rows, not 4 bytes at a time
template <bool Q8>
inline void put_quants16(uint8_t* at, const uint8_t* const* q, int64_t quants) {
  for (int64_t c = 0; c < quants; c += 64) {
    const int64_t words = std::min<int64_t>(16, (quants - c) / 4);
    const __mmask16 mask = __mmask16((1u << words) - 1);
    __m512i v[16];
    for (int r = 0; r < REGROUPED_TILE; r++) v[r] = _mm512_maskz_loadu_epi32(mask, q[r] + c);
    transpose16(v);
    for (int64_t k = 0; k < words; k++)
      _mm512_storeu_si512(at + c * 16 + 64 * k, Q8 ? _mm512_xor_si512(v[k], _mm512_set1_epi8(char(0x80))) : v[k]);
  }
}

// Rows g0..g1 - 1 of tile t of out (KB records of a tile's rows), row g's blocks at row(g) (null: a padding row)
template <int SCALES, bool FIFTH, bool Q8, class Row>
void pack_tile(uint8_t* out, int64_t t, int64_t g0, int64_t g1, int64_t KB, int64_t block, int64_t scales_at,
               int64_t quants, const Row& row) {
  constexpr int64_t T = SCALES ? REGROUPED_TILE : TILE;
  const uint8_t* rows[T];
  bool whole = SCALES && g1 - g0 == T;
  for (int64_t g = g0; g < g1; g++) whole &= (rows[g % T] = row(g)) != nullptr;
  for (int64_t b = 0; b < KB; b++) {
    uint8_t* rec = out + (t * KB + b) * T * block;
    if (!whole) {
      for (int64_t g = g0; g < g1; g++)
        put<SCALES, FIFTH, Q8>(rec, g % T, rows[g % T] ? rows[g % T] + b * block : nullptr, block, scales_at, quants);
      continue;
    }
    const uint8_t* q[T];
    for (int64_t r = 0; r < T; r++) {
      put<SCALES, FIFTH, Q8>(rec, r, rows[r] + b * block, block, scales_at, 0);
      q[r] = rows[r] + b * block + (scales_at ? 0 : 2 * SCALES) + (FIFTH ? 4 : 0);
    }
    put_quants16<Q8>(rec + SCALES * 2 * REGROUPED_TILE + (FIFTH ? 64 : 0), q, quants);
  }
}

// f.template operator()<SCALES, FIFTH, Q8>(quants) for a block layout (pack_gguf_into's arguments), checked
template <class F>
void with_layout(int64_t block, bool regrouped, int64_t scales, int64_t scales_at, bool fifth_bits, bool q8_halves,
                 const F& f) {
  const int64_t quants = block - 2 * scales - (fifth_bits ? 4 : 0);
  const bool q8_0 = scales == 1 && !fifth_bits && quants == 32;
  TORCH_CHECK(regrouped ? (q8_halves ? q8_0 && scales_at == 0
                                     : (scales == 1 || scales == 2) && quants > 0 && quants % 4 == 0 &&
                                           (scales_at == 0 || (!fifth_bits && scales_at == block - 2 * scales)))
                        : block > 0 && block <= 256,
              "pack_gguf: no such block layout");
  if (!regrouped)
    f.template operator()<0, false, false>(quants);
  else if (q8_halves)
    f.template operator()<1, false, true>(quants);
  else if (scales == 1 && fifth_bits)
    f.template operator()<1, true, false>(quants);
  else if (scales == 1)
    f.template operator()<1, false, false>(quants);
  else if (fifth_bits)
    f.template operator()<2, true, false>(quants);
  else
    f.template operator()<2, false, false>(quants);
}

// out's records (ceil(n / tile), KB, tile * block) for a tensor's `rows` rows from `row`, tile TILE or (regrouped)
// REGROUPED_TILE; the call that reaches row n - 1 also writes the padding rows after it
void check_out(const at::Tensor& out, int64_t row, int64_t rows, int64_t n, int64_t KB, int64_t block, bool regrouped) {
  const int64_t tile = regrouped ? REGROUPED_TILE : TILE, tiles = (n + tile - 1) / tile;
  TORCH_CHECK(row >= 0 && rows >= 0 && row + rows <= n, "pack_gguf: rows ", row, "..", row + rows, " of ", n);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 3 && out.size(0) == tiles &&
                  out.size(1) == KB && out.size(2) == tile * block,
              "pack_gguf: out must be contiguous (", tiles, ", ", KB, ", ", tile * block, ") uint8, got ", out.sizes());
}

// raw (rows, KB * block) uint8: rows row..row + rows - 1 of an n-row tensor, packed into their records of out. A
// regrouped block's `scales` float16 fields lie at its start or (scales_at > 0) its end.
void pack_gguf_into(const at::Tensor& raw, at::Tensor& out, int64_t row, int64_t n, int64_t block, bool regrouped,
                    int64_t scales, int64_t scales_at, bool fifth_bits, bool q8_halves) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 && block > 0 &&
                  raw.size(1) % block == 0,
              "pack_gguf: raw must be contiguous (rows, blocks * ", block, ") uint8");
  const int64_t rows = raw.size(0), KB = raw.size(1) / block;
  check_out(out, row, rows, n, KB, block, regrouped);
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  with_layout(block, regrouped, scales, scales_at, fifth_bits, q8_halves, [&]<int S, bool F, bool Q>(int64_t quants) {
    const int64_t T = S ? REGROUPED_TILE : TILE;
    const int64_t last = row + rows == n ? (n + T - 1) / T * T : row + rows;  // with the padding rows
    at::parallel_for(row / T, (last + T - 1) / T, std::max<int64_t>(1, PACK_TASK_BYTES / (T * block * KB)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++)
        pack_tile<S, F, Q>(dst, t, std::max(row, t * T), std::min(last, (t + 1) * T), KB, block, scales_at, quants,
                           [&](int64_t g) { return g < row + rows ? in + (g - row) * KB * block : nullptr; });
    });
  });
}

// size bytes of file descriptor fd at offset into p, retried where a read is interrupted or short: the bytes read
// (fewer only where the file ends first), or -errno
int64_t pread_all(int fd, uint8_t* p, int64_t size, int64_t offset) {
  int64_t done = 0;
  while (done < size) {
    const ssize_t got = pread(fd, p + done, size_t(size - done), off_t(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return -int64_t(errno);
    if (got == 0) break;
    done += got;
  }
  return done;
}

// Rows row..row + rows - 1 of an n-row GGUF tensor read from the file and packed into their records of out, as
// pack_gguf_into packs them: output row row + i is the file's row source[i] (its bytes at offset + source[i] *
// row_bytes; source empty: row i), every float16 at the bytes `float16_at` of each block checked (none: bfloat16
// rows, as 64-byte blocks kept whole, are the tiles matvec_bf16_tiled reads). Each thread
// takes whole units of `unit` output rows (whole tiles), reads the file's rows they come from with one pread into
// its own buffer, which stays in its core's cache, checks them there and packs them from there: one pass over the
// file's bytes, without a call from Python per chunk (reading, checking and packing 2 MiB chunks in turn, from
// Python, took a third of a 1.7B model's start). Returns (the first i * blocks + block whose float16 is inf or
// nan, or -1; 0, an errno, or -1 where the file ended before the rows).
std::tuple<int64_t, int64_t> read_pack_gguf(int64_t fd, int64_t offset, const at::Tensor& source, at::Tensor& out,
                                            int64_t row, int64_t rows, int64_t n, int64_t block, bool regrouped,
                                            std::vector<int64_t> float16_at, bool fifth_bits, bool q8_halves,
                                            int64_t unit) {
  TORCH_CHECK(float16_at.size() <= 2 && (!regrouped || !float16_at.empty()) && out.dim() == 3 && unit > 0 &&
                  offset >= 0,
              "read_pack_gguf: at most two float16 fields (a regrouped type one at least), a unit of rows, an offset");
  for (int64_t at : float16_at)
    TORCH_CHECK(at >= 0 && at + 2 <= block, "read_pack_gguf: a float16 field outside the block");
  const int64_t KB = out.size(1), row_bytes = KB * block;
  check_out(out, row, rows, n, KB, block, regrouped);
  TORCH_CHECK(unit % (regrouped ? REGROUPED_TILE : TILE) == 0, "read_pack_gguf: a unit of whole tiles");
  TORCH_CHECK(source.numel() == 0 || (source.scalar_type() == at::kLong && source.is_contiguous() &&
                                      source.numel() == rows),
              "read_pack_gguf: source must be empty or ", rows, " int64 row indices");
  const int64_t* from = source.numel() ? source.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; from && i < rows; i++)
    TORCH_CHECK(from[i] >= 0 && from[i] < rows, "read_pack_gguf: source row ", from[i], " outside 0..", rows - 1);
  auto file_row = [&](int64_t r) { return from ? from[r - row] : r - row; };
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<int64_t> bad{INT64_MAX}, error{0};
  const int64_t scales_at = float16_at.empty() ? 0 : float16_at[0];
  with_layout(block, regrouped, int64_t(float16_at.size()), scales_at, fifth_bits, q8_halves,
              [&]<int S, bool F, bool Q>(int64_t quants) {
    const int64_t T = S ? REGROUPED_TILE : TILE, tiles = out.size(0);
    const int64_t last = row + rows == n ? tiles * T : row + rows;  // with the padding rows
    const int64_t first_unit = row / unit, units = (last + unit - 1) / unit - first_unit;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> buffer;
      for (int64_t u = first_unit + begin; u < first_unit + end && !error; u++) {
        const int64_t r0 = std::max(row, u * unit), r1 = std::min(row + rows, (u + 1) * unit);
        int64_t lo = INT64_MAX, hi = 0;  // the file's rows that rows r0..r1 - 1 come from
        for (int64_t r = r0; r < r1; r++) lo = std::min(lo, file_row(r)), hi = std::max(hi, file_row(r) + 1);
        buffer.resize(std::max<int64_t>(0, hi - lo) * row_bytes);
        const int64_t got = pread_all(int(fd), buffer.data(), int64_t(buffer.size()), offset + lo * row_bytes);
        if (got != int64_t(buffer.size())) return void(error = got < 0 ? -got : -1);
        auto src = [&](int64_t r) { return r < row + rows ? buffer.data() + (file_row(r) - lo) * row_bytes : nullptr; };
        const auto found = [&](int64_t i) {
          for (int64_t seen = bad; i < seen && !bad.compare_exchange_weak(seen, i);) {
          }
        };
        for (int64_t r = r0; r < r1; r++) {
          if (float16_at.empty() &&  // bfloat16 rows: every value
              any_nonfinite_bits<uint16_t, 0x7F80>(reinterpret_cast<const uint16_t*>(src(r)), row_bytes / 2, false))
            found((r - row) * KB);
          for (int64_t b = 0; b < KB; b++)
            for (int64_t at : float16_at) {
              uint16_t h;
              std::memcpy(&h, src(r) + b * block + at, 2);
              if ((h & 0x7C00) == 0x7C00) found((r - row) * KB + b);
            }
        }
        for (int64_t t = u * unit / T; t < std::min(tiles, (u + 1) * unit / T); t++)
          pack_tile<S, F, Q>(dst, t, std::max(row, t * T), std::min(last, (t + 1) * T), KB, block, scales_at, quants,
                             src);
      }
    });
  });
  return {bad == INT64_MAX ? -1 : int64_t(bad), int64_t(error)};
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

// Whether t (contiguous float32, bfloat16 or float16) holds an inf or a nan: an element whose exponent bits are
// all set. Split over PyTorch's threads; torch.isfinite(t).all() read bfloat16 at a quarter of a GB/s (a scalar
// loop) and wrote a bool of every element.
bool any_nonfinite(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "any_nonfinite: t must be a contiguous CPU tensor");
  switch (t.scalar_type()) {
    case at::kFloat:
      return any_nonfinite_bits<uint32_t, 0x7F800000u>(static_cast<const uint32_t*>(t.data_ptr()), t.numel());
    case at::kBFloat16:
      return any_nonfinite_bits<uint16_t, 0x7F80>(static_cast<const uint16_t*>(t.data_ptr()), t.numel());
    case at::kHalf:
      return any_nonfinite_bits<uint16_t, 0x7C00>(static_cast<const uint16_t*>(t.data_ptr()), t.numel());
    default:
      TORCH_CHECK(false, "any_nonfinite: t must be float32, bfloat16 or float16, not ", t.scalar_type());
  }
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
      const int64_t at = part * PART, size = std::min(n, at + PART) - at;
      const int64_t got = pread_all(int(fd), p + at, size, offset + at);
      if (got < 0) return void(error = int(-got));
      if (got < size)  // the end of the file: what lies before at + got was read
        for (int64_t seen = read_to; at + got < seen && !read_to.compare_exchange_weak(seen, at + got);) {
        }
    }
  });
  return error ? -int64_t(error) : int64_t(read_to);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.def("pread_parallel(int fd, int offset, Tensor(a!) out) -> int", pread_parallel);
  m.def("read_pack_gguf(int fd, int offset, Tensor source, Tensor(a!) out, int row, int rows, int n, int block, "
        "bool regrouped, int[] float16_at, bool fifth_bits, bool q8_halves, int unit) -> (int, int)",
        read_pack_gguf);
  m.def("first_nonfinite_float16(Tensor raw, int block, int at) -> int", first_nonfinite_float16);
  m.def("any_nonfinite(Tensor t) -> bool", any_nonfinite);
  m.def("pack_gguf_into(Tensor raw, Tensor(a!) out, int row, int n, int block, bool regrouped, int scales, "
        "int scales_at, bool fifth_bits, bool q8_halves) -> ()",
        pack_gguf_into);
}
