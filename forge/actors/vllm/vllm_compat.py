"""How forge has vLLM 0.32 start its engine-core process on CPU; drop it once vLLM starts an
engine core without importing itself again and without the interpreter's teardown.

vLLM 0.32 starts its engine core with `spawn` on CPU, whatever VLLM_WORKER_MULTIPROC_METHOD
says. The spawned process imports vLLM again, after the caller has: the longest part of a
generator's start. And when stopped it runs the interpreter's teardown (every module cleared,
the heap of torch, transformers and vLLM garbage-collected), which outlasts the grace vLLM gives
it before a SIGKILL.

Here the engine core is forked from a multiprocessing forkserver that imports vLLM while the
caller does. The server is a single-threaded process that only imported modules, so a child
inherits no threads, OpenMP pool or CUDA context (why vLLM will not fork its caller). The child
runs with the environment the caller had when it started it, as a spawned one would, and ends
with `os._exit` once its own clean-up and atexit handlers have run. It uses the internals of
CPython 3.11's forkserver (`_forkserver._forkserver_alive_fd`).
"""

import atexit
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.process
import os
import tempfile

from forge.weights.shm_folders import ShmFolder

# What an engine core's process runs: imported by the server before the first child.
_PRELOAD = ["vllm.v1.engine.core", "forge.actors.vllm.worker"]


class EngineCoreProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with its caller's environment of the moment it was
    started (vLLM sets variables for its engine core just before) and runs the atexit
    handlers a spawned process would."""

    def start(self) -> None:
        self._callers_environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        # The server ends when every holder of this descriptor has; a child holds one (to
        # start children of its own through the server). Without closing it, the engine core
        # would keep the server alive, and the server (its parent) the engine core, after the
        # caller died.
        server = multiprocessing.forkserver._forkserver
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        # Only what differs: emptying the environment would stop setproctitle (vLLM names its
        # engine core's process with it) finding the memory it writes the title into.
        callers = self._callers_environ
        for key in os.environ.keys() - callers.keys():
            del os.environ[key]
        os.environ.update({k: v for k, v in callers.items() if os.environ.get(k) != v})
        # vLLM 0.32's engine core meets its workers through a file in the temp folder
        # (vllm_dist_<uuid>, a torch FileStore), which a killed engine core leaves behind:
        # it goes in the generator's socket folder, removed even then (_own_socket_folder).
        tempfile.tempdir = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.tempdir
        # torch read TORCHDYNAMO_DISABLE when the server imported it, before the caller set it.
        import torch._dynamo

        torch._dynamo.config.disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"
        try:
            super().run()
        finally:
            atexit._run_exitfuncs()  # a forkserver child skips them: it ends with os._exit


class EngineCoreContext(multiprocessing.context.ForkServerContext):
    """The multiprocessing context vLLM starts engine cores with."""

    Process = EngineCoreProcess


def preload_engine_cores() -> None:
    """Starts the forkserver, which imports what an engine core runs, and points vLLM at it.
    Call before this process imports vLLM, so that the two imports overlap."""
    context = EngineCoreContext()
    context.set_forkserver_preload(_PRELOAD)
    _own_socket_folder()
    multiprocessing.forkserver.ensure_running()
    import vllm.v1.engine.utils

    vllm.v1.engine.utils.get_mp_context = lambda: context


def _own_socket_folder() -> None:
    """Puts the sockets this process and its engine cores bind, the forkserver's (in
    multiprocessing's temp folder) and vLLM's ZMQ ones (VLLM_RPC_BASE_PATH), in a shared
    memory folder owned by this process.

    multiprocessing removes its own folder (/tmp/pymp-*) only at the interpreter's exit, and
    vLLM's socket files (/tmp/<uuid>) stay after an engine core that ends with `os._exit` or
    is killed; a forge folder is also removed by the next run's start or `forge clean` once
    its owner is dead.
    """
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is None:
        folder = ShmFolder.create(f"mp-{os.getpid()}", "sockets of vLLM's processes")
        config["tempdir"] = str(folder.path)
        os.environ["VLLM_RPC_BASE_PATH"] = str(folder.path)
        atexit.register(folder.remove)
