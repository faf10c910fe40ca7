"""Settings of the trainer group and its optimizer (the `trainer` section of a run config)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.extensions import plugin

BackendName = plugin("trainer_backend", ["fsdp", "megatron"])


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: BackendName = Field("fsdp", description="fsdp | megatron, or module:attr of a TrainBackend class "
                                 "(cfg, model_path)")
    world_size: int = Field(1, ge=1, description="trainer ranks (Ray actors)")
    tensor_parallel_size: int = Field(1, ge=1, description="megatron: ranks per tensor-parallel group")
    pipeline_parallel_size: int = Field(1, ge=1, description="megatron: pipeline stages; data parallel = "
                                                              "world_size / (tensor_parallel_size * this)")
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int | None = Field(None, ge=1, description="for cosine/linear decay")
    decay_steps: int | None = Field(None, ge=1, description=(
        "decay only over the last decay_steps before total_steps, constant before (warm-up, stable, "
        "decay); default: every step after the warm-up"))
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    micro_batch_size: int = Field(64, ge=1)
    shared_prefix: int = Field(16, ge=0, description=(
        "fsdp, one unsharded rank: rows of a micro-batch that begin with at least this many identical tokens "
        "(a system prompt, a group's prompt) run them once, not once per row (0: off)"))
    bf16: bool = False
    threads: int = Field(1, ge=1, description="torch threads per rank")
    device: str = "cpu"
    gpus_per_rank: float = Field(1.0, gt=0, le=1, description="GPUs each rank reserves in Ray when device is cuda "
                                 "(below 1 to share a GPU with an SGLang engine)")
    cpu_affinity: list[int] | None = Field(None, description="pin each rank to these CPU cores (Linux)")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources each rank requests, which places it on the nodes that offer them"))
    seed: int = 0

    @model_validator(mode="after")
    def _parallelism(self) -> TrainerConfig:
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if model_parallel > 1 and self.backend != "megatron":
            raise ValueError("tensor_parallel_size / pipeline_parallel_size > 1 need backend: megatron")
        if self.world_size % model_parallel:
            raise ValueError(f"world_size ({self.world_size}) must be a multiple of tensor_parallel_size x "
                             f"pipeline_parallel_size ({model_parallel})")
        if self.decay_steps is not None and (self.total_steps is None or self.lr_schedule == "constant"
                                             or self.decay_steps > self.total_steps - self.warmup_steps):
            raise ValueError(f"trainer.decay_steps ({self.decay_steps}) needs lr_schedule linear or cosine and "
                             f"total_steps with room for it after warmup_steps ({self.total_steps}, "
                             f"{self.warmup_steps})")
        return self

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)


class SFTConfig(BaseModel):
    """Supervised fine-tuning to a target competence (bootstraps of base policies and teachers)."""
    model_config = ConfigDict(extra="forbid")
    max_steps: int = Field(1000, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = Field(50, ge=0)
    eval_every: int = Field(25, ge=1)
    dev_size: int = Field(200, ge=1, description="train rows held back to decide when to stop")
    target_accuracy: float | None = Field(0.3, gt=0, le=1, description="stop once dev accuracy reaches it")
    threads: int | None = Field(None, ge=1, description="torch threads of the trainer ranks while fine-tuning "
                                "(default: trainer.threads and its cpu_affinity; when set, the run's pinning is "
                                "not applied: the engine is mostly idle meanwhile)")
