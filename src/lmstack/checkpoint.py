"""Safetensors checkpoints: one file, an explicit file, or a sharded index; read lazily, a slice at a time.

Headers are parsed and checked here, once, before a tensor's byte is read, so a hostile file is refused
with its path and tensor name instead of crashing or allocating what it claims.
"""

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernels
from .config import UnsupportedModel, parse_json, read_json

READ_SLICE_BYTES = 1 << 20
PACK_UNIT_BYTES = 256 << 10  # a packed tensor's bytes a thread reads and packs at a time: they stay in its core's L2
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

DTYPES = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
}
# safetensors dtypes that are well formed but that we do not read
OTHER_DTYPES = ("U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64")


class CheckpointError(ValueError):
    """A checkpoint file is malformed, or does not hold what the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple
    file: Path


PARALLEL_READ_BYTES = 1 << 20  # reads this large are split over the kernels' threads


def pread_into(fd: int, buffer, offset: int, path, what: str):
    """Fill `buffer` (a writable buffer) from the file at `offset`; a file cut short since it was opened is named."""
    view, done = memoryview(buffer).cast("B"), 0
    if len(view) >= PARALLEL_READ_BYTES and kernels.loaded():
        done = kernels.pread_parallel(fd, offset, view)
        if done < 0:
            raise OSError(-done, f"{path}: {what} cannot be read: {os.strerror(-done)}")
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path}: {what} cannot be read: the file was cut short since it was opened")
        done += n


def read_pack(fd: int, path, name: str, offset: int, source, out, row: int, rows: int, n: int, qtype: int,
              group: int) -> int:
    """kernels.read_pack_gguf of tensor `name`, whose bytes lie at `offset` of file `path`, each thread taking about
    PACK_UNIT_BYTES of rows at a time, a multiple of `group` rows; a failed read or a file cut short refused by name:
    the first block holding a non-finite value or scale, or -1."""
    row_bytes = out.shape[1] * kernels.block_kind(qtype).bytes
    unit = group * max(1, PACK_UNIT_BYTES // (group * max(1, row_bytes)))
    bad, error = kernels.read_pack_gguf(fd, offset, source, out, row, rows, n, qtype, unit)
    if error < 0:
        raise CheckpointError(f"{path}: tensor {name!r} cannot be read: the file was cut short since it was opened")
    if error:
        raise OSError(error, f"{path}: tensor {name!r} cannot be read: {os.strerror(error)}")
    return bad


def check_finite(tensor: torch.Tensor, path, name: str, source: torch.Tensor | None = None):
    """Refuse inf and nan in a tensor as it is read, naming file and tensor; called on what was just written,
    while it is still in cache. `source`: the values it was converted from, where a finite one may have overflowed."""
    if tensor.is_floating_point() and not kernels.all_finite(tensor):
        if source is not None and kernels.all_finite(source):
            raise CheckpointError(f"{path}: tensor {name!r} holds values that overflow to inf when stored as "
                                  f"{str(tensor.dtype).removeprefix('torch.')} (which reaches "
                                  f"±{torch.finfo(tensor.dtype).max:.4g})")
        raise CheckpointError(f"{path}: tensor {name!r} holds non-finite values (inf or nan) as {tensor.dtype}")


class SafetensorsFile:
    """One .safetensors file: header parsed and checked once on open, tensors read with pread.

    Reading, not mapping: the header is never parsed again (the `safetensors` library re-parsed it on every
    read), a file cut short while open is refused by name, and its pages never count toward the process's
    resident memory.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such safetensors file")
        self._fh = open(self.path, "rb", buffering=0)
        try:
            self._tensors, self._offsets = _read_header(self.path, self._fh)
        except BaseException:
            self._fh.close()
            raise
        self.closed = False

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype, shape = self._tensors[name]
        return TensorInfo(dtype, shape, self.path)

    def read(self, name: str, bf16: str = "widen") -> torch.Tensor:
        """The tensor as torch; bf16="widen" gives bfloat16 as float32, "bits" keeps it bfloat16."""
        if bf16 not in ("widen", "bits"):
            raise ValueError(f"bf16 must be 'widen' or 'bits', got {bf16!r}")
        info = self.info(name)
        tensor = torch.empty(info.shape, dtype=DTYPES[info.dtype][0])
        if tensor.numel():
            pread_into(self._fd(), tensor.view(-1).view(torch.uint8).numpy(), self._offsets[name], self.path,
                       f"tensor {name!r}")
        if info.dtype == "BF16" and bf16 == "widen":
            tensor = tensor.float()
        return tensor

    def read_into(self, name: str, dest: torch.Tensor):
        """Read tensor `name` into `dest`: straight into it where the dtypes agree, else converted a slice of about
        1 MiB at a time; inf and nan (also from a conversion that overflows) are refused.

        No full-size transient: a load never holds a second copy of the largest tensor, and the
        allocator is never handed a huge block to free (which would make it keep later ones).
        """
        info = self.info(name)
        if tuple(dest.shape) != info.shape:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(info.shape)}, "
                                  f"the destination {list(dest.shape)}")
        dtype, size = DTYPES[info.dtype]
        shape = info.shape or (1,)
        target = dest.reshape(shape)  # a view: a scalar as one row
        row_bytes = math.prod(shape[1:]) * size
        if not shape[0] or not row_bytes:
            return
        if dest.dtype == dtype and dest.is_cpu and dest.is_contiguous():  # read in place: no slice copied twice
            pread_into(self._fd(), target.view(-1).view(torch.uint8).numpy(), self._offsets[name], self.path,
                       f"tensor {name!r}")
            check_finite(target, self.path, name)
            return
        rows = max(1, READ_SLICE_BYTES // row_bytes)
        buffer = torch.empty(min(rows, shape[0]) * row_bytes, dtype=torch.uint8)
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            chunk = buffer[:n * row_bytes]
            pread_into(self._fd(), chunk.numpy(), self._offsets[name] + start * row_bytes, self.path,
                       f"tensor {name!r}")
            values = chunk.view(dtype).view(n, *shape[1:])
            target[start:start + n].copy_(values)
            check_finite(target[start:start + n], self.path, name, values)

    def pack_into(self, name: str, out: torch.Tensor, row: int, n: int):
        """Tensor `name`, a BF16 matrix, read straight into kernels.tile_int8's tiles (out, in bytes: kernels.
        packed_shape(kernels.BF16, n, k)) as rows row.. of an n-row projection, every value checked, by the
        kernels' threads a few rows at a time (kernels.read_pack_gguf reads BF16 rows as blocks kept whole)."""
        info = self.info(name)
        if info.dtype != "BF16" or len(info.shape) != 2 or out.dim() != 3 or out.shape[1] * 32 != info.shape[1]:
            raise ValueError(f"{self.path}: tensor {name!r} ({info.dtype}, {list(info.shape)}) is not a BF16 matrix "
                             f"of the tiles' {out.shape[1] * 32 if out.dim() == 3 else '?'} columns")
        offset = self._offsets[name]
        if read_pack(self._fd(), self.path, name, offset, None, out, row, info.shape[0], n, kernels.BF16,
                     kernels.TILE) >= 0:
            raise CheckpointError(f"{self.path}: tensor {name!r} holds non-finite values (inf or nan) as BF16")

    def _fd(self) -> int:
        if self.closed:
            raise ValueError(f"{self.path}: read from a closed file")
        return self._fh.fileno()

    def close(self):
        self.closed = True
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_header(path: Path, fh) -> tuple[dict, dict]:
    """Parse and validate a safetensors header: {name: (dtype, shape)} and {name: where its data starts}.

    As the format and the `safetensors` library require, the tensors must tile the data exactly:
    no overlap, no gap, no trailing bytes. Each check runs before anything the header claims is allocated.
    """
    size = os.fstat(fh.fileno()).st_size
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: file too short for a safetensors header ({size} bytes)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"{path}: header length {header_len} exceeds the file ({size} bytes) "
                              f"or the limit ({MAX_HEADER_BYTES})")
    raw = bytearray(header_len)
    pread_into(fh.fileno(), raw, 8, path, "the header")
    raw = bytes(raw)
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: header does not start with '{{'")
    header = parse_json(raw, f"{path}: header", CheckpointError)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_size = size - 8 - header_len
    tensors, starts, spans = {}, {}, []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype in OTHER_DTYPES:
            raise UnsupportedModel(f"{where}: dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
                or math.prod(max(d, 1) for d in shape) >= 1 << 48):  # the library multiplies them in 64 bits
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of integers in [0, 2**40) "
                                  f"with fewer than 2**48 elements")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} outside the data ({data_size} bytes)")
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                f"{where}: dtype {dtype} and shape {shape} need {nbytes} bytes, offsets give {offsets[1] - offsets[0]}")
        tensors[name] = (dtype, tuple(shape))
        starts[name] = 8 + header_len + offsets[0]
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves bytes {end}..{begin} unused"
            raise CheckpointError(f"{path}: tensor {name!r} {what}")
        end = stop
    if end != data_size:
        raise CheckpointError(f"{path}: {data_size - end} bytes after the last tensor belong to none")
    return tensors, starts


