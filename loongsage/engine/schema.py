"""Validation of inbound SGLang-protocol requests (the server side of ../shared/SGLANG_PROTOCOL.md).

Unknown fields are rejected; SGLang fields we do not implement are rejected by name unless the
value is SGLang's neutral default, so a request is never silently misread.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from loongsage.engine.sampling import SamplingParams
from loongsage.wire import RequestError, Strict, format_validation_error, parse

__all__ = ["RequestError", "parse", "parse_sampling"]

# SGLang sampling fields we accept only at their neutral value.
_NEUTRAL = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None, "stream_interval": None,
}


class SamplingParamsIn(Strict):
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
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer (sampling.py hashes it)

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


class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class PauseRequest(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None


class AbortRequest(Strict):
    rid: str | list[str] | None = None
    abort_all: bool = False


class MemoryRequest(Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = None
    rid: str | None = None


class WeightVersionRequest(Strict):
    new_version: str | int
    abort_all_requests: bool = True
    rid: str | None = None


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
