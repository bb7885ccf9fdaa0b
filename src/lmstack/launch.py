"""The `lmstack` command as a process starts it. Importing torch takes a second on one core; a command that will
load a GGUF file onto the CPU first starts a thread that faults in the memory its packed weights will take
(memory.Prefault), on another core, then imports the rest and runs cli.main."""

import argparse
import gc
import os
import sys

from . import memory

LOADING = ("generate", "chat", "serve")  # the commands that load the file given as --model


def main() -> int:
    prefault_for(sys.argv[1:])
    with memory.collector_paused():
        from .cli import main as run
        # the imports' objects (torch's about a million) live as long as the process: set aside, so that no pass
        # of the collector walks them, the first one once it is on again included (77 ms of every start)
        gc.freeze()
    return run()


def prefault_for(argv: list):
    """Start memory.Prefault for a command that will keep a GGUF file's blocks as stored on the CPU (weight format
    gguf, device cpu or auto): the file's size, which bounds them, until models.load has read its header and keeps
    only what they take. The flags are the command's own, read as its parser will read them; anything else (a
    name, a directory, --pipeline, whose processes load a share each) starts nothing."""
    if not argv or argv[0] not in LOADING:
        return
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--model", "-m")
    parser.add_argument("--weight-format")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--pipeline", action="store_true")
    try:
        args, _ = parser.parse_known_args(argv[1:])
    except argparse.ArgumentError:  # the command's parser says what is wrong
        return
    if (args.model is None or args.weight_format not in (None, "gguf") or args.device not in ("auto", "cpu")
            or args.pipeline or not os.path.isfile(args.model)):
        return
    try:
        with open(args.model, "rb") as f:
            if f.read(4) != b"GGUF":
                return
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return
    memory.start_prefault(size)
