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


class _Trainers:
    """What a transport reads of the trainer group when it is built: the exported weights' layout."""
    ranks: list = []

    @staticmethod
    def weight_meta():
        return [("a.weight", "float32", [4, 4]), ("b.weight", "float32", [4])]


def test_mesh_picks_the_transport_per_route_and_device():
    from loongsage.rollout.client import EngineClient
    from loongsage.transfer.mapped import MappedShmSync
    from loongsage.transfer.mesh import WeightMesh
    from loongsage.transfer.staged import ShmWeightSync

    urls = {f"engine-{i}": EngineClient(f"http://127.0.0.1:{i + 1}") for i in range(3)}
    routes = plan(Endpoint("trainer", "a", "cuda:0"), [Endpoint("engine-0", "a", "cuda:0"),  # same GPU
                                                       Endpoint("engine-1", "a", "cuda:1"),  # same host, GPU
                                                       Endpoint("engine-2", "a", "cpu")])
    mesh = WeightMesh(routes, _Trainers, urls, "bfloat16", 64.0, "nccl")
    # embedded engines: the engine's own buffers are written (device to device over CUDA IPC, or
    # into /dev/shm for a CPU engine); a GPU engine on the shm route loads staging buffers by handle
    assert isinstance(mesh.parts["cuda_ipc"], MappedShmSync)
    assert mesh.parts["cuda_ipc"].clients == [urls["engine-0"]]
    assert isinstance(mesh.parts["shm"], ShmWeightSync) and not mesh.parts["shm"].on_device
    cpu_only = plan(Endpoint("trainer", "a", "cuda:0"), [Endpoint("engine-2", "a", "cpu")])
    assert isinstance(WeightMesh(cpu_only, _Trainers, urls, "float32", 64.0, "nccl").parts["shm"], MappedShmSync)
    # SGLang engines: the trainer's device buffers, handed over as CUDA IPC handles
    sglang = WeightMesh(plan(Endpoint("trainer", "a", "cuda:0"), [Endpoint("engine-0", "a", "cuda:0")]),
                        _Trainers, urls, "bfloat16", 64.0, "nccl", extensions=False)
    assert isinstance(sglang.parts["cuda_ipc"], ShmWeightSync) and sglang.parts["cuda_ipc"].on_device


def test_physical_devices_follow_cuda_visible_devices():
    from loongsage.transfer.devices import physical_device

    assert physical_device("cpu", "0") == "cpu"
    assert physical_device("cuda:0", "") == "cuda:0"
    assert physical_device("cuda", "3") == "cuda:3"  # an actor given GPU 3 calls it cuda:0
    assert physical_device("cuda:1", "2,5") == "cuda:5"
    assert physical_device("cuda:0", "GPU-1a2b") == "cuda:GPU-1a2b"
    # two actors sharing GPU 3 meet on one device: the planner picks cuda_ipc
    assert plan(Endpoint("trainer", "a", physical_device("cuda:0", "3")),
                [Endpoint("engine-0", "a", physical_device("cuda", "3"))]).routes[0].transport == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda:2: only 2 visible device"):
        physical_device("cuda:2", "0,1")


def test_sglang_engines_cannot_relay():
    from loongsage.transfer.mesh import WeightMesh

    relayed = plan(Endpoint("trainer", "a"), [Endpoint("engine-0", "b"), Endpoint("engine-1", "b")])
    with pytest.raises(ValueError, match="SGLang engines cannot relay"):
        WeightMesh(relayed, None, {"engine-0": "u0", "engine-1": "u1"}, "float32", 64.0, "gloo", extensions=False)


def _weight_sync_bench():
    """benchmarks/weight_sync.py as a module (importable by name: its receivers are spawned processes)."""
    import importlib
    import sys
    from pathlib import Path

    where = str(Path(__file__).parents[1] / "benchmarks")
    if where not in sys.path:  # stays: spawned children rebuild sys.path from this process's
        sys.path.append(where)
    return importlib.import_module("weight_sync")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh runs it)"))])
def test_every_raw_transport_delivers_the_exact_bits(device, tmp_path, monkeypatch):
    """The weight_sync benchmark's transfers between two processes (LoongSage's handles: /dev/shm on
    CPU, CUDA IPC on a GPU; gloo or NCCL) land bit-identical in the receiver, and leave no file behind."""
    import tempfile

    bench = _weight_sync_bench()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for kind in bench.KINDS:
        seconds, verified = bench.measure(kind, 50_000, 2, device)
        assert verified, kind
        assert seconds > 0
    assert not list(tmp_path.iterdir())
