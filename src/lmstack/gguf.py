"""GGUF files read with every length checked, onto the same ModelPlan.

The header is walked once through a small window of the file: each count and length is checked against
the bytes that remain before anything is read or skipped, and values are only located, not decoded. A
value is read when asked for (`get`, `array`), arrays with numpy, so a large array costs its own bytes
and nothing more. Tensor data is read with `pread` on the descriptor opened once, never mapped: a file
cut short while it is open is refused by name, where a mapping would die of SIGBUS. A large tensor is read a
chunk of rows at a time (`data(tensor, rows)`), so loading never holds a second copy of a whole one.

The architecture's family module (families/) reads the metadata as a config dict for `plan_for`, so every
refusal stays with the family, and names the tensors: they are renamed to the Hugging Face names the plan
reads, dequantized on read (by the `gguf` package, llama.cpp's own), and the q/k rows that llama.cpp's
converter permutes for its rotary layout are put back in Hugging Face's order.
"""

import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from . import kernels
from .checkpoint import CheckpointError, TensorInfo, check_finite, pread_into, read_pack
from .config import MAX_EXPERTS, HFConfig, UnsupportedModel
from .families import GGUF_ARCHITECTURES
from .kernels import GGUF_TYPES, first_nonfinite_float16

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 65535  # keys and tensor names: the format's own limit on keys
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # an array of arrays; deeper is refused
WINDOW = 1 << 16  # bytes read at a time while walking the header
CHUNK_BYTES = 16 << 20  # float32 bytes of a tensor dequantized at a time

# value type -> numpy dtype of its little-endian encoding (strings and arrays have none)
SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
INTEGERS = tuple(t for t in SCALARS if t.name.startswith(("UINT", "INT")))
FLOATS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
TYPE_IDS = {t.value: t for t in GGUFValueType}
QUANT_IDS = {t.value: t for t in GGMLQuantizationType}
# the types whose blocks lmstack's kernels multiply as stored (weight_format "gguf"), and those it keeps as exact
# float tensors; any other type is refused under weight_format "gguf"
BLOCK_TYPES = tuple(GGMLQuantizationType(i) for i in GGUF_TYPES)
FLOAT_DTYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}
FLOAT_TYPES = tuple(FLOAT_DTYPES)

_REQUIRED = object()


def is_gguf(path) -> bool:
    """A file that starts with GGUF's magic bytes (a .gguf name alone is not trusted)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == MAGIC


@dataclass(frozen=True)
class Field:
    """Where one metadata value lies: its type, its bytes [start, end), and an array's item type and count."""
    type: GGUFValueType
    start: int
    end: int
    item_type: GGUFValueType | None = None
    count: int = 0


@dataclass(frozen=True)
class Tensor:
    """One tensor's entry: its GGUF name, dims in GGUF order (fastest first), type, where its bytes lie in the
    file, and how many the data gives it (with the padding up to the next tensor)."""
    name: str
    dims: tuple
    type: GGMLQuantizationType
    offset: int
    nbytes: int
    span: int


