"""Draws training prompts epoch by epoch in a seeded order; a prompt's place in that order (its
cursor) names it, so a resumed run draws the same prompts from where the checkpoint left off."""
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
        self.taken = 0  # prompts drawn so far: the cursor of the next one

    def take(self, n: int) -> list[TaskRow]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.rows[self.order.pop()])
            self.taken += 1
        return out

    def skip_to(self, cursor: int) -> None:
        """Draws until `cursor` prompts have been drawn (a fresh sampler of the same seed then
        continues exactly as the one that had drawn them)."""
        if cursor < self.taken:
            raise ValueError(f"sampler is at {self.taken}, cannot go back to {cursor}")
        self.take(cursor - self.taken)
