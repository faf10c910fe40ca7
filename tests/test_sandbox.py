"""The tool sandbox against hostile code: every attack ends in a failed call with a reason, nothing
of the run is visible or writable, and nothing the code starts outlives the call."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import uuid

import psutil
import pytest

from loongsage.agentflow.sandbox import SandboxLimits, run_python
from loongsage.agentflow.toolcalls import ToolCall
from loongsage.agentflow.tools import ToolRegistry, python_tool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")


def _run(code: str, **limits):
    return asyncio.run(run_python(textwrap.dedent(code), SandboxLimits(**limits)))


def _sandbox_processes() -> set[int]:
    """Processes of the sandbox's outside user, or running its launcher or a sandboxed program."""
    out = set()
    for p in psutil.process_iter(["uids", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if (p.info["uids"] and p.info["uids"].real == 65534) or "sandbox_init" in cmd or "/scratch/main.py" in cmd:
            out.add(p.pid)
    return out


@pytest.fixture
def run_files(tmp_path):
    """What a run owns: held-out answers under its data folder and a run directory."""
    data = tmp_path / "data"
    data.mkdir()
    secret = f"HELD-OUT-ANSWER-{uuid.uuid4().hex}"
    (data / "eval.jsonl").write_text(secret + "\n")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    before = _sandbox_processes()
    yield data / "eval.jsonl", secret, run_dir
    assert _sandbox_processes() <= before, "a sandboxed process outlived its call"


def test_ordinary_code_runs_and_sees_only_its_scratch():
    res = _run("""
        import os, json
        open("notes.txt", "w").write("kept in scratch")
        print(json.dumps({"cwd": os.getcwd(), "uid": os.getuid(), "root": sorted(os.listdir("/")),
                          "note": open("/scratch/notes.txt").read(), "shm": os.path.exists("/dev/shm")}))
    """)
    assert res.ok, res
    info = __import__("json").loads(res.stdout)
    assert info["cwd"] == "/scratch" and info["note"] == "kept in scratch" and not info["shm"]
    assert "work" not in info["root"] and "home" not in info["root"] and "etc" not in info["root"]


def test_audit_hook_removal_then_a_process_reading_held_out_answers_fails(run_files):
    path, secret, _ = run_files
    res = _run(f"""
        import sys, subprocess
        sys.modules["__main__"]._DENY = ("zzz",)  # the old in-process hook's switch
        print(subprocess.run(["cat", {str(path)!r}], capture_output=True, check=True).stdout.decode())
    """)
    assert not res.ok and "CalledProcessError" in res.stderr
    assert secret not in res.stdout + res.stderr


def test_reading_a_planted_file_outside_scratch_fails(run_files):
    path, secret, _ = run_files
    res = _run(f"print(open({str(path)!r}).read())")
    assert not res.ok and "FileNotFoundError" in res.as_text() and secret not in res.stdout


def test_ctypes_cannot_read_files_or_undo_the_mounts(run_files):
    path, secret, _ = run_files
    res = _run(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open({str(path).encode()!r}, os.O_RDONLY)
        umount = libc.umount2(b"/usr", 2)
        setns = libc.unshare(0x10000000 | 0x20000)
        if fd >= 0 or umount == 0 or setns == 0:
            print("escaped", fd, umount, setns)
        else:
            raise SystemExit(f"refused: {{os.strerror(ctypes.get_errno())}}")
    """)
    assert not res.ok and "refused" in res.stderr and "escaped" not in res.stdout and secret not in res.stdout


def test_writing_into_the_run_directory_fails(run_files):
    _, _, run_dir = run_files
    res = _run(f"open({str(run_dir / 'metrics.jsonl')!r}, 'a').write('forged')")
    assert not res.ok and "Error" in res.as_text()
    assert not (run_dir / "metrics.jsonl").exists()
    res = _run("open('/usr/forged', 'w')")
    assert not res.ok and "Read-only file system" in res.as_text()


def test_a_socket_reaches_nothing(run_files):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    res = _run(f"""
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=2)
    """)
    assert not res.ok and "unreachable" in res.as_text().lower()
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing arrived
    listener.close()


def test_a_forked_setsid_child_does_not_outlive_the_call(run_files):
    marker = f"survivor-{uuid.uuid4().hex}"
    res = _run(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        print("parent returns at once")
    """)
    assert not res.ok and "left processes running" in res.reason
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_a_fork_bomb_is_contained(run_files):
    res = _run("""
        import os
        while True:
            os.fork()
    """, timeout_s=10)
    # contained either way: stopped by the sandbox (time, leftover processes), or every fork refused
    # at the process limit (EAGAIN) until the bomb's processes all died of it
    assert not res.ok and (res.reason or "Resource temporarily unavailable" in res.stderr), res


def test_memory_time_and_output_limits():
    async def go():
        return await asyncio.gather(
            run_python("x = bytearray(1 << 30)", SandboxLimits(memory_mb=256)),
            run_python("while True: pass", SandboxLimits(timeout_s=1)),
            run_python("while True: print('a' * 1000)", SandboxLimits(max_output=50, max_output_bytes=1 << 20)),
            run_python("print('b' * 100000)", SandboxLimits(max_output=50)))
    mem, loop, flood, big = asyncio.run(go())
    assert not mem.ok and "MemoryError" in mem.stderr
    assert loop.timed_out and loop.as_text().startswith("error: time limit exceeded")
    assert flood.reason == "output limit exceeded" and len(flood.stdout) == 50
    assert big.ok and len(big.stdout) == 50  # cut, not failed: under the output kill limit


def test_the_run_environment_does_not_leak_in(monkeypatch):
    monkeypatch.setenv("LOONGSAGE_ENGINE_API_KEY", "top-secret-key")
    res = _run("import os; print(sorted(os.environ.items()))")
    assert res.ok and "top-secret-key" not in res.stdout


def test_python_tool_reports_failures_to_the_model():
    reg = ToolRegistry().add(python_tool(timeout_s=2))
    ok = asyncio.run(reg.execute(ToolCall("python", {"code": "print(6*7)"})))
    bad = asyncio.run(reg.execute(ToolCall("python", {"code": "import socket; socket.create_connection(('1.1.1.1', 80))"})))
    assert ok == "42\n"
    assert "Network is unreachable" in bad


def test_tool_python_command(tmp_path, run_files):
    path, secret, _ = run_files
    good, evil = tmp_path / "good.py", tmp_path / "evil.py"
    good.write_text("print(sum(range(10)))\n")
    evil.write_text(f"print(open({str(path)!r}).read())\n")
    cli = [sys.executable, "-m", "loongsage.cli", "tool", "python"]
    r = subprocess.run([*cli, str(good)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "45\n"
    r = subprocess.run([*cli, str(evil), "--timeout-s", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "FileNotFoundError" in r.stdout and secret not in r.stdout
