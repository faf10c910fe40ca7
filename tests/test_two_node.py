"""A real two-node Ray cluster on this machine (scripts/two_node_check.py): a network namespace and a
veth pair make the second node; the trainer runs on the head, two engines on the worker, the weights
reach them over the collective to one relay with shared-memory fan-out, and everything the check
started is gone afterwards, also when the run fails."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 to build a second node (ip netns)")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("ls2n-")}


def _ray_nodes_running() -> list[str]:
    """Ray processes of a two-node check: the only ones on this machine with a 10.x node address."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "ray" in line and re.search(r"(address|ip_address)=10\.", line)]


def _cluster_record() -> str | None:
    """A leftover record of the check's head would make every later plain ray.init() join it."""
    path = "/tmp/ray/ray_current_cluster"
    return open(path).read().strip() if os.path.exists(path) else None


def _check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/two_node_check.py", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_trainer_and_engines_on_two_nodes_train_through_a_relay(arith_caches):
    """The arithmetic recipe's short form, from the session's cached bootstrap (the e2e runs build it;
    the path is absolute, so the worker node's engines load it from the same disk)."""
    from loongsage.config import load_config

    quick = [o for o in load_config("recipes/arith_grpo.yaml").quick.overrides if not o.startswith("train.")]
    before = _namespaces()
    out = _check("--steps", "20", "--engines", "2", *quick, *arith_caches[0])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["nodes"] == 2 and result["hosts"]["head"] != result["hosts"]["worker"]
    assert result["routes"] == {"engine-0": ["collective", None], "engine-1": ["relay_shm", "engine-0"]}
    assert result["max_gap"] < 1e-4  # the weights arrive exactly over the real network path
    assert result["eval_after"] >= result["eval_before"] - 0.01
    assert _namespaces() == before and not _ray_nodes_running()
    assert _cluster_record() != f"{result['hosts']['head']}:{result['ray_port']}"


def test_a_failing_run_still_tears_the_second_node_down():
    before = _namespaces()
    out = _check("--steps", "2", "trainer.lr=-1", timeout=300)
    assert out.returncode != 0 and "trainer.lr" in (out.stdout + out.stderr)
    assert _namespaces() == before and not _ray_nodes_running()
    assert not (_cluster_record() or "").startswith("10.")
