"""TransferMesh planner: the fastest route per receiver, one relay per other host, disk as fallback."""
from __future__ import annotations

import pytest

from loongsage.cli import main
from loongsage.transfer.topology import Endpoint, plan

TRAINER = Endpoint("trainer", "a", "cuda:0")


def _routes(receivers):
    return {r.receiver: (r.transport, r.relay) for r in plan(TRAINER, receivers).routes}


def test_same_device_same_host_other_hosts_and_fallbacks():
    routes = _routes([
        Endpoint("e0", "a", "cuda:0"),  # same device: zero-copy handle
        Endpoint("e1", "a", "cuda:1"),  # same host, other device: shared memory
        Endpoint("e2", "b", "cuda:0"),  # first on host b: the relay
        Endpoint("e3", "b", "cuda:1"),  # host b: from the relay
        Endpoint("e4", "c", "cuda:0", ("shm", "disk")),  # host c, no collective: disk
        Endpoint("e5", "a", "cuda:2", ("disk",)),  # same host, nothing faster in common
        Endpoint("e6", "b", "cpu", ("collective", "disk")),  # host b but no shm for the fan-out
    ])
    assert routes == {"e0": ("cuda_ipc", None), "e1": ("shm", None), "e2": ("collective", None),
                      "e3": ("relay_shm", "e2"), "e4": ("disk", None), "e5": ("disk", None), "e6": ("disk", None)}


def test_one_relay_per_host_and_cpu_endpoints_use_shm():
    cpu = Endpoint("trainer", "a")
    p = plan(cpu, [Endpoint(f"e{i}", h) for i, h in enumerate("aabbbc")])
    assert p.relays() == ["e2", "e5"]
    assert p.by_transport() == {"shm": ["e0", "e1"], "collective": ["e2", "e5"], "relay_shm": ["e3", "e4"]}
    text = p.format()
    assert "sender trainer on host a (cpu)" in text and "relay_shm  via e2" in text


def test_bad_endpoints_are_named():
    with pytest.raises(ValueError, match="e1: unknown transports \\['rdma'\\]"):
        Endpoint("e1", "a", transports=("rdma", "disk"))
    with pytest.raises(ValueError, match="e1: every endpoint must support 'disk'"):
        Endpoint("e1", "a", transports=("shm",))
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda:<i>'"):
        Endpoint("e1", "a", device="tpu")
    with pytest.raises(ValueError, match="receiver names must be unique"):
        plan(TRAINER, [Endpoint("e", "a"), Endpoint("e", "b")])


def test_transfer_plan_command_prints_a_two_host_plan(capsys):
    assert main(["transfer", "plan", "recipes/arith_grpo.yaml", "rollout.num_engines=3",
                 "transfer.hosts={engine-1: node-b, engine-2: node-b}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sender trainer on host local (cpu)"
    assert out[1].split()[:3] == ["->", "engine-0", "shm"]
    assert out[2].split()[:3] == ["->", "engine-1", "collective"]
    assert out[3].split()[:5] == ["->", "engine-2", "relay_shm", "via", "engine-1"]
    assert main(["transfer", "plan", "transfer.hosts={engine-7: b}"]) == 2
    assert "transfer: unknown endpoints ['engine-7']" in capsys.readouterr().err


def test_mesh_refuses_routes_without_a_transport_by_name():
    from loongsage.transfer.mesh import WeightMesh

    routes = plan(Endpoint("trainer", "a", "cuda:0"), [Endpoint("engine-0", "a", "cuda:0")])
    with pytest.raises(NotImplementedError, match=r"routes \['cuda_ipc'\] \(for \['engine-0'\]\) are planned but have no"):
        WeightMesh(routes, None, {"engine-0": "http://127.0.0.1:1"}, "float32", 64.0, "gloo")
    relayed = plan(Endpoint("trainer", "a"), [Endpoint("engine-0", "b"), Endpoint("engine-1", "b")])
    with pytest.raises(ValueError, match="SGLang engines cannot relay"):
        WeightMesh(relayed, None, {"engine-0": "u0", "engine-1": "u1"}, "float32", 64.0, "gloo", extensions=False)