class Checkpoint:
    """All tensors of a checkpoint: one .safetensors file, or the shards its index's weight map names.

    `files` are the .safetensors paths; `weight_map` maps each tensor name to the file that holds it, by
    its path relative to `root` as an index spells it, or is None when `files` is one file (its header
    lists its tensors). Every header is read and checked here, so a map that places a tensor in a file
    that does not hold it is refused before a tensor's byte is read. `open(path)` finds the files of the
    three layouts.
    """

    def __init__(self, files, weight_map, root):
        self.root = Path(root)
        paths = [Path(f) for f in files]
        self._files: dict = {}
        if weight_map is None:
            if len(paths) != 1:
                raise ValueError(f"without a weight_map, files must be one .safetensors file, got {len(paths)}")
            self.path, self._where = paths[0], {}
            self._files[None] = SafetensorsFile(paths[0])
            return
        self.path, self._where = self.root, dict(weight_map)
        by_name = {}
        for path in paths:
            if not path.is_relative_to(self.root):
                raise CheckpointError(f"{path}: not inside the checkpoint directory {self.root}")
            by_name[path.relative_to(self.root)] = path
        try:  # the shards opened so far are closed if a later one is refused
            for tensor, name in self._where.items():
                key = Path(name)
                if key not in by_name:
                    raise CheckpointError(f"{self.root}: weight_map places tensor {tensor!r} in {name!r}, "
                                          f"which is not one of the checkpoint's files")
                if name not in self._files:
                    self._files[name] = SafetensorsFile(by_name[key])
                if tensor not in self._files[name]._tensors:
                    raise CheckpointError(f"{by_name[key]}: lacks tensor {tensor!r}, which the index places in "
                                          f"shard {name!r}")
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path) -> "Checkpoint":
        """A single model.safetensors, an explicit .safetensors path, or a directory holding
        model.safetensors.index.json and its shards."""
        path = Path(path)
        if path.is_file():
            return cls([path], None, path.parent)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if single.is_file():  # the shards' rule: with symlinks followed, it stays inside the directory
            return cls([_shard_path(path, single, single.name, kind="file")], None, path)
        if not index.is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        where = _read_index(index)
        names = dict.fromkeys(where.values())
        return cls([_shard_path(path, index, name) for name in names], where, path)

    def _file(self, name: str) -> SafetensorsFile:
        if not self._where:
            return self._files[None]
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r} in the index")
        return self._files[self._where[name]]

    def names(self) -> list[str]:
        return list(self._where) if self._where else self._files[None].names()

    def __contains__(self, name: str) -> bool:
        return name in (self._where if self._where else self._files[None]._tensors)

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def read(self, name: str, bf16: str = "widen") -> torch.Tensor:
        return self._file(name).read(name, bf16=bf16)

    def read_into(self, name: str, dest: torch.Tensor):
        self._file(name).read_into(name, dest)

    def pack_into(self, name: str, out: torch.Tensor, row: int, n: int):
        self._file(name).pack_into(name, out, row, n)

    def close(self):
        for file in self._files.values():
            file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shard_path(root: Path, index: Path, name: str, kind: str = "shard") -> Path:
    """A file of the checkpoint (a shard the index names): a relative path without '..' that, symlinks followed,
    stays in the directory."""
    if not name or "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{index}: {kind} {name!r} lies outside the checkpoint directory "
                              f"(an empty, absolute or '..' path)")
    try:
        shard = (root / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{index}: {kind} {name!r} cannot be resolved ({e})") from None
    if root.resolve() not in shard.parents:
        raise CheckpointError(f"{index}: {kind} {name!r} lies outside the checkpoint directory (symlinks followed)")
    if not shard.is_file():
        raise FileNotFoundError(f"{index}: names {kind} {name!r}, which does not exist")
    return root / name


def _read_index(index: Path) -> dict:
    where = read_json(index, CheckpointError).get("weight_map")
    if not isinstance(where, dict) or not where or not all(isinstance(v, str) for v in where.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names (got "
                              f"{type(where).__name__}{'' if where else ', empty'})")
    return where


DTYPE_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items()}


class TensorDict:
    """Tensors by checkpoint name, held in memory, read as a checkpoint's are (CausalLM(plan, weights))."""

    path = "weights"

    def __init__(self, weights):
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must map checkpoint names to tensors, got {type(weights).__name__}")
        for name, tensor in weights.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weights[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
        self._weights = weights

    def names(self) -> list[str]:
        return list(self._weights)

    def __contains__(self, name: str) -> bool:
        return name in self._weights

    def info(self, name: str) -> TensorInfo:
        tensor = self._weights[name]
        if not (tensor.is_floating_point() or tensor.dtype in DTYPE_NAMES):
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {tensor.dtype}, expected a float dtype")
        return TensorInfo(DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape), self.path)

    def read_into(self, name: str, dest: torch.Tensor):
        dest.copy_(self._weights[name])
        check_finite(dest, self.path, name)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
