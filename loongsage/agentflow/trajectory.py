"""Trajectories as trainable token sequences.

A `Chain` is one growing token sequence: model turns (trained: loss mask 1, the engine's logprobs
and versions) and inserted tokens (tool results, user turns, template glue: mask 0). An agent
episode is one chain when every model call extends the previous one; a call that does not (the
agent rewrote its history) starts a sibling chain, trained as another sample of the same rollout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.sample import Sample


@dataclass
class Chain:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # normalized history incl. the last model turn
    tools: list[dict] | None = None
    last_stop: int | None = None  # the stop token the last model turn ended with (None: cut short)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, ids: list[int], logprobs: list[float], versions: list[int],
                       temperature: float = 1.0) -> None:
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"model turn: {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.temperatures += [temperature] * len(ids)

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.temperatures += [1.0] * len(ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Trajectory:
    chains: list[Chain] = field(default_factory=list)
    reward: float = 0.0
    status: str = "ok"  # ok | truncated | failed (the agent's doing) | aborted (the system's: never scored)
    reason: str = ""
    answer: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # turns, tool_calls, malformed_tool_calls, ...

    def fail(self, reason: str) -> Trajectory:
        self.status, self.reason, self.reward = "failed", reason, 0.0
        return self

    def abort(self, reason: str) -> Trajectory:
        """The inference system failed the episode (an abort no continuation saved, an engine
        error): its group is not trained, whatever the agent did next."""
        self.status, self.reason, self.reward = "aborted", reason, 0.0
        return self

    def to_samples(self, group: int, rollout: int, tag: str) -> list[Sample]:
        """One sample per chain with model tokens; all carry the episode's reward and rollout id."""
        out = []
        for i, c in enumerate(ch for ch in self.chains if ch.model_tokens):
            out.append(Sample(list(c.prompt_ids), list(c.response_ids), list(c.loss_mask), list(c.logprobs),
                              list(c.versions), reward=self.reward, tag=tag, status=self.status, reason=self.reason,
                              group=group, text=self.answer, info={**self.info, "rollout": rollout, "chain": i},
                              temperatures=list(c.temperatures) if any(t != 1.0 for t in c.temperatures) else None))
        return out


def demonstration_chain(chat: ChatTokens, prompt: list[dict], tools: list[dict] | None, demo: list[dict]) -> Chain:
    """A conversation written by an expert as a chain: its assistant turns are the trained tokens
    (as the model would sample them), everything else is inserted exactly as at rollout time."""
    chain = Chain(chat.prompt_ids(prompt, tools), messages=list(prompt), tools=tools)
    pending: list[dict] = []
    for msg in demo + [None]:
        if msg is not None and msg["role"] != "assistant":
            pending.append(msg)
            continue
        if pending:
            chain.add_inserted(chat.continuation_ids(chain.messages, pending, tools, chain.last_stop))
            chain.messages += pending
            pending = []
        if msg is not None:
            ids = chat.assistant_ids(chain.messages, msg, tools)
            chain.add_model_turn(ids, [0.0] * len(ids), [-1] * len(ids))
            chain.last_stop = ids[-1] if ids and ids[-1] in chat.stop_ids else None
            chain.messages.append(msg)
    return chain
