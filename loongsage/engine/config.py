"""Settings of one embedded engine: the `engine` section of a run config, and the `loongsage engine`
flags, which are generated from this model (`cliargs.py`): one declaration of each setting."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PREFIX_CACHE_MIN_TOKENS = 16  # EngineCore's default too


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    max_running: int = Field(64, ge=1, description="KV slots: sequences decoded together")
    context_length: int | None = Field(None, ge=2, description="default: the model's max positions")
    max_prefill_tokens: int = Field(4096, ge=1, description="prefill budget per scheduler step")
    threads: int | None = Field(None, ge=1, description="torch threads in the engine process")
    prefix_cache: bool = True
    prefix_cache_min_tokens: int = Field(PREFIX_CACHE_MIN_TOKENS, ge=1, description=(
        "embedded engine: shortest cached prefix reused (a shorter one costs more to move between slots than its "
        "prefill, and keeps the prompt out of the batched prefill of fresh prompts); SGLang reuses any"))
    weight_version: int = Field(0, ge=0, description="the version the engine reports for its initial weights")
    cpu_affinity: list[int] | None = Field(None, description="pin the engine process to these CPU cores (Linux)")
    inject_errors: str | None = Field(None, pattern=r"^\d+:\d+$", description="fault injection (reliability tests, "
                                      "drills): 'AFTER:COUNT' answers HTTP 500 to COUNT /generate requests after the "
                                      "first AFTER (engine/faults.py); a restarted engine comes up without it")
    sglang_args: list[str] = Field(default_factory=list, json_schema_extra={"cli": False},
                                   description="extra `sglang.launch_server` flags (rollout.engine=sglang), e.g. "
                                               "['--tp-size', '2', '--mem-fraction-static', '0.7']")

    def sglang_args_for(self) -> list[str]:
        """The `python -m sglang.launch_server` flags equivalent to this config (SGLang on GPU)."""
        args = ["--dtype", self.dtype, "--max-running-requests", str(self.max_running),
                "--max-prefill-tokens", str(self.max_prefill_tokens), "--weight-version", str(self.weight_version)]
        if self.context_length:
            args += ["--context-length", str(self.context_length)]
        if not self.prefix_cache:
            args.append("--disable-radix-cache")
        return args + list(self.sglang_args)
