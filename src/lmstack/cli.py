"""The `lmstack` command: generate, chat, serve, convert, info, perplexity.

Errors are one line on stderr and a non-zero exit; the load's progress bar goes to stderr, and
only when it is a terminal.
"""

import argparse
import json
import math
import os
import re
import shutil
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

from . import kernels, memory, models
from .model import CausalLM, _gguf_bytes
from .parallel import PipelineCausalLM
from .checkpoint import DTYPES, Checkpoint
from .config import HFConfig, plan_for
from .gguf import GGUFFile, is_gguf
from .formats import NUMERIC_PROFILES, WEIGHT_FORMATS
from .lookup import DEFAULT_NGRAM
from .sampling import Sampler, text_steps

GENERATE_TOKENS = 64
CHAT_TOKENS = 256
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
         "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed", "stop": "--stop",
         "prompt_lookup": "--prompt-lookup", "lookup_ngram": "--lookup-ngram"}  # the library's names: our flags


def main(argv=None) -> int:
    args, unknown = _parser().parse_known_args(argv)
    if unknown:  # told with the command's own usage (argparse's top level would show only "COMMAND ...")
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if argv is None:  # the command itself, not a caller in its own process
        _drop_native_panic_messages()
    try:
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            raise OSError("stdout is closed: nowhere to write the answer")
        code = args.run(args) or 0
        if argv is None and args.run is _generate:  # its answer written, it holds nothing else to close
            _exit_at_once(code)
        return code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lmstack generate ... | head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError, RuntimeError, KeyError, MemoryError) as e:
        print(f"lmstack: error: {e}", file=sys.stderr)
        return 1


def _exit_at_once(code: int):
    """End the process without the interpreter's teardown (torch's modules and the model freed object by object,
    a tenth of a second of a 1.7B model's start), once what was written is out: stdout and stderr flushed, and
    the native stderr that _drop_native_panic_messages forwards copied to the end."""
    sys.stdout.flush()
    sys.stderr.flush()
    forwarder = next((t for t in threading.enumerate() if t.name == "lmstack-stderr"), None)
    if forwarder is not None:
        os.close(2)  # the pipe's only write end: the forwarder copies what is left and ends
        forwarder.join(timeout=1)
    os._exit(code)


RUST_PANIC = re.compile(rb"thread '.*' (\(\d+\) )?panicked at ")
RUST_FRAME = re.compile(rb"\s+(\d+: |at )")


def _drop_native_panic_messages():
    """Native code's writes to stderr pass through a thread that drops Rust's panic messages: a `tokenizers`
    panic on a hostile tokenizer.json prints one (a backtrace, with RUST_BACKTRACE) before the exception that
    becomes our one-line error. Python's own stderr (sys.stderr) writes to the terminal as before."""
    others = [t for t in threading.enumerate()  # but the prefault's, which writes no stderr
              if t is not threading.current_thread() and t.name != memory.PREFAULT_THREAD]
    if sys.stderr is None or sys.stderr is not sys.__stderr__ or others:
        return
    try:
        sys.stderr.flush()
        terminal, (read, write) = os.dup(2), os.pipe()
        os.dup2(write, 2)
        os.close(write)
    except OSError:
        return
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)
    threading.Thread(target=_forward_stderr, args=(read, terminal), name="lmstack-stderr", daemon=True).start()


