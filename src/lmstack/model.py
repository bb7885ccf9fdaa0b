"""CausalLM: embedding gather -> blocks -> final norm -> head, with a decode state the caller owns."""

import ctypes
import ctypes.util
import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import grammar, memory
from .blocks.mamba1 import Mamba1Block, RecurrentContext
from .blocks.mamba2 import Mamba2Block
from .blocks.transformer import AttentionContext, PagedContext, RMSNorm, TransformerBlock
from .checkpoint import Checkpoint, CheckpointError, TensorDict
from .config import ConfigError, HFConfig, ModelPlan, UnsupportedModel, plan_for, read_json, shown
from .formats import (QUANTIZED, GGUFBlocks, GGUFLinear, MatvecLinear, check_format, convert, head_projection,
                      profile_of, resolve)
from .gguf import BLOCK_TYPES, GGUFFile, is_gguf
from . import kernels, lookup
from .rope import Rotary
from .decoding import Decoder
from .sampling import Sampler
from .threads import Threads

RECURRENT_BLOCKS = {"mamba1": Mamba1Block, "mamba2": Mamba2Block}


def _block(plan: ModelPlan, i: int, dtype) -> nn.Module:
    """Layer i of the plan's kind, its parameters in dtype (Mamba blocks keep a few float32: blocks/mamba1.py)."""
    if plan.kind in RECURRENT_BLOCKS:
        return RECURRENT_BLOCKS[plan.kind](plan.d_model, plan.block_options, dtype)
    experts = bool(plan.layer_experts) and plan.layer_experts[i]
    return TransformerBlock(plan.d_model, plan.block_options, plan.layer_windows[i], experts).to(dtype)


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory():
    """Hand freed heap pages back to the OS (glibc keeps them, so a load's transients would add up)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


PACK_CHUNK_BYTES = 2 << 20  # a GGUF tensor's bytes read and packed at a time


def _as_stored(source: GGUFFile, name: str, k: int, mapped: bool = False):
    """A GGUF tensor as weight_format gguf keeps it: blocks, or an exact float32 or bfloat16 tensor (with `mapped`,
    a BF16 one in the file's mapping where GGUFFile.mappable)."""
    return _stored_parts(source, [name], k, mapped=mapped)[0]


def _stored_parts(source: GGUFFile, names: list, k: int, bf16_tiles: bool = False, mapped: bool = False) -> list:
    """The parts of a fused projection as _as_stored keeps them, consecutive ones of one block type as one; with
    bf16_tiles (a projection's, not the embedding's), BF16 ones read straight into one tiled MatvecLinear, or with
    `mapped` too, where mappable, each an untiled MatvecLinear on the file's mapping."""
    groups = []  # [block type or None, names]
    for name in names:
        info = source.info(name)
        qtype = _block_type(info, bf16_tiles and not _in_file(source, name, mapped))
        if qtype is not None and groups and groups[-1][0] == qtype:
            groups[-1][1].append(name)
        else:
            groups.append((qtype, [name]))
    return [_packed_blocks(source, group, qtype, k) if qtype is not None else
            _unpacked(source, group[0], bf16_tiles, mapped) for qtype, group in groups]


def _in_file(source: GGUFFile, name: str, mapped: bool) -> bool:
    """Whether tensor `name` stays in the file's mapping: a load with `mapped`, a matrix GGUFFile.mappable."""
    return mapped and source.mappable(name)


def _unpacked(source: GGUFFile, name: str, projection: bool, mapped: bool):
    """A part kept as an exact tensor (GGUFFile.stored); a projection's BF16 one in the file's mapping as an untiled
    MatvecLinear, which GGUFLinear would otherwise tile (a copy)."""
    weight = source.stored(name, mapped=mapped)
    if projection and _in_file(source, name, mapped):
        return MatvecLinear(weight, None, torch.bfloat16, tile=False)
    return weight


def _packed_blocks(source: GGUFFile, names: list, qtype: int, k: int) -> GGUFBlocks | MatvecLinear:
    """Tensors `names` (consecutive parts of one projection, of one block type) as one GGUFBlocks (_packed), BF16
    ones (kernels.BF16) as one MatvecLinear's tiles."""
    packed, n = _packed(source, names, qtype, k)
    if qtype == kernels.BF16:
        return MatvecLinear.from_tiles(packed, n, k)
    return GGUFBlocks.from_packed(packed, qtype, n, k)


def _packed(source, names: list, qtype: int, k: int) -> tuple[torch.Tensor, int]:
    """(records, rows) of tensors `names`, consecutive parts of one projection of one type, each packed into the
    records a few rows at a time (by each of the kernels' threads, source.pack_into; without the kernels a chunk at
    a time): beside the packed weights only those rows of the file's bytes are held, never a second copy of a whole
    tensor."""
    sizes = [source.info(name).shape[0] for name in names]
    n = sum(sizes)
    packed = memory.empty_bytes(kernels.packed_shape(qtype, n, k))
    row = 0
    for name, size in zip(names, sizes):
        if kernels.available():
            source.pack_into(name, packed, row, n)
        else:
            step = max(1, PACK_CHUNK_BYTES // max(1, source.nbytes(name) // size))
            for start in range(0, size, step):
                kernels.pack_gguf(source.stored(name, slice(start, start + step))[1], qtype, packed, row + start, n)
        row += size
    return packed, n


def packed_bytes(source: GGUFFile, embed: str | None = None, mapped: bool = False) -> int:
    """At least the bytes _packed_blocks takes for the file's tensors: each matrix of a block type, and each BF16 one
    but the embedding `embed` (which lookups read untiled) and, with `mapped`, the mappable ones, as its tiles of
    rows (a fused projection's parts share tiles, so take no more), 64 for alignment (memory.Prefault.take)."""
    total = 0
    for name in source.names():
        info = source.info(name)
        qtype = _block_type(info, bf16_tiles=name != embed and not _in_file(source, name, mapped))
        if qtype is not None:
            total += math.prod(kernels.packed_shape(qtype, *info.shape)) + 64
    return total


def _block_type(info, bf16_tiles: bool = False) -> int | None:
    """The ggml type id of a matrix whose blocks lmstack multiplies as stored (BLOCK_TYPES), or, with bf16_tiles,
    of a BF16 matrix kernels.tile_int8 can tile (read into its tiles as blocks are packed); else None."""
    if len(info.shape) != 2:
        return None
    if bf16_tiles and info.dtype == "BF16" and info.shape[1] % kernels.BF16_TILES.values == 0 and kernels.available():
        return kernels.BF16
    return next((t.value for t in BLOCK_TYPES if t.name == info.dtype), None)


def _gguf_bytes(source, name: str) -> int:
    """The bytes a tensor takes under weight_format gguf: as stored, or as float32 where widened."""
    info = source.info(name)
    as_stored = info.dtype in ("BF16", "F32") or info.dtype in (t.name for t in BLOCK_TYPES)
    return source.nbytes(name) if as_stored else 4 * math.prod(info.shape)


def _to_empty(module: nn.Module, device: torch.device, unread: set = frozenset()) -> nn.Module:
    """module.to_empty(device), but for the parameters named in `unread`, which stay on meta (under gguf a dense
    projection matrix would take several times its blocks, only to be dropped). Made with torch.empty: torch's
    empty_like of a meta tensor imports sympy, 35 MB of resident memory for nothing."""
    for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if key not in unread and tensor.device != device:
            owner, _, attribute = key.rpartition(".")
            sub = module.get_submodule(owner)
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if isinstance(tensor, nn.Parameter):
                sub.register_parameter(attribute, nn.Parameter(empty, requires_grad=tensor.requires_grad))
            else:
                sub.register_buffer(attribute, empty)
    return module


def _parameter_rows(block: nn.Module, key: str, rows: slice | None) -> torch.Tensor:
    param = block.get_parameter(key)
    return param if rows is None else param[rows]


def _check_tensors(plan: ModelPlan, checkpoint):
    """Every tensor the plan reads is there, floating point, with the shape it fills: checked on meta blocks,
    before anything is allocated, so a config that claims absurd sizes costs no memory."""
    shapes = {plan.embed_name: (plan.vocab_size, plan.d_model), plan.norm_name: (plan.d_model,)}
    if plan.head_name:
        shapes[plan.head_name] = (plan.vocab_size, plan.d_model)
    with torch.device("meta"):
        for i in range(plan.n_layers):
            block = _block(plan, i, torch.float32)
            for key, name, rows in plan.layer_weights(i):
                shapes[name] = tuple(_parameter_rows(block, key, rows).shape)
    for name, shape in shapes.items():
        if name not in checkpoint:
            raise CheckpointError(f"{checkpoint.path}: missing tensor {name!r}")
        info = checkpoint.info(name)
        if info.shape != shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, the config implies {list(shape)}")
        if info.dtype in ("I64", "I32", "I16", "I8", "U8", "BOOL"):
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected a float dtype")


@dataclass
class CausalLMState:
    """Per-layer decode state (KV caches, or conv and SSM states), preallocated; owned by the caller.

    `layers` holds one block state per layer in stack order; `max_tokens` is the capacity the caches were
    allocated for (None: no limit, a recurrent state does not grow). `length` cache slots are filled;
    row b's real tokens start at slot `offsets[b]` (left padding; default none).
    """

    batch_size: int
    max_tokens: int | None
    layers: list
    _: KW_ONLY
    owner: object = field(default=None, repr=False)
    offsets: torch.Tensor | None = None
    tokens: torch.Tensor | None = field(default=None, repr=False)  # (B, max_tokens) ids fed, kept for LongRoPE
    length: int = 0

    def __post_init__(self):
        if self.offsets is None:
            self.offsets = torch.zeros(self.batch_size, dtype=torch.long, device=getattr(self.owner, "device", "cpu"))

    @property
    def positions(self) -> torch.Tensor:
        """The position the next token of each row takes."""
        return self.length - self.offsets


def resolve_device(device) -> torch.device:
    """'auto' (CUDA when present), 'cpu', 'gpu', or any torch device string / torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "gpu":
        device = "cuda"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not 'auto', 'cpu', 'gpu' or a torch device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type not in ("cpu", "mps"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu, cuda, mps)")
    if device.type != "cpu" and device.index is None:  # "cuda" -> "cuda:0": the device its tensors report
        device = torch.empty(0, device=device).device
    return device


def eos_ids(config, directory: Path | None = None, vocab_size: int | None = None) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's eos_token_id, else the config's; each an
    integer id below vocab_size, or the file is refused by name."""
    value, where = None, None
    generation = directory / "generation_config.json" if directory else None
    if generation and generation.is_file():
        value, where = read_json(generation).get("eos_token_id"), generation
    if value is None:
        value, where = config.get("eos_token_id"), getattr(config, "path", None) or "config"
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    limit = vocab_size if vocab_size is not None else 1 << 63
    if not all(type(v) is int and 0 <= v < limit for v in values):
        raise ConfigError(f"{where}: eos_token_id = {shown(value)}, expected a token id or a list of them, "
                          f"each an integer in [0, {limit})")
    return tuple(values)


def _moved(value, device):
    """A copy of a per-forward context (dataclass, dict or tensor) with its tensors on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


ROWS = (list, tuple, np.ndarray, torch.Tensor)  # what a row of ids may be; anything else in a list is a token


def _holds_bool(ids) -> bool:
    """Whether nested lists hold a bool, which numpy would silently take for 0 or 1."""
    return any(isinstance(x, (bool, np.bool_)) or (isinstance(x, (list, tuple)) and _holds_bool(x)) for x in ids)


def left_pad(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids, rectangular or ragged, as (B, L) left-padded with 0, and each row's padding."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(row, ROWS) for row in ids):
        rows = [as_ids(row)[0] for row in ids]
        if len({len(row) for row in rows}) > 1:
            width = max(len(row) for row in rows)
            offsets = torch.tensor([width - len(row) for row in rows])
            padded = torch.zeros(len(rows), width, dtype=torch.long)
            for row, offset, out in zip(rows, offsets, padded):
                out[offset:] = row
            return padded, offsets
    ids = as_ids(ids)
    return ids, torch.zeros(ids.shape[0], dtype=torch.long)


def as_ids(ids, *, column: bool = False) -> torch.Tensor:
    """Token ids from a tensor, numpy array or nested lists, as a (B, L) int64 tensor.

    A 1-D input is one row (L,), or with `column` one token per row (B,).
    """
    if isinstance(ids, torch.Tensor):
        tensor = ids
    else:
        if isinstance(ids, (list, tuple)) and _holds_bool(ids):
            raise TypeError("ids must be integers, got a bool among them")
        try:
            array = np.asarray(ids)
        except ValueError:
            raise ValueError("ids must be a rectangular tensor, array or nested list of integers") from None
        if array.dtype == object:
            raise ValueError("ids must be a rectangular tensor, array or nested list of integers")
        if array.size == 0 and array.dtype == np.float64:
            array = array.astype(np.int64)
        if array.dtype.kind not in "iub":
            raise TypeError(f"ids must be integers, got {array.dtype}")
        tensor = torch.from_numpy(array)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"ids must be integers, got {tensor.dtype}")
    if tensor.dim() == 1:
        tensor = tensor[:, None] if column else tensor[None]
    if tensor.dim() != 2:
        raise ValueError(f"ids must have shape (B, L) or (L,), got {tuple(tensor.shape)}")
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(f"ids must hold at least one token per row, got shape {tuple(tensor.shape)}")
    return tensor.long()


def _check_max_positions(plan: ModelPlan, max_positions):
    """max_positions, when given, is a positive integer within the config's max_position_embeddings."""
    if max_positions is None:
        return
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive integer, got {max_positions!r}")
    limit = plan.max_position_embeddings
    if limit is not None and max_positions > limit:  # positions the model was not trained for
        raise UnsupportedModel(f"max_positions {max_positions} exceeds the config's max_position_embeddings {limit}")


class CausalLM:
    """A causal language model: embedding gather, blocks, final norm and head, from a plan and its weights."""

    def __init__(self, plan: ModelPlan, weights, *, weight_format="float32", max_positions=None, device="auto",
                 numeric_profile=None):
        """A model from its plan and its weights by checkpoint name (what a safetensors file holds, or what
        `parameters()` returns at float32): weights made in memory, e.g. by a training run. They are checked
        as `load` checks a checkpoint's (missing, mis-shaped, non-finite tensors are refused by name)."""
        self._build(plan, partial(TensorDict, weights), weight_format=weight_format,
                    numeric_profile=numeric_profile, max_positions=max_positions, device=device)

    d_model = property(lambda self: self.plan.d_model)
    n_layers = property(lambda self: self.plan.n_layers)
    kind = property(lambda self: self.plan.kind, doc='"transformer", "mamba1" or "mamba2"')
    norm_eps = property(lambda self: self.plan.norm_eps, doc="the final norm's epsilon")

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, path, *, weight_format="float32", numeric_profile=None, max_positions=None, device="auto",
             progress=None, mmap=True):
        """Load a Hugging Face checkpoint directory (or a .safetensors file beside its config.json), or a GGUF file
        (a path, or an open GGUFFile, which the load closes).

        `weight_format` is how projection matrices are stored, `numeric_profile` the arithmetic
        (see formats.py for the pairs). `progress(done, total)` is called after each tensor is read.
        Under weight_format gguf, `mmap` keeps BF16 matrices in a read-only mapping of the file, the page cache's
        pages shared, as llama.cpp does (GGUFFile.mapped): nothing copied, a start several times sooner; without
        it they are copied into the kernels' tiles, which many rows a step (a server's batches) read faster.
        """
        if isinstance(path, GGUFFile) or is_gguf(path):  # an open GGUFFile spares parsing its metadata twice
            gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
            config, directory, open_source = gguf.config, None, lambda: gguf
        else:
            path = Path(path)
            config = HFConfig.from_json(path if path.is_dir() else path.parent)
            directory, open_source = config.path.parent, partial(Checkpoint.open, path)
        plan, model = plan_for(config), cls.__new__(cls)
        model._build(plan, open_source, weight_format=weight_format, numeric_profile=numeric_profile,
                     max_positions=max_positions, device=device, config=config,
                     eos=eos_ids(config, directory, plan.vocab_size), progress=progress, mapped=mmap)
        return model

    def _build(self, plan: ModelPlan, open_source, *, weight_format, numeric_profile, max_positions, device,
               config=None, eos=(), progress=None, mapped=False):
        """The one way a model is made: the arguments checked against the plan before the source of its
        weights is opened, the source's tensors before anything is allocated; then the weights read (and
        the source closed) a layer at a time."""
        self.dtype = resolve(weight_format, numeric_profile)  # the arithmetic: activations, caches, embedding
        self.numeric_profile = profile_of(self.dtype)
        _check_max_positions(plan, max_positions)
        # Where each block lives (ParallelCausalLM splits them; "meta": held by another pipeline process).
        # The embedding lives with the first block, the norm and head with the last.
        self.layer_devices = self._layer_devices(device, plan.n_layers)
        check_format(weight_format, plan, self.layer_devices)
        with open_source() as source:
            if weight_format == "gguf" and not isinstance(source, GGUFFile):
                raise ValueError(f"weight_format 'gguf' keeps a GGUF file's tensors as stored: "
                                 f"{source.path} is not a GGUF file")
            if weight_format == "gguf":
                source.check_as_stored()
            _check_tensors(plan, source)
            self.plan, self.config, self.eos_ids = plan, config, tuple(eos)  # eos_ids: where generation may stop
            self.weight_format, self.vocab_size = weight_format, plan.vocab_size
            self._mapped = mapped
            self.device = next(d for d in self.layer_devices if d.type != "meta")
            self.max_positions = plan.max_position_embeddings if max_positions is None else max_positions
            self._allocate(source)
            self._fill(source, progress)
        release_freed_memory()  # what the source held (a GGUF file's parsed metadata), before the head's copy
        if self.head is not None and self.head.device.type != "meta":
            self._store_head()

    def _layer_devices(self, device, n_layers: int) -> list[torch.device]:
        return [resolve_device(device)] * n_layers

    def _allocate(self, source):
        """Everything but the blocks' weights, which _fill allocates a layer at a time (blocks stay on meta), and,
        under weight_format gguf, the embedding and head, which _fill_gguf makes from the file's tensors."""
        plan, dtype = self.plan, self.dtype
        with torch.device("meta"):
            # quantized formats are filled in float32 and quantized from that, a layer at a time
            fill = torch.float32 if self.weight_format in QUANTIZED else dtype
            self.blocks = nn.ModuleList(_block(plan, i, fill) for i in range(plan.n_layers))
            self.norm = RMSNorm(plan.d_model, plan.norm_eps, plan.block_options.get("norm_offset"))
        self.blocks.requires_grad_(False)
        self._check_memory(source)
        first, last = self.layer_devices[0], self.layer_devices[-1]
        # a recurrent stack's final norm stays float32, like its residual stream (blocks/mamba1.py)
        _to_empty(self.norm.to(dtype if plan.kind == "transformer" else torch.float32), last)
        tied_here = plan.tie_embeddings and first == last  # else a tied head is a copy beside the norm
        if self.weight_format == "gguf":
            self.embed = self.head = None
        else:
            self.embed = torch.empty(plan.vocab_size, plan.d_model, dtype=self._embed_dtype(source), device=first)
            self.head = self.embed if tied_here else torch.empty_like(self.embed, device=last)
        self.head_projection = None  # the head's matmul, made once the head is loaded (_store_head)
        self.rotary = self.local_rotary = None  # local: the sliding layers' own settings, where they differ
        if plan.kind == "transformer":
            o = plan.block_options
            dim = o.get("rotary_dim", o["head_dim"])
            self.rotary = Rotary(o["rope"], dim, self.device)
            if "local_rope" in o:
                self.local_rotary = Rotary(o["local_rope"], dim, self.device)
        self.unused_names: list[str] = []
        self._weights: dict[str, torch.Tensor] = {}
        self._converted: dict[str, tuple] = {}  # name -> (module, rows, attribute) of a re-stored projection

    def _embed_dtype(self, source) -> torch.dtype:
        """The embedding's (and head's) storage: the arithmetic's dtype, or bfloat16 under float32 arithmetic where
        the checkpoint stores them so, the format is not float32 and lmstack's kernels multiply bfloat16 weights in
        float32 (CPU): the same values in half the memory, and half the bytes the head reads at every token."""
        names = [self.plan.embed_name] + ([self.plan.head_name] if self.plan.head_name else [])
        if self.dtype == torch.float32 and self.weight_format != "float32" and kernels.available() and \
                all(device.type in ("cpu", "meta") for device in self.layer_devices) and \
                all(source.info(name).dtype == "BF16" for name in names):
            return torch.bfloat16
        return self.dtype

    def _check_memory(self, source):
        """Refuse, before allocating, weights larger than their devices can hold (counted as stored)."""
        stored = {"int8": 1, "int4": 0.5, "bfloat16": 2}.get(self.weight_format)  # bytes a weight, as stored
        need = Counter()
        if self.weight_format == "gguf":  # as the file stores them, or float32 where widened
            for i, device in enumerate(self.layer_devices):
                need[device] += sum(_gguf_bytes(source, name) for _, name, _ in self.plan.layer_weights(i))
            embed = _gguf_bytes(source, self.plan.embed_name)
        else:
            for block, device in zip(self.blocks, self.layer_devices):
                need[device] += sum(p.numel() * (stored or p.element_size()) for p in block.parameters())
            embed = self.plan.vocab_size * self.plan.d_model * self._embed_dtype(source).itemsize
        need[self.layer_devices[0]] += embed
        if not self.plan.tie_embeddings or self.layer_devices[0] != self.layer_devices[-1]:
            need[self.layer_devices[-1]] += _gguf_bytes(source, self.plan.head_name or self.plan.embed_name) \
                if self.weight_format == "gguf" else embed
        for device, nbytes in need.items():
            memory.ensure(int(nbytes), device, f"{self.plan.model_type} weights as {self.weight_format}")

    def _targets(self):
        """(checkpoint name, layer or None, device, destination) for every tensor the plan reads; a layer's
        destinations are callables, resolved once _fill has allocated that layer."""
        plan, gguf = self.plan, self.weight_format == "gguf"  # gguf: the embedding and head come from _fill_gguf
        if not gguf:
            yield plan.embed_name, None, self.embed.device, lambda: self.embed
        for i, block in enumerate(self.blocks):
            for key, name, rows in plan.layer_weights(i):
                yield name, i, self.layer_devices[i], partial(_parameter_rows, block, key, rows)
        yield plan.norm_name, None, self.norm.weight.device, lambda: self.norm.weight
        if not gguf and (plan.head_name or self.head is not self.embed):
            yield plan.head_name or plan.embed_name, None, self.head.device, lambda: self.head

    def _fill(self, checkpoint: Checkpoint, progress=None):
        targets = list(self._targets())  # names and shapes checked by _check_tensors
        self.unused_names = sorted(set(checkpoint.names()) - set(self.plan.weight_names()))
        targets = [t for t in targets if t[2].type != "meta"]  # meta: another process's share
        # layer -> its projection matrices, which _store_projections reads itself: under gguf as the file stores
        # them, under bfloat16 straight into bfloat16 or the kernels' tiles (never filled in float32 first)
        unread = {}
        if self.weight_format == "gguf" or self._bfloat16_read():
            unread = {i: {key for key, _, _ in self.plan.layer_weights(i) if key.endswith(".weight")
                          and key[:-len(".weight")] in getattr(block, "PROJECTIONS", ())}
                      for i, block in enumerate(self.blocks)}
        as_stored = {name for i, keys in unread.items() for key, name, _ in self.plan.layer_weights(i) if key in keys}
        for done, (name, layer, device, dest) in enumerate(targets, 1):
            if layer is not None and (done == 1 or targets[done - 2][1] != layer):
                _to_empty(self.blocks[layer], device, unread.get(layer, set()))  # a layer at a time: memory reused
            dest = dest()
            if name not in as_stored:
                with torch.no_grad():
                    checkpoint.read_into(name, dest)
            self._weights[name] = dest
            if layer is not None and (done == len(targets) or targets[done][1] != layer):
                self._store_projections(layer, checkpoint)  # its dense copy never coexists with another layer's
                release_freed_memory()
            if progress:
                progress(done, len(targets))
        if self.weight_format == "gguf":
            self._fill_gguf(checkpoint)

    def _fill_gguf(self, source: GGUFFile):
        """The embedding (its rows dequantized when looked up) and the head's projection from the file's tensors
        as stored; a tied head multiplies the embedding's own blocks."""
        plan, first, last = self.plan, self.layer_devices[0], self.layer_devices[-1]
        tied_here = plan.tie_embeddings and last.type != "meta"
        embed = _as_stored(source, plan.embed_name, plan.d_model, self._mapped) \
            if first.type != "meta" or tied_here else None
        if first.type != "meta":
            self.embed = embed
            if isinstance(embed, GGUFBlocks):
                self._converted[plan.embed_name] = (embed, None, "weight")
            else:
                self._weights[plan.embed_name] = embed
        if last.type != "meta":
            head = embed if plan.tie_embeddings else \
                _stored_parts(source, [plan.head_name], plan.d_model, bf16_tiles=True, mapped=self._mapped)[0]
            self.head_projection = GGUFLinear([head], None, self.dtype, tile=not plan.tie_embeddings)
            if plan.head_name:
                self._converted[plan.head_name] = (self.head_projection, None, "weight")

    def _store_head(self):
        """The head's matmul in its fast form (formats.head_projection); an untied dense head is dropped."""
        self.head_projection = head_projection(self.head, tied=self.plan.head_name is None)
        name = self.plan.head_name
        if name and self.head_projection.weight is not self.head:
            self._converted[name] = (self.head_projection, None, "weight")
            self._weights.pop(name, None)
            self.head = None

    def _bfloat16_read(self) -> bool:
        """Whether _store_projections reads bfloat16 projections itself (_bfloat16_projection): under float32
        arithmetic, which widens them as it multiplies, and under bfloat16 where the kernels tile them."""
        return self.weight_format == "bfloat16" and (self.dtype == torch.float32 or kernels.available())

    def _bfloat16_projection(self, source, i: int, path: str, linear: nn.Module) -> MatvecLinear:
        """Projection `path` of layer i stored in bfloat16, read from the checkpoint: where every part is a BF16
        matrix in a file, straight into the kernels' tiles (pack_into); else read into bfloat16 (each value
        rounded once, as .to(bfloat16) rounds it), which MatvecLinear tiles."""
        parts = self._parts(i, path)
        n, k, device = linear.out_features, linear.in_features, self.layer_devices[i]
        if device.type == "cpu" and kernels.available() and k % 32 == 0 and hasattr(source, "pack_into") and \
                all(source.info(name).dtype == "BF16" for name, _ in parts):
            tiles, _ = _packed(source, [name for name, _ in parts], kernels.BF16, k)
            return MatvecLinear.from_tiles(tiles, n, k, linear.bias, self.dtype)
        weight = torch.empty(n, k, dtype=torch.bfloat16, device=device)
        for name, rows in parts:
            source.read_into(name, weight if rows is None else weight[rows])
        return MatvecLinear(weight, linear.bias, self.dtype)

    def _parts(self, i: int, path: str) -> list[tuple[str, slice | None]]:
        """(checkpoint name, rows) of the parts of layer i's projection `path` (q, k and v of qkv), in row order."""
        parts = [(name, rows) for key, name, rows in self.plan.layer_weights(i) if key == f"{path}.weight"]
        return sorted(parts, key=lambda part: 0 if part[1] is None else part[1].start or 0)

    def _store_projections(self, i: int, source):
        """Re-store layer i's projection matrices in the weight format (formats.convert), or, where their dense
        parameters were left unread, make them from the checkpoint: under gguf from the file's tensors as stored,
        under bfloat16 read into bfloat16 (what convert would make of them)."""
        block = self.blocks[i]
        for path in getattr(block, "PROJECTIONS", ()):
            owner_path, attribute = path.rsplit(".", 1)
            owner = block.get_submodule(owner_path)
            linear = getattr(owner, attribute)
            if self.weight_format == "gguf":
                parts = _stored_parts(source, [name for name, _ in self._parts(i, path)], linear.in_features,
                                      bf16_tiles=True, mapped=self._mapped)
                stored = GGUFLinear(parts, linear.bias, self.dtype)
            elif self._bfloat16_read():
                stored = self._bfloat16_projection(source, i, path, linear)
            else:
                stored = convert(linear, self.weight_format, self.dtype)
            if stored is linear:
                continue
            if not all(kernels.all_finite(t.to_dense() if t.is_mkldnn else t) for t in vars(stored).values()
                       if isinstance(t, torch.Tensor) and t.is_floating_point()):
                names = [name for key, name, _ in self.plan.layer_weights(i) if key.startswith(path + ".")]
                raise CheckpointError(f"{', '.join(names)}: values overflow to inf when stored as {self.weight_format} "
                                      f"(bfloat16 reaches ±{torch.finfo(torch.bfloat16).max:.4g})")
            setattr(owner, attribute, stored)
            for key, name, rows in self.plan.layer_weights(i):
                if key.startswith(path + "."):
                    self._converted[name] = (stored, rows, key.rsplit(".", 1)[1])
                    del self._weights[name]
        if self.weight_format in QUANTIZED:  # what was filled in float32 takes the arithmetic's dtype
            block.to(self.dtype) if self.plan.kind == "transformer" else block.compute_in(self.dtype)
            for key, name, rows in self.plan.layer_weights(i):
                if name in self._weights:
                    param = block.get_parameter(key)
                    self._weights[name] = param if rows is None else param[rows]

    def parameters(self) -> dict[str, torch.Tensor]:
        """Loaded weights by checkpoint name: views into the fused block parameters, and for re-stored
        projections (int8, int4, packed bf16) their weights as the arithmetic sees them, dequantized."""
        weights = dict(self._weights)
        for name, (module, rows, attribute) in self._converted.items():
            tensor = module.dense_weight() if attribute == "weight" else module.bias
            weights[name] = tensor if rows is None else tensor[rows]
        return weights

    def __repr__(self):
        p = self.plan
        return (f"CausalLM({p.model_type}, layers={p.n_layers}, d_model={p.d_model}, vocab={p.vocab_size}, "
                f"weight_format={self.weight_format}, numeric_profile={self.numeric_profile}, "
                f"device={self.device})")

    # ---- state ---------------------------------------------------------------------------

    def allocate_state(self, batch_size: int, max_tokens: int | None = None) -> CausalLMState:
        """A decode state for `batch_size` rows and up to `max_tokens` tokens (default: max_positions).

        A recurrent model's state does not grow: without max_tokens (and max_positions) it takes any number.
        """
        max_tokens = self.max_positions if max_tokens is None else max_tokens
        checked = [("batch_size", batch_size)]
        if max_tokens is not None or self.rotary is not None:
            checked.append(("max_tokens", max_tokens))
        for name, value in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_positions is not None and max_tokens > self.max_positions:
            raise ValueError(f"max_tokens {max_tokens} exceeds max_positions {self.max_positions}")
        self._check_state_memory(batch_size, max_tokens)
        layers = [b.new_cache(batch_size, max_tokens, self.dtype, d) for b, d in zip(self.blocks, self.layer_devices)]
        tokens = None  # LongRoPE recomputes the sequence from its tokens once it passes the original context
        if self.rotary is not None and self.rotary.long is not None:
            tokens = torch.zeros(batch_size, max_tokens, dtype=torch.long, device=self.device)
        return CausalLMState(batch_size, max_tokens, layers, owner=self, tokens=tokens)

    def _check_state_memory(self, batch_size: int, max_tokens: int | None, extra: int = 0):
        """Refuse, before allocating, a decode state (and `extra` bytes on the model's device) that its devices
        cannot hold: a transformer's keys and values (a recurrent state does not grow with the tokens)."""
        need = Counter({self.device: extra})
        if self.plan.kind == "transformer":
            o = self.plan.block_options
            for device in self.layer_devices:
                need[device] += 2 * batch_size * o["n_kv_heads"] * o["head_dim"] * max_tokens * self.dtype.itemsize
        for device, nbytes in need.items():
            memory.ensure(nbytes, device, f"a decode state of {batch_size} x {max_tokens} tokens")

    def allocate_pages(self, n_blocks: int, block_size: int) -> list:
        """A paged KV pool of a transformer: per layer, n_blocks blocks of block_size slots (blocks/transformer.py)."""
        if self.rotary is None:
            raise ValueError(f"a {self.plan.kind} model keeps a recurrent state, not KV pages")
        return [b.new_pages(n_blocks, block_size, self.dtype, d) for b, d in zip(self.blocks, self.layer_devices)]

    @property
    def paged_positions(self) -> int | None:
        """The most positions a sequence may take in forward_paged: max_positions, or for LongRoPE its original
        context, past which the reference recomputes the keys the short factors rotated (KV pages keep them)."""
        if self.rotary is None or self.rotary.long is None:
            return self.max_positions
        return min(self.rotary.long[1], self.max_positions or self.rotary.long[1])

    def page_bytes(self, block_size: int) -> int:
        """The memory one block of block_size slots takes, over every layer's keys and values."""
        o = self.plan.block_options
        return 2 * self.plan.n_layers * o["n_kv_heads"] * o["head_dim"] * block_size * self.dtype.itemsize

    @torch.no_grad()
    def forward_paged(self, ids, positions, seqs, tables, slots, pages, rows) -> torch.Tensor:
        """Tokens of many sequences in one forward, reading and writing keys and values through block tables.

        ids, positions, seqs, slots (T,): each token, its position, its sequence (row of `tables`, (S, max_blocks))
        and the pool slot its keys and values go to; `pages` from allocate_pages. Returns float32 logits
        (len(rows), vocab) at the flat token indices `rows`.
        """
        x = self._embed(ids)[None]
        if self.rotary.long is not None:
            self._check_longrope_pages(positions, seqs)
        cos, sin = self.rotary(positions[None], self.dtype, seqs[None])  # (LongRoPE chooses per sequence)
        local = self.local_rotary(positions[None], self.dtype, seqs[None]) if self.local_rotary else None
        ctx = PagedContext(cos, sin, slots, tables, seqs, positions, local)
        if (stack := self._fused_stack(x, ctx)) is not None:
            x = stack.paged(x, cos, sin, [p.k for p in pages], [p.v for p in pages], slots, tables, seqs, positions,
                            *(local or (None, None)))
        else:
            for block, layer_pages in zip(self.blocks, pages):
                x = block(x, layer_pages, ctx)
        return self._logits(x[:, rows]).float()[0]

    def _check_longrope_pages(self, positions: torch.Tensor, seqs: torch.Tensor):
        """A paged sequence whose cached keys took LongRoPE's short factors cannot go past the original context:
        the reference would recompute them with the long ones, and KV pages (shared between prefixes) are not
        re-rotated. Refused by name rather than computed otherwise."""
        context = self.rotary.long[1]
        for s in seqs.unique().tolist():
            p = positions[seqs == s]
            if 0 < int(p.min()) <= context < int(p.max()) + 1:
                raise ValueError(f"{self.plan.model_type}: a sequence with {int(p.min())} cached tokens would pass "
                                 f"LongRoPE's original context of {context} positions in a paged step (its cached "
                                 f"keys took the short factors); run it with generate(), or prefill it whole")

    def reset_state(self, state: CausalLMState) -> CausalLMState:
        """The state emptied for reuse, in place (capacity and batch size kept); stale cache contents are
        never read past `length`."""
        self._check_state(state, 0)
        state.length = 0
        state.offsets.zero_()
        return state

    def _check_state(self, state, n_new: int, batch: int | None = None):
        if not isinstance(state, CausalLMState) or state.owner is not self:
            raise ValueError("state was not allocated by this model (use model.allocate_state)")
        if batch is not None and batch != state.batch_size:
            raise ValueError(f"ids have batch size {batch}, the state was allocated for {state.batch_size}")
        if state.max_tokens is not None and state.length + n_new > state.max_tokens:
            raise ValueError(f"{n_new} new tokens after {state.length} exceed the state's capacity "
                             f"of {state.max_tokens} tokens")

    # ---- running -------------------------------------------------------------------------

    def _check_ids(self, ids, state):
        ids = as_ids(ids)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        B, L = ids.shape
        start = 0
        if state is not None:
            self._check_state(state, L, B)
            start = state.length - int(state.offsets.min())
        if self.max_positions is not None and start + L > self.max_positions:
            raise ValueError(f"positions up to {start + L - 1} exceed max_positions {self.max_positions}")
        return ids.to(self.device)

    def forward(self, ids, state: CausalLMState | None = None) -> torch.Tensor:
        """Logits (B, L, vocab) in float32; with a state, continue from it and advance it."""
        ids = self._check_ids(ids, state)
        return self._run(ids, state).float()

    __call__ = forward

    def step(self, ids, state: CausalLMState) -> torch.Tensor:
        """One token per row (B,) or (B, 1) -> next-token logits (B, vocab) in float32; the state advances."""
        if state is None:
            raise ValueError("step needs a state (model.allocate_state); forward runs without one")
        ids = as_ids(ids, column=True)
        if ids.shape[1] != 1:
            raise ValueError(f"step takes one token per row, got shape {tuple(ids.shape)}")
        return self.forward(ids, state)[:, -1]

    def generate(self, ids, max_new_tokens: int, *, greedy: bool = True, eos_ids=(), until=None, prompt_lookup=0,
                 lookup_ngram=lookup.DEFAULT_NGRAM, constraint=None, **sampling) -> torch.Tensor:
        """(B, L) ids in, (B, L + max_new_tokens) ids out: each prompt followed by its continuation.

        `greedy=True` takes the argmax (ties to the lowest id); `greedy=False` samples, and needs a
        `temperature` > 0 (Sampler's options: lmstack's extension, as are `eos_ids`, `until` and prompt lookup;
        see `stream`). Ragged rows are left-padded with -1 to the longest prompt; a row that stops keeps the
        token it stopped at and holds -1 after it.
        """
        if not isinstance(greedy, bool):
            raise TypeError(f"greedy must be True or False, got {greedy!r}")
        sampler = Sampler(**sampling)
        if greedy and not sampler.greedy:
            raise ValueError(f"greedy=True with temperature {sampler.temperature!r} would sample: "
                             "pass greedy=False to sample")
        if not greedy and sampler.temperature == 0:
            raise ValueError("greedy=False needs a sampling option: a temperature > 0 (with top_k, top_p, min_p, "
                             "seed as wanted)")
        ids, offsets = self._prompt(ids, max_new_tokens)
        lookup.check(self, ids.shape[0], prompt_lookup, lookup_ngram)
        B, L = ids.shape
        out = torch.full((B, L + max_new_tokens), -1, dtype=torch.long, device=self.device)
        out[:, :L] = ids.masked_fill(torch.arange(L, device=self.device) < offsets[:, None], -1)
        if max_new_tokens:
            for i, tokens in enumerate(self._stream(ids, offsets, max_new_tokens, sampler, eos_ids, until,
                                                    prompt_lookup, lookup_ngram, constraint)):
                out[:, L + i] = tokens
        return out

    def stream(self, ids, max_new_tokens: int, *, eos_ids=(), until=None, prompt_lookup=0,
               lookup_ngram=lookup.DEFAULT_NGRAM, constraint=None, **sampling) -> Iterator[torch.Tensor]:
        """Yield each step's new tokens (B,) as they are made: one prefill, then one step per token.

        `ids` may be ragged (rows of different lengths): rows are left-padded and masked, so each row
        gets the tokens it gets alone. A row stops after a token in `eos_ids`, or when `until(tokens)`,
        called with each step's tokens before they are yielded, returns True for it ((B,) bool);
        a stopped row yields -1. `sampling`: Sampler's fields (temperature, top_k, top_p, min_p,
        repetition_penalty, seed); the default is greedy.

        `prompt_lookup=N` (prompt lookup decoding, lookup.py) drafts up to N tokens per forward: those that
        followed the first earlier occurrence, in the prompt or the text so far, of the last `lookup_ngram`
        tokens or fewer; one forward checks them all. The tokens are the plain generation's (sampled ones too,
        seed for seed); text that repeats the prompt comes faster. One prompt at a time, transformer models on
        CPU with lmstack's kernels; elsewhere lookup.PromptLookupError.

        `constraint` (a grammar.Grammar, e.g. grammar.compile(tokenizer, vocab_size, json_schema=...)) masks
        every step to the tokens the grammar allows; a row ends when the grammar is complete. Drafts of prompt
        lookup pass through the same mask (lookup.decode).
        """
        sampler = Sampler(**sampling)
        ids, offsets = self._prompt(ids, max_new_tokens)
        lookup.check(self, ids.shape[0], prompt_lookup, lookup_ngram)
        if not max_new_tokens:
            return iter(())
        return self._stream(ids, offsets, max_new_tokens, sampler, eos_ids, until, prompt_lookup, lookup_ngram,
                            constraint)

    def _prompt(self, ids, max_new_tokens):
        """The prompt rows left-padded (B, L) on the model's device and their padding, checked before anything
        runs: the longest prompt and its continuation fit in max_positions."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        ids, offsets = left_pad(ids)
        L = ids.shape[1]
        if self.max_positions is not None and L + max_new_tokens > self.max_positions:
            raise ValueError(f"prompt length {L} + max_new_tokens {max_new_tokens} exceeds max_positions "
                             f"{self.max_positions}")
        self._check_state_memory(ids.shape[0], L + max_new_tokens, extra=ids.shape[0] * (L + max_new_tokens) * 8)
        return self._check_ids(ids, None), offsets.to(self.device)

    def _stream(self, ids, offsets, max_new_tokens, sampler, eos_ids, until, prompt_lookup=0,
                lookup_ngram=lookup.DEFAULT_NGRAM, constraint=None):
        state = self.allocate_state(ids.shape[0], ids.shape[1] + max_new_tokens - 1)  # the last token is not fed
        state.offsets.copy_(offsets)
        eos = torch.tensor(list(eos_ids), dtype=torch.long, device=self.device)
        prompts = [row[offset:].tolist() for row, offset in zip(ids, offsets.tolist())]  # the real tokens
        decoder = Decoder.build(sampler, prompts, self.vocab_size, self.device, constraint=constraint)
        if prompt_lookup:
            return lookup.decode(self, ids, state, max_new_tokens, decoder, eos, until, prompt_lookup, lookup_ngram)
        return self._decode(ids, state, max_new_tokens, decoder, eos, until)

    @torch.no_grad()
    def _decode(self, ids, state, max_new_tokens, decoder, eos, until):
        B = ids.shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        logits = self._run(ids, state, last_only=True)
        threads = Threads() if self.device.type == "cpu" else None
        try:
            for i in range(max_new_tokens):
                tokens = decoder.choose(logits[:, -1], done)
                grammar.compute_ahead([decoder.mask])
                done |= torch.isin(tokens, eos)
                if decoder.ended is not None:
                    done |= decoder.ended
                if until is not None:
                    done |= until(tokens)
                yield tokens
                if done.all() or i + 1 == max_new_tokens:
                    return
                if threads is not None:
                    threads.adapt()
                logits = self._run(tokens.clamp(min=0)[:, None], state, last_only=True)
        finally:
            if threads is not None:
                threads.restore()

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, state: CausalLMState | None, last_only: bool = False,
             alone: bool = False) -> torch.Tensor:
        """The one path every entry point takes; ids are already checked. `alone` (under formats.row_invariant,
        where lookup.exact_verification allows it): each token gets the logits a one-token step would give it."""
        if state is not None and state.tokens is not None:
            if (logits := self._longrope_recompute(ids, state, last_only, alone)) is not None:
                return logits
            state.tokens[:, state.length:state.length + ids.shape[1]] = ids
        x = self._embed(ids.to(self.device))
        ctx = self._context(ids.shape, state, alone)
        if state is not None and (stack := self._fused_stack(x, ctx)) is not None:
            x = stack.decode(x, ctx.cos, ctx.sin, [c.k for c in state.layers], [c.v for c in state.layers], ctx.start,
                             *(ctx.local or (None, None)))
        else:
            for i, block in enumerate(self.blocks):
                if x.device != self.layer_devices[i]:  # ParallelCausalLM: the activations hop to the next device
                    x, ctx = x.to(self.layer_devices[i]), _moved(ctx, self.layer_devices[i])
                x = block(x, None if state is None else state.layers[i], ctx)
        if state is not None:
            state.length += ids.shape[1]
        if last_only:
            x = x[:, -1:]
        return self._logits(x)

    def _longrope_recompute(self, ids: torch.Tensor, state: CausalLMState, last_only: bool, alone: bool):
        """LongRoPE: the forward that first passes the original context takes the long factors for every position,
        and the reference recomputes the cached ones with them (Phi3ForCausalLM.prepare_inputs_for_generation drops
        its cache at that step): so does this, from the tokens the state keeps, so that every step equals a
        stateless forward over the whole sequence. None where the forward does not pass it."""
        context, cached = self.rotary.long[1], state.length - int(state.offsets.min())
        if not 0 < cached <= context < cached + ids.shape[1]:
            return None
        length, state.length = state.length, 0
        logits = self._run(torch.cat((state.tokens[:, :length], ids.to(state.tokens.device)), dim=1), state,
                           last_only, alone)
        return logits if last_only else logits[:, length:]

    def _fused_stack(self, x: torch.Tensor, ctx):
        """Every block in one call (kernels_layer.cpp's Stack) for a step in which each block would take its fused
        path (TransformerBlock.fusable: a paged step, or a decode step with no layer masked) on one device; made
        once per dtype."""
        if self.rotary is None or len(set(self.layer_devices)) > 1 or not self.blocks[0].fusable(x, ctx):
            return None
        if isinstance(ctx, AttentionContext) and any(m is not None for m in ctx.masks.values()):
            return None
        stacked = getattr(self, "_stack", None)
        if stacked is None or stacked[0] != x.dtype:
            layers = [block.fused_layer(x.dtype) for block in self.blocks]
            stack = None
            if all(layer is not None for layer in layers):
                stack = torch.classes.lmstack.Stack()
                for layer in layers:
                    stack.add(layer)
            self._stack = stacked = (x.dtype, stack)
        return stacked[1]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for ids, in the model's dtype (under gguf, dequantized from the file's blocks),
        times the plan's embed_scale rounded to that dtype, as the reference multiplies it."""
        if isinstance(self.embed, GGUFBlocks):
            x = self.embed.embedding(ids, self.dtype)
        else:
            x = F.embedding(ids, self.embed).to(self.dtype)
        if self.plan.embed_scale is not None:
            x = x * torch.tensor(self.plan.embed_scale, dtype=self.dtype)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head, in the model's dtype; soft-capped where the plan says."""
        logits = self.head_projection(self.norm(x).to(self.dtype))
        if (cap := self.plan.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _context(self, shape, state, alone=False):
        """What every layer of one forward shares, for this model's kind of block."""
        if self.rotary is None:
            return self._recurrent_context(shape, state)
        return self._attention_context(shape, state, alone)

    def _attention_context(self, shape, state, alone=False) -> AttentionContext:
        B, L = shape
        start = 0 if state is None else state.length
        slots = torch.arange(start, start + L, device=self.device)
        offsets = None if state is None or not state.offsets.any() else state.offsets
        positions = slots.expand(B, L) if offsets is None else (slots[None] - offsets[:, None]).clamp(min=0)
        windows = set(self.plan.layer_windows)
        if alone:  # each position's tables and mask made as its own step makes them (an elementwise op's
            # vectorized and scalar paths may round differently, and which elements take which depends on the size)
            cos, sin = self._tables_alone(self.rotary, positions)
            local = self._tables_alone(self.local_rotary, positions) if self.local_rotary else None
            masks = {w: [self._mask(slots[i:i + 1], start + i + 1, w, offsets) for i in range(L)] for w in windows}
            return AttentionContext(start, cos, sin, masks, alone=True, local=local)
        cos, sin = self.rotary(positions, self.dtype)
        local = self.local_rotary(positions, self.dtype) if self.local_rotary else None
        masks = {w: self._mask(slots, start + L, w, offsets) for w in windows}
        return AttentionContext(start, cos, sin, masks, local=local)

    def _tables_alone(self, rotary: Rotary, positions: torch.Tensor) -> tuple:
        """cos, sin for each position made as its own step makes them."""
        tables = [rotary(positions[:, i:i + 1], self.dtype) for i in range(positions.shape[1])]
        return tuple(torch.cat(t, dim=1) for t in zip(*tables))

    def _recurrent_context(self, shape, state) -> RecurrentContext:
        """Left padding (slots before offsets[b]) is masked, so a row's state stays zero until its first token."""
        start = 0 if state is None else state.length
        if state is None or int(state.offsets.max()) <= start:
            return RecurrentContext(start)
        slots = torch.arange(start, start + shape[1], device=self.device)
        return RecurrentContext(start, slots[None] >= state.offsets[:, None])

    def _mask(self, slots, n_keys, window, offsets):
        """None where SDPA's own causal flag is exact; else a boolean (B or 1, 1, L, S) mask."""
        start, L = int(slots[0]), len(slots)
        windowed = window is not None and n_keys > window
        if offsets is None and not windowed and (start == 0 or L == 1):
            return None
        keys = torch.arange(n_keys, device=self.device)
        allowed = keys[None] <= slots[:, None]
        if windowed:
            allowed &= slots[:, None] - keys[None] < window
        allowed = allowed[None, None]
        if offsets is not None:
            real = keys[None, None, None] >= offsets[:, None, None, None]
            allowed = (allowed & real) | (keys[None] == slots[:, None])[None, None]
        return allowed
