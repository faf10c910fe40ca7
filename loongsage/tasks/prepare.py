"""Turns a task config into train/eval rows, and rows into prompt token ids."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from loongsage.tasks.base import TaskRow, task_spec
from loongsage.tasks.config import TaskConfig
from loongsage.tasks.dataset import DataSchema, load_rows, write_jsonl


def prepare_data(cfg: TaskConfig) -> tuple[list[TaskRow], list[TaskRow]]:
    """Generated rows are written once (eval disjoint from train) and reloaded from jsonl."""
    if cfg.train_path is not None:
        schema = DataSchema(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
        return tuple([_formatted(r, cfg.prompt_format) for r in load_rows(path, schema, cfg.bad_rows)]
                     for path in (cfg.train_path, cfg.eval_path))
    key = json.dumps([cfg.name, cfg.params, cfg.train_size, cfg.eval_size, cfg.seed], sort_keys=True)
    folder = Path(cfg.data_dir) / f"{cfg.name.replace(':', '-')}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    train_file, eval_file = folder / "train.jsonl", folder / "eval.jsonl"
    if not (train_file.is_file() and eval_file.is_file()):
        spec = task_spec(cfg)
        eval_rows = spec.generate(cfg.eval_size, seed=cfg.seed + 1_000_003, **cfg.params)
        held_out = {_key(r) for r in eval_rows}
        train_rows = spec.generate(cfg.train_size, seed=cfg.seed, exclude=held_out, **cfg.params)
        write_jsonl(eval_rows, eval_file)
        write_jsonl(train_rows, train_file)
    return load_rows(train_file), load_rows(eval_file)


def _formatted(row: TaskRow, prompt_format: str | None) -> TaskRow:
    """A string prompt as one user message in `prompt_format` (chat models); others as they are."""
    if prompt_format is None or not isinstance(row.prompt, str):
        return row
    return dataclasses.replace(row, prompt=[{"role": "user", "content": prompt_format.replace("{prompt}", row.prompt)}])


def _key(row: TaskRow) -> str:
    return row.meta.get("expression") or (row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt))


def prompt_ids(tokenizer, row: TaskRow) -> list[int]:
    """Token ids of a row's prompt: raw text as is, chat messages through the chat template."""
    if isinstance(row.prompt, str):
        return tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(row.prompt, tools=row.tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