class _Walk:
    """The header read front to back through a small window, each read checked against the bytes left."""

    def __init__(self, fd: int, size: int, fail):
        self.fd, self.size, self.fail = fd, size, fail
        self.pos, self.window, self.window_start = 0, b"", 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str):
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes, {self.left()} remain at byte {self.pos}")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        at = self.pos - self.window_start
        if at + n > len(self.window):
            self.window, self.window_start, at = os.pread(self.fd, max(n, WINDOW), self.pos), self.pos, 0
            if len(self.window) < n:
                raise self.fail(f"the file ended at byte {self.pos + len(self.window)} while reading {what}: "
                                f"it changed since it was opened")
        self.pos += n
        return self.window[at:at + n]

    def skip(self, n: int, what: str):
        self.need(n, what)
        self.pos += n

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def name(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > MAX_NAME_BYTES:
            raise self.fail(f"{what} is {n} bytes long (at most {MAX_NAME_BYTES})")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} {raw[:64]!r} is not UTF-8") from None

    def value_type(self, what: str) -> GGUFValueType:
        kind = self.u32(f"the type of {what}")
        if kind not in TYPE_IDS:
            raise self.fail(f"{what} has unknown value type {kind}")
        return TYPE_IDS[kind]

    def value(self, kind: GGUFValueType, what: str, depth: int = 0) -> Field:
        """Skip one value of type `kind`, checking every length on the way; where it lay."""
        start = self.pos
        if kind in SCALARS:
            self.skip(SCALARS[kind].itemsize, what)
        elif kind == GGUFValueType.STRING:
            self.skip(self.u64(f"the length of {what}"), what)
        else:
            item = self.value_type(f"the items of {what}")
            count = self.u64(f"the length of {what}")
            if item in SCALARS:
                self.need(count * SCALARS[item].itemsize, f"{what} ({count} {item.name} items)")
                self.pos += count * SCALARS[item].itemsize
            elif item == GGUFValueType.STRING:
                self.need(count * 8, f"{what} ({count} strings)")
                self._strings(count, what)
            else:
                if depth + 1 >= MAX_NESTING:
                    raise self.fail(f"{what} nests arrays deeper than {MAX_NESTING}")
                self.need(count * 12, f"{what} ({count} arrays)")
                for i in range(count):
                    self.value(GGUFValueType.ARRAY, f"{what}[{i}]", depth + 1)
            return Field(kind, start, self.pos, item, count)
        return Field(kind, start, self.pos)

    def _strings(self, count: int, what: str):
        """Skip `count` strings: the window's bytes are read in place, a window at a time."""
        unpack, size = struct.Struct("<Q").unpack_from, self.size
        for i in range(count):
            at = self.pos - self.window_start
            if at + 8 > len(self.window):
                self.need(8, f"{what}[{i}]")
                self.window, self.window_start, at = os.pread(self.fd, WINDOW, self.pos), self.pos, 0
                if len(self.window) < 8:
                    raise self.fail(f"the file ended while reading {what}[{i}]: it changed since it was opened")
            n = unpack(self.window, at)[0]
            if n > size - self.pos - 8:
                raise self.fail(f"{what}[{i}] needs {n} bytes, {size - self.pos - 8} remain at byte {self.pos + 8}")
            self.pos += 8 + n


