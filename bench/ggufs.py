"""The GGUF files the benches run, made once and kept under a cache directory (default ~/.cache/lmstack-bench).

Two models:
- "smollm2" (or any GGUF path): the default SmolLM2-135M, whose packaged file is Q4_1. Its tensors are
  dequantized to an F32 file first (gguf's dequantize), and every type is quantized from that source, as a user
  quantizes from a full-precision conversion.
- "smollm2-1.7b-random": a SmolLM2-1.7B-shaped llama (hidden 2048, 24 layers, 32 heads and 32 key/value heads,
  ffn 8192, vocab 49152, tied embedding) with random weights written by gguf's writer as BF16, and SmolLM2's
  tokenizer. Decode speed does not depend on the values, and at this size a step is bound by memory bandwidth.

Quantizer, first that is given or installed: llama.cpp's `llama-quantize` binary (`--llama-quantize PATH`),
llama-cpp-python's `llama_model_quantize`, else gguf's reference quantizers (BF16, Q8_0 and Q4_0 only: gguf
cannot make K-quants). llama.cpp's quantizer picks a type per tensor as it does for users (a Q4_K_M file is a
mix of Q4_K and Q6_K; the tied embedding of a Q4_0 file is Q6_K). Files are named by type and quantizer.

    python bench/ggufs.py --model smollm2-1.7b-random --types BF16,Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K \\
        --llama-quantize /work/peers/llama.cpp-build/bin/llama-quantize
"""

import argparse
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

TYPES = ("BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
CACHE = Path(os.environ.get("LMSTACK_BENCH_CACHE", "~/.cache/lmstack-bench")).expanduser()
RANDOM_1P7B = "smollm2-1.7b-random"
SHAPE_1P7B = dict(hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192)
LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_BF16 = 0, 32  # general.file_type
QUANTIZE_THREADS = 2


def _copy_fields(reader, writer, skip=lambda name: False):
    import gguf

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or skip(field.name):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)


def _write_streamed(writer, tensors):
    """Write tensors = [(name, shape, dtype, raw type, make() -> array)], each array made only when written."""
    for name, shape, dtype, raw, _ in tensors:
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for *_, make in tensors:
        writer.write_tensor_data(make())
    writer.close()


def random_llama(target: Path, tokenizer_source: Path, hidden: int, layers: int, heads: int, kv_heads: int,
                 ffn: int, seed: int = 0):
    """A tied llama GGUF of the given shape with random BF16 matrices (float32 norms of ones) and the tokenizer
    of tokenizer_source. The bfloat16 values have random signs and mantissas and magnitudes of 2^-9 to 2^-5,
    like a trained model's, so activations stay finite through the layers."""
    import gguf

    reader = gguf.GGUFReader(tokenizer_source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(target, "llama")
    writer.add_name(f"random llama {hidden}x{layers}")
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_BF16)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(130000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    _copy_fields(reader, writer, skip=lambda name: not name.startswith("tokenizer."))
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        def make():
            bits = rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
            return (bits & 0x81FF) | 0x3B00  # sign, 2 exponent bits (2^-9..2^-6), 7 mantissa bits
        return (rows, cols), np.uint16, gguf.GGMLQuantizationType.BF16, make

    def norm():
        return (hidden,), np.float32, gguf.GGMLQuantizationType.F32, lambda: np.ones(hidden, np.float32)

    tensors = [("token_embd.weight", *matrix(vocab, hidden))]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", *norm()),
                    (f"blk.{i}.attn_q.weight", *matrix(heads * head_dim, hidden)),
                    (f"blk.{i}.attn_k.weight", *matrix(kv_heads * head_dim, hidden)),
                    (f"blk.{i}.attn_v.weight", *matrix(kv_heads * head_dim, hidden)),
                    (f"blk.{i}.attn_output.weight", *matrix(hidden, heads * head_dim)),
                    (f"blk.{i}.ffn_norm.weight", *norm()),
                    (f"blk.{i}.ffn_gate.weight", *matrix(ffn, hidden)),
                    (f"blk.{i}.ffn_up.weight", *matrix(ffn, hidden)),
                    (f"blk.{i}.ffn_down.weight", *matrix(hidden, ffn))]
    tensors.append(("output_norm.weight", *norm()))
    _write_streamed(writer, tensors)


