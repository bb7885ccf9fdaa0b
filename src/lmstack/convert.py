"""A GGUF file written as the Hugging Face checkpoint directory transformers loads."""

import json
from pathlib import Path

from .checkpoint import CheckpointError
from .config import plan_for
from .gguf import GGUFFile
from .tokenizer import Tokenizer


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
        tokenizer = Tokenizer.from_gguf(source)
        empty = tokenizer.encode("")
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
            "add_bos_token": bos is not None and empty[:1] == [bos],  # as the tokenizer adds them
            "add_eos_token": bool(eos) and empty[-1:] == eos[:1],  # (SentencePiece adds BOS unless told not to)
            "clean_up_tokenization_spaces": False,
            "chat_template": source.get("tokenizer.chat_template", None),
        }
        generation = {"bos_token_id": bos, "eos_token_id": source.config["eos_token_id"], "pad_token_id": pad}
        config = {"architectures": [source.architecture.hf_class], **source.config, "dtype": "float32"}
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
