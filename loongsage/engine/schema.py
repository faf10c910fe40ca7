"""Validation of inbound SGLang-protocol requests (the server side of ../shared/SGLANG_PROTOCOL.md).

Unknown fields are rejected; SGLang fields we do not implement are rejected by name unless the
value is SGLang's neutral default, so a request is never silently misread.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loongsage.engine.sampling import SamplingParams

# SGLang sampling fields we accept only at their neutral value.
_NEUTRAL = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None, "stream_interval": None,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Strict):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return v

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop):
            raise ValueError("sampling_params.stop: empty stop strings are not allowed")
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            sampling_seed=self.sampling_seed,
        )


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class UpdateFromTensor(_Strict):
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    rid: str | None = None


class InitGroup(_Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"
    rid: str | None = None


class UpdateFromDistributed(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: Literal["flattened_bucket"] | None = None
    rid: str | None = None


class DestroyGroup(_Strict):
    group_name: str = "weight_update_group"
    rid: str | None = None


class ShareWeights(_Strict):
    """LoongSage extension: a relay engine shares the weights it serves with same-host peers."""
    receivers: int = Field(ge=1, le=1024)
    bucket_mb: float = Field(64.0, gt=0)


class FlipWeights(_Strict):
    """LoongSage extension: serve the standby mapped buffer the trainer has just written."""
    standby: int = Field(ge=0, le=1)
    weight_version: str | int | None = None
    flush_cache: bool = True


class UpdateFromDisk(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    flush_cache: bool = True
    rid: str | None = None


class PauseRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None


class AbortRequest(_Strict):
    rid: str | list[str] | None = None
    abort_all: bool = False


class MemoryRequest(_Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = None
    rid: str | None = None


class WeightVersionRequest(_Strict):
    new_version: str | int
    abort_all_requests: bool = True
    rid: str | None = None


class RequestError(ValueError):
    """A client error: answered with HTTP 400 and this message."""


def parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc)) from None


def parse_sampling(raw: dict | None, index: int | None = None) -> SamplingParamsIn:
    raw = dict(raw or {})
    where = "sampling_params" if index is None else f"sampling_params[{index}]"
    for key in list(raw):
        if key in _NEUTRAL:
            if raw[key] not in (_NEUTRAL[key], None):
                raise RequestError(f"{where}.{key}: not supported by the embedded engine (only its default "
                                   f"{_NEUTRAL[key]!r} is accepted)")
            raw.pop(key)
    try:
        return SamplingParamsIn.model_validate(raw)
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, prefix=where)) from None


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in ((prefix,) if prefix else ()) + tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        else:
            parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
