"""SGLang protocol encoding, apart from the transport: request builders and response parsers.

The same functions serve a real SGLang server and the embedded engine (same fields).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GenerateOutput:
    rid: str
    output_ids: list[int]
    text: str
    finish_reason: dict
    output_logprobs: list[float] | None
    output_versions: list[int] | None  # LoongSage extension; None from a stock SGLang server
    input_logprobs: list[float | None] | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: int
    input_top: list[list[list] | None] | None = None  # per input position: its top [logprob, id, text] as sent
    resumed: int = 0  # times the router continued it after a system abort (rollout/resume.py)

    @property
    def finish_type(self) -> str:
        return (self.finish_reason or {}).get("type", "unknown")

    @property
    def versions(self) -> list[int]:
        """Per output token policy version. A stock SGLang server reports one version per response;
        that is exact because a run with SGLang engines ends requests at every weight update
        (`rollout.pause_mode: abort`) and continues them as new segments."""
        if self.output_versions is not None:
            return list(self.output_versions)
        return [self.weight_version] * len(self.output_ids)


def build_generate(
    input_ids: list[int] | list[list[int]],
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
    return_logprob: bool = True,
    logprob_start_len: int | list[int] = -1,
    top_logprobs_num: int = 0,
    rid: str | list[str] | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": [dict(p) for p in sampling_params] if isinstance(sampling_params, list)
        else dict(sampling_params or {}),
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "stream": stream,
    }
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if rid is not None:
        body["rid"] = rid
    return body


def parse_generate(obj: dict[str, Any]) -> GenerateOutput:
    meta = obj.get("meta_info", {})
    out_lp = meta.get("output_token_logprobs")
    in_lp = meta.get("input_token_logprobs")
    in_top = meta.get("input_top_logprobs")
    return GenerateOutput(
        rid=meta.get("id", ""),
        output_ids=list(obj.get("output_ids", [])),
        text=obj.get("text", ""),
        finish_reason=meta.get("finish_reason") or {},
        output_logprobs=None if out_lp is None else [t[0] for t in out_lp],
        output_versions=meta.get("output_token_weight_versions"),
        input_logprobs=None if in_lp is None else [t[0] for t in in_lp],
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_version=parse_version(meta.get("weight_version")),
        input_top=in_top,  # as sent: a teacher's full-vocabulary top is [tokens x vocabulary] triples
    )


def parse_version(value: Any) -> int:
    """SGLang's `weight_version` (a string on the wire) as LoongSage's integer version; SGLang's
    unnamed initial version ("default", or none) is 0."""
    if value is None or value in ("", "default"):
        return 0
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    raise ValueError(f"weight_version {value!r} is not an integer version (start SGLang with --weight-version N)")


def build_score(input_ids: list[int], start: int, top_k: int = 0, rid: str | None = None) -> dict[str, Any]:
    """A prefill-only request scoring the given tokens from position `start` on (a teacher's view of
    a student's response): no token is sampled; `input_token_logprobs` holds the logprob of each
    token from `start` given the ones before, `input_top_logprobs` the top-k of each position."""
    return build_generate(input_ids, {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                          logprob_start_len=start, top_logprobs_num=top_k, rid=rid)


def build_update_from_distributed(
    names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: str | int | None,
    group_name: str = "weight_update_group", flattened: bool = False, flush_cache: bool = True,
) -> dict[str, Any]:
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if flattened:
        body["load_format"] = "flattened_bucket"
    return body


def build_init_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
                     backend: str = "gloo", group_name: str = "weight_update_group") -> dict[str, Any]:
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "backend": backend, "group_name": group_name}
