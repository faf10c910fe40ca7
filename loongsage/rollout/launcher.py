"""Starts an inference server as a child process (on 127.0.0.1 unless told the node's address) and
waits until it is healthy."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching process dies (Linux), so an engine
    never outlives a crashed controller or a killed Ray actor."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    url: str
    log_path: str
    api_key: str | None = None
    scratch: str | None = None  # the server's TMPDIR (a released engine's weights go there): removed once it is gone
    _closed: bool = field(default=False, repr=False)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drop_scratch()

    def kill(self) -> None:
        """At once (SIGKILL, also to a stopped or hung process): an engine being replaced."""
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_engine(model: str, host: str = "127.0.0.1", port: int | None = None, threads: int = 1,
                  extra_args: list[str] | None = None, startup_timeout_s: float = 120.0,
                  log_path: str | None = None, api_key: str | None = None) -> EngineProcess:
    """The embedded engine (`loongsage engine`) as a child process; its API key travels in the
    environment (a command line is readable by every user of the machine)."""
    from loongsage.engine.security import API_KEY_ENV

    port = port or free_port(host)
    cmd = [sys.executable, "-m", "loongsage.cli", "engine", "--model", str(model), "--host", host,
           "--port", str(port), "--threads", str(threads), *(extra_args or [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return _launch(cmd, host, port, env, startup_timeout_s, log_path, api_key)


def sglang_command(model: str, host: str, port: int, args: list[str], api_key: str | None = None) -> list[str]:
    """SGLang takes its key only on the command line (`--api-key`)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host,
            "--port", str(port), *args, *(["--api-key", api_key] if api_key else [])]


def launch_sglang(model: str, args: list[str], host: str = "127.0.0.1", port: int | None = None,
                  startup_timeout_s: float = 900.0, log_path: str | None = None,
                  api_key: str | None = None) -> EngineProcess:
    """An SGLang server (GPU) as a child process; the same client code talks to it."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("rollout.engine=sglang needs SGLang on a GPU node: pip install -e .[gpu]")
    port = port or free_port(host)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return _launch(sglang_command(model, host, port, args, api_key), host, port, env, startup_timeout_s, log_path,
                   api_key)


def _launch(cmd: list[str], host: str, port: int, env: dict, startup_timeout_s: float,
            log_path: str | None, api_key: str | None = None) -> EngineProcess:
    # The server's own temporary folder, removed when it stops or is killed (it may die with files
    # there); its log goes there too unless a log_path is given.
    scratch = tempfile.mkdtemp(prefix="loongsage-engine-")
    env = dict(env, TMPDIR=scratch)
    log_path = log_path or f"{scratch}/server.log"
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    logf = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    logf.close()
    ep = EngineProcess(proc, f"http://{host}:{port}", log_path, api_key, scratch)
    deadline = time.monotonic() + startup_timeout_s
    # One client for every probe: a fresh `httpx.get` builds its TLS context each time (~45 ms of
    # CPU), which at 5 probes a second took a fifth of a core from the start-up it waits for.
    with httpx.Client(timeout=2.0, trust_env=False) as probe:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = ep.log_tail()
                ep.stop()
                raise RuntimeError(f"engine exited with code {proc.returncode} during start-up:\n{tail}")
            try:
                if probe.get(f"{ep.url}/health").status_code == 200:
                    return ep
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    tail = ep.log_tail()
    ep.stop()
    raise TimeoutError(f"engine at {ep.url} not healthy after {startup_timeout_s}s:\n{tail}")
