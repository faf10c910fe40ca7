"""Multi-digit addition as plain completion: "123+456=" -> "579" (then end of text)."""
from __future__ import annotations

import random

from loongsage.tasks.base import TaskRow, TaskSpec, draw_unique, register


def generate(n: int, seed: int = 0, digits: int = 3, exclude: set[str] | None = None) -> list[TaskRow]:
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1

    def draw() -> tuple[str, TaskRow]:
        x, y = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"{x}+{y}=", TaskRow(prompt=f"{x}+{y}=", answer=str(x + y), tag="arith")

    return draw_unique(n, draw, exclude)


def reward(response: str, row: TaskRow) -> float:
    """1 for exactly the sum (the engine strips the end-of-text token from the text)."""
    return 1.0 if response.strip() == row.answer else 0.0


SPEC = register(TaskSpec("arithmetic", "multi-digit addition, plain completion", generate, reward))
