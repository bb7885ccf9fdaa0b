"""CLI and API edges, round 2: closed standard streams, arguments at the edge of the arithmetic, invalid UTF-8,
and Ctrl-C mid-stream."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from lmstack import CausalLM, Sampler
from test_hostile import CONFIG, byte_tokenizer_json, checkpoint_dir, tensors

NO_POSITIONS = {**{k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}, "vocab_size": 257}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama without max_position_embeddings, and a byte-level tokenizer of its 257 ids."""
    root = checkpoint_dir(tmp_path_factory.mktemp("cli") / "m", config=NO_POSITIONS, weights=tensors(NO_POSITIONS))
    (root / "tokenizer.json").write_text(byte_tokenizer_json())
    return root


def run(*args, input=None, close=(), timeout=120):
    """`python -m lmstack ARGS` with the given file descriptors closed; (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "lmstack", *args], input=input, capture_output=True,
                          timeout=timeout, preexec_fn=lambda: [os.close(fd) for fd in close])
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def one_line_error(code, err, *words):
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_closed_stdout_and_stdin_are_one_line_errors(model_dir):
    code, _, err = run("generate", "-m", str(model_dir), "-n", "2", "hello", close=(1,))
    one_line_error(code, err, "stdout is closed")
    code, _, err = run("generate", "-m", str(model_dir), "-n", "2", close=(0,))
    one_line_error(code, err, "no prompt")
    code, _, err = run("chat", "-m", str(model_dir), close=(0,))
    assert code == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("flag, value, name", [("--temperature", "1e-45", "temperature"),
                                               ("--repetition-penalty", "1e-320", "repetition_penalty"),
                                               ("--seed", str(1 << 64), "seed"), ("--top-k", str(1 << 63), "top_k")])
def test_sampling_flags_at_the_edge_of_the_arithmetic_are_refused_by_name(model_dir, flag, value, name):
    code, _, err = run("generate", "-m", str(model_dir), "-n", "2", flag, value, "hello")
    one_line_error(code, err, name, value if "e" not in value else "")


def test_sampling_arguments_just_inside_the_limits_generate(model_dir):
    lm = CausalLM.load(model_dir, device="cpu")
    for options in (dict(temperature=1e-30, seed=(1 << 64) - 1), dict(temperature=0.7, repetition_penalty=1e-30,
                                                                     seed=0)):
        out = lm.generate([[1, 2, 3]], 4, greedy=False, **options)
        assert out.shape == (1, 7) and int(out.min()) >= 0
    for bad in (dict(temperature=1e-45), dict(repetition_penalty=1e-320), dict(seed=1 << 64), dict(seed=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampler(**bad)


def test_invalid_utf8_prompts_are_named(model_dir):
    code, _, err = run("generate", "-m", str(model_dir), "-n", "2", input=b"caf\xe9!")
    one_line_error(code, err, "stdin: not UTF-8", "0xe9", "offset 3")
    code, _, err = run("generate", "-m", str(model_dir), "-n", "2", os.fsdecode(b"caf\xe9"))
    one_line_error(code, err, "not UTF-8")


def test_ctrl_c_while_streaming_ends_the_line(model_dir):
    # SIGINT as a terminal delivers it, even where this test runs in a background job (which ignores it)
    process = subprocess.Popen([sys.executable, "-m", "lmstack", "generate", "-m", str(model_dir), "-n", "100000",
                                "--temperature", "1", "--seed", "0", "hello"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        os.set_blocking(process.stdout.fileno(), False)
        out, deadline = b"", time.monotonic() + 120
        while not out and time.monotonic() < deadline:
            out += process.stdout.read() or b""
            time.sleep(0.05)
        assert out, "no output to interrupt"
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and "Traceback" not in err.decode(), err
    assert (out + rest).endswith(b"\n")


# ---- one set of checks for ids, at every entry point -----------------------------------------------


@pytest.fixture(scope="module")
def lm(model_dir):
    return CausalLM.load(model_dir, device="cpu")


@pytest.mark.parametrize("ids", [[True, 2], [[1, False]], [[1, 2], [True]], np.array([True, False])])
def test_booleans_are_refused_by_every_entry_point(lm, ids):
    with pytest.raises(TypeError, match="bool"):
        lm.forward(ids)
    with pytest.raises(TypeError, match="bool"):
        lm.generate(ids, 1)


def test_numpy_scalars_are_ids_at_every_entry_point(lm):
    row = [np.int64(5), np.int64(7), np.int32(9)]
    torch.testing.assert_close(lm.forward(row), lm.forward([5, 7, 9]), rtol=0, atol=0)
    assert torch.equal(lm.generate(row, 3), lm.generate([5, 7, 9], 3))
    assert torch.equal(lm.generate([row, [np.int64(1)]], 2), lm.generate([[5, 7, 9], [1]], 2))


def test_errors_name_the_flag_at_fault(model_dir):
    """The library names its parameters; the command names its flags too (this model has no context limit, so the
    decode state's size is what -n asks for)."""
    code, _, err = run("generate", "-m", str(model_dir), "-n", "1000000000", "hello")
    one_line_error(code, err, "decode state", "--max-new-tokens 1000000000")
    code, _, err = run("generate", "-m", str(model_dir), "--top-p", "2", "hello")
    one_line_error(code, err, "top_p", "--top-p 2.0")


def test_a_tokenizers_panic_is_one_short_line(model_dir, tmp_path):
    """Rust prints a panic's message (and, with RUST_BACKTRACE, a backtrace) itself: the command drops it."""
    import shutil

    root = tmp_path / "m"
    shutil.copytree(model_dir, root)
    spec = json.loads((root / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    (root / "tokenizer.json").write_text(json.dumps(spec))
    for backtrace in ("0", "1"):
        os.environ["RUST_BACKTRACE"], saved = backtrace, os.environ.get("RUST_BACKTRACE")
        try:
            code, _, err = run("generate", "-m", str(root), "-n", "2", "a" * 41)
        finally:
            os.environ.pop("RUST_BACKTRACE") if saved is None else os.environ.update(RUST_BACKTRACE=saved)
        one_line_error(code, err, "tokenizers failed on this input", "retry-limit")
        assert "panicked" not in err and "Exception" not in err and len(err) < 300, err


def test_chat_input_spelling_a_control_token_is_ordinary_text(model_dir, tmp_path):
    """What is typed to `lmstack chat` cannot forge the template's markup (here its `<s>` separators)."""
    import shutil

    import tokenizers

    from test_hostile import byte_tokenizer_json

    root = tmp_path / "m"
    shutil.copytree(model_dir, root)
    (root / "chat_template.jinja").write_text("{% for m in messages %}<s>{{ m.content }}{% endfor %}<s>")
    typed = "a<s>b<s>c"
    code, _, err = run("chat", "-m", str(root), "-n", "1", "-v", input=(typed + "\n").encode())
    plain = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    plain.encode_special_tokens = True
    assert code == 0 and f"[prompt: {2 + len(plain.encode(typed).ids)} tokens" in err, err
