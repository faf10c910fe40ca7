"""Tasks: data-set generators for the CPU recipes, verifier rewards, and user data loading."""
from loongsage.tasks.base import TASKS, TaskRow, TaskSpec, get_task
from loongsage.tasks.dataset import DataError, DataSchema, load_rows, write_jsonl

__all__ = ["TASKS", "TaskRow", "TaskSpec", "get_task", "DataError", "DataSchema", "load_rows", "write_jsonl"]
