"""String reversal, a skill distinct from arithmetic (for multi-teacher distillation):
"reverse:hello=" -> "olleh"."""
from __future__ import annotations

import random
import string

from loongsage.tasks.base import TaskRow, TaskSpec, draw_unique, register


def generate(n: int, seed: int = 0, min_len: int = 4, max_len: int = 8, exclude: set[str] | None = None) -> list[TaskRow]:
    rng = random.Random(seed)

    def draw() -> tuple[str, TaskRow]:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        return f"reverse:{word}=", TaskRow(prompt=f"reverse:{word}=", answer=word[::-1], tag="reverse")

    return draw_unique(n, draw, exclude)


def reward(response: str, row: TaskRow) -> float:
    return 1.0 if response.strip() == row.answer else 0.0


SPEC = register(TaskSpec("reverse", "reverse a lowercase word, plain completion", generate, reward))
