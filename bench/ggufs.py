"""The GGUF files the benches run, made once and kept under a cache directory (default ~/.cache/lmstack-bench).

The models:
- "smollm2" (or any GGUF path): the default SmolLM2-135M, whose packaged file is Q4_1. Its tensors are
  dequantized to an F32 file first (gguf's dequantize), and every type is quantized from that source, as a user
  quantizes from a full-precision conversion.
- random weights written by gguf's writer as BF16 (RANDOM): decode speed does not depend on the values.
  "smollm2-1.7b-random": a SmolLM2-1.7B-shaped llama (hidden 2048, 24 layers, 32 heads and 32 key/value heads,
  ffn 8192, vocab 49152, tied embedding) with SmolLM2's tokenizer, where a step is bound by memory bandwidth.
  "gemma3-1b-random": a gemma-3-1b-shaped gemma3 (hidden 1152, 26 layers, 4 heads and 1 key/value head of 256,
  ffn 6912, sliding window 512 in 5 layers of 6, tied) with Gemma 4's vocabulary of 262,144 tokens (Gemma 3's
  size; llama.cpp's ggml-vocab-gemma-4.gguf from the tests' fixtures).
  "qwen3moe-8l-random": 8 layers of Qwen3-30B-A3B's shape (hidden 2048, 32 heads and 4 key/value heads of 128,
  128 experts of 768 of which 8 are chosen per token, untied head) with Qwen's vocabulary (ggml-vocab-qwen2.gguf).

Quantizer, first that is given or installed: llama.cpp's `llama-quantize` binary (`--llama-quantize PATH`),
llama-cpp-python's `llama_model_quantize`, else gguf's reference quantizers (BF16, Q8_0 and Q4_0 only: gguf
cannot make K-quants). llama.cpp's quantizer picks a type per tensor as it does for users (a Q4_K_M file is a
mix of Q4_K and Q6_K; the tied embedding of a Q4_0 file is Q6_K). Files are named by type and quantizer.

    python bench/ggufs.py --model smollm2-1.7b-random --types BF16,Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K \\
        --llama-quantize /work/peers/llama.cpp-build/bin/llama-quantize
"""