def _forward_stderr(read: int, terminal: int):
    """Copy what comes in on `read` to `terminal`, less each panic: its header, message and note or backtrace."""
    pending, panic, frames = b"", False, False
    while chunk := os.read(read, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        out = []
        for line in lines:
            if not panic and RUST_PANIC.match(line):
                panic, frames = True, False
            elif panic and line.startswith(b"note: "):
                panic = False
            elif panic and line == b"stack backtrace:":
                frames = True
            elif panic and frames and not RUST_FRAME.match(line):
                panic = False
                out.append(line + b"\n")
            elif not panic:
                out.append(line + b"\n")
        if pending and not panic and not b"thread '".startswith(pending[:8]):
            out.append(pending)
            pending = b""
        if out:
            os.write(terminal, b"".join(out))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmstack", description="Run a causal language model: a Hugging Face "
                                     "checkpoint directory, a GGUF file, or the built-in 'smollm2'.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def weight_options(p):
        p.add_argument("--weight-format", default=None, choices=sorted(WEIGHT_FORMATS),
                       help="how matrices are stored (default: the checkpoint's own: gguf for a GGUF file on CPU, "
                       "bfloat16 for BF16 safetensors, else float32)")
        p.add_argument("--numeric-profile", default=None, choices=sorted(NUMERIC_PROFILES),
                       help="the arithmetic (default: fp32 for every format; bf16: faster, see formats.py)")
        p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, gpu, cuda:N")
        p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=None,
                       help="keep a GGUF's BF16 matrices in the file's pages, mapped (the default but for serve), or "
                            "copy them into memory in the kernels' tiles (serve's default: its batches read them "
                            "faster)")

    def model_options(p, max_new_tokens):
        p.add_argument("--model", "-m", default=None,
                       help="checkpoint directory, .safetensors or .gguf file, or a name (default: smollm2)")
        weight_options(p)
        p.add_argument("--max-new-tokens", "--max-tokens", "-n", type=_positive, default=max_new_tokens,
                       help="--max-tokens: mlx-lm's and the OpenAI API's name for it")
        p.add_argument("--temperature", "-t", type=float, default=0.0, help="0: greedy (the default)")
        p.add_argument("--top-k", type=int, default=0, help="0: off")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--repetition-penalty", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
        p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
        p.add_argument("--prompt-lookup", type=_natural, default=0, metavar="N",
                       help="prompt lookup decoding: check up to N drafted tokens per forward, copied from the prompt "
                            "and the text so far (the same tokens; faster on text that repeats). 0: off")
        p.add_argument("--lookup-ngram", type=_positive, default=DEFAULT_NGRAM, metavar="N",
                       help=f"drafts follow a match of the last N tokens or fewer (default {DEFAULT_NGRAM})")
        p.add_argument("--json-schema", type=_json_file, default=None, metavar="FILE",
                       help="answer JSON valid for the JSON Schema in FILE (constrained decoding)")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        p.add_argument("--verbose", "-v", action="store_true", help="load time and tokens/s on stderr")

    p = commands.add_parser("generate", help="continue a prompt, streaming the text")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    model_options(p, GENERATE_TOKENS)
    p.add_argument("--pipeline", action="store_true",
                   help="split the layers over the processes of `torchrun --nproc-per-node N -m lmstack generate "
                        "--pipeline ...`; rank 0 prints")
    p.set_defaults(run=_generate)

    p = commands.add_parser("chat", help="talk with the model through its chat template")
    p.add_argument("--system", default=None, help="a system message to start each conversation")
    model_options(p, CHAT_TOKENS)
    p.set_defaults(run=_chat)

    p = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint directory, .safetensors or .gguf file, or a name (default: smollm2)")
    weight_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: --model as given)")
    p.add_argument("--api-key", default=os.environ.get("LMSTACK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $LMSTACK_API_KEY, else none)")
    p.add_argument("--max-running", type=_positive, default=16, help="requests decoded together")
    p.add_argument("--max-waiting", type=_natural, default=64, help="requests queued beyond those; more get 429")
    p.add_argument("--kv-cache-memory", type=_size_arg, default=None, metavar="SIZE",
                   help="KV cache pool, e.g. 2GiB (default: the engine's, see lmstack.engine)")
    p.add_argument("--max-prefill-tokens", type=_positive, default=512, help="prompt tokens per engine step")
    p.add_argument("--short-slots", type=_natural, default=None, metavar="N",
                   help="of the --max-running slots, those kept for short requests (default: max-running // 8)")
    p.add_argument("--short-tokens", type=_positive, default=8, metavar="N",
                   help="a short request makes at most N tokens, from a prompt that one step computes whole")
    p.add_argument("--max-tokens-limit", type=_positive, default=4096, help="the most max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=_positive, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--cors-origins", nargs="+", default=[], metavar="ORIGIN", help="allow these browser origins")
    p.add_argument("--allow-special-in-messages", action="store_true",
                   help="let the text of chat messages and tools spell control tokens (<|im_start|>, ...), for "
                        "trusted clients that render prompts of their own (default: it is ordinary text)")
    p.add_argument("--send-buffer", type=_size_arg, default=64 * 1024, metavar="SIZE",
                   help="bytes of a stream held for a client that does not read it, in the socket and again in "
                        "the server (default 64KiB)")
    p.add_argument("--send-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                   help="a stream whose send buffer stays full this long is cut off and its request aborted")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call syntax: hermes, llama3_json or mistral (default: from the chat "
                        "template)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--verbose", "-v", action="store_true", help="load time on stderr")
    p.set_defaults(run=_serve)

    p = commands.add_parser("convert", help="write a GGUF file as a Hugging Face checkpoint directory")
    p.add_argument("gguf", help=".gguf file, or a name (smollm2)")
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(run=_convert)

    p = commands.add_parser("perplexity", help="sliding-window perplexity of a text file")
    p.add_argument("model", help="checkpoint directory, .safetensors or .gguf file, or a name (smollm2)")
    p.add_argument("file", type=Path, help="a UTF-8 text file")
    weight_options(p)
    p.add_argument("--window", type=_positive, default=512, help="tokens per window")
    p.add_argument("--stride", type=_positive, default=None, help="tokens a window advances (default: window/2)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--verbose", "-v", action="store_true", help="load time on stderr")
    p.set_defaults(run=_perplexity)

    p = commands.add_parser("info", help="what lmstack makes of a model, without loading its weights")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory, file or name (default: smollm2)")
    p.add_argument("--weight-format", default=None, choices=sorted(WEIGHT_FORMATS),
                   help="the storage to tell the cost of (default: the one generate would choose on this machine)")
    p.set_defaults(run=_info)
    for p in commands.choices.values():
        p.set_defaults(command_parser=p)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _json_file(text: str) -> dict:
    """A JSON Schema file's object, read when the flags are parsed (before the model loads)."""
    try:
        value = json.loads(Path(text).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text}: a JSON Schema is a JSON object, got {type(value).__name__}")
    return value


def _natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20, "G": 1e9,
              "GB": 1e9, "GIB": 2**30}


