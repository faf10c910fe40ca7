"""Draws training prompts epoch by epoch in a seeded order."""
from __future__ import annotations

import random

from loongsage.tasks.base import TaskRow


class PromptSampler:
    def __init__(self, rows: list[TaskRow], seed: int = 0):
        if not rows:
            raise ValueError("no training rows")
        self.rows, self.rng = rows, random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def take(self, n: int) -> list[TaskRow]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.rows[self.order.pop()])
        return out
