"""The row every data set becomes, and the registry of built-in tasks with their verifiers."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TaskRow:
    prompt: str | list[dict[str, Any]]  # raw completion prompt, or chat messages
    answer: str
    tag: str = "default"
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt": self.prompt, "answer": self.answer, "tag": self.tag}
        if self.tools:
            out["tools"] = self.tools
        if self.meta:
            out["meta"] = self.meta
        return out


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    generate: Callable[..., list[TaskRow]]  # generate(n, seed, **params)
    reward: Callable[[str, TaskRow], float]  # reward(response_text, row) in [0, 1]
    # Agent tasks: the messages an expert adds after the prompt (tool calls, final answer), for SFT bootstraps
    demonstration: Callable[[TaskRow], list[dict[str, Any]]] | None = None


TASKS: dict[str, TaskSpec] = {}


def draw_unique(n: int, draw: Callable[[], tuple[str, TaskRow]], exclude: set[str] | None = None,
                max_tries_per_row: int = 1000) -> list[TaskRow]:
    """Calls `draw() -> (key, row)` until n rows with distinct keys, none of them in `exclude`."""
    rows, seen = [], set(exclude or ())
    tries = 0
    while len(rows) < n:
        key, row = draw()
        tries += 1
        if tries > max_tries_per_row * n:
            raise ValueError(f"cannot draw {n} distinct problems (got {len(rows)}); widen the task parameters")
        if key in seen:
            continue
        seen.add(key)
        rows.append(row)
    return rows


def register(spec: TaskSpec) -> TaskSpec:
    TASKS[spec.name] = spec
    return spec


def task_spec(cfg) -> TaskSpec:
    """The task of a `task` config section: a built-in name or `module:attr` of a TaskSpec, with the
    configured `reward` (module:attr or registered) in place of its verifier."""
    import dataclasses

    from loongsage.extensions import resolve

    spec = resolve(cfg.name, "task") if ":" in cfg.name else get_task(cfg.name)
    if cfg.reward is not None:
        spec = dataclasses.replace(spec, reward=resolve(cfg.reward, "reward"))
    return spec


def get_task(name: str) -> TaskSpec:
    from loongsage.tasks import arithmetic, calculator, count, math_answer, reverse  # noqa: F401  (registers them)

    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