def f32_copy(source: Path, target: Path):
    """source with every tensor dequantized to F32 (gguf's dequantize), its metadata kept."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    _copy_fields(reader, writer, skip=lambda name: name == gguf.Keys.General.FILE_TYPE)
    writer.add_file_type(LLAMA_FTYPE_ALL_F32)

    def make(tensor):
        return lambda: gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)

    shapes = [tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors]  # numpy order
    _write_streamed(writer, [(t.name, shape, np.float32, gguf.GGMLQuantizationType.F32, make(t))
                             for t, shape in zip(reader.tensors, shapes)])


def quantize(source: Path, target: Path, name: str, llama_quantize: str | None):
    """target: source in type `name`, by the first quantizer available (see the module's docstring)."""
    if llama_quantize:
        done = subprocess.run([llama_quantize, "--allow-requantize", str(source), str(target), name,
                               str(QUANTIZE_THREADS)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{llama_quantize} could not quantize {source} to {name}: {done.stderr[-800:]}")
        return
    try:
        import llama_cpp
    except ImportError:
        return gguf_quantize(source, target, name)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    params.allow_requantize = True
    params.nthread = QUANTIZE_THREADS
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {name}")


def gguf_quantize(source: Path, target: Path, name: str):
    """Every matrix of source requantized to the type with gguf's reference quantizers; vectors kept."""
    import gguf

    if name not in ("BF16", "Q8_0", "Q4_0"):
        raise ValueError(f"gguf cannot quantize to {name}: give --llama-quantize PATH or install llama-cpp-python")
    qtype = gguf.GGMLQuantizationType[name]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    _copy_fields(reader, writer)
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2 and tensor.shape[0] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            data = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _made(target: Path, make):
    """target, made by make(partial path) unless it exists (an interrupted make leaves no file under its name)."""
    if not target.exists():
        partial = target.with_name(target.name + ".partial")
        make(partial)
        partial.rename(target)
    return target


def source_file(model: str | None, cache: Path) -> tuple[Path, Path]:
    """(the directory of the model's files, its full-precision source file) for a model name or GGUF path."""
    if model == RANDOM_1P7B:
        from lmstack import models

        workdir = cache / RANDOM_1P7B
        workdir.mkdir(parents=True, exist_ok=True)
        return workdir, _made(workdir / "model-BF16.gguf",
                              lambda path: random_llama(path, models.resolve(None), **SHAPE_1P7B))
    from lmstack import models

    given = models.resolve(model)
    stat = given.stat()
    key = hashlib.sha256(f"{given.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    workdir = cache / f"{given.stem}-{key}"
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir, _made(workdir / "source-F32.gguf", lambda path: f32_copy(given, path))


def quantizer_name(llama_quantize: str | None) -> str:
    if llama_quantize:
        return "llama-quantize"
    try:
        import llama_cpp  # noqa: F401
        return "llama-cpp-python"
    except ImportError:
        return "gguf"


def bench_files(model: str | None, types, cache: Path = CACHE, llama_quantize: str | None = None) -> dict:
    """{type: path} of the model's files in the given types, made where missing."""
    workdir, source = source_file(model, cache)
    files = {}
    for name in types:
        if name not in TYPES:
            raise ValueError(f"unknown file type {name!r}: one of {', '.join(TYPES)}")
        if source.name == f"model-{name}.gguf":
            files[name] = source
            continue
        target = workdir / f"model-{name}-{quantizer_name(llama_quantize)}.gguf"
        files[name] = _made(target, lambda path: quantize(source, path, name, llama_quantize))
    return files


def hf_checkpoint(path: Path) -> Path:
    """The GGUF file converted to a Hugging Face checkpoint directory beside it (for transformers), made once."""
    from lmstack.convert import convert

    return _made(path.with_name(path.stem + "-hf"), lambda directory: convert(path, directory))


def bytes_per_token(path: Path) -> int:
    """Tensor bytes a decode step reads from the file: every tensor but an untied embedding (one row of it)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"a GGUF path or name (default smollm2), or {RANDOM_1P7B}")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary")
    args = parser.parse_args()
    for name, path in bench_files(args.model, args.types.split(","), args.cache, args.llama_quantize).items():
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.0f} MB, {bytes_per_token(path) / 1e6:.0f} MB a token)")


if __name__ == "__main__":
    main()
