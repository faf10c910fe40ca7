"""A fork server for Python agent programs: it imports the agent's heavy modules once (the `openai`
SDK alone costs ~0.6 s of CPU per interpreter here) and forks a fresh process per episode that runs
the unmodified script as `__main__`, with its own environment, stdin/stdout/stderr files, process
group, argv and exit status: the same contract as a plain subprocess, minus the interpreter start-up.

Protocol (JSON lines): the runner writes {"id", "argv", "env", "stdin", "stdout", "stderr"} (paths,
and "max_output_bytes": the size limit of every file the child writes)
to the server's stdin; the server answers {"id", "pid"} when the child runs and {"id", "exit"} when
it ends (exit = the status code, negative for a signal).
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import threading


def _child(req: dict) -> None:
    os.setsid()
    if req.get("max_output_bytes"):  # a flood ends the agent (SIGXFSZ), not the disk
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (req["max_output_bytes"], req["max_output_bytes"]))
    for fd, path, mode in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, mode, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
    code = 0
    try:
        runpy.run_path(req["argv"][0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for name in sys.argv[1:]:
        importlib.import_module(name)
    out_lock = threading.Lock()
    ids: dict[int, str] = {}

    def send(obj: dict) -> None:
        with out_lock:
            sys.__stdout__.write(json.dumps(obj) + "\n")
            sys.__stdout__.flush()

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                if stdin_closed.is_set():
                    return
                stdin_closed.wait(0.05)
                continue
            code = os.waitstatus_to_exitcode(status)
            with out_lock:
                rid = ids.pop(pid, None)
            if rid is not None:
                send({"id": rid, "exit": code})

    stdin_closed = threading.Event()
    threading.Thread(target=reap, daemon=True).start()
    send({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        with out_lock:  # registered before the reaper can see the child end
            pid = os.fork()
            if pid == 0:
                _child(req)
            ids[pid] = req["id"]
        send({"id": req["id"], "pid": pid})
    stdin_closed.set()


if __name__ == "__main__":
    main()