import argparse
import hashlib
import lzma
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TYPES = ("BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
CACHE = Path(os.environ.get("LMSTACK_BENCH_CACHE", "~/.cache/lmstack-bench")).expanduser()
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


@dataclass(frozen=True)
class RandomModel:
    """A random-weight model's architecture and shape; the tokenizer is copied from another GGUF file (a
    vocabulary of the real model's size, so that the head reads as many bytes as the real one)."""

    arch: str  # GGUF general.architecture: llama, gemma3 or qwen3moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: str  # "smollm2" (lmstack's packaged model), or a vocabulary of tests/fixtures/llama_cpp_vocab
    head_dim: int | None = None  # None: hidden // heads
    tied: bool = True
    rope_theta: float = 10000.0
    eps: float = 1e-6
    window: int | None = None  # gemma3: the sliding layers' window (llama.cpp slides 5 layers of each 6)
    experts: int = 0  # qwen3moe: experts per layer, each of ffn rows, top_k of them chosen per token
    top_k: int = 0


RANDOM = {
    # SmolLM2-1.7B's shape
    "smollm2-1.7b-random": RandomModel("llama", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192,
                                       vocab="smollm2", rope_theta=130000.0, eps=1e-5),
    # gemma-3-1b's shape, with Gemma 4's vocabulary of 262,144 tokens (Gemma 3's size)
    "gemma3-1b-random": RandomModel("gemma3", hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, ffn=6912,
                                    vocab="gemma-4", rope_theta=1_000_000.0, window=512),
    # Qwen3-30B-A3B's shape (128 experts of 768, top 8; 32 heads, 4 key/value heads of 128; Qwen's vocabulary),
    # 8 of its 48 layers
    "qwen3moe-8l-random": RandomModel("qwen3moe", hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128,
                                      ffn=768, vocab="qwen2", tied=False, rope_theta=1_000_000.0, experts=128,
                                      top_k=8),
}
VOCABS = Path(__file__).parents[1] / "tests" / "fixtures" / "llama_cpp_vocab"


def vocab_file(name: str, workdir: Path) -> Path:
    """The GGUF file whose tokenizer a random model copies: lmstack's packaged model, or a llama.cpp vocabulary
    from the tests' fixtures, decompressed beside the model."""
    from lmstack import models

    if name == "smollm2":
        return models.resolve(None)
    return _made(workdir / f"ggml-vocab-{name}.gguf",
                 lambda path: path.write_bytes(lzma.decompress((VOCABS / f"ggml-vocab-{name}.gguf.xz").read_bytes())))


def random_model(target: Path, tokenizer_source: Path, m: RandomModel, seed: int = 0):
    """A GGUF of the given architecture and shape with random BF16 matrices (float32 norms of ones, which Gemma's
    converter would store for weights of 0) and the tokenizer of tokenizer_source, in the metadata llama.cpp
    reads. The bfloat16 values have random signs and mantissas and magnitudes of 2^-9 to 2^-6, like a trained
    model's, so activations stay finite through the layers."""
    import gguf

    reader = gguf.GGUFReader(tokenizer_source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = m.head_dim or m.hidden // m.heads
    writer = gguf.GGUFWriter(target, m.arch)
    writer.add_name(f"random {m.arch} {m.hidden}x{m.layers}")
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_BF16)
    writer.add_context_length(8192)
    writer.add_embedding_length(m.hidden)
    writer.add_block_count(m.layers)
    writer.add_feed_forward_length(m.ffn)
    writer.add_head_count(m.heads)
    writer.add_head_count_kv(m.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(m.rope_theta)
    writer.add_layer_norm_rms_eps(m.eps)
    writer.add_vocab_size(vocab)
    if m.window is not None:
        writer.add_sliding_window(m.window)
    if m.experts:
        writer.add_expert_count(m.experts)
        writer.add_expert_used_count(m.top_k)
        writer.add_expert_feed_forward_length(m.ffn)
    _copy_fields(reader, writer, skip=lambda name: not name.startswith("tokenizer."))
    rng = np.random.default_rng(seed)

    def matrix(*shape):
        def make():
            bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
            return (bits & 0x81FF) | 0x3B00  # sign, 2 exponent bits (2^-9..2^-6), 7 mantissa bits
        return shape, np.uint16, gguf.GGMLQuantizationType.BF16, make

    def norm(size=m.hidden):
        return (size,), np.float32, gguf.GGMLQuantizationType.F32, lambda: np.ones(size, np.float32)

    qk_norms = m.arch in ("gemma3", "qwen3moe")
    tensors = [("token_embd.weight", *matrix(vocab, m.hidden))]
    for i in range(m.layers):
        b = f"blk.{i}"
        tensors += [(f"{b}.attn_norm.weight", *norm()),
                    (f"{b}.attn_q.weight", *matrix(m.heads * head_dim, m.hidden)),
                    (f"{b}.attn_k.weight", *matrix(m.kv_heads * head_dim, m.hidden)),
                    (f"{b}.attn_v.weight", *matrix(m.kv_heads * head_dim, m.hidden)),
                    (f"{b}.attn_output.weight", *matrix(m.hidden, m.heads * head_dim))]
        if qk_norms:
            tensors += [(f"{b}.attn_q_norm.weight", *norm(head_dim)), (f"{b}.attn_k_norm.weight", *norm(head_dim))]
        if m.arch == "gemma3":
            tensors += [(f"{b}.post_attention_norm.weight", *norm()), (f"{b}.post_ffw_norm.weight", *norm())]
        tensors.append((f"{b}.ffn_norm.weight", *norm()))
        if m.experts:
            tensors += [(f"{b}.ffn_gate_inp.weight", *matrix(m.experts, m.hidden)),
                        (f"{b}.ffn_gate_exps.weight", *matrix(m.experts, m.ffn, m.hidden)),
                        (f"{b}.ffn_up_exps.weight", *matrix(m.experts, m.ffn, m.hidden)),
                        (f"{b}.ffn_down_exps.weight", *matrix(m.experts, m.hidden, m.ffn))]
        else:
            tensors += [(f"{b}.ffn_gate.weight", *matrix(m.ffn, m.hidden)),
                        (f"{b}.ffn_up.weight", *matrix(m.ffn, m.hidden)),
                        (f"{b}.ffn_down.weight", *matrix(m.hidden, m.ffn))]
    tensors.append(("output_norm.weight", *norm()))
    if not m.tied:
        tensors.append(("output.weight", *matrix(vocab, m.hidden)))
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
    if model in RANDOM:
        workdir = cache / model
        workdir.mkdir(parents=True, exist_ok=True)
        spec = RANDOM[model]
        return workdir, _made(workdir / "model-BF16.gguf",
                              lambda path: random_model(path, vocab_file(spec.vocab, workdir), spec))
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


def bytes_per_token(path: Path, dense: bool = False) -> int:
    """Tensor bytes a decode step reads from the file: every tensor but an untied embedding (one row of it), and of
    a mixture's stacked experts (blk.N.ffn_*_exps) the share of the experts a token chooses. `dense`: as if every
    expert ran, the bytes of a dense model of the same total size."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    share = 1.0 if dense or experts is None else (
        reader.fields[f"{arch}.expert_used_count"].contents() / experts.contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return round(sum(int(t.n_bytes) * (share if t.name.endswith("_exps.weight") else 1.0) for t in reader.tensors
                     if tied or t.name != "token_embd.weight"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=f"a GGUF path or name (default smollm2), or one of {', '.join(RANDOM)}")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary")
    args = parser.parse_args()
    for name, path in bench_files(args.model, args.types.split(","), args.cache, args.llama_quantize).items():
        dense = bytes_per_token(path, dense=True)
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.0f} MB, {bytes_per_token(path) / 1e6:.0f} MB a token; "
              f"{dense / 1e6:.0f} MB for a dense model of its size)")


if __name__ == "__main__":
    main()