def _size_arg(text: str) -> int:
    """Bytes from `1073741824`, `1GiB`, `512MiB`, `1.5GB`."""
    number = text.rstrip("BbKkMmGgIi")
    unit = text[len(number):].strip().upper()
    try:
        value = float(number) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or a number of bytes, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


class _Progress:
    """A tqdm bar on stderr while tensors load, or nothing when quiet or stderr is not a terminal."""

    def __init__(self, quiet: bool, what: str):
        self.enabled = not quiet and sys.stderr.isatty()
        self.what, self.bar = what, None

    def __call__(self, done: int, total: int):
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.what, unit="tensor", leave=False, file=sys.stderr,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.bar.close()


def _load(args):
    """(model, tokenizer) as the command's flags ask; a GGUF's BF16 matrices mapped (CausalLM.load's mmap) unless
    --no-mmap, or for serve unless --mmap (the server copies them into the kernels' tiles, which its batches of rows
    read faster)."""
    if hasattr(args, "temperature"):
        try:
            Sampler(**_sampling(args))  # refuse bad sampling flags before the load
        except ValueError as e:
            raise _naming_flags(e, args) from None
    start = time.perf_counter()
    model_class = PipelineCausalLM if getattr(args, "pipeline", False) else CausalLM
    if args.weight_format is None:
        args.weight_format = models.native_format(models.resolve(args.model), args.device)
    with memory.collector_paused():
        lm, tokenizer = models.load(args.model, weight_format=args.weight_format, numeric_profile=args.numeric_profile,
                                    device=args.device, progress=_Progress(args.quiet, "loading"),
                                    model_class=model_class,
                                    mmap=args.run is not _serve if args.mmap is None else args.mmap)
    if args.verbose:
        runs_on = f"; lmstack's CPU kernels {'on' if kernels.available() else 'off'}" if lm.device.type == "cpu" else ""
        print(f"[{lm!r} loaded in {time.perf_counter() - start:.1f} s{runs_on}]", file=sys.stderr)
    return lm, tokenizer


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def _answer(lm, tokenizer, ids, args) -> str:
    """Stream one continuation of `ids` to stdout, ending the line; the text."""
    start = time.perf_counter()
    text, steps, first = "", 0, None
    try:
        for (piece,) in text_steps(lm, tokenizer, [ids], args.max_new_tokens, stop=args.stop, **_sampling(args),
                                   prompt_lookup=args.prompt_lookup, lookup_ngram=args.lookup_ngram,
                                   json_schema=args.json_schema):
            steps += 1
            first = first or time.perf_counter()
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
                text += piece
    except (ValueError, MemoryError) as e:
        raise _naming_flags(e, args) from None
    finally:  # Ctrl-C included: the answer's line is ended
        if not text.endswith("\n"):
            print(flush=True)
    if args.verbose:
        end, tokens = time.perf_counter(), steps - 1  # the last step only flushes held-back text
        decode = f"{(tokens - 1) / (end - first):.1f}" if tokens > 1 and end > first else "-"
        print(f"[prompt: {len(ids)} tokens, {len(ids) / (first - start):.1f} tokens/s; "
              f"decode: {tokens} tokens, {decode} tokens/s]", file=sys.stderr)
    return text


