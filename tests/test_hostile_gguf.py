"""Hostile GGUF files, round 2: metadata whose counts and lengths lie, tensor data that overlaps, wraps or
disagrees with its type, and files cut short while open. Each is opened in a child process under a memory
cap and a time limit (isolated.py): a hang, a blow-up or a SIGBUS fails fast."""

import os
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as T

import isolated
from lmstack import CausalLM, CheckpointError, SafetensorsFile, Tokenizer, kernels
from lmstack.checkpoint import PARALLEL_READ_BYTES, pread_into
from lmstack.gguf import BLOCK_TYPES, GGUFFile, GGUFHeader
from test_hostile import checkpoint_dir, gguf_file

# ---- raw GGUF bytes ----------------------------------------------------------------------------


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def header(n_fields: int, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields)


def array(item: T, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IIQ", T.ARRAY, item, count) + payload


def field(key: str, encoded: bytes) -> bytes:
    return string(key) + encoded


def with_fields(path, *fields: bytes):
    """Insert metadata entries into a GGUF file, padded to keep its tensor data aligned."""
    data = path.read_bytes()
    extra = b"".join(fields)
    pad = -(len(extra) + len(field("general.pad", array(T.UINT8, 0)))) % 32
    extra += field("general.pad", array(T.UINT8, pad, b"\0" * pad))
    n_tensors, n_fields = struct.unpack_from("<QQ", data, 8)
    path.write_bytes(data[:8] + struct.pack("<QQ", n_tensors, n_fields + len(fields) + 1) + extra + data[24:])


def tensor_entries(path) -> list[tuple[int, int]]:
    """(where the tensor's type id lies, where its offset lies) for each tensor entry, as gguf's own reader
    finds them."""
    places = []
    for t in gguf.GGUFReader(path).tensors:
        at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
        places.append((at, at + 4))
    return places


# ---- actions run in the child --------------------------------------------------------------------


def open_gguf(path):
    """Open, read every metadata value and every tensor; how many keys there were."""
    with GGUFFile(path) as f:
        for key in f.keys():
            f.get(key)
        for name in f.names():
            f.read(name)
        return len(f.keys())


def load_with_blob(path):
    """Load the model and its tokenizer, and read the large array the file carries as numpy."""
    CausalLM.load(path, device="cpu")
    with GGUFFile(path) as f:
        Tokenizer.from_gguf(f)
        return int(f.array("general.blob").sum()), len(f.array("general.words"))


def open_raw(path):
    """Only the header: files without the keys a model needs."""
    with GGUFHeader(path) as f:
        return [f.get(key) for key in f.keys()]


def cut_then(path, what):
    """Open the file, cut it short (before the tokens for "metadata", to half else), then do `what` with it."""
    source = GGUFFile(path)
    os.truncate(path, 100 if what == "metadata" else os.path.getsize(path) // 2)
    if what == "load":
        CausalLM.load(source, device="cpu")
    elif what == "metadata":
        source.get("tokenizer.ggml.tokens")
    else:
        for name in source.names():
            source.read(name)


def stored(path, name):
    """Tensor `name` as weight_format "gguf" keeps it."""
    with GGUFFile(path) as f:
        f.stored(name)


def packed(path, name):
    """Tensor `name` read and packed as a load under weight_format "gguf" packs it (the kernels' threads)."""
    assert kernels.available()
    with GGUFFile(path) as f:
        rows, k = f.info(name).shape
        qtype = next(t.value for t in BLOCK_TYPES if t.name == f.info(name).dtype)
        f.pack_into(name, torch.empty(kernels.packed_shape(qtype, rows, k), dtype=torch.uint8), 0, rows)


def cut_safetensors(root):
    with SafetensorsFile(os.path.join(root, "model.safetensors")) as f:
        os.truncate(f.path, os.path.getsize(f.path) // 2)
        for name in f.names():
            f.read(name)


def outcome(*call, **limits):
    return isolated.run((__name__, *call), **limits)[0]


def refused(*call, words=(), error="CheckpointError"):
    return all_refused({call[1]: (call, words)}, error)[call[1]]


def all_refused(cases: dict, error="CheckpointError") -> dict:
    """Run every case {name: (call, words)} in one child; each must raise `error` with all its words."""
    outcomes = isolated.run(*[(__name__, *call) for call, _ in cases.values()])
    wrong = {}
    for (name, (call, words)), result in zip(cases.items(), outcomes):
        missing = [w for w in words if w not in result["message"]]
        if result["error"] != error or missing:
            wrong[name] = (result["error"], missing, result["message"][:500])
    assert not wrong, wrong
    return {name: result["message"] for name, result in zip(cases, outcomes)}


# ---- class 1: metadata read within bounds --------------------------------------------------------

LIES = {
    # the example: 49 bytes, one array that claims 2**62 elements
    "uint8 array of 2**62": header(1) + field("a", array(T.UINT8, 1 << 62)),
    "string array of 2**62": header(1) + field("a", array(T.STRING, 1 << 62)),
    "array of 2**62 arrays": header(1) + field("a", array(T.ARRAY, 1 << 62)),
    "float64 array one item short": header(1) + field("a", array(T.FLOAT64, 3, b"\0" * 16)),
    "string longer than the file": header(1) + field("a", struct.pack("<I", T.STRING) + string("xy")[:-1]),
    "string of 2**63 bytes": header(1) + field("a", struct.pack("<IQ", T.STRING, 1 << 63)),
    "a string item past the end": header(1) + field("a", array(T.STRING, 2, string("ok") + struct.pack("<Q", 9))),
    "key of 2**64-1 bytes": header(1) + struct.pack("<Q", (1 << 64) - 1) + b"k" * 16,
    "key of 100000 bytes": header(1) + string("k" * 100000) + struct.pack("<IB", T.UINT8, 1),
    "key not UTF-8": header(1) + string(b"\xff\xfe") + struct.pack("<IB", T.UINT8, 1),
    "unknown value type": header(1) + field("a", struct.pack("<I", 99) + b"\0" * 8),
    "arrays nested three deep": header(1) + field("a", array(T.ARRAY, 1, array(T.ARRAY, 1, array(T.UINT8, 0))[4:])),
    "duplicate key": header(2) + field("a", struct.pack("<IB", T.UINT8, 1)) * 2,
    "2**62 metadata entries": header(1 << 62),
    "2**62 tensors": header(0, 1 << 62),
    "version 1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
    "big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
    "alignment 0": header(1) + field("general.alignment", struct.pack("<II", T.UINT32, 0)),
    "alignment 48": header(1) + field("general.alignment", struct.pack("<II", T.UINT32, 48)),
    "alignment a string": header(1) + field("general.alignment", struct.pack("<I", T.STRING) + string("32")),
}
LIE_WORDS = {"key of 2**64-1 bytes": ["at most 65535"], "key of 100000 bytes": ["at most 65535"],
             "key not UTF-8": ["not UTF-8"], "unknown value type": ["unknown value type 99"],
             "arrays nested three deep": ["nests arrays"], "duplicate key": ["'a' appears more than once"],
             "big-endian": ["big-endian"], "version 1": ["version 1"]}


def test_metadata_that_lies_about_its_size_is_refused(tmp_path):
    cases = {}
    for i, (name, data) in enumerate(LIES.items()):
        path = tmp_path / f"{i}.gguf"
        path.write_bytes(data)
        words = LIE_WORDS.get(name, ["alignment"] if "alignment" in name else ["needs", "remain"])
        cases[name] = (("open_raw", str(path)), [str(path), "not a readable GGUF file", *words])
    all_refused(cases)


def test_values_equal_what_ggufs_own_reader_reads(tmp_path):
    """Every value type, arrays of each and of arrays: lmstack's lazy reads against gguf.GGUFReader's."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for kind, dtype in [(T.UINT8, np.uint8), (T.INT8, np.int8), (T.UINT16, np.uint16), (T.INT16, np.int16),
                        (T.UINT32, np.uint32), (T.INT32, np.int32), (T.UINT64, np.uint64), (T.INT64, np.int64),
                        (T.FLOAT32, np.float32), (T.FLOAT64, np.float64)]:
        values = (rng.standard_normal(5) * 100).astype(dtype)
        writer.add_key_value(f"t.{kind.name}", values[0].item(), kind)
        writer.add_key_value(f"t.{kind.name}s", values.tolist(), T.ARRAY, sub_type=kind)
    writer.add_bool("t.bool", True)
    writer.add_array("t.bools", [True, False, True])
    writer.add_string("t.string", "héllo ✓")
    writer.add_array("t.strings", ["", "a", "ünï", "x" * 300])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], ["a", "b"], [True]])
    writer.add_array("t.blob", rng.integers(0, 255, 1 << 16).tolist())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    expected = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values() if not f.name.startswith("GGUF.")}
    expected["t.nested"] = [[1, 2], ["a", "b"], [True]]  # gguf's contents() flattens nested arrays: the written value
    with GGUFHeader(path) as f:
        assert f.keys() == list(expected)
        for key, value in expected.items():
            got = f.get(key)
            if f.field(key).type == T.FLOAT32:
                assert got == float(str(np.float32(value))), key
            else:
                assert got == value and type(got) is type(value), key
        assert f.array("t.UINT16s").dtype == np.uint16 and f.array("t.bools").dtype == bool
        assert f.array("t.strings") == expected["t.strings"]
        with pytest.raises(CheckpointError, match="'t.string' is a STRING, not an array"):
            f.array("t.string")


def test_large_arrays_cost_their_bytes_not_python_objects(tmp_path):
    """A 64 MB uint8 array and two million empty strings in a valid model: the open stays under the cap
    (the `gguf` reader made ~750 bytes of Python objects per file byte) and within the time limit."""
    path = tmp_path / "m.gguf"
    gguf_file(path)
    with_fields(path, field("general.blob", array(T.UINT8, 64 << 20, bytes(64 << 20))),
                field("general.words", array(T.STRING, 2_000_000, bytes(16_000_000))))
    result = outcome("load_with_blob", str(path), memory=512 << 20, seconds=120)
    assert result["error"] is None and result["result"] == [0, 2_000_000], result


def test_real_gguf_reads_as_ggufs_own_reader_does(tmp_path):
    """SmolLM2's GGUF: every metadata value as gguf.GGUFReader gives it, and every tensor's bytes."""
    from lmstack.models import resolve
    path = resolve("smollm2")
    reader = gguf.GGUFReader(path)
    with GGUFHeader(path) as f:
        for fld in reader.fields.values():
            if fld.name.startswith("GGUF."):
                continue
            got, want = f.get(fld.name), fld.contents()
            assert got == (float(str(np.float32(want))) if fld.types == [T.FLOAT32] else want), fld.name
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            mine = f.tensors[t.name]
            assert (mine.dims, mine.type, mine.offset, mine.nbytes) == (
                tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset, t.n_bytes), t.name
            assert np.array_equal(f.data(mine), t.data.reshape(-1).view(np.uint8)), t.name


# ---- class 2: tensor data that overlaps, is misaligned, wraps around or disagrees with its type ------


def patched(tmp_path, edits) -> str:
    """The tiny llama GGUF with its i-th tensor entry's type or offset replaced: edits {i: {"type"/"offset": v}}."""
    tmp_path.mkdir()
    path = tmp_path / "m.gguf"
    gguf_file(path)
    data = bytearray(path.read_bytes())
    places = tensor_entries(path)
    originals = [struct.unpack_from("<Q", data, at)[0] for _, at in places]
    for i, change in edits(originals).items():
        if "type" in change:
            struct.pack_into("<I", data, places[i][0], change["type"])
        if "offset" in change:
            struct.pack_into("<Q", data, places[i][1], change["offset"])
    path.write_bytes(bytes(data))
    return str(path)


TENSOR_LIES = {
    "every offset 0": (lambda offs: {i: {"offset": 0} for i in range(len(offs))}, ["offset 0, expected"]),
    "offset not aligned": (lambda offs: {3: {"offset": offs[3] + 4}}, ["not a multiple of 32"]),
    "offset 2**64 - 8 wraps to the header": (lambda offs: {2: {"offset": (1 << 64) - 8}}, ["offset 18446744073709551608"]),
    "last offset past the data": (lambda offs: {len(offs) - 1: {"offset": offs[-1] + 4096}}, ["expected"]),
    # the norm's 32 bytes as F16 take 16: the next tensor is where it was, the padding holds the rest
    "F32 norm said to be F16": (lambda offs: {1: {"type": gguf.GGMLQuantizationType.F16}}, ["F16", "padding"]),
    "F32 matrix said to be F16": (lambda offs: {2: {"type": gguf.GGMLQuantizationType.F16}}, ["expected", "F16"]),
    "last tensor said to be F16": (lambda offs: {len(offs) - 1: {"type": gguf.GGMLQuantizationType.F16}},
                                   ["after the last tensor", "belong to none"]),
    "tensor said to be Q8_0": (lambda offs: {0: {"type": gguf.GGMLQuantizationType.Q8_0}}, ["Q8_0"]),
    # rows of 8 and 16 values: not whole blocks of 256 (K-quants) or 32
    **{f"matrix said to be {q}": (lambda offs, q=q: {2: {"type": gguf.GGMLQuantizationType[q]}},
                                  [q, f"multiple of {gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]][0]} values"])
       for q in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")},
    "unknown type id 99": (lambda offs: {0: {"type": 99}}, ["unknown type id 99"]),
}


def test_tensor_data_that_lies_is_refused_by_name(tmp_path):
    cases = {}
    for i, (name, (edits, words)) in enumerate(TENSOR_LIES.items()):
        path = patched(tmp_path / str(i), edits)
        cases[name] = (("open_gguf", path), [path, "tensor '", *words])
    all_refused(cases)


def test_tensor_entry_lies_are_refused(tmp_path):
    """Duplicate tensor names and five dimensions, written by hand."""
    base, cases = header(0, 1), {}
    for name, entry, words in [
        ("five dims", string("w") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0), ["5 dimensions"]),
        ("dims past 2**62", string("w") + struct.pack("<I2QIQ", 2, 1 << 40, 1 << 40, 0, 0), ["2**62"]),
        ("twice", (string("w") + struct.pack("<IQIQ", 1, 8, 0, 0)) + string("w") + struct.pack("<IQIQ", 1, 8, 0, 32),
         ["appears more than once"]),
    ]:
        path = tmp_path / f"{name}.gguf"
        count = 2 if name == "twice" else 1
        path.write_bytes(header(0, count) + entry + b"\0" * (64 - (len(base) + len(entry)) % 32 + 64))
        cases[name] = (("open_raw", str(path)), [str(path), *words])
    all_refused(cases)


def test_custom_alignment_reads_the_same_tensors(tmp_path):
    """A file aligned to 64 bytes (general.alignment) holds the same weights as one aligned to 32."""
    writers = {}
    for alignment in (32, 64):
        path = tmp_path / f"a{alignment}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        if alignment != 32:
            writer.add_custom_alignment(alignment)
        for i, size in enumerate((3, 17, 8)):
            writer.add_tensor(f"t{i}", np.arange(size, dtype=np.float32) + i)
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
        writer.close()
        with GGUFHeader(path) as f:
            assert f.get("general.alignment", 32) == alignment
            assert {t.offset % alignment for t in f.tensors.values()} == {0}
            writers[alignment] = {n: f.data(t).view(np.float32).tolist() for n, t in f.tensors.items()}
    assert writers[32] == writers[64] == {f"t{i}": (np.arange(size) + i).tolist() for i, size in enumerate((3, 17, 8))}


# ---- class 3: blocks whose scales are not numbers -----------------------------------------------


def test_block_scales_that_are_inf_or_nan_are_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    """Every float16 scale of every block type the kernels take (d, and dmin or m), set to inf, -inf or nan in
    one block of one row: refused by weight_format "gguf" naming the tensor, its type and the block, whether read
    alone or packed by the kernels as a load packs it."""
    from test_gguf_blocks import BLOCK_TYPES, tiny_gguf

    cases, name = {}, "model.layers.1.mlp.down_proj.weight"  # rows of 512: two blocks of 256
    for qtype in BLOCK_TYPES:
        kind = kernels.GGUF_TYPES[qtype.value]
        path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_wide", qtype=qtype)
        with GGUFHeader(path) as f:
            t = f.tensors["blk.1.ffn_down.weight"]
            row_bytes = t.dims[0] // kind.values * kind.bytes
        data = path.read_bytes()
        for i, at in enumerate(kind.float16_at):
            for value in (0x7C00, 0xFC00, 0x7E01):
                patched = bytearray(data)
                where = t.offset + 5 * row_bytes + kind.bytes + at  # row 5, block 1
                patched[where:where + 2] = struct.pack("<H", value)
                target = tmp_path / f"{qtype.name}-{i}-{value:x}.gguf"
                target.write_bytes(bytes(patched))
                for read in ("stored", "packed") if kernels.available() else ("stored",):
                    cases[f"{target.stem} {read}"] = ((read, str(target), name), [name, qtype.name, "inf or nan",
                                                                                  "block 1 of row 5", f"bytes {at}"])
        path.unlink()
    all_refused(cases)


def test_block_tensors_cut_short_are_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    """A K-quant file missing the end of its last tensor, and one cut short while open."""
    from test_gguf_blocks import tiny_gguf

    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_wide", qtype=gguf.GGMLQuantizationType.Q6_K)
    with GGUFHeader(path) as f:
        last = max(f.tensors.values(), key=lambda t: t.offset)
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:last.offset + last.nbytes - 100])
    all_refused({"short": (("open_gguf", str(short)), [str(short), f"tensor {last.name!r}", "runs past the data"]),
                 "cut while open": (("cut_then", str(path), "load"), [str(path), "cut short"])})


# ---- class 4: files cut short after they were opened ---------------------------------------------


def test_gguf_cut_short_while_open_is_refused_not_sigbus(tmp_path):
    cases = {}
    for what in ("load", "metadata", "tensors"):
        path = tmp_path / f"{what}.gguf"
        gguf_file(path)
        cases[what] = (("cut_then", str(path), what), [str(path), "cut short"])
    all_refused(cases)


def test_a_read_split_over_threads_gives_the_files_bytes_and_names_a_short_file(tmp_path):
    """pread_into of a megabyte or more (split over the kernels' threads): the file's bytes at the offset; a file
    that ends inside the read is named, not half-read."""
    kernels.available()  # reads are split only once the kernels are loaded
    data = np.random.default_rng(0).integers(0, 256, 3 * PARALLEL_READ_BYTES + 5, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    with path.open("rb") as fh:
        buffer = np.empty(2 * PARALLEL_READ_BYTES + 3, dtype=np.uint8)
        pread_into(fh.fileno(), buffer, 7, path, "the bytes")
        assert buffer.tobytes() == data[7:7 + len(buffer)]
        with pytest.raises(CheckpointError, match="the bytes cannot be read: the file was cut short"):
            pread_into(fh.fileno(), np.empty(2 * PARALLEL_READ_BYTES, dtype=np.uint8), PARALLEL_READ_BYTES + 11, path,
                       "the bytes")


def test_safetensors_cut_short_while_open_is_refused(tmp_path):
    root = checkpoint_dir(tmp_path / "ckpt")
    refused("cut_safetensors", str(root), words=[str(root / "model.safetensors")])
