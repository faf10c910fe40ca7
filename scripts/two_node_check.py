"""A real second node on this machine: a network namespace joined to the host by a veth pair, a Ray
head on the host's end and a Ray worker inside the namespace (two node addresses, a real network
path), and the arith recipe run across them with the trainer on the head and the engines on the
worker (`trainer.resources`, `rollout.engine_resources`). Needs root (`ip netns`).

    python scripts/two_node_check.py [--steps 20] [--engines 2] [recipe overrides ...]

Everything it starts is torn down afterwards, also on failure: the run, both Ray nodes (their
process sessions, never another Ray on the machine), the namespace and its links. The last line is
one JSON object: {"nodes", "routes", "max_gap", "eval_before", "eval_after"}, where routes is the
run's TransferMesh plan (receiver -> transport, relay) and max_gap the largest per-token
|logprob| difference between engines and trainer over the run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def namespace():
    """(namespace, host address, namespace address): a veth pair on a private /24."""
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"ls2n-{tag}", f"ls2a{tag}", f"ls2b{tag}"
    net = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
    host_ip, ns_ip = f"{net}.1", f"{net}.2"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)  # removes its peer too
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def end_session(proc: subprocess.Popen) -> None:
    """Ends every process of `proc`'s session (a Ray node: its CLI, GCS, raylet, workers)."""
    sid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _sid(int(p)) == sid]
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + 10
        while members and time.time() < deadline:
            members = [p for p in members if _alive(p)]
            time.sleep(0.2)
        if not members:
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def forget_cluster(address: str | None) -> None:
    """`ray start --head` records its address in /tmp/ray/ray_current_cluster, and a later plain
    `ray.init()` on this machine would try to join that gone cluster: the record goes with it."""
    record = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(FileNotFoundError):
        if address and record.read_text().strip() == address:
            record.unlink()


def ray_node(args: list[str], env: dict, log: Path, ns: str | None = None) -> subprocess.Popen:
    cmd = [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", *args]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_nodes(address: str, env: dict, want: int, procs: list[subprocess.Popen], logs: list[Path],
                   timeout_s: float = 120.0) -> int:
    """Waits until `want` nodes are up at `address`; a `ray start` of `procs` that exits meanwhile is
    an error with its log's tail."""
    deadline = time.time() + timeout_s
    alive = 0
    while time.time() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise NodeFailed(f"ray start exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        out = subprocess.run([str(BIN / "ray"), "status", "--address", address], env=env, capture_output=True, text=True)
        active = out.stdout.split("Pending:")[0] if "Pending:" in out.stdout else ""
        alive = sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))
        if alive >= want:
            return alive
        time.sleep(1.0)
    raise NodeFailed(f"{alive} of {want} Ray nodes came up at {address}:\n" +
                     "\n".join(log.read_text()[-1500:] for log in logs))


class NodeFailed(RuntimeError):
    """A Ray node did not come up."""


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's choice), not a random one that a connection of
    the machine's may hold."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_head(host_ip: str, env: dict, log: Path, nodes: list[subprocess.Popen], attempts: int = 3) -> int:
    """The Ray head on the host's end of the pair (appended to `nodes`); returns its port. A head
    that fails to come up (a port taken in between) is ended and started again on another port."""
    for attempt in range(attempts):
        port = free_port(host_ip)
        nodes.append(ray_node(["--head", f"--node-ip-address={host_ip}", f"--port={port}", "--num-cpus=1",
                               "--include-dashboard=false", '--resources={"node_a": 1}'], env, log))
        try:
            wait_for_nodes(f"{host_ip}:{port}", env, 1, nodes[-1:], [log], timeout_s=60)
            return port
        except NodeFailed:
            end_session(nodes.pop())
            forget_cluster(f"{host_ip}:{port}")
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("two_node_check: needs root and iproute2 (`ip netns`) to build the second node")
    work = Path(tempfile.mkdtemp(prefix="loongsage-two-node-"))
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    # both nodes and the driver prove themselves with Ray's token (~/.ray/auth_token, made if missing)
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    nodes: list[subprocess.Popen] = []
    run = address = None
    try:
        with namespace() as (ns, host_ip, ns_ip):
            port = start_head(host_ip, env, work / "head.log", nodes)
            address = f"{host_ip}:{port}"
            nodes.append(ray_node([f"--address={address}", f"--node-ip-address={ns_ip}", "--num-cpus=1",
                                   f'--resources={{"node_b": {args.engines}}}'], env, work / "worker.log", ns))
            alive = wait_for_nodes(address, env, 2, nodes, [work / "head.log", work / "worker.log"])
            run_dir = work / "run"
            cmd = [str(BIN / "loongsage"), "train", "recipes/arith_grpo.yaml", f"run_dir={run_dir}",
                   f"ray.address={address}", "trainer.resources={node_a: 1}", "rollout.engine_resources={node_b: 1}",
                   f"rollout.num_engines={args.engines}", f"train.steps={args.steps}",
                   f"train.eval_every={args.steps}", "train.eval_size=200", "train.max_minutes=null", *args.overrides]
            run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(work / "train.log", "w"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
            if run.wait(timeout=900) != 0:
                raise RuntimeError(f"the two-node run failed:\n{(work / 'train.log').read_text()[-3000:]}")
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            plan = json.loads((run_dir / "transfer_plan.json").read_text())
            print(plan["text"], flush=True)
            evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
            gaps = [r["mismatch/abs_logprob_diff"] for r in records if r.get("mismatch/abs_logprob_diff") is not None]
            print(json.dumps({"nodes": alive, "hosts": {"head": host_ip, "worker": ns_ip}, "ray_port": port,
                              "routes": {r["receiver"]: [r["transport"], r["relay"]] for r in plan["routes"]},
                              "max_gap": max(gaps) if gaps else None,
                              "eval_before": evals[0] if evals else None, "eval_after": evals[-1] if evals else None}))
    finally:
        if run is not None and run.poll() is None:
            end_session(run)
        for node in reversed(nodes):
            end_session(node)
        forget_cluster(address)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