def _naming_flags(error: Exception, args) -> Exception:
    """The error, with the flags it is about and their values: the library names its parameters, and a decode
    state too large for memory is what --max-new-tokens asked for."""
    message = str(error)
    flags = [flag for name, flag in FLAGS.items() if re.search(rf"\b{name}\b", message)]
    if not flags and isinstance(error, MemoryError):
        flags = [FLAGS["max_new_tokens"]]
    if not flags:
        return error
    given = ", ".join(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in flags)
    return (MemoryError if isinstance(error, MemoryError) else ValueError)(f"{message} (asked by {given})")


def _generate(args):
    if args.pipeline and int(os.environ.get("RANK", "0")):  # a later stage: its layers, until rank 0 is done
        return _load(args)[0].serve()
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():  # None: started with stdin closed (`<&-`)
            raise ValueError("no prompt: give PROMPT or pipe it on stdin")
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"stdin: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    elif not prompt.isascii():
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that were not UTF-8 arrive as lone surrogates
            raise ValueError(f"the prompt is not UTF-8 text (at character {e.start})") from None
    if not prompt:
        raise ValueError("the prompt is empty")
    lm, tokenizer = _load(args)
    try:
        _answer(lm, tokenizer, tokenizer.encode(prompt), args)
    finally:
        if args.pipeline:
            lm.close()  # ends the other ranks' serve()


def _perplexity(args):
    from .perplexity import perplexity

    try:
        text = args.file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.file}: not UTF-8 text ({e})") from None
    lm, tokenizer = _load(args)
    ids = tokenizer.encode(text)
    window = args.window if lm.max_positions is None else min(args.window, lm.max_positions)
    result = perplexity(lm, [ids], window=window, stride=args.stride, progress=_Progress(args.quiet, "scoring"))
    print(f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
          f"(window {window}, stride {args.stride or window // 2}, {lm.weight_format})")


