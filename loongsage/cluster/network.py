"""Where a service of this process may listen, and rendezvous sockets bound before they are shared.

A single-machine run listens on loopback only; in a Ray cluster every service binds the address of
the node it runs on (the one Ray knows it by), never all interfaces. torch's TCPStore binds every
interface when it opens its own socket, so a store master is handed one we bound ourselves.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's view of IPv4 loopback
    return (mapped or ip).is_loopback


def node_address() -> str:
    """This process's node address as Ray sees it (127.0.0.1 in a local run, or without Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return LOOPBACK


def interface_of(address: str) -> str:
    """The network interface that holds `address` (gloo and NCCL bind their sockets to it)."""
    if is_loopback(address):
        return "lo"
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    raise RuntimeError(f"no network interface of this node has the address {address}")


def use_interface_of(address: str) -> None:
    """Points gloo and NCCL of this process at the interface holding `address` (before any group)."""
    ifname = interface_of(address)
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)


@dataclass
class Rendezvous:
    """A store master's listening socket: bound to `host` on a free port before the address is handed
    out (so there is no race for the port), and given to TCPStore instead of its own any-address one."""
    host: str
    port: int
    _sock: socket.socket

    @classmethod
    def open(cls, host: str) -> Rendezvous:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, 0), family=family, backlog=128)
        return cls(host, sock.getsockname()[1], sock)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def take_fd(self) -> int:
        """The socket's descriptor, handed over once (the store owns and closes it)."""
        return self._sock.detach()


def tcp_store(host: str, port: int, world_size: int, rendezvous: Rendezvous | None, timeout):
    """torch's TCPStore: the master (the holder of `rendezvous`) listens on that socket only."""
    import torch.distributed as dist

    if rendezvous is not None:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                             master_listen_fd=rendezvous.take_fd())
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
