"""The prompt ledger, `RUN_DIR/prompts.jsonl`: one line per admitted prompt instance, with its fate.

An instance is `(source, cursor)`: the cursor-th prompt its source's sampler drew. Its fate is one
of FATES, with the step it was settled at. Across resumes every instance gets exactly one line:
a checkpoint stores how many lines the ledger had and, per source, the cursors at or after its
resume cursor that were already settled; a resume cuts the ledger back to that many lines (what
was settled after the checkpoint is redone) and its samplers pass over the settled cursors (so
nothing settled before the checkpoint is drawn again).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

FATES = ("trained", "skipped", "filtered", "dropped_stale", "cancelled", "failed", "aborted")


class PromptLedger:
    def __init__(self, path: str | Path, keep_lines: int | None = None, settled: dict[str, list[int]] | None = None):
        """`keep_lines`, `settled`: from the checkpoint a run resumes from (the ledger is cut back to
        `keep_lines`; `settled` are cursors past the resume cursors already settled)."""
        self.path = Path(path)
        if keep_lines is not None:
            _truncate_lines(self.path, keep_lines)
        self.lines = _count_lines(self.path)
        self._file = open(self.path, "a")
        self.settled: dict[str, set[int]] = defaultdict(set)
        for source, cursors in (settled or {}).items():
            self.settled[source].update(cursors)

    def settle(self, source: str, cursor: int, fate: str, step: int) -> None:
        if fate not in FATES:
            raise ValueError(f"fate {fate!r}: expected one of {FATES}")
        self._file.write(json.dumps({"source": source, "cursor": cursor, "fate": fate, "step": step}) + "\n")
        self._file.flush()
        self.lines += 1
        self.settled[source].add(cursor)

    def settled_from(self, source: str, cursor: int) -> list[int]:
        """Settled cursors of `source` at or after `cursor` (older ones are forgotten)."""
        self.settled[source] = {c for c in self.settled[source] if c >= cursor}
        return sorted(self.settled[source])

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_ledger(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _truncate_lines(path: Path, keep: int) -> None:
    if not path.exists():
        if keep:
            raise FileNotFoundError(f"{path}: the checkpoint counts {keep} ledger lines, the file is missing")
        return
    with open(path, "rb") as f:
        lines = f.readlines()
    if len(lines) < keep:
        raise ValueError(f"{path}: {len(lines)} lines, the checkpoint counts {keep}")
    with open(path, "wb") as f:
        f.writelines(lines[:keep])
