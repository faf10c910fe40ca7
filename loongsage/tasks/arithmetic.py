"""Multi-digit addition as plain completion: "123+456=" -> "579" (then end of text)."""
from __future__ import annotations

import random

from loongsage.tasks.base import TaskRow, TaskSpec, register


def generate(n: int, seed: int = 0, digits: int = 3, exclude: set[str] | None = None) -> list[TaskRow]:
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows, seen = [], set(exclude or ())
    if n > (hi - lo + 1) ** 2 - len(seen):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems")
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        prompt = f"{a}+{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append(TaskRow(prompt=prompt, answer=str(a + b), tag="arith"))
    return rows


def reward(response: str, row: TaskRow) -> float:
    """1 for exactly the sum (the engine strips the end-of-text token from the text)."""
    return 1.0 if response.strip() == row.answer else 0.0


SPEC = register(TaskSpec("arithmetic", "multi-digit addition, plain completion", generate, reward))
