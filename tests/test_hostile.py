"""Hostile files: a corpus of malformed checkpoints, configs, tokenizers and GGUF files, each refused with the
documented exception and a message naming the file and the field or tensor at fault."""

import ast
import json
import struct
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file

from lmstack import (CausalLM, Checkpoint, CheckpointError, ConfigError, HFConfig, SafetensorsFile,
                     TokenizerError, UnsupportedModel, plan_for)
from lmstack.families.transformer import GGUF_LAYER_NAMES as LAYER_NAMES
from lmstack.gguf import GGUFFile
from lmstack.tokenizer import Tokenizer

SRC = Path(__file__).parent.parent / "src" / "lmstack"

D, F, V = 8, 16, 32
CONFIG = dict(model_type="llama", hidden_size=D, intermediate_size=F, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6)


def tensors(config=CONFIG) -> dict:
    """The tensors of a tiny llama, as a checkpoint names them."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def checkpoint_dir(root: Path, config=CONFIG, weights=None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file(weights or tensors(), root / "model.safetensors")
    return root


def safetensors_bytes(header, data=b"", *, length=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def sparse(path: Path, size: int):
    """A file that claims `size` bytes without writing them."""
    with open(path, "wb") as fh:
        fh.truncate(size)


# ---- how each case is opened -------------------------------------------------------------------

def open_safetensors(root):
    path = root / "model.safetensors"
    with SafetensorsFile(path) as f:
        for name in f.names():
            f.read(name)


def load(root):
    CausalLM.load(root, device="cpu")


def plan(root):
    plan_for(HFConfig.from_json(root))


def tokenizer(root):
    Tokenizer.from_pretrained(root)


def chat(root):
    Tokenizer.from_pretrained(root).apply_chat_template([{"role": "user", "content": "hi"}])


def open_gguf(root):
    with GGUFFile(root / "m.gguf") as f:
        plan_for(f.config)
        Tokenizer.from_gguf(f)
        for name in f.names():
            f.read(name)


# ---- safetensors ---------------------------------------------------------------------------------

def st(raw: bytes):
    def build(root):
        root.mkdir(parents=True, exist_ok=True)
        (root / "model.safetensors").write_bytes(raw)
        return "model.safetensors"
    return build


F32x2 = b"\0" * 8
SAFETENSORS = [
    ("empty file", st(b""), CheckpointError, ["too short"]),
    ("five bytes", st(b"\1\0\0\0\0"), CheckpointError, ["too short"]),
    ("header longer than the file", st(safetensors_bytes({"w": entry()}, F32x2, length=1000)), CheckpointError,
     ["header length 1000"]),
    ("header length 2**63", st(safetensors_bytes(b"{}", length=1 << 63)), CheckpointError, ["header length"]),
    ("header not JSON", st(safetensors_bytes(b"{nope")), CheckpointError, ["not valid JSON"]),
    ("header not UTF-8", st(safetensors_bytes(b'{"\xff": 1}')), CheckpointError, ["not valid JSON"]),
    ("header a list", st(safetensors_bytes(b"[1, 2]")), CheckpointError, ["does not start with"]),
    ("header after a space", st(safetensors_bytes(b' {"w": 1}')), CheckpointError, ["does not start with"]),
    ("header nested 100000 deep", st(safetensors_bytes(b'{"w": ' + b"[" * 100000 + b"]" * 100000 + b"}")),
     CheckpointError, ["not valid JSON", "RecursionError"]),
    ("offset with 5000 digits", st(safetensors_bytes(b'{"w": {"data_offsets": [0, ' + b"9" * 5000 + b"]}}")),
     CheckpointError, ["not valid JSON"]),
    ("duplicate tensor", st(safetensors_bytes(b'{"w": ' + json.dumps(entry()).encode() + b', "w": '
                                              + json.dumps(entry()).encode() + b"}", F32x2)),
     CheckpointError, ["'w' appears more than once"]),
    ("entry not an object", st(safetensors_bytes({"w": [1]})), CheckpointError, ["'w'", "not an object"]),
    ("unknown dtype", st(safetensors_bytes({"w": entry(dtype="F99")}, F32x2)), CheckpointError,
     ["'w'", "unknown dtype 'F99'"]),
    ("missing dtype", st(safetensors_bytes({"w": {"shape": [2], "data_offsets": [0, 8]}}, F32x2)), CheckpointError,
     ["'w'", "unknown dtype None"]),
    ("dtype a list", st(safetensors_bytes({"w": entry(dtype=["F32"])}, F32x2)), CheckpointError,
     ["'w'", "unknown dtype"]),
    ("fp8 dtype", st(safetensors_bytes({"w": entry(dtype="F8_E4M3", shape=(8,))}, F32x2)), UnsupportedModel,
     ["'w'", "F8_E4M3"]),
    ("shape a string", st(safetensors_bytes({"w": dict(entry(), shape="2")}, F32x2)), CheckpointError,
     ["'w'", "shape '2'"]),
    ("negative dim", st(safetensors_bytes({"w": entry(shape=(-2,))}, F32x2)), CheckpointError, ["'w'", "shape [-2]"]),
    ("float dim", st(safetensors_bytes({"w": entry(shape=(2.0,))}, F32x2)), CheckpointError, ["'w'", "shape [2.0]"]),
    ("bool dim", st(safetensors_bytes({"w": entry(shape=(True, 2))}, F32x2)), CheckpointError, ["'w'", "shape"]),
    ("dim 2**41", st(safetensors_bytes({"w": entry(shape=(1 << 41,))}, F32x2)), CheckpointError, ["'w'", "shape"]),
    ("dims overflow 64 bits before a 0", st(safetensors_bytes({"w": entry(shape=(1 << 39, 1 << 39, 0),
                                                                          offsets=(0, 0))})),
     CheckpointError, ["'w'", "2**48 elements"]),
    ("huge tensor claimed", st(safetensors_bytes({"w": entry(shape=(1 << 20, 1 << 20), offsets=(0, 1 << 42))},
                                                 F32x2)),
     CheckpointError, ["'w'", "data_offsets", "outside the data (8 bytes)"]),
    ("offsets missing", st(safetensors_bytes({"w": {"dtype": "F32", "shape": [2]}}, F32x2)), CheckpointError,
     ["'w'", "data_offsets None"]),
    ("offsets reversed", st(safetensors_bytes({"w": entry(offsets=(8, 0))}, F32x2)), CheckpointError,
     ["'w'", "data_offsets [8, 0]"]),
    ("offsets past the data", st(safetensors_bytes({"w": entry(offsets=(8, 16))}, F32x2)), CheckpointError,
     ["'w'", "data_offsets [8, 16]"]),
    ("three offsets", st(safetensors_bytes({"w": entry(offsets=(0, 4, 8))}, F32x2)), CheckpointError,
     ["'w'", "data_offsets"]),
    ("float offsets", st(safetensors_bytes({"w": entry(offsets=(0, 8.0))}, F32x2)), CheckpointError,
     ["'w'", "data_offsets"]),
    ("bytes disagree with shape", st(safetensors_bytes({"w": entry(shape=(4,))}, F32x2)), CheckpointError,
     ["'w'", "need 16 bytes, offsets give 8"]),
    ("overlapping tensors", st(safetensors_bytes({"a": entry(), "b": entry(shape=(1,), offsets=(4, 8))}, F32x2)),
     CheckpointError, ["'b'", "overlaps"]),
    ("gap between tensors", st(safetensors_bytes({"a": entry(shape=(1,), offsets=(0, 4)),
                                                 "b": entry(shape=(0,), offsets=(8, 8))}, F32x2)),
     CheckpointError, ["'b'", "bytes 4..8 unused"]),
    ("trailing bytes", st(safetensors_bytes({"w": entry(shape=(1,), offsets=(0, 4))}, F32x2)), CheckpointError,
     ["4 bytes after the last tensor"]),
    ("metadata a list", st(safetensors_bytes({"__metadata__": [1], "w": entry()}, F32x2)), CheckpointError,
     ["__metadata__"]),
    ("metadata values not strings", st(safetensors_bytes({"__metadata__": {"a": 1}, "w": entry()}, F32x2)),
     CheckpointError, ["__metadata__"]),
]


# ---- sharded index -------------------------------------------------------------------------------

def sharded(index, *, extra=None):
    """A checkpoint directory with one real shard and the given index (a dict, or raw bytes)."""
    def build(root):
        checkpoint_dir(root)
        (root / "model.safetensors").rename(root / "shard-1.safetensors")
        raw = index if isinstance(index, bytes) else json.dumps(index).encode()
        (root / "model.safetensors.index.json").write_bytes(raw)
        if extra:
            return extra(root)
        return "model.safetensors.index.json"
    return build


def weight_map(**changes):
    names = {name: "shard-1.safetensors" for name in tensors()}
    return {"metadata": {}, "weight_map": {**names, **changes}}


def symlink_out(root):
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    save_file({"x": torch.zeros(1)}, outside / "x.safetensors")
    (root / "shard-2.safetensors").symlink_to(outside / "x.safetensors")
    return "model.safetensors.index.json"


def symlink_loop(root):
    (root / "shard-2.safetensors").symlink_to(root / "shard-3.safetensors")
    (root / "shard-3.safetensors").symlink_to(root / "shard-2.safetensors")
    return "model.safetensors.index.json"


def other_shard(root):
    save_file({"x": torch.zeros(1)}, root / "shard-2.safetensors")
    return "shard-2.safetensors"


def huge_index(root):
    sparse(root / "model.safetensors.index.json", 200 << 20)
    return "model.safetensors.index.json"


NORM = "model.norm.weight"
INDEX = [
    ("index not JSON", sharded(b"{"), CheckpointError, ["not valid JSON"]),
    ("index a list", sharded([1]), CheckpointError, ["expected a JSON object, got list"]),
    ("index of 200 MB", sharded({}, extra=huge_index), CheckpointError, ["209715200 bytes"]),
    ("index duplicate key", sharded(b'{"weight_map": {"a": "x", "a": "y"}}'), CheckpointError,
     ["'a' appears more than once"]),
    ("no weight_map", sharded({"metadata": {}}), CheckpointError, ["'weight_map'"]),
    ("weight_map a list", sharded({"weight_map": ["shard-1.safetensors"]}), CheckpointError, ["'weight_map'"]),
    ("weight_map empty", sharded({"weight_map": {}}), CheckpointError, ["'weight_map'", "empty"]),
    ("weight_map value an int", sharded(weight_map(**{NORM: 1})), CheckpointError, ["'weight_map'"]),
    ("shard ../", sharded(weight_map(**{NORM: "../x.safetensors"})), CheckpointError,
     ["'../x.safetensors'", "outside the checkpoint directory"]),
    ("shard sub/../../", sharded(weight_map(**{NORM: "sub/../../x.safetensors"})), CheckpointError,
     ["'sub/../../x.safetensors'", "outside"]),
    ("shard absolute", sharded(weight_map(**{NORM: "/etc/passwd"})), CheckpointError, ["'/etc/passwd'", "outside"]),
    ("shard empty name", sharded(weight_map(**{NORM: ""})), CheckpointError, ["shard ''", "outside"]),
    ("shard with NUL", sharded(weight_map(**{NORM: "a\0.safetensors"})), CheckpointError, ["outside"]),
    ("shard symlinked out", sharded(weight_map(**{NORM: "shard-2.safetensors"}), extra=symlink_out),
     CheckpointError, ["'shard-2.safetensors'", "outside"]),
    ("shard in a symlink loop", sharded(weight_map(**{NORM: "shard-2.safetensors"}), extra=symlink_loop),
     CheckpointError, ["'shard-2.safetensors'"]),
    ("shard missing", sharded(weight_map(**{NORM: "shard-9.safetensors"})), FileNotFoundError,
     ["'shard-9.safetensors'", "does not exist"]),
    ("shard not safetensors", sharded(weight_map(**{NORM: "config.json"}), extra=lambda root: "config.json"),
     CheckpointError,
     ["config.json", "header length"]),
    ("shard lacks the tensor", sharded(weight_map(**{NORM: "shard-2.safetensors"}), extra=other_shard),
     CheckpointError, ["shard-2.safetensors", "lacks tensor 'model.norm.weight'"]),
]


# ---- config.json and the checkpoint it describes -------------------------------------------------

def config(raw=None, culprit="config.json", **changes):
    def build(root):
        checkpoint_dir(root)
        data = raw if raw is not None else json.dumps({**CONFIG, **changes}).encode()
        (root / "config.json").write_bytes(data)
        return culprit
    return build


def weights(**changes):
    def build(root):
        held = tensors()
        held.update(changes)
        checkpoint_dir(root, weights=held)
        return "model.safetensors"
    return build


def huge_config(root):
    checkpoint_dir(root)
    sparse(root / "config.json", 200 << 20)
    return "config.json"


CONFIGS = [
    ("config not JSON", config(b"{'a': 1}"), ConfigError, ["not valid JSON"]),
    ("config a list", config(b"[]"), ConfigError, ["expected a JSON object, got list"]),
    ("config not UTF-8", config(b'{"model_type": "\xff"}'), ConfigError, ["not UTF-8"]),
    ("config of 200 MB", huge_config, ConfigError, ["209715200 bytes"]),
    ("config duplicate key", config(b'{"model_type": "llama", "model_type": "mistral"}'), ConfigError,
     ["'model_type' appears more than once"]),
    ("no model_type", config(model_type=None), ConfigError, ["'model_type'"]),
    ("model_type an int", config(model_type=7), ConfigError, ["'model_type'", "7"]),
    ("unknown model_type", config(model_type="gpt_neox"), UnsupportedModel, ["model_type 'gpt_neox'"]),
    ("hidden_size a string", config(hidden_size="8"), ConfigError, ["'hidden_size' = '8'"]),
    ("hidden_size 0", config(hidden_size=0), ConfigError, ["'hidden_size' = 0"]),
    ("hidden_size negative", config(hidden_size=-8), ConfigError, ["'hidden_size' = -8"]),
    ("hidden_size true", config(hidden_size=True), ConfigError, ["'hidden_size' = True"]),
    ("hidden_size 2**40", config(hidden_size=1 << 40), ConfigError, ["'hidden_size'"]),
    ("heads do not divide hidden_size", config(num_attention_heads=3), ConfigError, ["'hidden_size'", "multiple"]),
    ("kv heads do not divide heads", config(num_key_value_heads=3, num_attention_heads=4), ConfigError,
     ["'num_key_value_heads' = 3"]),
    ("vocab_size 2**40", config(vocab_size=1 << 40), ConfigError, ["'vocab_size'"]),
    ("a million layers", config(num_hidden_layers=10**6), ConfigError, ["'num_hidden_layers'"]),
    ("odd head_dim", config(head_dim=5), ConfigError, ["'head_dim' = 5"]),
    ("rms_norm_eps NaN", config(b'{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, '
                                b'"num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 32, '
                                b'"rms_norm_eps": NaN}'), ConfigError, ["'rms_norm_eps'"]),
    ("rope_theta negative", config(rope_theta=-1.0), ConfigError, ["'rope_theta'"]),
    ("rope_scaling a list", config(rope_scaling=[1]), ConfigError, ["'rope_scaling'"]),
    ("unknown rope type", config(rope_scaling={"type": "dynamic", "factor": 2.0}), UnsupportedModel,
     ["rope_scaling.rope_type", "'dynamic'"]),
    ("rope factor zero", config(rope_scaling={"type": "linear", "factor": 0}), ConfigError, ["factor"]),
    ("tie_word_embeddings a string", config(tie_word_embeddings="yes"), ConfigError, ["'tie_word_embeddings'"]),
    ("max_position_embeddings a float", config(max_position_embeddings=64.0), ConfigError,
     ["'max_position_embeddings'"]),
    ("layer_types too short", config(model_type="qwen2", layer_types=[]), ConfigError, ["'layer_types'"]),
    ("absurd but in-range sizes", config(hidden_size=1 << 17, intermediate_size=1 << 20, num_hidden_layers=1024,
                                         num_attention_heads=1024, vocab_size=1 << 22, culprit="model.safetensors"),
     CheckpointError,
     ["model.safetensors", "'model.embed_tokens.weight'", "the config implies [4194304, 131072]"]),
    ("weight of the wrong shape", weights(**{NORM: torch.zeros(D + 1)}), CheckpointError,
     ["model.safetensors", "'model.norm.weight'", f"[{D + 1}]"]),
    ("integer weight", weights(**{NORM: torch.zeros(D, dtype=torch.int32)}), CheckpointError,
     ["model.safetensors", "'model.norm.weight'", "dtype I32"]),
    ("weight missing", lambda root: (checkpoint_dir(root, weights={k: v for k, v in tensors().items()
                                                                   if k != NORM}), "")[1],  # the checkpoint's
     CheckpointError, ["missing tensor 'model.norm.weight'"]),
]


# ---- tokenizer.json, tokenizer_config.json, chat templates -------------------------------------

def byte_tokenizer_json() -> str:
    tokens = [bytes([b]) for b in range(256)] + [b"<s>"]
    return Tokenizer(tokens, [], pattern="gpt2", added={"<s>": 256}).to_json()


def tok(raw=None, config=None, template=None, spec=None):
    def build(root):
        root.mkdir(parents=True, exist_ok=True)
        text = raw if raw is not None else json.dumps(spec) if spec is not None else byte_tokenizer_json()
        (root / "tokenizer.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        if config is not None:
            (root / "tokenizer_config.json").write_bytes(config if isinstance(config, bytes) else
                                                         json.dumps(config).encode())
        if template is not None:
            (root / "chat_template.jinja").write_text(template)
        return ("chat_template.jinja" if template is not None else "tokenizer_config.json" if config is not None
                else "tokenizer.json")
    return build


def huge(name):
    def build(root):
        tok()(root)
        sparse(root / name, 200 << 20)
        return name
    return build


BPE = {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}
TOKENIZERS = [
    ("tokenizer.json not JSON", tok(b"{"), TokenizerError, ["not valid JSON"]),
    ("tokenizer.json a list", tok(b"[]"), TokenizerError, ["expected a JSON object"]),
    ("tokenizer.json not UTF-8", tok(b'{"model": "\xfe"}'), TokenizerError, ["not UTF-8"]),
    ("tokenizer.json of 200 MB", huge("tokenizer.json"), TokenizerError, ["209715200 bytes"]),
    ("no model", tok(spec={"version": "1.0"}), TokenizerError, ["field 'model'"]),
    ("unknown model type", tok(spec={"model": {"type": "Magic"}}), TokenizerError, ["model.type 'Magic'"]),
    ("vocab id 4e9", tok(spec={"version": "1.0", "model": {**BPE, "vocab": {"a": 4_000_000_000}}}), TokenizerError,
     ["token 'a' has id 4000000000"]),
    ("merge of unknown tokens", tok(spec={"version": "1.0", "model": {**BPE, "merges": [["a", "zz"]]}}),
     TokenizerError, ["tokenizers cannot load it", "zz"]),
    ("empty vocabulary", tok(spec={"version": "1.0", "model": {**BPE, "vocab": {}}}), TokenizerError, ["empty"]),
    ("duplicate vocab key", tok(b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "a": 1}, '
                                b'"merges": []}}'), TokenizerError, ["'a' appears more than once"]),
    ("tokenizer_config not JSON", tok(config=b"nope"), TokenizerError, ["not valid JSON"]),
    ("tokenizer_config of 200 MB", huge("tokenizer_config.json"), TokenizerError, ["209715200 bytes"]),
    ("bos_token not in the vocabulary", tok(config={"bos_token": "<bos>"}), TokenizerError, ["bos_token '<bos>'"]),
    ("bos_token an int", tok(config={"bos_token": 5}), TokenizerError, ["bos_token = 5"]),
    ("eos_token content a list", tok(config={"eos_token": {"content": ["x"]}}), TokenizerError, ["eos_token"]),
    ("add_bos_token a string", tok(config={"add_bos_token": "false"}), TokenizerError, ["add_bos_token = 'false'"]),
    ("chat_template an int", tok(config={"chat_template": 5}), TokenizerError, ["chat_template is a int"]),
    ("chat_template.jinja of 200 MB", huge("chat_template.jinja"), TokenizerError, ["209715200 bytes"]),
]
CHAT = [
    ("template reads __class__", tok(template="{{ ''.__class__.__mro__[1].__subclasses__() }}"), TokenizerError,
     ["chat template", "unsafe"]),
    ("template reaches os", tok(template="{{ cycler.__init__.__globals__.os.system('echo hi') }}"), TokenizerError,
     ["chat template", "unsafe"]),
    ("template mutates messages", tok(template="{{ messages.append(1) }}"), TokenizerError, ["chat template"]),
    ("template includes a file", tok(template="{% include '/etc/passwd' %}"), TokenizerError,
     ["chat template", "loader"]),
    ("template imports a file", tok(template="{% import '/etc/passwd' as p %}"), TokenizerError,
     ["chat template", "loader"]),
    ("template divides by zero", tok(template="{{ 1 / 0 }}"), TokenizerError, ["chat template", "division"]),
    ("template range of 10**9", tok(template="{% for i in range(10**9) %}{% endfor %}"), TokenizerError,
     ["chat template", "Range too big"]),
    ("template syntax error", tok(template="{% for %}"), TokenizerError, ["chat template"]),
    ("template list without default", tok(config={"chat_template": [{"name": "tool_use", "template": "x"}]}),
     TokenizerError, ["no chat_template"]),
]


# ---- GGUF ----------------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {hf: name for name, hf in LAYER_NAMES.items()}


def gguf_file(path: Path, drop=(), weights=None, types=None, **metadata):
    """A tiny llama GGUF; `metadata` overrides keys (an int is written as uint32, a str as string, a list as
    an array), `drop` leaves keys out; `weights` replaces tensors(), `types` writes some of them in another float
    type than F32 ({name: GGMLQuantizationType})."""
    keys = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": D,
            "llama.feed_forward_length": F, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": [chr(c) for c in range(33, 33 + V - 1)] + ["<s>"],
            "tokenizer.ggml.token_type": [1] * (V - 1) + [3], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.bos_token_id": V - 1, "tokenizer.ggml.eos_token_id": V - 1}
    keys.update(metadata)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if key in drop:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, tensor in (weights or tensors()).items():
        if name.startswith("model.layers.0."):
            stem = name.removeprefix("model.layers.0.").removesuffix(".weight")
            names[name] = f"blk.0.{GGUF_LAYER_NAMES[stem]}.weight"
        qtype = (types or {}).get(name, gguf.GGMLQuantizationType.F32)
        writer.add_tensor(names[name], gguf.quants.quantize(tensor.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gg(drop=(), edit=None, **metadata):
    def build(root):
        root.mkdir(parents=True, exist_ok=True)
        gguf_file(root / "m.gguf", drop, **metadata)
        if edit:
            path = root / "m.gguf"
            path.write_bytes(edit(path.read_bytes()))
        return "m.gguf"
    return build


GGUF = [
    ("gguf magic only", gg(edit=lambda b: b[:4]), CheckpointError, ["not a readable GGUF file"]),
    ("gguf bad magic", gg(edit=lambda b: b"GGUX" + b[4:]), CheckpointError, ["not a readable GGUF file"]),
    ("gguf version 99", gg(edit=lambda b: b[:4] + struct.pack("<I", 99) + b[8:]), CheckpointError,
     ["not a readable GGUF file"]),
    ("gguf truncated in metadata", gg(edit=lambda b: b[:200]), CheckpointError, ["not a readable GGUF file"]),
    ("gguf tensor data cut short", gg(edit=lambda b: b[:-64]), CheckpointError, ["not a readable GGUF file"]),
    ("gguf 2**62 tensors", gg(edit=lambda b: b[:8] + struct.pack("<Q", 1 << 62) + b[16:]), CheckpointError,
     ["not a readable GGUF file"]),
    ("gguf 2**62 metadata keys", gg(edit=lambda b: b[:16] + struct.pack("<Q", 1 << 62) + b[24:]), CheckpointError,
     ["not a readable GGUF file"]),
    ("gguf head_count 0", gg(**{"llama.attention.head_count": 0}), CheckpointError,
     ["'llama.attention.head_count' = 0"]),
    ("gguf head_count a string", gg(**{"llama.attention.head_count": "two"}), CheckpointError,
     ["'llama.attention.head_count' = 'two'"]),
    ("gguf embedding_length missing", gg(drop=("llama.embedding_length",)), CheckpointError,
     ["lacks 'llama.embedding_length'"]),
    ("gguf block_count 10**6", gg(**{"llama.block_count": 10**6}), ConfigError, ["'num_hidden_layers' = 1000000"]),
    ("gguf tokens not strings", gg(**{"tokenizer.ggml.tokens": list(range(V))}), CheckpointError,
     ["tokenizer.ggml.tokens"]),
    ("gguf token types too few", gg(**{"tokenizer.ggml.token_type": [1]}), CheckpointError,
     ["tokenizer.ggml.token_type"]),
    ("gguf merge without a space", gg(**{"tokenizer.ggml.merges": ["ab"]}), CheckpointError,
     ["tokenizer.ggml.merges"]),
    ("gguf eos id past the tokens", gg(**{"tokenizer.ggml.eos_token_id": 10**6}), CheckpointError,
     ["tokenizer.ggml.eos_token_id", "1000000"]),
    ("gguf pre-tokenizer unknown", gg(**{"tokenizer.ggml.pre": "klingon"}), UnsupportedModel,
     ["tokenizer.ggml.pre 'klingon'"]),
]

# (name, build(root) -> the culprit file's name in root, open(root), exception, words the message holds)
CORPUS = ([(*c[:2], open_safetensors, *c[2:]) for c in SAFETENSORS]
          + [(*c[:2], lambda root: Checkpoint.open(root).read(NORM), *c[2:]) for c in INDEX]
          + [(*c[:2], load, *c[2:]) for c in CONFIGS]
          + [(*c[:2], tokenizer, *c[2:]) for c in TOKENIZERS]
          + [(*c[:2], chat, *c[2:]) for c in CHAT]
          + [(*c[:2], open_gguf, *c[2:]) for c in GGUF])


def test_corpus_has_distinct_cases():
    names = [case[0] for case in CORPUS]
    assert len(names) == len(set(names)) >= 60


@pytest.mark.parametrize("name, build, opener, error, words", CORPUS, ids=[case[0] for case in CORPUS])
def test_malformed_file_is_refused_by_name(tmp_path, name, build, opener, error, words):
    root = tmp_path / "ckpt"
    culprit = root / build(root)
    start = time.perf_counter()
    with pytest.raises(error) as caught:
        opener(root)
    assert type(caught.value) is error  # the documented class itself, not a subclass or a neighbour
    message = str(caught.value)
    assert str(culprit) in message or (name.startswith("template") and str(root / "tokenizer.json") in message)
    for word in words:
        assert word in message
    assert time.perf_counter() - start < 10, "refused, but not quickly"


def test_missing_paths_are_file_not_found(tmp_path):
    for opener in (load, plan, tokenizer, open_gguf, open_safetensors):
        with pytest.raises(FileNotFoundError, match=str(tmp_path)):
            opener(tmp_path)


def test_valid_files_of_the_corpus_load(tmp_path):
    """The corpus' builders make valid files when nothing is changed: each refusal is the change's doing."""
    load(checkpoint_dir(tmp_path / "st"))
    sharded(weight_map())(tmp_path / "sharded")
    load(tmp_path / "sharded")
    tok(config={"bos_token": "<s>", "chat_template": "{{ messages[0]['content'] }}"})(tmp_path / "tok")
    assert Tokenizer.from_pretrained(tmp_path / "tok").apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    gg()(tmp_path / "gguf")
    open_gguf(tmp_path / "gguf")
    CausalLM.load(tmp_path / "gguf" / "m.gguf", device="cpu")


# ---- no code from a checkpoint ever runs ---------------------------------------------------------

FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib"}


def forbidden(source: str) -> list[str]:
    """Lines of `source` that unpickle, evaluate, torch.load / np.load, or ask for remote code."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Import):
            problems += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            problems.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in FORBIDDEN_CALLS:
                problems.append(f"{line}: {f.id}()")
            if (isinstance(f, ast.Attribute) and f.attr in ("load", "loads") and isinstance(f.value, ast.Name)
                    and f.value.id in ("torch", "pickle", "np", "numpy")):
                problems.append(f"{line}: {f.value.id}.{f.attr}()")
            problems += [f"{line}: {k.arg}=" for k in node.keywords if k.arg in ("trust_remote_code", "allow_pickle")]
        elif isinstance(node, ast.Constant) and node.value == "trust_remote_code":
            problems.append(f"{line}: 'trust_remote_code'")
    return problems


def test_package_never_unpickles_or_evaluates():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    problems = {str(p.relative_to(SRC)): found for p in files if (found := forbidden(p.read_text(encoding="utf-8")))}
    assert not problems


def test_the_scan_flags_each_forbidden_form():
    source = ("import pickle\nfrom marshal import loads\neval('1')\nexec('x')\ntorch.load(f)\n"
              "np.load(f, allow_pickle=True)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n")
    assert len(forbidden(source)) == 8  # np.load counts twice: the call and allow_pickle
    assert forbidden("import json\njson.loads(s)\nsafe_open(p)\n") == []
