"""The state of one generated sequence inside the engine, and the snapshot sent to clients."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from loongsage.engine.sampling import SamplingParams


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class Finish:
    """Why a sequence ended; SGLang's `finish_reason` dict only at the HTTP edge (`to_wire`)."""
    kind: FinishKind
    matched: int | str | None = None  # stop: the token id or stop string
    length: int | None = None  # length: the output length
    message: str | None = None  # abort: why

    def to_wire(self) -> dict:
        out: dict = {"type": self.kind.value}
        if self.kind is FinishKind.STOP:
            out["matched"] = self.matched
        elif self.kind is FinishKind.LENGTH:
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass
class SeqRequest:
    """One sequence to generate (a request with n > 1 or a batch becomes several)."""

    rid: str  # unique per sequence
    group_rid: str  # the rid the client sent (abort_request matches either)
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    on_update: Callable[[SeqSnapshot], None] | None = None


@dataclass
class SeqSnapshot:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    output_top: list[list[tuple[float, int]]]
    output_versions: list[int]
    input_logprobs: list[float | None] | None
    input_top: list[list[tuple[float, int]] | None] | None
    prompt_tokens: int
    cached_tokens: int
    finish: Finish | None
    weight_version: int


@dataclass
class Sequence:
    req: SeqRequest
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    input_logprobs: list | None = None
    input_top: list | None = None
    kv_len: int = 0  # tokens whose K/V sit in the slot
    kv_epoch: int = 0  # the engine's weights epoch when that K/V began (core.EngineCore._weights_epoch)
    slot: int = -1
    cached_tokens: int = 0
    finish: Finish | None = None
    share_from: Sequence | None = None  # admitted with an equal prompt: copies its K/V (core._admit)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.req.input_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.req.input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.req.input_ids) + len(self.output_ids)

    def snapshot(self, weight_version: int) -> SeqSnapshot:
        return SeqSnapshot(
            rid=self.req.rid,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            output_top=list(self.output_top),
            output_versions=list(self.output_versions),
            input_logprobs=None if self.input_logprobs is None else list(self.input_logprobs),
            input_top=None if self.input_top is None else list(self.input_top),
            prompt_tokens=len(self.req.input_ids),
            cached_tokens=self.cached_tokens,
            finish=self.finish,
            weight_version=weight_version,
        )
