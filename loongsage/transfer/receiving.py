"""What every weight route's engine side shares: SGLang's version field (a string on the wire, an
integer inside), and the one answer shape of a weight update (success, or a 400 with the reason, the
served weights unchanged)."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from loongsage.api import WeightHost
from loongsage.wire import RequestError, error


def as_version(value: str | int | None) -> int | None:
    """SGLang's `weight_version` field as LoongSage's integer version."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    raise RequestError(f"weight_version: {value!r} is not an integer version")


async def apply_update(host: WeightHost, load: Callable[[], int], version: str | int | None, flush_cache: bool = True,
                       abort_all: bool = False):
    try:
        n = await host.update(load, as_version(version), flush_cache, abort_all)
    except RequestError:
        raise
    except Exception as exc:
        return error(400, f"weight update failed: {exc}")
    return {"success": True, "message": f"updated {n} tensors; weight_version={host.weight_version}"}


class Receiver:
    """A route's engine side: its HTTP routes over a `WeightHost`, and whatever it holds (released
    when the server stops)."""

    def __init__(self, host: WeightHost):
        self.host = host

    def routes(self) -> APIRouter:
        raise NotImplementedError

    def release(self) -> None:
        return None