def _strings(raw: bytes, count: int, fail, what: str) -> list[str]:
    """Decode `count` length-prefixed UTF-8 strings from `raw`, whose lengths were checked when walked."""
    unpack, out, at = struct.Struct("<Q").unpack_from, [], 0
    for i in range(count):
        n = unpack(raw, at)[0]
        try:
            out.append(raw[at + 8:at + 8 + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise fail(f"{what}[{i}] {raw[at + 8:at + 8 + min(n, 64)]!r} is not UTF-8") from None
        at += 8 + n
    return out


class GGUFHeader:
    """A GGUF file's metadata and tensor entries, for any architecture; values read from the file when asked for.

    `keys()` lists the metadata, `get(key)` reads one value (arrays as lists), `array(key)` an array as numpy
    (a list of str for strings), `field(key)` tells a value's type and size without reading it; `tensors` maps
    GGUF names to their entries, whose bytes `data(tensor)` reads.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        self._fh, self._map = open(self.path, "rb", buffering=0), None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file: {what}")

    def _parse(self):
        """Locate every metadata value and tensor, checking each length, offset and type before using it."""
        fd = self._fh.fileno()
        walk = _Walk(fd, os.fstat(fd).st_size, self._fail)
        if (magic := walk.take(4, "the magic")) != MAGIC:
            raise self._fail(f"magic {magic!r}, expected {MAGIC!r}")
        version = walk.u32("the version")
        if version not in VERSIONS:
            swapped = " (big-endian, which is not supported)" if version & 0xFFFF == 0 else ""
            raise self._fail(f"version {version}{swapped}, expected one of {VERSIONS}")
        n_tensors, n_fields = walk.u64("the tensor count"), walk.u64("the metadata count")
        walk.need(n_fields * 13, f"{n_fields} metadata entries")  # the smallest entry takes 13 bytes
        self._fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = walk.name("a metadata key")
            if key in self._fields:
                raise self._fail(f"metadata key {key!r} appears more than once")
            self._fields[key] = walk.value(walk.value_type(f"metadata {key!r}"), f"metadata {key!r}")
        field = self._fields.get("general.alignment")
        alignment = self.get("general.alignment") if field else DEFAULT_ALIGNMENT
        if (field and field.type != GGUFValueType.UINT32) or alignment < 1 or alignment & (alignment - 1):
            raise self._fail(f"general.alignment {alignment!r} is not a power of two stored as UINT32")
        walk.need(n_tensors * 24, f"{n_tensors} tensor entries")  # the smallest entry takes 24 bytes
        entries = []
        for _ in range(n_tensors):
            name = walk.name("a tensor name")
            where = f"tensor {name!r}"
            n_dims = walk.u32(f"the dimension count of {where}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"{where} has {n_dims} dimensions (1 to {MAX_DIMS})")
            dims = tuple(walk.u64(f"the dimensions of {where}") for _ in range(n_dims))
            kind = walk.u32(f"the type of {where}")
            offset = walk.u64(f"the offset of {where}")
            entries.append((name, dims, kind, offset))
        data_start = -walk.pos % alignment + walk.pos
        data_size = walk.size - data_start
        self.tensors: dict[str, Tensor] = {}
        expected, previous = 0, None
        for name, dims, kind, offset in entries:
            where = f"tensor {name!r}"
            if kind not in QUANT_IDS:
                raise self._fail(f"{where} has unknown type id {kind}")
            qtype = QUANT_IDS[kind]
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            elements = math.prod(dims)
            if dims[0] % block or elements >= 1 << 62:
                raise self._fail(f"{where}: dims {list(dims)} do not fit type {qtype.name} (rows of a "
                                 f"multiple of {block} values, fewer than 2**62 in all)")
            nbytes = elements // block * type_size
            if offset % alignment:
                raise self._fail(f"{where} has offset {offset}, not a multiple of {alignment} (general.alignment)")
            if offset != expected:
                after = ("the data's start" if previous is None else
                         f"the end of tensor {previous.name!r} ({previous.type.name}, {previous.nbytes} bytes)")
                raise self._fail(f"{where} has offset {offset}, expected {expected}: {after} aligned to {alignment} "
                                 f"bytes (tensors follow one another, each span the size its type and dims give)")
            if offset + nbytes > data_size:
                raise self._fail(f"{where} ({qtype.name}, {nbytes} bytes at offset {offset}) runs past the data "
                                 f"({data_size} bytes)")
            if name in self.tensors:
                raise self._fail(f"{where} appears more than once")
            span = min(nbytes + (-nbytes % alignment), data_size - offset)
            self.tensors[name] = previous = Tensor(name, dims, qtype, data_start + offset, nbytes, span)
            expected = offset + nbytes + (-nbytes % alignment)
        end = 0 if previous is None else previous.offset + previous.nbytes - data_start
        if data_size - end >= alignment:
            raise self._fail(f"{data_size - end} bytes after the last tensor {previous.name!r} ({previous.type.name}, "
                             f"{previous.nbytes} bytes) belong to none")

    # ---- metadata ------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every metadata key, in the file's order."""
        return list(self._fields)

    def field(self, key: str) -> Field | None:
        """Where `key`'s value lies and its type (None when absent): what to check before reading a large one."""
        return self._fields.get(key)

    def get(self, key: str, default=_REQUIRED):
        """A metadata value (arrays as lists); `{arch}` in the key is this file's architecture."""
        key = key.replace("{arch}", getattr(self, "arch", ""))
        field = self._fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        if field.type == GGUFValueType.ARRAY:
            value = self.array(key)
            return value if isinstance(value, list) else value.tolist()
        raw = self._bytes(field, key)
        if field.type == GGUFValueType.STRING:
            return _strings(raw, 1, self._fail, f"metadata {key!r}")[0]
        value = np.frombuffer(raw, SCALARS[field.type])[0].item()
        if field.type == GGUFValueType.BOOL:
            return bool(value)
        if field.type == GGUFValueType.FLOAT32:  # the decimal the writer meant: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value

    def _int(self, key: str, default=_REQUIRED, minimum=1):
        """An integer metadata value of at least `minimum`, or `default` when absent."""
        value = self.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            key = key.replace("{arch}", getattr(self, "arch", ""))
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} = {value!r}, expected an integer >= {minimum}")
        return value

    def eos_ids(self) -> list[int]:
        """Every id that ends a generation: EOS, and end-of-turn / end-of-message where given."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return list(dict.fromkeys(i for i in (self._int(k, None, minimum=0) for k in keys) if i is not None))

    def array(self, key: str):
        """An array value: numpy for numbers (bool for BOOL), a list of str for strings, lists for nested arrays."""
        field = self._fields.get(key)
        if field is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
        if field.type != GGUFValueType.ARRAY:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is a {field.type.name}, not an array")
        raw = self._bytes(field, key)[12:]
        if field.item_type == GGUFValueType.STRING:
            return _strings(raw, field.count, self._fail, f"metadata {key!r}")
        if field.item_type == GGUFValueType.ARRAY:
            return self._nested(raw, field.count, key)
        values = np.frombuffer(raw, SCALARS[field.item_type], field.count)
        return values != 0 if field.item_type == GGUFValueType.BOOL else values.astype(values.dtype.newbyteorder("="))

    def _nested(self, raw: bytes, count: int, key: str) -> list:
        """An array of arrays (bounds checked when walked), as lists."""
        out, at = [], 0
        for _ in range(count):
            kind, n = struct.unpack_from("<IQ", raw, at)
            item = TYPE_IDS[kind]
            at += 12
            if item == GGUFValueType.STRING:
                values = _strings(raw[at:], n, self._fail, f"metadata {key!r}")
                at += sum(8 + len(v.encode()) for v in values)
            else:
                values = np.frombuffer(raw, SCALARS[item], n, at)
                at += values.nbytes
                values = (values != 0).tolist() if item == GGUFValueType.BOOL else values.tolist()
            out.append(values)
        return out

    def _bytes(self, field: Field, key: str) -> bytes:
        raw = os.pread(self._fd(), field.end - field.start, field.start)
        if len(raw) != field.end - field.start:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} cannot be read: the file was cut short "
                                  f"since it was opened")
        return raw

    def _fd(self) -> int:
        if self._fh is None:
            raise ValueError(f"{self.path}: read from a closed file")
        return self._fh.fileno()

    def data(self, tensor: Tensor, rows: slice | None = None) -> np.ndarray:
        """A tensor's bytes as stored, or those of rows [start, stop) of its dims[0]-long rows, read with pread
        into a fresh buffer: a file cut short since it was opened is named (a mapping would die of SIGBUS).

        The read that reaches the tensor's last row checks the padding after it (_check_padding).
        """
        n_rows = math.prod(tensor.dims[1:])
        row_bytes = tensor.nbytes // n_rows if n_rows else 0
        start, stop, _ = (rows or slice(None)).indices(n_rows)
        stop = max(start, stop)
        raw = np.empty((stop - start) * row_bytes, dtype=np.uint8)
        pread_into(self._fd(), raw, tensor.offset + start * row_bytes, self.path, f"tensor {tensor.name!r}")
        if stop == n_rows:
            self._check_padding(tensor)
        return raw

    def mapped(self, tensor: Tensor) -> torch.Tensor:
        """A tensor's bytes (uint8) in a read-only mapping of the file, every bound checked when the file was
        opened: the page cache's own pages, shared, never copied, as llama.cpp maps a file. A file cut short or
        rewritten in place while a model holds its pages ends the process (SIGBUS) or changes the weights under
        it; a file replaced by a rename does not."""
        if self._map is None:
            try:
                self._map = mmap.mmap(self._fd(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise OSError(e.errno, f"{self.path} cannot be mapped ({e.strerror}): load it with mmap=False "
                                       f"(lmstack: --no-mmap) to read its BF16 matrices into memory") from None
            if hasattr(mmap, "MADV_WILLNEED"):  # read ahead of the first pass where the file is not cached
                self._map.madvise(mmap.MADV_WILLNEED)
        self._check_padding(tensor)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # PyTorch's "not writable": weights are never written
            return torch.frombuffer(self._map, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.offset)

    def _check_padding(self, tensor: Tensor):
        """The bytes between a tensor's data and the next tensor's are zeros, as every writer leaves them: a type or
        dims that give fewer bytes than the tensor's data holds would otherwise read part of it as something else."""
        padding = np.empty(tensor.span - tensor.nbytes, dtype=np.uint8)
        pread_into(self._fd(), padding, tensor.offset + tensor.nbytes, self.path, f"tensor {tensor.name!r}")
        if padding.any():
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r} ({tensor.type.name}, dims "
                                  f"{list(tensor.dims)}) takes {tensor.nbytes} bytes, but the padding after them "
                                  f"is not zeros: its type or dims disagree with its data")

    def close(self):
        """Close the file; the pages of a mapping stay with the tensors that view them."""
        if self._fh is not None:
            self._fh.close()
        self._fh = self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GGUFFile(GGUFHeader):
    """A GGUF file of a supported architecture seen as a checkpoint: a config dict, and float32 tensors under
    Hugging Face names."""

    def __init__(self, path):
        super().__init__(path)
        try:
            arch = self.get("general.architecture", None)
            if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
                raise UnsupportedModel(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                       f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
            self.arch, self.architecture = arch, GGUF_ARCHITECTURES[arch]
            self._tensors = {}
            for name, t in self.tensors.items():
                for hf_name, entry in self._hf_entries(name, t):
                    if hf_name in self._tensors:
                        raise CheckpointError(f"{self.path}: two tensors take the same Hugging Face name {hf_name!r}")
                    self._tensors[hf_name] = entry
            self._check_types()
            # the family's reading of the metadata as config.json; plan_for's errors then name this file
            self.config = HFConfig(self.architecture.config(self), self.path)
        except BaseException:
            self.close()
            raise

    def _hf_entries(self, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """A GGUF tensor under its Hugging Face name; one that stacks a layer's experts (dims (in, out, experts))
        as one entry per expert, over that expert's bytes (the last one keeps the padding after them)."""
        template = self.architecture.expert_name(name)
        if template is None:
            return [(self.architecture.hf_name(name), t)]
        if len(t.dims) != 3 or not 1 <= t.dims[2] <= MAX_EXPERTS:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dims {list(t.dims)}, expected (in, out, experts) "
                                  f"with 1 to {MAX_EXPERTS} experts")
        n = t.dims[2]
        each = t.nbytes // n
        return [(template.replace("{e}", str(e)),
                 Tensor(f"{name} (expert {e})", t.dims[:2], t.type, t.offset + e * each, each,
                        each if e < n - 1 else t.span - e * each)) for e in range(n)]

    # ---- model metadata ------------------------------------------------------------------

    def _check_types(self):
        """Refuse, before reading a weight, any tensor type `gguf` cannot dequantize."""
        for qtype in {t.type for t in self._tensors.values()}:
            block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
            try:
                dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
            except NotImplementedError:
                name = next(t.name for t in self._tensors.values() if t.type == qtype)
                raise UnsupportedModel(f"{self.path}: tensor {name!r} has type {qtype.name}, which gguf "
                                       f"cannot dequantize") from None

    # ---- tensors: the Checkpoint surface -------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(t.type.name, tuple(reversed(t.dims)), self.path)

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor in the file, as stored (quantized)."""
        return self._tensor(name).nbytes

    def read(self, name: str, bf16: str = "widen") -> torch.Tensor:
        """The tensor dequantized to float32, in Hugging Face's layout (bf16 is accepted for Checkpoint's surface)."""
        weight = torch.empty(self.info(name).shape)
        self._dequantize_into(self._tensor(name), weight)
        return self._hf_rows(name, weight)

    def _floats(self, t: Tensor) -> torch.Tensor:
        """Float tensor t (F32, F16, BF16) in its own dtype, read straight into place: `gguf`'s dequantize widens it
        through NumPy a chunk at a time, several times slower than the read."""
        weight = torch.empty(tuple(reversed(t.dims)), dtype=FLOAT_DTYPES[t.type])
        pread_into(self._fd(), weight.view(-1).view(torch.uint8).numpy(), t.offset, self.path, f"tensor {t.name!r}")
        self._check_padding(t)
        return weight

    def check_as_stored(self):
        """Refuse, before reading a weight, a tensor weight_format "gguf" cannot keep as stored: its type neither a
        block type lmstack's kernels multiply (BLOCK_TYPES) nor a float type (FLOAT_TYPES). Dequantizing it would
        silently cost several times its bytes: that takes asking for float32 or bfloat16 storage."""
        for t in self._tensors.values():
            if t.type not in BLOCK_TYPES + FLOAT_TYPES:
                raise UnsupportedModel(
                    f"{self.path}: tensor {t.name!r} has type {t.type.name}, which weight_format 'gguf' cannot "
                    f"multiply as stored (it takes {', '.join(q.name for q in BLOCK_TYPES + FLOAT_TYPES)}); "
                    f"weight_format 'float32' or 'bfloat16' dequantizes it")

    def _dequantize_into(self, t: Tensor, dest: torch.Tensor):
        """Tensor t dequantized by `gguf` into dest (contiguous, its rows in the file's order), a chunk of rows at a
        time: `gguf`'s temporaries take several times their output, so a whole tensor's would dwarf its bytes. A
        float type's values are copied as they are (what `gguf` gives, several times sooner)."""
        rows = dest.view(-1, t.dims[0]) if t.dims[0] else dest.view(0, 0)
        step = max(1, CHUNK_BYTES // max(1, 4 * t.dims[0]))
        for start in range(0, rows.shape[0], step):
            raw = self.data(t, slice(start, start + step)).reshape(len(rows[start:start + step]), -1)
            if t.type in FLOAT_TYPES:
                values = torch.from_numpy(raw).view(FLOAT_DTYPES[t.type])
            else:
                values = torch.from_numpy(np.asarray(dequantize(raw, t.type), dtype=np.float32))
            rows[start:start + step].copy_(values)

    def mappable(self, name: str) -> bool:
        """Whether stored(name, mapped=True) gives the file's own pages: a BF16 matrix whose rows are Hugging Face's
        (not q or k, whose rows llama.cpp's converter permuted)."""
        t = self._tensor(name)
        return t.type == GGMLQuantizationType.BF16 and len(t.dims) == 2 and not self._permuted(name)

    def stored(self, name: str, rows: slice | None = None, mapped: bool = False):
        """Tensor `name` as the file stores it, rows in Hugging Face's order: (ggml type id, (rows, bytes) uint8) for
        the block types lmstack multiplies as stored (BLOCK_TYPES), with every float16 scale finite; else an exact
        tensor: BF16 as bfloat16 (with `mapped`, in the file's mapping where mappable), any other type as float32
        (F16 widened, a 1-D block tensor dequantized). `rows` reads only those rows: a large tensor is packed a
        chunk at a time."""
        t = self._tensor(name)
        if t.type not in BLOCK_TYPES or len(t.dims) != 2:
            if mapped and self.mappable(name):
                weight = self.mapped(t).view(torch.bfloat16).view(tuple(reversed(t.dims)))
            elif t.type == GGMLQuantizationType.BF16:
                weight = self._hf_rows(name, self._floats(t))
            else:
                weight = self.read(name)
            check_finite(weight, self.path, name)
            return weight
        kind = GGUF_TYPES[t.type.value]
        if self._permuted(name):  # q and k: each head's rows permuted among themselves; the heads of `rows` are read
            per_head = max(1, t.dims[1] // self._heads(name, t.dims[1]))
            start, stop, _ = (rows or slice(None)).indices(t.dims[1])
            lo, hi = start // per_head * per_head, max(start, -(-stop // per_head) * per_head)
            heads = self.data(t, slice(lo, hi)).reshape(hi - lo, t.nbytes // max(1, t.dims[1]))
            raw = heads[unpermuted_order(hi - lo, (hi - lo) // per_head)[start - lo:stop - lo]]
        else:
            raw = self.data(t, rows)
        raw = raw.reshape(-1, t.dims[0] // kind.values, kind.bytes)
        first = rows.start or 0 if rows is not None else 0
        for at in kind.float16_at:
            if (bad := first_nonfinite_float16(raw, at)) is not None:
                raise self._nonfinite_scale(name, first * raw.shape[1] + bad)
        return t.type.value, torch.from_numpy(raw.reshape(raw.shape[0], -1))

    def pack_into(self, name: str, out: torch.Tensor, row: int, n: int):
        """Tensor `name`, a matrix of a type the kernels multiply as stored, read and packed into its rows row.. of
        out, the records of an n-row projection (kernels.pack_gguf's layout; rows in Hugging Face's order, every
        float16 scale checked), by the kernels' threads a few rows at a time (kernels.read_pack_gguf); a BF16 one
        into the tiles of kernels.tile_int8, every value checked."""
        t = self._tensor(name)
        kind, rows = kernels.block_kind(t.type.value), t.dims[1]
        source, group = None, kind.tile
        if self._permuted(name):  # each unit of rows the threads take holds whole heads: one read each
            heads = self._heads(name, rows)
            source, group = torch.from_numpy(unpermuted_order(rows, heads)), math.lcm(kind.tile, rows // heads)
        bad = read_pack(self._fd(), self.path, name, t.offset, source, out, row, rows, n, t.type.value, group)
        if bad >= 0:
            if not kind.float16_at:
                raise CheckpointError(f"{self.path}: tensor {name!r} holds non-finite values (inf or nan) as "
                                      f"{t.type.name}")
            raise self._nonfinite_scale(name, bad)
        self._check_padding(t)

    def _nonfinite_scale(self, name: str, index: int) -> CheckpointError:
        """The error for block `index` (row * blocks + block, rows in Hugging Face's order) of block tensor `name`,
        one of whose float16 scales is inf or nan."""
        t = self._tensor(name)
        kind, row_bytes = GGUF_TYPES[t.type.value], t.nbytes // t.dims[1]
        row, block = divmod(index, t.dims[0] // kind.values)
        file_row = int(unpermuted_order(t.dims[1], self._heads(name, t.dims[1]))[row]) if self._permuted(name) else row
        for at in kind.float16_at:
            bits = int.from_bytes(os.pread(self._fd(), 2, t.offset + file_row * row_bytes + block * kind.bytes + at),
                                  "little")
            if bits & 0x7C00 == 0x7C00:
                return CheckpointError(f"{self.path}: tensor {name!r} ({t.type.name}) has a float16 scale that is "
                                       f"inf or nan (bytes {at}..{at + 1} of block {block} of row {row})")
        raise AssertionError(f"{name}: block {index} has no inf or nan scale")

    def _permuted(self, name: str) -> bool:
        """Whether llama.cpp's converter permuted tensor `name`'s rows for its rotary layout."""
        return self.architecture.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                                "k_proj.bias"))

    def _norm_offset(self, name: str) -> float:
        """What llama.cpp's converter added to norm weight `name` (Gemma's 1 + weight); 0 elsewhere."""
        return self.architecture.norm_offset if name.endswith("norm.weight") else 0

    def _hf_rows(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The tensor as Hugging Face's checkpoint holds it: the q/k rows llama.cpp's converter permuted put back
        in order, and a norm weight it stored plus an offset (Gemma's 1 + weight) less that offset."""
        if self._norm_offset(name):
            return weight - self._norm_offset(name)
        if self._permuted(name):
            weight = unpermute(weight, self._heads(name, weight.shape[0]))
        return weight

    def _heads(self, name: str, rows: int) -> int:
        """The heads of permuted tensor `name` (q or k), whose `rows` rows must be pairs of rows of each head."""
        heads = self.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        if rows % (2 * heads):
            raise CheckpointError(f"{self.path}: tensor {name!r} has {rows} rows, not pairs of rows for each of "
                                  f"{heads} heads")
        return heads

    def read_into(self, name: str, dest: torch.Tensor):
        """Copy tensor `name` into `dest`, refusing inf and nan (also from a conversion that overflows); straight
        into dest a chunk at a time where the values go in as they are stored."""
        if self._permuted(name) or self._norm_offset(name) or not dest.is_contiguous():
            dest.copy_(self.read(name))
        else:
            self._dequantize_into(self._tensor(name), dest)
        if not kernels.all_finite(dest):  # read again to tell a value the file holds from one dest's dtype cannot
            check_finite(dest, self.path, name, None if dest.dtype == torch.float32 else self.read(name))

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._tensors[name]


@dataclass(frozen=True)
class TokenizerData:
    """What a GGUF says of its tokenizer, as plain data: `tokenizer.ggml.*` checked, nothing interpreted.

    `types` are llama.cpp's token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    6 byte); `merges` are "left right" strings; `chat_template` is a string, or {name: template} when
    the file names some (`tokenizer.chat_template.NAME`).
    """
    source: str
    arch: str | None
    model: str
    pre: str | None
    tokens: list
    types: list
    scores: list | None
    merges: list | None
    bos: int | None
    eos: tuple
    unk: int | None
    pad: int | None
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    chat_template: str | dict | None


END_OF_TURN = "<end_of_turn>"  # Gemma's; llama.cpp ends a generation at it by its text, as no key names it


def tokenizer_data(header: GGUFHeader) -> TokenizerData:
    """The tokenizer metadata of any GGUF, whatever its architecture, checked for type and range; `eos` are the
    ids that end a generation: EOS, end-of-turn and end-of-message, and the token END_OF_TURN where there is one."""
    path = header.path

    def check(key, ok, expected):
        if not ok:
            raise CheckpointError(f"{path}: GGUF metadata {key} is malformed: expected {expected}")

    def flag(key):
        value = header.get(key, None)
        check(key, value is None or isinstance(value, bool), "true or false")
        return value

    model = header.get("tokenizer.ggml.model")
    check("tokenizer.ggml.model", isinstance(model, str), "a string")
    pre = header.get("tokenizer.ggml.pre", None)
    check("tokenizer.ggml.pre", pre is None or isinstance(pre, str), "a string")

    def array_of(key, kinds, expected, *default):  # its items checked by their declared type, not one by one
        field = header.field(key)
        check(key, field is None or field.type == GGUFValueType.ARRAY and field.item_type in kinds, expected)
        return header.get(key, *default)

    tokens = array_of("tokenizer.ggml.tokens", (GGUFValueType.STRING,), "a non-empty list of strings")
    check("tokenizer.ggml.tokens", bool(tokens), "a non-empty list of strings")
    types = array_of("tokenizer.ggml.token_type", INTEGERS, "one integer type per token", [1] * len(tokens))
    check("tokenizer.ggml.token_type", len(types) == len(tokens), "one integer type per token")
    scores = array_of("tokenizer.ggml.scores", INTEGERS + FLOATS, "one number per token", None)
    check("tokenizer.ggml.scores", scores is None or len(scores) == len(tokens), "one number per token")
    merges = array_of("tokenizer.ggml.merges", (GGUFValueType.STRING,), "'left right' strings", None)
    check("tokenizer.ggml.merges", merges is None or all(m.count(" ") == 1 for m in merges), "'left right' strings")
    ids = {key: header._int(f"tokenizer.ggml.{key}_token_id", None, minimum=0)
           for key in ("bos", "unknown", "padding")}
    for key, i in (*ids.items(), *(("eos", i) for i in header.eos_ids())):
        check(f"tokenizer.ggml.{key}_token_id", i is None or i < len(tokens), f"ids below {len(tokens)}, got {i}")
    template = header.get("tokenizer.chat_template", None)
    check("tokenizer.chat_template", template is None or isinstance(template, str), "a string")
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix):]: header.get(key) for key in header.keys() if key.startswith(prefix)}
    for name, text in named.items():
        check(prefix + name, isinstance(text, str), "a string")
    if named:
        template = {**({"default": template} if template is not None else {}), **named}
    eos = header.eos_ids()
    if END_OF_TURN in tokens and tokens.index(END_OF_TURN) not in eos:
        eos.append(tokens.index(END_OF_TURN))
    arch = header.get("general.architecture", None)
    return TokenizerData(
        source=str(path), arch=arch if isinstance(arch, str) else None, model=model, pre=pre, tokens=tokens,
        types=types, scores=scores, merges=merges, bos=ids["bos"], eos=tuple(eos), unk=ids["unknown"],
        pad=ids["padding"], add_bos=flag("tokenizer.ggml.add_bos_token"), add_eos=flag("tokenizer.ggml.add_eos_token"),
        add_space_prefix=flag("tokenizer.ggml.add_space_prefix"), chat_template=template)


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`, which interleaves each head's two rotary halves row by row."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermuted_order(rows: int, n_heads: int) -> np.ndarray:
    """The file's row of each of unpermute's output rows: gathering a block tensor's rows by it (a copy of whole
    rows) is many times faster than PyTorch's copy of the transposed view."""
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(0, 2, 1).reshape(-1)
