"""Rollout settings: engines and batching (`rollout`), sampling (`sampling`, sent as SGLang `sampling_params`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.extensions import plugin

WindowStrategyName = plugin("window", ["staleness", "windowed_fifo"])
DataFilter = plugin("filter")
ClientClass = plugin("client")


TRUNCATION_REFUSED = ("the trainer scores each token under logits / temperature over the whole vocabulary, the "
                      "distribution the engine records logprobs of; a truncated one (top-p, top-k) would make the "
                      "policy gradient biased and the train-inference gap large, so it is refused for training")


class SamplingConfig(BaseModel):
    """How training rollouts sample. Any temperature trains exactly (the trainer applies it); top-p
    and top-k are refused: see TRUNCATION_REFUSED."""
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="must stay 1.0 for training")
    top_k: int = Field(-1, ge=-1, description="must stay -1 (off) for training")
    max_new_tokens: int = Field(16, ge=1)
    n: int = Field(1, ge=1, description="samples per prompt (a GRPO group)")

    @model_validator(mode="after")
    def _greedy_group(self) -> SamplingConfig:
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError("n > 1 with temperature 0 gives n identical greedy samples; raise temperature or set n=1")
        if self.top_p < 1.0 or self.top_k > 0:
            raise ValueError(f"top_p={self.top_p}, top_k={self.top_k}: {TRUNCATION_REFUSED}; "
                             "set top_p: 1.0 and top_k: -1 (temperature is fine)")
        return self

    def sampling_params(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens}


class EngineHealthConfig(BaseModel):
    """How the controller watches its engines (controller/supervisor.py) and the router fails over."""
    model_config = ConfigDict(extra="forbid")
    check_every_s: float = Field(2.0, ge=0.0, description="seconds between /health probes of each engine; 0 turns "
                                 "supervision off (an engine that dies is not replaced: calls fail over to the "
                                 "others, or their rollouts are aborted)")
    timeout_s: float = Field(10.0, gt=0.0, description="a probe (or restart step) slower than this counts as failed")
    failures: int = Field(3, ge=1, description="consecutive failed probes of a live but unhealthy engine (hung, or "
                          "answering errors) before it is restarted; one that is gone is restarted at once")
    max_restarts: int = Field(5, ge=0, description="engine restarts the run allows in all; one more ends it")
    engine_retries: int = Field(3, ge=0, description="new attempts of a model call an engine failed (another engine "
                                "while one is up); the rollout is aborted (samples/aborted_by_system) after them")
    engine_wait_s: float = Field(300.0, gt=0.0, description="how long a call waits for an engine when none is up")


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: str = Field("embedded", pattern="^(embedded|sglang)$")
    engine_gpus: float = Field(1.0, ge=0, description="GPUs each engine actor on a GPU (SGLang, or "
                               "embedded with engine.device=cuda) reserves in Ray; fractions share a GPU with the trainer, "
                               "which puts weight sync on the cuda_ipc route")
    num_engines: int = Field(1, ge=1)
    engine_resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources each engine actor requests, which places it on the nodes that offer them "
        "(`ray start --resources '{\"rollout\": 4}'`)"))
    engine_threads: int = Field(1, ge=1)
    prompts_per_step: int = Field(32, ge=1)
    dynamic_sampling: bool = Field(True, description="drop groups whose rewards are all equal; sample more")
    max_sampling_rounds: int = Field(4, ge=1, description="at most this many batches' worth of groups drawn per step")
    max_staleness: int = Field(0, ge=0, description="k: train a group at step t only if t-1 - min_version <= k; 0 = sync")
    max_inflight_groups: int | None = Field(None, ge=1, description="default: (k + 1) * prompts_per_step")
    pause_mode: str | None = Field(None, pattern="^(in_place|retract|abort|none)$", description=(
        "how engines hold in-flight requests during a weight update; default in_place for the embedded engine, "
        "abort for SGLang (which reports no per-token versions: a request must not run across an update)"))
    seeded_sampling: bool = Field(False, description="a sampling seed per prompt instance (single-turn rollouts), so "
                                  "that a resumed run samples what the interrupted one would have, and a rerun repeats "
                                  "(the embedded engine's draws depend on seed and token index alone; ~0.1 ms per "
                                  "256-row decode step on CPU)")
    abort_retries: int = Field(2, ge=0, description="times a request the system aborted (not cancelled) is continued "
                               "from its tokens so far; still aborted, its group is masked (samples/aborted_by_system)")
    coalesce_prompts: int = Field(0, ge=0, description=(
        "generate calls made together with the same sampling parameters (a burst of groups) go to one engine "
        "as one batched request of up to this many prompts, not a request each (0: off). Cheaper per sample "
        "at small sizes; each batch returns when its longest answer is done, so for short, even outputs"))
    health: EngineHealthConfig = Field(default_factory=EngineHealthConfig)
    weight_bucket_mb: float = Field(64.0, gt=0)
    window: WindowStrategyName = Field("staleness", description="staleness: take finished groups as they finish; "
                                       "windowed_fifo: only within B of the oldest uncollected group; or module:attr "
                                       "of a window strategy class (window.py)")
    filters: list[DataFilter] = Field(default_factory=list, description="module:attr (or registered) filters "
                                      "(group) -> keep?, applied with dynamic_sampling")
    client: ClientClass | None = Field(None, description="module:attr of an InferenceClient class (base_url, api_key) "
                                       "instead of the built-in SGLang-protocol HTTP client")

    @model_validator(mode="after")
    def _exact_versions(self) -> RolloutConfig:
        """SGLang labels a response with one weight version, the one serving when it ends: a request
        that ran across an update would pass its older tokens off as fresher (and the staleness
        window would under-count them). With `abort` an update ends requests at its boundary and the
        router continues them from their tokens, one version per segment, so every label is exact."""
        if self.pause_mode is None:
            self.pause_mode = "abort" if self.engine == "sglang" else "in_place"
        elif self.engine == "sglang" and self.pause_mode != "abort":
            raise ValueError(f"pause_mode={self.pause_mode} with engine=sglang: SGLang reports no per-token weight "
                             "versions, so requests must not run across a weight update; use pause_mode=abort (the "
                             "default for SGLang: an update ends them at its boundary and they continue from their "
                             "tokens)")
        return self
