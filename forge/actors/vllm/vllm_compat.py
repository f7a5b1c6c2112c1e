"""Workaround for vLLM 0.32's engine stop on CPU; drop it once vLLM's engine process skips the
interpreter's teardown itself.

vLLM 0.32 stops its engine process with SIGTERM and SIGKILLs it when a short grace period ends.
The engine's own clean-up fits in it; on CPU the teardown Python does after it (every module
cleared, the heap of torch, transformers and vLLM garbage-collected) does not: left to it,
every stop waits out the grace and ends in a SIGKILL. Freezing the heap instead, as vLLM does
on ROCm, would have triton's nanobind report everything still alive as leaked.

It relies on two CPython 3.11 internals: `threading._register_atexit` and
`atexit._run_exitfuncs`.
"""

import atexit
import ctypes
import os
import sys
import threading


def exit_without_teardown() -> None:
    """Makes this process end, once its atexit handlers have run, without the interpreter's
    teardown."""
    # Registered as the process exits (CPython runs threading's exit hooks before atexit's),
    # it is the last atexit handler registered: the first to run, before any other has.
    threading._register_atexit(atexit.register, _exit_after_handlers)


def _exit_after_handlers() -> None:
    """Runs the other atexit handlers, in their order, flushes what was printed, and ends the
    process with status 0, which vLLM's AsyncLLM does not read once its engine has started: it
    learns of a dead engine through its sockets."""
    atexit.unregister(_exit_after_handlers)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # C and C++ code's buffered output
    os._exit(0)
