"""TensorBoard event files in RUN_DIR/tensorboard."""
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
        for k, v in numeric(record).items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
