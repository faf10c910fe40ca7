"""Counting out a range, a scratchpad whose length is the problem's size: "count:7..12=" ->
"7 8 9 10 11 12". Every step is local (the next number from the last one: a carry into the tens
digit now and then) and the end is a comparison with the prompt, so a small model learns it, while
the outputs of one batch range from a few tokens to over a hundred: the length spread of reasoning
rollouts, where a step's time is decided by its longest samples."""
from __future__ import annotations

import random

from loongsage.tasks.base import TaskRow, TaskSpec, draw_unique, register


def generate(n: int, seed: int = 0, max_start: int = 200, max_span: int = 30,
             exclude: set[str] | None = None) -> list[TaskRow]:
    rng = random.Random(seed)

    def draw() -> tuple[str, TaskRow]:
        a = rng.randint(1, max_start)
        b = a + rng.randint(0, max_span)
        prompt = f"count:{a}..{b}="
        return prompt, TaskRow(prompt=prompt, answer=" ".join(str(i) for i in range(a, b + 1)), tag="count")

    return draw_unique(n, draw, exclude)


def reward(response: str, row: TaskRow) -> float:
    """1 for exactly the range (a verifier, as for math: no credit for most of it)."""
    return 1.0 if response.strip() == row.answer else 0.0


SPEC = register(TaskSpec("count", "count out the range a..b, plain completion (long, uneven outputs)", generate,
                         reward))
