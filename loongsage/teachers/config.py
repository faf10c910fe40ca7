"""The `teachers` section: named teacher models, each served by its own engines, and how much of
them may be resident at once (`teacher_memory_mb` in the run config)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.agentflow.config import AgentConfig
from loongsage.engine.config import EngineConfig
from loongsage.rollout.config import SamplingConfig
from loongsage.tasks.config import TaskConfig
from loongsage.trainer.config import SFTConfig


class TeacherBootstrap(BaseModel):
    """Build the teacher: the run's model (its `model` section) fine-tuned on `task` until its dev
    accuracy reaches `sft.target_accuracy` (cached like base policies). `sampling` bounds its dev
    rollouts (an agent's turns need room for their tool calls); unset, it is that of the first data
    source routed to this teacher."""
    model_config = ConfigDict(extra="forbid")
    task: TaskConfig
    agent: AgentConfig = AgentConfig()
    sampling: SamplingConfig | None = None
    sft: SFTConfig = SFTConfig(target_accuracy=0.9)


class TeacherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    model: str | None = Field(None, description="an HF model folder (its tokenizer must be the student's)")
    bootstrap: TeacherBootstrap | None = Field(None, description="or build it by SFT (see TeacherBootstrap)")
    engine: EngineConfig = EngineConfig()
    kind: str = Field("embedded", pattern="^(embedded|sglang)$", description="embedded (CPU) or sglang (GPU)")
    num_engines: int = Field(1, ge=1)
    engine_threads: int = Field(1, ge=1)
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources each of its engines requests, which places them on the nodes that offer them"))
    follow_student_every: int | None = Field(None, ge=1, description="self-distillation: the teacher takes the "
                                             "student's weights every K steps (a TransferMesh receiver)")

    @model_validator(mode="after")
    def _source(self) -> TeacherConfig:
        if (self.model is None) == (self.bootstrap is None) and self.follow_student_every is None:
            raise ValueError(f"teacher {self.name!r}: give exactly one of model or bootstrap")
        if self.model is not None and self.bootstrap is not None:
            raise ValueError(f"teacher {self.name!r}: give exactly one of model or bootstrap")
        return self
