"""The gateway's Anthropic Messages and OpenAI Responses APIs with the official `anthropic` and
`openai` SDKs against a real engine (the tiny model trained to make one calculator call): tool use
round trips, streaming, errors, and the same exact token capture and chain merging as chat
completions (a conversation recorded through one protocol has the very token ids of the same
conversation through another)."""
from __future__ import annotations

import asyncio
import json
import sys

import pytest
from anthropic import AsyncAnthropic, AuthenticationError, BadRequestError
from openai import AsyncOpenAI
from test_agentflow_gateway import GREEDY, _with_gateway

from helpers import MALFORMED_CALL, with_client
from loongsage.tasks.calculator import CALCULATOR_TOOL

FN = CALCULATOR_TOOL["function"]
TOOL = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": FN["name"], "description": FN["description"], "parameters": FN["parameters"]}


async def _chat_completions_records(server, gw, key: str) -> list[dict]:
    """The calculator conversation through chat completions: the reference every protocol must match."""
    openai = AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "6*7=?"}]
    first = await openai.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0)
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "42"}]
    await openai.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0)
    return gw.sessions.lookup(key).records


def _same_tokens(records: list[dict], reference: list[dict]) -> None:
    for a, o in zip(records, reference, strict=True):
        assert (a["prompt_ids"], a["output_ids"], a["extends"]) == (o["prompt_ids"], o["output_ids"], o["extends"])


def _client(server, key: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=server.base_url.removesuffix("/v1"), api_key=key, max_retries=0)


def test_anthropic_client_tool_use_round_trip_records_what_the_openai_path_records(tool_engine, tool_model):
    async def go(gw, server):
        client = _client(server, "carol")
        msgs = [{"role": "user", "content": "6*7=?"}]
        r1 = await client.messages.create(model="policy", max_tokens=80, messages=msgs, tools=[TOOL])
        assert r1.stop_reason == "tool_use" and r1.role == "assistant" and r1.type == "message"
        (use,) = [b for b in r1.content if b.type == "tool_use"]
        assert (use.name, use.input) == ("calculator", {"expression": "6*7"})
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
        r2 = await client.messages.create(model="policy", max_tokens=80, messages=msgs, tools=[TOOL])
        assert [(b.type, b.text) for b in r2.content] == [("text", "The answer is 42")]
        assert r2.stop_reason == "end_turn"
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
        carol = gw.sessions.lookup("carol")
        assert [r["extends"] for r in carol.records] == [False, True] and carol.drift_rate == 0.0
        (chain,) = carol.chains  # one merged sample: the tool result inserted between the two turns
        assert chain.ids == carol.records[1]["prompt_ids"] + carol.records[1]["output_ids"]
        for rec in carol.records:  # the engine's own output for exactly the recorded prompt
            direct = await with_client(tool_engine.url, lambda c, ids=rec["prompt_ids"]: c.generate(ids, GREEDY))
            assert rec["output_ids"] == direct.output_ids

        _same_tokens(carol.records, await _chat_completions_records(server, gw, "dave"))

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


def test_anthropic_client_streaming(tool_engine, tool_model):
    async def go(gw, server):
        client = _client(server, "erin")
        msgs = [{"role": "user", "content": "6*7=?"}]
        async with client.messages.stream(model="policy", max_tokens=80, messages=msgs, tools=[TOOL]) as stream:
            first = await stream.get_final_message()
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.input == {"expression": "6*7"} and first.usage.output_tokens > 10
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
        pieces = []
        async with client.messages.stream(model="policy", max_tokens=80, messages=msgs, tools=[TOOL]) as stream:
            async for text in stream.text_stream:
                pieces.append(text)
            second = await stream.get_final_message()
        assert "".join(pieces) == "The answer is 42" and len(pieces) > 3  # streamed while it was generated
        assert second.stop_reason == "end_turn"
        async with client.messages.stream(model="policy", max_tokens=80, tools=[TOOL],
                                          messages=[{"role": "user", "content": "oops=?"}]) as stream:
            bad = await stream.get_final_message()
        assert [(b.type, b.text) for b in bad.content] == [("text", MALFORMED_CALL)]  # never a half-parsed call
        assert [r["extends"] for r in gw.sessions.lookup("erin").records] == [False, True, False]

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: Field required"),
    ({"max_tokens": 8, "messages": []}, "messages: List should have at least 1 item"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]},
     "messages.0: assistant messages cannot hold tool_result blocks"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]},
     "messages.0.content.0: a tool_use block needs id, input"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type: Input should be 'text', 'tool_use' or 'tool_result'"),
    ({"max_tokens": 8, "temperature": 3, "messages": [{"role": "user", "content": "hi"}]}, "temperature"),
])
def test_anthropic_bad_requests_are_400s_naming_the_field(tool_engine, tool_model, body, message):
    async def go(gw, server):
        client = _client(server, "frank")
        with pytest.raises(BadRequestError) as exc:
            await client.post("/v1/messages", body=body, cast_to=object)
        assert exc.value.status_code == 400 and message in exc.value.body["error"]["message"], exc.value.body
        assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


def test_anthropic_key_is_checked_like_a_bearer_token(tool_engine, tool_model):
    async def go(gw, server):
        key, session = gw.sessions.open("episode-1")
        r = await _client(server, key).messages.create(model="policy", max_tokens=8,
                                                       messages=[{"role": "user", "content": "6*7=?"}])
        assert r.usage.output_tokens > 0 and session.calls == 1
        with pytest.raises(AuthenticationError) as exc:
            await _client(server, "lsk-not-a-key").messages.create(model="policy", max_tokens=8,
                                                                   messages=[{"role": "user", "content": "hi"}])
        assert exc.value.status_code == 401 and json.dumps(exc.value.body).count("invalid or missing API key") == 1

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go, open_keys=False))