def _chat(args):
    lm, tokenizer = _load(args)
    if tokenizer.chat_template is None:
        raise ValueError(f"{tokenizer.source}: the model has no chat template; use `lmstack generate`")
    if sys.stdin is None:
        raise ValueError("stdin is closed: nothing to chat with")
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat with the model: /reset starts over, /exit or Ctrl-D leaves.", file=sys.stderr)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(start)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)  # what is typed is ordinary text
        try:
            answer = _answer(lm, tokenizer, ids, args)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            print(f"lmstack: error: {e} (/reset starts over)", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


def _serve(args):
    import logging

    from .server import Service, serve

    if args.short_slots is not None and args.short_slots >= args.max_running:
        raise ValueError(f"--short-slots {args.short_slots} leaves no slot of --max-running {args.max_running} "
                         "for requests that are not short")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    service = Service(args.served_model_name or args.model or models.DEFAULT, api_key=args.api_key,
                      max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                      max_waiting=args.max_waiting, cors_origins=args.cors_origins,
                      allow_special_in_messages=args.allow_special_in_messages, send_buffer=args.send_buffer,
                      send_timeout=args.send_timeout, tool_call_parser=args.tool_call_parser)
    serve(lambda: _load(args), service, host=args.host, port=args.port,
          engine_options=dict(max_running=args.max_running, kv_cache_memory=args.kv_cache_memory,
                              max_prefill_tokens=args.max_prefill_tokens, short_slots=args.short_slots,
                              short_tokens=args.short_tokens))


def _convert(args):
    from .convert import convert

    path = models.resolve(args.gguf)
    if not is_gguf(path):
        raise ValueError(f"{path}: not a GGUF file (convert reads GGUF)")
    convert(path, args.out, progress=_Progress(args.quiet, "converting"))
    print(f"wrote {args.out}")


NO_BREAK = "\xa0"  # a space textwrap does not break at


def _info(args):
    path = models.resolve(args.model)
    if is_gguf(path):
        source = GGUFFile(path)
        config, kind = source.config, "GGUF"
    else:
        config = HFConfig.from_json(path if path.is_dir() else path.parent)
        source, kind = Checkpoint.open(path), "safetensors"
    plan = plan_for(config)
    o = plan.block_options
    weight_format = args.weight_format or models.native_format(path)
    with source:
        used = dict.fromkeys(plan.weight_names())
        infos = {name: source.info(name) for name in used if name in source}
        nbytes = {name: source.nbytes(name) if kind == "GGUF" else math.prod(info.shape) * DTYPES[info.dtype][1]
                  for name, info in infos.items()}
        loaded = {name: _gguf_bytes(source, name) for name in infos} if weight_format == "gguf" else None
        mapped = sum(nbytes[name] for name in infos if source.mappable(name)) if loaded is not None else 0
        unused = sorted(set(source.names()) - set(used))
    stored, params = sum(nbytes.values()), sum(math.prod(info.shape) for info in infos.values())
    per_token = ""
    if any(plan.layer_experts):  # a token reads top_k of each mixture's experts (all stored alike)
        e, experts = o["experts"], [name for name in infos if ".experts." in name]
        idle = 1 - e["top_k"] / e["n_experts"]
        active = params - idle * sum(math.prod(infos[n].shape) for n in experts)
        per_token = (f"; a token reads {active / 1e6:.1f}M of them ({100 * active / params:.0f}%), "
                     f"{_size(int(stored - idle * sum(nbytes[n] for n in experts)))} as stored")
    by_type = Counter()
    for name, info in infos.items():
        by_type[info.dtype] += nbytes[name]
    counts = Counter(info.dtype for info in infos.values())
    types = ", ".join(f"{t} x{counts[t]} {_size(n)}".replace(" ", NO_BREAK) for t, n in by_type.most_common())
    windows = sorted({w for w in plan.layer_windows if w is not None})
    honored = [f"act {o['act']}", f"rms_norm_eps {o['norm_eps']:g}", "rope " + _rope(o["rope"]),
               f"qkv_bias {o['qkv_bias']}", f"o_bias {o['o_bias']}", f"mlp_bias {o['mlp_bias']}",
               f"qk_norm {o['qk_norm']}", f"tied embeddings {plan.tie_embeddings}",
               f"sliding window {windows or 'none'}"]
    sliding = sum(w is not None for w in plan.layer_windows)
    if 0 < sliding < plan.n_layers:
        honored[-1] += f" on {sliding} of {plan.n_layers} layers"
    honored += _family_options(plan)
    rows = [
        ("model", f"{path} ({kind})"),
        ("family", f"{plan.family} ({plan.kind})"),
        ("sizes", f"{plan.n_layers} layers, d_model {plan.d_model}, {o['n_heads']} heads ({o['n_kv_heads']} kv) "
                  f"of {o['head_dim']}, d_ff {o['d_ff']}, vocab {plan.vocab_size}"),
        ("context", f"{plan.max_position_embeddings or 'unbounded'} positions"),
        ("options", ", ".join(honored)),
        ("weights", f"{params / 1e6:.1f}M parameters, {_size(stored)} stored; "
                    f"{_size(params * 4)} as float32, {_size(params * 2)} as bfloat16{per_token}"),
        ("types", types),
        ("loaded", _storage_cost(weight_format, infos, nbytes, loaded, params, mapped)),
        ("unused", ", ".join(unused) if unused else "none"),
    ]
    width = max(40, shutil.get_terminal_size().columns)
    for key, value in rows:
        print(textwrap.fill(value, width, initial_indent=f"{key:<9}", subsequent_indent=" " * 9,
                            break_on_hyphens=False).replace(NO_BREAK, " "))


def _storage_cost(weight_format: str, infos: dict, nbytes: dict, loaded: dict | None, params: int,
                  mapped: int) -> str:
    """What the weights take once loaded as weight_format, beside the bytes the checkpoint holds; `mapped`: the
    bytes of them a gguf load leaves in the file's pages (GGUFFile.mappable)."""
    stored = sum(nbytes.values())
    if loaded is not None:  # gguf: each tensor as stored, or widened to float32
        widened = Counter()
        for name, n in loaded.items():
            if n != nbytes[name]:
                widened[infos[name].dtype] += n - nbytes[name]
        in_file = f"; {_size(mapped)} of BF16 mapped from the file" if mapped else ""
        if not widened:
            return f"as gguf: {_size(stored)}, every tensor as stored{in_file}"
        return (f"as gguf: {_size(sum(loaded.values()))}; {', '.join(widened)} dequantized to float32 "
                f"({_size(sum(widened.values()))} more than stored){in_file}")
    if weight_format not in ("float32", "bfloat16"):
        return f"as {weight_format}: the projection matrices quantized on load"
    size = 4 if weight_format == "float32" else 2
    return (f"as {weight_format}: {_size(params * size)}, every tensor dequantized: "
            f"{params * size / max(stored, 1):.1f}x the {_size(stored)} stored")


def _rope(rope: dict) -> str:
    """A rope spec in one line: a list of per-frequency factors (LongRoPE's) as its length."""
    return " ".join(f"{k}=[{len(v)} values]" if isinstance(v, list) else f"{k}={v}" for k, v in rope.items())


def _family_options(plan) -> list[str]:
    """The options beyond Llama's that the plan sets (Gemma's, Phi's, the experts'), as `info` shows them."""
    o, out = plan.block_options, []
    if o.get("norm_offset") is not None:
        out.append(f"norm scale {o['norm_offset']:g} + weight")
    if o.get("sandwich_norms"):
        out.append("sandwich norms")
    if o.get("attn_scale") is not None:
        out.append(f"attention scale {o['attn_scale']:.4g}")
    if o.get("attn_softcap") is not None:
        out.append(f"attention softcap {o['attn_softcap']:g}")
    if "local_rope" in o:
        out.append("sliding layers' rope " + _rope(o["local_rope"]))
    if "rotary_dim" in o:
        out.append(f"rotary dims {o['rotary_dim']} of {o['head_dim']}")
    if plan.embed_scale is not None:
        out.append(f"embedding scale {plan.embed_scale:.4g}")
    if plan.final_softcap is not None:
        out.append(f"final logit softcap {plan.final_softcap:g}")
    if any(plan.layer_experts):
        e = o["experts"]
        out.append(f"experts: top {e['top_k']} of {e['n_experts']} (d_ff {e['d_ff']}) on "
                   f"{sum(plan.layer_experts)} of {plan.n_layers} layers, softmax over all then "
                   f"{'the chosen renormalized' if e['norm_topk_prob'] else 'not renormalized'}")
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
