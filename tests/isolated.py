"""Test actions run in a child process under a memory cap and a time limit, so that a hang, a blow-up or a
crash (SIGBUS, SIGABRT) fails its test quickly instead of taking the test run down with it.

An action is a function of a test module, named as (module, function, *args) with JSON arguments; its
outcome comes back as {"error": exception class name or None, "message": ..., "result": ...}.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

MEMORY = 1 << 30  # bytes of address space an action may add to what the child holds once lmstack is imported
SECONDS = 60  # for every action of one call together, the child's start included

CHILD = r"""
import importlib, json, resource, sys
import lmstack
for name in lmstack.__all__:  # its names import torch and the library's modules when first used
    getattr(lmstack, name)

def address_space():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))

extra, calls = int(sys.argv[1]), json.loads(sys.stdin.read())
limit = address_space() + extra
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for module, function, *args in calls:
    print(json.dumps({"start": function}), flush=True)
    try:
        result, error, message = getattr(importlib.import_module(module), function)(*args), None, ""
    except BaseException as e:  # the class is the outcome: a MemoryError or a PanicException counts too
        result, error, message = None, type(e).__name__, str(e)[:20000]
    print(json.dumps({"error": error, "message": message, "result": result}), flush=True)
"""


def run(*calls, memory=MEMORY, seconds=SECONDS) -> list[dict]:
    """Run each call (module, function, *args) in one fresh child; their outcomes, in order."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(memory)], input=json.dumps(calls), env=env,
                              capture_output=True, text=True, timeout=seconds)
        out, err, status = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, err, status = _text(e.stdout), _text(e.stderr), f"killed after {seconds} s"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    outcomes = [line for line in lines if "start" not in line]
    if len(outcomes) < len(calls):
        current = calls[len(outcomes)]
        raise AssertionError(f"{current[1]}{tuple(current[2:])}: the child ended ({status}) without an outcome: "
                             f"a hang, a crash or memory beyond {memory} bytes\n{err[-3000:]}")
    return outcomes


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""
