"""Run configuration: one schema composed of the components' own configs (each beside its
component) and the run loop's own sections (`train`, `bootstrap`), loaded from YAML plus dotted
command-line overrides (`engine.max_running=32`), validated before anything starts.

Every problem is one line naming the key and what was expected (`ConfigError`).
"""
from __future__ import annotations

import re
import time
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loongsage.agentflow.config import AgentConfig
from loongsage.algo.config import AlgoConfig
from loongsage.cluster.config import RayConfig
from loongsage.cluster.placement import PlacementConfig, check_colocation
from loongsage.engine.config import EngineConfig
from loongsage.extensions import load_custom
from loongsage.models.config import ModelConfig
from loongsage.rollout.config import RolloutConfig, SamplingConfig
from loongsage.tasks.config import TaskConfig
from loongsage.teachers.config import TeacherConfig
from loongsage.tracking.config import TrackingConfig
from loongsage.trainer.config import SFTConfig, TrainerConfig
from loongsage.transfer.config import TransferConfig
from loongsage.validation.config import Expectation, QuickConfig


class TrainLoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(100, ge=0)
    max_minutes: float | None = Field(None, gt=0, description="stop after this wall-clock budget")
    eval_every: int = Field(20, ge=1)
    eval_size: int | None = Field(None, ge=1, description="held-out rows per evaluation (default: all)")
    eval_temperature: float = Field(0.0, ge=0.0, description="0: greedy; otherwise one sampled answer/episode "
                                    "per row at this temperature (success of the policy as it samples)")
    save_every: int | None = Field(None, ge=1)
    target_accuracy: float | None = Field(None, gt=0, le=1, description="stop once held-out accuracy reaches this")
    controller_cpu_affinity: list[int] | None = Field(
        None, description="pin the controller process to these cores once the actors are up (Linux)")


class BootstrapConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    cache_dir: str = ".cache/loongsage/base_policies"
    sft: SFTConfig = SFTConfig()


