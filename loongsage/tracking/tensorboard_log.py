"""TensorBoard event files in RUN_DIR/tensorboard.

A step's scalars go out as one event holding all of them: one event per scalar (`add_scalar`)
cost the controller ~7 ms of CPU a step for ~50 metrics (each event serialized, checksummed in
Python and queued on its own), time taken from the trainer and engines sharing the machine; one
event a step costs ~0.7 ms, and TensorBoard reads the same curves from it."""
from __future__ import annotations

from pathlib import Path

from loongsage.tracking import numeric


class TensorBoardLog:
    def __init__(self, run_dir: Path, resumed_at: int | None):
        """A resumed run drops what the run it resumes had logged beyond `resumed_at` (the redone
        steps appear once, as in metrics.jsonl)."""
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=None if resumed_at is None else resumed_at + 1)

    def log(self, record: dict, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in numeric(record).items()]
        if values:
            self._tb._get_file_writer().add_summary(Summary(value=values), step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
