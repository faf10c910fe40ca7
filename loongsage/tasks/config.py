"""Which task a run trains and evaluates on: a built-in generator or user files."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loongsage.extensions import plugin

Reward = plugin("reward")


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("arithmetic", description="a built-in task (generator and verifier), or module:attr of a TaskSpec")
    reward: Reward | None = Field(None, description="module:attr (or registered) reward (response_text, row) -> "
                                  "float, instead of the task's verifier")
    params: dict[str, Any] = Field(default_factory=dict, description="generator parameters, e.g. digits: 3")
    train_size: int = Field(2000, ge=1)
    eval_size: int = Field(200, ge=1)
    seed: int = 0
    data_dir: str = ".cache/loongsage/data"
    train_path: str | None = None  # user data (jsonl/parquet) instead of generated rows
    eval_path: str | None = None
    prompt_key: str = "prompt"
    prompt_format: str | None = Field(None, description="user data: a string prompt becomes one user chat message "
                                      "of this text with {prompt} replaced (e.g. the answer format an instruct "
                                      "model is asked for); None keeps it a raw completion prompt")
    answer_key: str = Field("answer", description="user data: the reference answer's key; prompt_key and answer_key "
                            "may be dotted to reach into nested records (DAPO-Math: reward_model.ground_truth)")
    bad_rows: Literal["error", "skip"] = Field("error", description="a malformed row of train_path/eval_path: stop "
                                               "with its file and line, or skip it (each listed in a warning)")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from loongsage.extensions import resolve
        from loongsage.tasks.base import TASKS, get_task

        if ":" in name:
            resolve(name, "task")
            return name
        try:
            get_task(name)
        except KeyError:
            raise ValueError(f"unknown task; expected one of {sorted(TASKS)} or module:attr of a TaskSpec") from None
        return name

    @model_validator(mode="after")
    def _paths(self) -> TaskConfig:
        if (self.train_path is None) != (self.eval_path is None):
            raise ValueError("train_path and eval_path must be given together")
        if self.prompt_format is not None and "{prompt}" not in self.prompt_format:
            raise ValueError("prompt_format must contain {prompt} (where the row's prompt goes)")
        return self
