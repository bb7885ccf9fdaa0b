"""GGUF files read through the `gguf` package (llama.cpp's own reader), onto the same ModelPlan.

The metadata becomes a config dict for `plan_for`, so every refusal stays in config.py; tensors are
renamed to the Hugging Face names the plan reads, dequantized on read, and the q/k rows that
llama.cpp's converter permutes for its rotary layout are put back in Hugging Face's order.
"""

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from .checkpoint import CheckpointError, TensorInfo
from .config import HFConfig, UnsupportedModel, plan_for

MAGIC = b"GGUF"

# GGUF general.architecture -> (Hugging Face model_type, q/k rows permuted by llama.cpp's converter,
# the transformers class `convert` names in config.json)
ARCHITECTURES = {
    "llama": ("llama", True, "LlamaForCausalLM"),
    "mistral": ("mistral", True, "MistralForCausalLM"),
    "qwen2": ("qwen2", False, "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", False, "Qwen3ForCausalLM"),
}

NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.pre -> (PATTERNS name, ignore_merges, normalizer), as llama.cpp and the HF files have them
PRE_TOKENIZERS = {
    "gpt2": ("gpt2", False, None),
    "gpt-2": ("gpt2", False, None),
    "smollm": ("smollm", False, None),
    "starcoder": ("smollm", False, None),
    "llama-bpe": ("llama3", True, None),
    "llama3": ("llama3", True, None),
    "qwen2": ("qwen2", False, "NFC"),
}

_REQUIRED = object()


