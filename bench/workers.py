"""Each engine of a bench in its own process: the bench script starts itself with `--worker SPEC`, and the
worker answers one JSON request per line of stdin ({"op": a method of the engine, its arguments}) with one
JSON line on stdout."""

import json
import os
import subprocess
import sys
from pathlib import Path


def serve(build):
    """The worker's side: build() the engine (its own prints go to stderr), then answer requests until stdin
    closes."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    engine = build()
    print(json.dumps("ready"), file=answers)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(getattr(engine, request.pop("op"))(**request)), file=answers)
    answers.close()
    if hasattr(engine, "close"):
        engine.close()  # before the interpreter's exit, which would free llama.cpp's objects out of order
    os._exit(0)  # llama-cpp-python's teardown at exit prints a spurious error


class Worker:
    """One engine in its own process, running `script --worker SPEC`."""

    def __init__(self, script, engine, **spec):
        self.name = engine
        spec = dict(engine=engine, **{k: str(v) if isinstance(v, Path) else v for k, v in spec.items()})
        self.process = subprocess.Popen([sys.executable, script, "--worker", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker ended (its error is above)")
        return json.loads(line)

    def __call__(self, op, **arguments):
        self.process.stdin.write(json.dumps(dict(op=op, **arguments)) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self):
        self.process.stdin.close()
        self.process.wait()
