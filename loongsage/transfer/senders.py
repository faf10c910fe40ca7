"""The trainer side of every route, by name: a trainer rank keeps one of each it is asked for and
runs their steps (`TrainerRank.transfer(route, method, ...)`)."""
from __future__ import annotations

from loongsage.transfer.broadcast import BroadcastSender
from loongsage.transfer.disk import DiskSender
from loongsage.transfer.mapped import MappedSender
from loongsage.transfer.staged import StagedSender
from loongsage.transfer.verify import ChecksumSender

SENDERS = {"broadcast": BroadcastSender, "disk": DiskSender, "mapped": MappedSender, "staged": StagedSender,
           "verify": ChecksumSender}