def is_gguf(path) -> bool:
    """A file that starts with GGUF's magic bytes (a .gguf name alone is not trusted)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == MAGIC


def hf_name(name: str) -> str:
    """The Hugging Face checkpoint name of a GGUF tensor name; unknown names stay as they are."""
    stem, _, suffix = name.rpartition(".")
    if stem in NAMES:
        return f"{NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return name


class GGUFFile:
    """A GGUF file seen as a checkpoint: a config dict, and float32 tensors under Hugging Face names."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader's checks surface as whatever numpy or struct raised
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        arch = self.get("general.architecture")
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise UnsupportedModel(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                   f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        self.arch = arch
        self._tensors = {hf_name(t.name): t for t in self.reader.tensors}
        self._check_types()
        self.config = HFConfig(self._config(), self.path)  # plan_for's errors then name this file

    # ---- metadata ------------------------------------------------------------------------

    def get(self, key: str, default=_REQUIRED):
        """A metadata value (arrays as lists); `{arch}` in the key is this file's architecture."""
        key = key.replace("{arch}", getattr(self, "arch", ""))
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        try:
            value = field.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} cannot be read "
                                  f"({type(e).__name__}: {e})") from None
        if field.types == [gguf.GGUFValueType.FLOAT32]:  # the decimal the writer meant: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value

    def _int(self, key: str, default=_REQUIRED, minimum=1):
        """An integer metadata value of at least `minimum`, or `default` when absent."""
        value = self.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise CheckpointError(f"{self.path}: GGUF metadata {key.replace('{arch}', self.arch)!r} = {value!r}, "
                                  f"expected an integer >= {minimum}")
        return value

    def _check_types(self):
        """Refuse, before reading a weight, any tensor type `gguf` cannot dequantize."""
        for qtype in {t.tensor_type for t in self._tensors.values()}:
            block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
            try:
                dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
            except NotImplementedError:
                name = next(t.name for t in self._tensors.values() if t.tensor_type == qtype)
                raise UnsupportedModel(f"{self.path}: tensor {name!r} has type {qtype.name}, which gguf "
                                       f"cannot dequantize") from None

    def _config(self) -> dict:
        """The config.json a Hugging Face checkpoint of the same model would carry."""
        model_type = ARCHITECTURES[self.arch][0]
        if "rope_freqs.weight" in self._tensors:
            raise UnsupportedModel(f"{self.path}: tensor 'rope_freqs.weight' (rotary frequencies stored as "
                                   f"a tensor, as for Llama 3.1 scaling) is not supported")
        if self.get("{arch}.expert_count", 0):
            raise UnsupportedModel(f"{self.path}: {self.arch}.expert_count = {self.get('{arch}.expert_count')} "
                                   f"(mixture of experts) is not supported")
        for key in ("head_count", "head_count_kv"):
            if isinstance(self.get(f"{{arch}}.attention.{key}", None), list):
                raise UnsupportedModel(f"{self.path}: {self.arch}.attention.{key} per layer is not supported")
        n_heads = self._int("{arch}.attention.head_count")
        n_kv_heads = self._int("{arch}.attention.head_count_kv", n_heads)
        embed = self._tensors.get("model.embed_tokens.weight")
        vocab = self.get("{arch}.vocab_size", None) or (int(embed.shape[-1]) if embed is not None else None)
        config = dict(
            model_type=model_type,
            hidden_size=self._int("{arch}.embedding_length"),
            num_hidden_layers=self.get("{arch}.block_count"),
            intermediate_size=self.get("{arch}.feed_forward_length"),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            max_position_embeddings=self.get("{arch}.context_length", None),
            rms_norm_eps=self.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.get("{arch}.rope.freq_base", 10000.0),
            vocab_size=vocab,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            bos_token_id=self._int("tokenizer.ggml.bos_token_id", None, minimum=0),
            eos_token_id=eos[0] if len(eos := self.eos_ids()) == 1 else eos or None,
        )
        if (head_dim := self._int("{arch}.attention.key_length", None)) is not None:
            config["head_dim"] = head_dim
        head_dim = head_dim or config["hidden_size"] // n_heads
        rotary = self._int("{arch}.rope.dimension_count", head_dim)
        if head_dim and rotary != head_dim:
            config["partial_rotary_factor"] = rotary / head_dim
        scaling = self.get("{arch}.rope.scaling.type", "none")
        if scaling == "linear":
            config["rope_scaling"] = {"type": "linear", "factor": self.get("{arch}.rope.scaling.factor")}
        elif scaling == "yarn":
            config["rope_scaling"] = {
                "type": "yarn", "factor": self.get("{arch}.rope.scaling.factor"),
                "original_max_position_embeddings": self.get("{arch}.rope.scaling.original_context_length")}
        elif scaling != "none":
            config["rope_scaling"] = {"type": scaling}  # plan_for refuses it by name
        if (window := self.get("{arch}.attention.sliding_window", None)) is not None:
            config["sliding_window"] = window
            config["use_sliding_window"] = True
        return config

    def eos_ids(self) -> list[int]:
        """Every id that ends a generation: EOS, and end-of-turn / end-of-message where given."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return list(dict.fromkeys(i for i in (self._int(k, None, minimum=0) for k in keys) if i is not None))

    # ---- tensors: the Checkpoint surface -------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), self.path)

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor in the file, as stored (quantized)."""
        return int(self._tensor(name).n_bytes)

    def read(self, name: str, bf16: str = "widen") -> torch.Tensor:
        """The tensor dequantized to float32, in Hugging Face's layout (bf16 is accepted for Checkpoint's surface)."""
        t = self._tensor(name)
        shape = self.info(name).shape
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        if ARCHITECTURES[self.arch][1] and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                          "k_proj.bias")):
            heads = self.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            if shape[0] % (2 * heads):
                raise CheckpointError(f"{self.path}: tensor {name!r} has {shape[0]} rows, not pairs of rows "
                                      f"for each of {heads} heads")
            weight = unpermute(weight, heads)
        return weight

    def read_into(self, name: str, dest: torch.Tensor):
        dest.copy_(self.read(name))

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._tensors[name]

    def close(self):
        self.reader = None
        self._tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- tokenizer -----------------------------------------------------------------------

    def tokenizer(self):
        """The Tokenizer the metadata describes: a byte-level BPE ("gpt2" in llama.cpp's words)."""
        from .tokenizer import BYTE_CHARS, Tokenizer

        kind = self.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModel(f"{self.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2)")
        pre = self.get("tokenizer.ggml.pre", "gpt2")
        if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
            raise UnsupportedModel(f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported "
                                   f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        pattern, ignore_merges, normalizer = PRE_TOKENIZERS[pre]
        byte_of = {c: b for b, c in enumerate(BYTE_CHARS)}

        def unspell(text: str) -> bytes:
            try:
                return bytes(byte_of[c] for c in text)
            except KeyError:
                raise CheckpointError(f"{self.path}: token {text!r} is not spelled in byte-level characters") from None

        def check(key, ok, expected):
            if not ok:
                raise CheckpointError(f"{self.path}: GGUF metadata {key} is malformed: expected {expected}")

        texts = self.get("tokenizer.ggml.tokens")
        check("tokenizer.ggml.tokens", isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts),
              "a non-empty list of strings")
        types = self.get("tokenizer.ggml.token_type", [1] * len(texts))
        check("tokenizer.ggml.token_type", isinstance(types, list) and len(types) == len(texts), "one type per token")
        merges = self.get("tokenizer.ggml.merges", [])
        check("tokenizer.ggml.merges", isinstance(merges, list) and all(isinstance(m, str) and m.count(" ") == 1
                                                                        for m in merges), "'left right' strings")
        bos = self._int("tokenizer.ggml.bos_token_id", None, minimum=0)
        for i in (bos, *self.eos_ids()):
            check("tokenizer.ggml.*_token_id", i is None or i < len(texts), f"ids below {len(texts)}, got {i}")
        template = self.get("tokenizer.chat_template", None)
        check("tokenizer.chat_template", template is None or isinstance(template, str), "a string")
        special = {i for i, kind in enumerate(types) if kind in (3, 4)}  # control, user-defined
        tokens = [text.encode() if i in special else unspell(text) for i, text in enumerate(texts)]
        merges = [tuple(unspell(side) for side in merge.split(" ")) for merge in merges]
        return Tokenizer(
            tokens, merges, pattern=pattern, added={texts[i]: i for i in sorted(special)}, normalizer=normalizer,
            bos_ids=() if bos is None else (bos,), eos_ids=tuple(self.eos_ids()),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(self.get("tokenizer.ggml.add_eos_token", False)),
            ignore_merges=ignore_merges, chat_template=template,
            source=str(self.path))


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`, which interleaves each head's two rotary halves row by row."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)



def convert(path, out, progress=None):
    """Write a GGUF file as a Hugging Face checkpoint directory that transformers loads.

    config.json, model.safetensors (the plan's tensors, dequantized to float32), tokenizer.json,
    tokenizer_config.json and generation_config.json; the model is refused before anything is written.
    """
    from safetensors.torch import save_file

    out = Path(out)
    with GGUFFile(path) as source:
        plan = plan_for(source.config)
        names = list(dict.fromkeys(plan.weight_names()))
        for name in names:
            if name not in source:
                raise CheckpointError(f"{source.path}: missing tensor {name!r} (Hugging Face name)")
        tokenizer = source.tokenizer()
        texts = source.get("tokenizer.ggml.tokens")
        bos, eos = source.get("tokenizer.ggml.bos_token_id", None), source.eos_ids()
        pad = source._int("tokenizer.ggml.padding_token_id", None, minimum=0)
        if pad is not None and pad >= len(texts):
            raise CheckpointError(f"{source.path}: tokenizer.ggml.padding_token_id {pad} is past the "
                                  f"{len(texts)} tokens")
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None if bos is None else texts[bos],
            "eos_token": texts[eos[0]] if eos else None,
            "pad_token": None if pad is None else texts[pad],
            "add_bos_token": bool(source.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(source.get("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False,
            "chat_template": source.get("tokenizer.chat_template", None),
        }
        generation = {"bos_token_id": bos, "eos_token_id": source.config["eos_token_id"], "pad_token_id": pad}
        config = {"architectures": [ARCHITECTURES[source.arch][2]], **source.config, "dtype": "float32"}
        tensors = {}
        for done, name in enumerate(names, 1):
            tensors[name] = source.read(name).contiguous()
            if progress:
                progress(done, len(names))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
    for name, data in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                       ("generation_config.json", generation)):
        (out / name).write_text(json.dumps({k: v for k, v in data.items() if v is not None}, indent=2) + "\n",
                                encoding="utf-8")
