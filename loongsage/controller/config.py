"""Run-loop settings: the `train`, `sft` and `bootstrap` sections."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_steps: int = Field(1000, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = Field(50, ge=0)
    eval_every: int = Field(25, ge=1)
    dev_size: int = Field(200, ge=1, description="train rows held back to decide when to stop")
    target_accuracy: float | None = Field(0.3, gt=0, le=1, description="stop once dev accuracy reaches it")


class BootstrapConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    cache_dir: str = ".cache/loongsage/base_policies"
    sft: SFTConfig = SFTConfig()
