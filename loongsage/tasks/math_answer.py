"""Math word problems from user data (GSM8K, DAPO-Math style): the reward extracts the response's final
answer the way those data sets' own evaluations do and compares it with the reference as numbers.

Where the final answer is, in order: the last `\\boxed{...}` (DAPO-Math, the Qwen math prompts), the
text after the last `####` (GSM8K's own format), the last "answer is ..." / "Answer: ...", else the
last number in the response. The reference may be a bare value or a full GSM8K solution ending in
`#### 72`. Numbers compare after dropping thousands separators, `$`, `%` and a trailing period
(`1,000.00` == `1000`, `3/4` == `0.75`); anything else compares as normalised text.

The task has no generator: give `task.train_path` and `task.eval_path` (jsonl or parquet).
"""
from __future__ import annotations

import re
from fractions import Fraction

from loongsage.tasks.base import TaskRow, TaskSpec, register

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced (`\\boxed{\\frac{1}{2}}`)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    said = re.findall(r"(?:answer is|answer:)\s*\$?\s*(" + _NUMBER + ")", text, flags=re.IGNORECASE)
    if said:
        return said[-1]
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def as_number(value: str) -> Fraction | None:
    text = value.strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".").strip()
    text = re.sub(r"^\\(?:text|mathrm)\{(.*)\}$", r"\1", text)
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", text)
    try:
        if frac:
            return Fraction(int(frac.group(1)), int(frac.group(2)))
        return Fraction(text) if re.fullmatch(_NUMBER.replace(",", ""), text) else None
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str, reference: str) -> bool:
    a, b = as_number(given), as_number(reference)
    if a is not None and b is not None:
        return a == b
    return re.sub(r"\s+", "", given) == re.sub(r"\s+", "", reference)


def reward(response: str, row: TaskRow) -> float:
    """1 when the response's final answer equals the reference's (GSM8K solutions: after `####`)."""
    given = final_answer(response)
    reference = row.answer.rsplit("####", 1)[1].strip() if "####" in row.answer else row.answer
    return 1.0 if given is not None and same_answer(given, reference) else 0.0


def generate(n: int, seed: int = 0, **_) -> list[TaskRow]:
    raise ValueError("task math has no generator: set task.train_path and task.eval_path (GSM8K, DAPO-Math "
                     "and the like as jsonl or parquet, with task.prompt_key / task.answer_key)")


SPEC = register(TaskSpec("math", "math word problems from user data; final-answer extraction (boxed, ####, "
                         "last number)", generate, reward))
