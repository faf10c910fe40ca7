"""TransferMesh topology and planner: who holds the weights, who needs them, and the fastest path to
each receiver. Pure data and functions (discovery fills `Endpoint`s; transports carry out `Route`s).

Per receiver, the first that applies:
- same host and same CUDA device, both speak CUDA IPC   -> `cuda_ipc` (zero-copy handle)
- same host, both speak shared memory                   -> `shm` (/dev/shm buffers allocated once, reused)
- another host, both speak the collective               -> `collective`: one broadcast reaches one relay per
                                                           host (the first capable receiver there); the other
                                                           receivers on that host take it from the relay
                                                           (`relay_shm`, or `disk` if they lack shm)
- otherwise                                             -> `disk` (safetensors; every receiver can read it)
"""
from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("cuda_ipc", "shm", "collective", "disk")


@dataclass(frozen=True)
class Endpoint:
    name: str  # "trainer", "engine-0", "teacher-1"
    host: str  # host id: Ray node id, or a configured override
    device: str = "cpu"  # "cpu" or "cuda:<i>"
    transports: tuple[str, ...] = TRANSPORTS

    def __post_init__(self) -> None:
        unknown = sorted(set(self.transports) - set(TRANSPORTS))
        if unknown:
            raise ValueError(f"{self.name}: unknown transports {unknown}; expected a subset of {list(TRANSPORTS)}")
        if "disk" not in self.transports:
            raise ValueError(f"{self.name}: every endpoint must support 'disk' (the universal fallback)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"{self.name}: device must be 'cpu' or 'cuda:<i>', got {self.device!r}")

    def speaks(self, other: Endpoint, transport: str) -> bool:
        return transport in self.transports and transport in other.transports


@dataclass(frozen=True)
class Route:
    receiver: str
    transport: str  # cuda_ipc | shm | collective | relay_shm | disk
    relay: str | None = None  # relay_shm: the receiver on the same host that gets the collective
    reason: str = ""


@dataclass
class Plan:
    sender: Endpoint
    routes: list[Route] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # receiver -> its device

    def on_cpu(self, receivers: list[str]) -> bool:
        return all(self.devices.get(r, "cpu") == "cpu" for r in receivers)

    def by_transport(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.routes:
            out.setdefault(r.transport, []).append(r.receiver)
        return out

    def relays(self) -> list[str]:
        return [r.receiver for r in self.routes if r.transport == "collective"]

    def format(self) -> str:
        lines = [f"sender {self.sender.name} on host {self.sender.host} ({self.sender.device})"]
        for r in self.routes:
            via = f" via {r.relay}" if r.relay else ""
            lines.append(f"  -> {r.receiver:<12s} {r.transport:<10s}{via:<16s} {r.reason}")
        return "\n".join(lines)


def plan(sender: Endpoint, receivers: list[Endpoint]) -> Plan:
    names = [r.name for r in receivers]
    if len(set(names)) != len(names):
        raise ValueError(f"receiver names must be unique, got {names}")
    out = Plan(sender, devices={r.name: r.device for r in receivers})
    relay_of_host: dict[str, Endpoint] = {}
    for r in receivers:
        if r.host == sender.host:
            if r.device == sender.device and r.device.startswith("cuda") and sender.speaks(r, "cuda_ipc"):
                out.routes.append(Route(r.name, "cuda_ipc", reason=f"same device {r.device}"))
            elif sender.speaks(r, "shm"):
                out.routes.append(Route(r.name, "shm", reason=f"same host {r.host}"))
            else:
                out.routes.append(Route(r.name, "disk", reason="same host, no shared-memory transport in common"))
            continue
        relay = relay_of_host.get(r.host)
        if relay is None and sender.speaks(r, "collective"):
            relay_of_host[r.host] = r
            out.routes.append(Route(r.name, "collective", reason=f"relay for host {r.host}"))
        elif relay is not None and relay.speaks(r, "shm"):
            out.routes.append(Route(r.name, "relay_shm", relay=relay.name, reason=f"fan-out on host {r.host}"))
        else:
            out.routes.append(Route(r.name, "disk", reason=f"host {r.host}: no collective or relay in common"))
    return out