def test_a_black_box_agent_written_with_the_anthropic_sdk_runs_an_episode(tool_engine, tool_model):
    """examples/calc_agent_anthropic.py as a training run runs it: its own process and gateway session
    (ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY), two calls merged into one loss-masked sample, rewarded."""
    from test_agentflow_gateway import ROOT, ROW

    from loongsage.agentflow.blackbox import BlackBoxRunner
    from loongsage.tasks.base import get_task

    async def go(gw, server):
        runner = await BlackBoxRunner(server, [sys.executable, str(ROOT / "examples" / "calc_agent_anthropic.py")],
                                      timeout_s=60, concurrency=2).start()
        try:
            return await asyncio.gather(*[runner.run(ROW, get_task("calculator"), f"ep{i}") for i in range(2)])
        finally:
            await runner.stop()

    for t in asyncio.run(_with_gateway(tool_engine.url, tool_model, go, open_keys=False)):
        assert t.status == "ok" and t.answer == "The answer is 42" and t.reward == 1.0, (t.status, t.reason)
        assert t.info["calls"] == 2 and t.info["drifted_calls"] == 0 and t.info["tool_calls"] == 1
        (s,) = t.to_samples(0, 0, "calc")
        assert sum(s.loss_mask) < len(s.loss_mask) and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1


def test_responses_api_tool_call_round_trip_records_what_chat_completions_records(tool_engine, tool_model):
    async def go(gw, server):
        client = AsyncOpenAI(base_url=server.base_url, api_key="grace", max_retries=0)
        items = [{"role": "user", "content": "6*7=?"}]
        r1 = await client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL], temperature=0)
        (call,) = [o for o in r1.output if o.type == "function_call"]
        assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "6*7"})
        assert r1.status == "completed" and r1.object == "response"
        items += [o.model_dump(exclude_none=True) for o in r1.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        r2 = await client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL], temperature=0)
        assert r2.output_text == "The answer is 42" and r2.status == "completed"
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
        grace = gw.sessions.lookup("grace")
        assert [r["extends"] for r in grace.records] == [False, True] and len(grace.chains) == 1
        _same_tokens(grace.records, await _chat_completions_records(server, gw, "heidi"))
        cut = await client.responses.create(model="policy", input="6*7=?", tools=[RESPONSES_TOOL], max_output_tokens=3)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


def test_responses_api_streaming(tool_engine, tool_model):
    async def go(gw, server):
        client = AsyncOpenAI(base_url=server.base_url, api_key="ivan", max_retries=0)
        items = [{"role": "user", "content": "6*7=?"}]
        async with client.responses.stream(model="policy", input=items, tools=[RESPONSES_TOOL]) as stream:
            first = await stream.get_final_response()
        (call,) = [o for o in first.output if o.type == "function_call"]
        assert json.loads(call.arguments) == {"expression": "6*7"}
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        deltas, kinds = [], []
        async for event in await client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL],
                                                         stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.completed":
                final = event.response
        assert "".join(deltas) == "The answer is 42" and len(deltas) > 3 and final.output_text == "The answer is 42"
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert [r["extends"] for r in gw.sessions.lookup("ivan").records] == [False, True]

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


@pytest.mark.parametrize("body, message", [
    ({"model": "policy"}, "input: Field required"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id: not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type: 'reasoning' is not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0: a function_call item needs call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role: 'tool'"),
    ({"input": [{"role": "user", "content": 5}]}, "input.0: content must be a string or a list"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0: only function tools with a name"),
])
def test_responses_bad_requests_are_400s_naming_the_field(tool_engine, tool_model, body, message):
    async def go(gw, server):
        r = await with_http(server, "/v1/responses", body)
        assert r[0] == 400 and message in r[1]["error"]["message"], r

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


async def with_http(server, path: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(f"{server.base_url.removesuffix('/v1')}{path}", json=body,
                                                    headers={"Authorization": "Bearer judy"}) as r:
        return r.status, await r.json()


def test_a_langgraph_agent_runs_black_box_episodes_with_exact_tokens(tool_engine, tool_model):
    """examples/calc_agent_langgraph.py (a LangGraph StateGraph over LangChain's ChatOpenAI) as a run
    runs it (forked from a server with LangGraph imported): its calls extend one token chain (no drift),
    merged into one loss-masked sample."""
    from test_agentflow_gateway import ROOT, ROW

    from loongsage.agentflow.blackbox import BlackBoxRunner
    from loongsage.tasks.base import get_task

    async def go(gw, server):
        runner = await BlackBoxRunner(server, [sys.executable, str(ROOT / "examples" / "calc_agent_langgraph.py")],
                                      timeout_s=90, concurrency=2, preload=["langgraph", "langchain_openai"]).start()
        try:
            return await asyncio.gather(*[runner.run(ROW, get_task("calculator"), f"lg{i}") for i in range(2)])
        finally:
            await runner.stop()

    for t in asyncio.run(_with_gateway(tool_engine.url, tool_model, go, open_keys=False)):
        assert t.status == "ok" and t.answer == "The answer is 42" and t.reward == 1.0, (t.status, t.reason)
        assert t.info["calls"] == 2 and t.info["drifted_calls"] == 0 and t.info["tool_calls"] == 1
        (s,) = t.to_samples(0, 0, "calc")
        assert sum(s.loss_mask) < len(s.loss_mask) and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
