"""Token-in, token-out model calls for agents: ids go to the engines through the router, and the
sampled ids come back with their logprobs and per-token policy versions, never retokenized."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.toolcalls import ParsedTurn, parse_tool_calls
from loongsage.rollout.router import Router
from loongsage.sample import scoring_temperature


@dataclass
class ModelTurn:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str  # the turn's text with markup, without the stop token
    parsed: ParsedTurn
    finish: str  # stop | length | abort
    weight_version: int
    stopped_with: int | None = None  # the end-of-turn token that ended it (None: cut short or a stop string)
    temperature: float = 1.0  # the distribution its logprobs are of (see sample.scoring_temperature)
    resumed: int = 0  # continuations after system aborts (rollout/resume.py)

    def message(self) -> dict:
        """The OpenAI assistant message this turn is."""
        msg: dict = {"role": "assistant", "content": self.parsed.content}
        if self.parsed.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.parsed.tool_calls]
        return msg


class PolicyLLM:
    def __init__(self, router: Router, chat: ChatTokens, sampling: dict):
        self.router, self.chat, self.sampling = router, chat, dict(sampling)

    async def generate(self, ids: list[int], sampling: dict | None = None, session: str | None = None,
                       rid: str | None = None) -> ModelTurn:
        params = {**self.sampling, **(sampling or {}), "n": 1}
        out = (await self.router.generate(ids, params, session=session, return_logprob=True, rid=rid))[0]
        return self._turn(out, params)

    async def stream(self, ids: list[int], sampling: dict | None = None,
                     session: str | None = None) -> AsyncIterator[tuple[str, ModelTurn | None]]:
        """(text so far, None) while the turn is generated, then (full text, the turn)."""
        params = {**self.sampling, **(sampling or {}), "n": 1}
        last = None
        async for out in self.router.generate_stream(ids, params, session=session, return_logprob=True):
            last = out
            if not out.finish_reason:
                yield self.chat.turn_text(out.output_ids), None
        if last is None:
            raise RuntimeError("the engine closed the stream without a result")
        turn = self._turn(last, params)
        yield turn.text, turn

    def _turn(self, out, params: dict) -> ModelTurn:
        text = self.chat.turn_text(out.output_ids)
        last = out.output_ids[-1] if out.output_ids else None
        stop = last if out.finish_type == "stop" and last in self.chat.stop_ids else None
        return ModelTurn(list(out.output_ids), list(out.output_logprobs or []), out.versions, text,
                         parse_tool_calls(text), out.finish_type, out.weight_version, stop,
                         scoring_temperature(params.get("temperature")), out.resumed)
