"""The engine side of every route: an inference server mounts each one's routes over its
`WeightHost` (`engine/server.py`) and releases what they hold when it stops."""
from __future__ import annotations

from loongsage.api import WeightHost
from loongsage.transfer.broadcast import BroadcastReceiver
from loongsage.transfer.disk import DiskReceiver
from loongsage.transfer.mapped import MappedReceiver
from loongsage.transfer.receiving import Receiver
from loongsage.transfer.relay import RelayReceiver
from loongsage.transfer.staged import StagedReceiver
from loongsage.transfer.verify import ChecksumReceiver

RECEIVERS = (StagedReceiver, DiskReceiver, BroadcastReceiver, MappedReceiver, RelayReceiver, ChecksumReceiver)


def receivers_for(host: WeightHost) -> list[Receiver]:
    return [cls(host) for cls in RECEIVERS]
