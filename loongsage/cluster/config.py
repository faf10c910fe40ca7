"""The `ray` section of a run config."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(None, description="join this cluster; None starts a local one on 127.0.0.1")
    num_cpus: int | None = Field(None, ge=1)
    log_to_driver: bool = False
