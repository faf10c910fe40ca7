"""The `transfer` section: overrides of what discovery reports (host ids, transports per endpoint),
and the endpoints a run configuration implies (for `loongsage transfer plan`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from loongsage.extensions import plugin
from loongsage.transfer.topology import TRANSPORTS, Endpoint

TransportClass = plugin("transport")


class TransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hosts: dict[str, str] = Field(default_factory=dict, description="endpoint name -> host id, e.g. {engine-1: node-b}")
    transports: dict[str, list[str]] = Field(default_factory=dict, description="endpoint name -> transports it speaks")
    verify_every: int = Field(10, ge=0, description="every N-th version, receivers' weight checksums must equal the "
                                                     "trainer's (one more pass over the weights on both sides); 0: "
                                                     "never. Embedded engines only: SGLang has no checksum route")
    implementations: dict[str, TransportClass] = Field(
        default_factory=dict, description="route -> module:attr of a WeightTransport class replacing the built-in one "
                                          "for that route (cuda_ipc, shm, collective, relay_shm, disk)")
    disk_dir: str | None = Field(None, description="disk routes: folder for the weight files, visible to their "
                                 "receivers (default: a temporary folder on this machine)")

    def endpoint(self, name: str, host: str, device: str) -> Endpoint:
        """An endpoint as discovered (or assumed), with this section's overrides applied."""
        return Endpoint(name, self.hosts.get(name, host), "cuda:0" if device == "cuda" else device,
                        tuple(self.transports.get(name, TRANSPORTS)))


def endpoints(transfer: TransferConfig, trainer_device: str, engine_device: str, num_engines: int,
              default_host: str = "local") -> tuple[Endpoint, list[Endpoint]]:
    """The sender (trainer rank 0) and the receivers (engines) with the configured overrides."""
    names = ["trainer"] + [f"engine-{i}" for i in range(num_engines)]
    unknown = sorted((set(transfer.hosts) | set(transfer.transports)) - set(names))
    if unknown:
        raise ValueError(f"transfer: unknown endpoints {unknown}; this run has {names}")

    return (transfer.endpoint("trainer", default_host, trainer_device),
            [transfer.endpoint(f"engine-{i}", default_host, engine_device) for i in range(num_engines)])