class DataSourceConfig(BaseModel):
    """One data source of a mixed run: its own task (data and reward), agent, sampling, share of every
    step (`prompts_per_step` groups of `sampling.n`) and teachers (name -> weight, mixed per token)."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    task: TaskConfig
    agent: AgentConfig = AgentConfig()
    sampling: SamplingConfig = SamplingConfig()
    prompts_per_step: int = Field(ge=1)
    teachers: dict[str, float] = Field(default_factory=dict, description="teacher name -> weight (> 0)")
    eval_size: int | None = Field(None, ge=1, description="held-out rows per evaluation (default: train.eval_size)")

    @model_validator(mode="after")
    def _weights(self) -> DataSourceConfig:
        bad = [n for n, w in self.teachers.items() if w <= 0]
        if bad:
            raise ValueError(f"teachers: weights must be > 0 (got {bad})")
        return self


class ConfigError(ValueError):
    """A configuration problem, as one line naming the key."""


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_prompts: int = Field(64, ge=1)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "run"
    custom_dirs: list[str] = Field(default_factory=lambda: ["custom"], description="folders whose modules are imported "
                                   "before the config is read (their @register-ed extensions); missing ones are skipped")
    run_dir: str | None = None  # default: runs/<name>-<time>
    seed: int = 0
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    trainer: TrainerConfig = TrainerConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainLoopConfig = TrainLoopConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    ray: RayConfig = RayConfig()
    placement: PlacementConfig = PlacementConfig()
    demo: DemoConfig = DemoConfig()
    transfer: TransferConfig = TransferConfig()
    metrics: TrackingConfig = TrackingConfig()
    data_sources: list[DataSourceConfig] = Field(default_factory=list, description="several sources mixed in exact "
                                                 "proportions; empty: one source from task/agent/sampling")
    teachers: list[TeacherConfig] = Field(default_factory=list, description="teacher models for distillation")
    teacher_memory_mb: float | None = Field(None, gt=0, description="resident teacher weights at most this much; "
                                            "the rest is released and resumed on demand (None: all resident)")
    expect: list[Expectation] = Field(default_factory=list, description="what a run of this recipe must show "
                                      "(bounds on metrics and summary values), checked by `loongsage validate`")
    quick: QuickConfig = QuickConfig()

    @model_validator(mode="after")
    def _fits_context(self) -> RunConfig:
        ctx = self.engine.context_length or self.model.tiny.max_position_embeddings
        if self.model.path is None and self.sampling.max_new_tokens >= ctx:
            raise ValueError(f"sampling.max_new_tokens ({self.sampling.max_new_tokens}) must be below the "
                             f"context length ({ctx})")
        return self

    @model_validator(mode="after")
    def _placement(self) -> RunConfig:
        check_colocation(self.placement.mode, self.trainer, self.rollout, self.rollout.max_staleness)
        return self

    @model_validator(mode="after")
    def _sources_and_teachers(self) -> RunConfig:
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teachers: names must be unique (got {names})")
        sources = self.sources()
        if len({s.name for s in sources}) != len(sources):
            raise ValueError(f"data_sources: names must be unique (got {[s.name for s in sources]})")
        parts = self.trainer.data_parallel_size * self.algo.mini_batches
        for s in sources:
            unknown = sorted(set(s.teachers) - set(names))
            if unknown:
                raise ValueError(f"data_sources.{s.name}.teachers: unknown teachers {unknown}; declared: {names}")
            if len(sources) > 1 and (s.prompts_per_step * s.sampling.n) % parts:
                raise ValueError(f"data_sources.{s.name}: prompts_per_step x sampling.n = "
                                 f"{s.prompts_per_step * s.sampling.n} samples cannot be split evenly over "
                                 f"{parts} parts (data-parallel ranks x algo.mini_batches: each must get every "
                                 "source in proportion)")
        opd = self.algo.loss.distill
        if opd.active and not any(s.teachers for s in sources):
            raise ValueError("algo.loss.distill is on, but no data source names a teacher")
        if opd.gkd_coef == 1.0 and any(not s.teachers for s in sources):
            raise ValueError("algo.loss.distill.gkd_coef = 1 (pure distillation) needs a teacher on every data source: "
                             f"{[s.name for s in sources if not s.teachers]} have none")
        if self.teachers and not opd.active:
            raise ValueError("teachers are declared but algo.loss.distill is off (set pg_coef or gkd_coef)")
        tempered = [s.name for s in sources if s.teachers and s.sampling.temperature not in (0.0, 1.0)]
        if opd.active and tempered:
            raise ValueError(f"data_sources {tempered}: distillation with a sampling temperature other than 1 is not "
                             "supported (teachers score at T = 1, the student would be trained at T); sample at 1")
        return self

    def sources(self) -> list[DataSourceConfig]:
        """The data sources of the run: `data_sources`, or one named `default` from the top-level
        task, agent, sampling and rollout.prompts_per_step."""
        if self.data_sources:
            return list(self.data_sources)
        return [DataSourceConfig(name="default", task=self.task, agent=self.agent, sampling=self.sampling,
                                 prompts_per_step=self.rollout.prompts_per_step,
                                 teachers={t.name: 1.0 for t in self.teachers}, eval_size=self.train.eval_size)]

    def resolve_run_dir(self) -> Path:
        if self.run_dir is None:
            self.run_dir = str(Path("runs") / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        return Path(self.run_dir).resolve()  # absolute: actors on other nodes write checkpoints there


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. engine.max_running=32)")
    key, raw = item.split("=", 1)
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[:i + 1])}: is a value, not a section; cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type[BaseModel] = RunConfig):
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: invalid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    for item in overrides:
        apply_override(data, *parse_override(item))
    custom = data.get("custom_dirs", ["custom"])
    if isinstance(custom, list):
        try:
            load_custom(custom)
        except Exception as exc:
            raise ConfigError(f"custom_dirs: importing {custom} failed ({type(exc).__name__}: {exc})") from None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, schema)) from None


def format_error(exc: ValidationError, schema: type[BaseModel], prefix: str = "") -> str:
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"]]
    key = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    if err["type"] == "extra_forbidden":
        parent = _model_at(schema, loc[:-1])
        known = ", ".join(parent.model_fields) if parent else "?"
        return f"{key}: unknown key; expected one of: {known}{more}"
    if err["type"] == "missing":
        return f"{key}: required key is missing{more}"
    msg = err["msg"].removeprefix("Value error, ")
    got = f" (got {err['input']!r})" if err["type"] != "value_error" else ""
    return f"{key}: {msg}{got}{more}"


def _model_at(schema: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    node: Any = schema
    for part in loc:
        if part.isdigit():  # an item of a list field: its element type (list[X] or list[X] | None)
            args = [a for a in typing.get_args(node) if a is not type(None)]
            node = typing.get_args(args[0])[0] if args and typing.get_args(args[0]) else (args[0] if args else None)
            continue
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return None
        node = field.annotation
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def dump_config(cfg: BaseModel, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
