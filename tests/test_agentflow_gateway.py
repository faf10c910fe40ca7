"""The gateway with the official `openai` client against a real engine (a tiny model trained to make
one calculator call), white-box episodes, and black-box agent programs (the example written with the
openai SDK, plus ones that crash, hang, print garbage, flood their output or never call the model)."""
from __future__ import annotations

import asyncio
import glob
import json
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI, AuthenticationError
from transformers import AutoTokenizer

from helpers import MALFORMED_CALL, processes_mentioning, with_client
from loongsage.agentflow.agents import tool_loop
from loongsage.agentflow.blackbox import BlackBoxRunner
from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.config import AgentLimits
from loongsage.agentflow.context import AgentContext, run_episode
from loongsage.agentflow.gateway import Gateway, GatewayServer
from loongsage.agentflow.llm import PolicyLLM
from loongsage.agentflow.sessions import CallRecorder, SessionStore
from loongsage.agentflow.tools import registry_for
from loongsage.rollout.router import Router
from loongsage.tasks.base import TaskRow, get_task
from loongsage.tasks.calculator import CALCULATOR_TOOL

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0.0, "max_new_tokens": 80}
ROW = TaskRow(prompt=[{"role": "user", "content": "6*7=?"}], answer="42", tag="calc", tools=[CALCULATOR_TOOL],
              meta={"expression": "6*7"})


async def _with_gateway(url: str, model: str, fn, open_keys=True, record_dir=None, sampling=GREEDY, **kw):
    chat = ChatTokens(AutoTokenizer.from_pretrained(model), model)
    router = Router([url])
    gw = Gateway(PolicyLLM(router, chat, sampling), chat, SessionStore(open_keys=open_keys),
                 recorder=CallRecorder(record_dir) if record_dir else None, **kw)
    server = await GatewayServer(gw).start()
    try:
        return await fn(gw, server)
    finally:
        await server.stop()
        await router.aclose()


def test_openai_client_tool_call_round_trip(tool_engine, tool_model, tmp_path):
    async def go(gw, server):
        client = AsyncOpenAI(base_url=server.base_url, api_key="alice", max_retries=0)
        msgs = [{"role": "user", "content": "6*7=?"}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0)
        (call,) = r1.choices[0].message.tool_calls
        assert r1.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "6*7"}
        msgs += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0)
        assert r2.choices[0].message.content == "The answer is 42" and r2.choices[0].finish_reason == "stop"
        assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        # a malformed tool call comes back as plain content, counted, never as a half-parsed call
        other = AsyncOpenAI(base_url=server.base_url, api_key="mallory", max_retries=0)
        bad = await other.chat.completions.create(model="policy", messages=[{"role": "user", "content": "oops=?"}],
                                                  tools=[CALCULATOR_TOOL], temperature=0)
        assert bad.choices[0].message.tool_calls is None and bad.choices[0].message.content == MALFORMED_CALL
        assert bad.choices[0].finish_reason == "stop"
        mallory = gw.sessions.lookup("mallory")
        assert mallory.malformed_tool_calls == 1 and mallory.records[-1]["malformed_tool_calls"] == 1
        # the recorded ids are the engine's own output for exactly the recorded prompt
        session = gw.sessions.lookup("alice")
        assert [r["extends"] for r in session.records] == [False, True] and session.drift_rate == 0.0
        for rec in session.records:
            direct = await with_client(tool_engine.url, lambda c, ids=rec["prompt_ids"]: c.generate(ids, GREEDY))
            assert rec["output_ids"] == direct.output_ids
            assert rec["output_logprobs"] == pytest.approx(direct.output_logprobs, abs=1e-5)
        (chain,) = session.chains
        assert chain.ids == session.records[1]["prompt_ids"] + session.records[1]["output_ids"]
        return session.records

    records = asyncio.run(_with_gateway(tool_engine.url, tool_model, go, record_dir=tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [x["session"] for x in lines] == ["alice", "alice", "mallory"]
    assert lines[1]["output_ids"] == records[1]["output_ids"]
    assert {"session", "prompt_ids", "output_ids", "output_logprobs", "weight_version"} <= set(lines[0])


def test_openai_client_streaming(tool_engine, tool_model):
    async def go(gw, server):
        client = AsyncOpenAI(base_url=server.base_url, api_key="bob", max_retries=0)
        msgs = [{"role": "user", "content": "6*7=?"}]
        stream = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL],
                                                      stream=True, stream_options={"include_usage": True})
        calls, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and usage.completion_tokens > 10
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("calculator", {"expression": "6*7"})]
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": "calculator", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]
        pieces = []
        async for chunk in await client.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR_TOOL],
                                                                stream=True):
            pieces += [ch.delta.content for ch in chunk.choices if ch.delta.content]
        assert "".join(pieces) == "The answer is 42" and len(pieces) > 3  # streamed while it was generated
        bad = []
        async for chunk in await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "oops=?"}], tools=[CALCULATOR_TOOL], stream=True):
            bad += [(ch.delta.content, ch.delta.tool_calls) for ch in chunk.choices if ch.delta.content or ch.delta.tool_calls]
        assert "".join(c for c, _ in bad) == MALFORMED_CALL and not any(t for _, t in bad)
        assert [r["extends"] for r in gw.sessions.lookup("bob").records] == [False, True, False]  # + the oops call

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go))


def test_gateway_auth_isolation_and_bad_input(tool_engine, tool_model):
    async def go(gw, server):
        key_a, a = gw.sessions.open("a")
        key_b, b = gw.sessions.open("b")
        with pytest.raises(AuthenticationError):
            await AsyncOpenAI(base_url=server.base_url, api_key="made-up", max_retries=0).models.list()
        client_a = AsyncOpenAI(base_url=server.base_url, api_key=key_a, max_retries=0)
        await client_a.chat.completions.create(model="p", messages=[{"role": "user", "content": "6*7=?"}])
        base = server.base_url
        async with aiohttp.ClientSession() as http:
            async def post(body, key=key_b, raw=None):
                async with http.post(f"{base}/chat/completions", data=raw if raw is not None else json.dumps(body),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            async with http.get(f"{base}/loongsage/session", headers={"Authorization": f"Bearer {key_b}"}) as r:
                own = await r.json()
            assert own["session"] == "b" and own["records"] == [] and len(a.records) == 1
            ok_msgs = [{"role": "user", "content": "hi"}]
            cases = [(None, b"{not json"), ({"messages": []}, None), ({"messages": [{"role": "wizard", "content": "x"}]}, None),
                     ({"messages": ok_msgs, "n": 2}, None), ({"messages": ok_msgs, "temperature": -1}, None),
                     ({"messages": ok_msgs, "tools": [{"type": "function", "function": {}}]}, None),
                     ({"messages": "hello"}, None), (None, b"[1, 2]"), (None, b"x" * (2 << 20))]
            for body, raw in cases:
                status, err = await post(body, raw=raw)
                assert 400 <= status < 500, (body, raw and raw[:20], status, err)
                assert err["error"]["message"]
            assert (await post({"messages": ok_msgs}, key="nope"))[0] == 401
            async with http.post(f"{base}/loongsage/reward", json={"reward": "high"},
                                 headers={"Authorization": f"Bearer {key_b}"}) as r:
                assert r.status == 400
            async with http.post(f"{base}/loongsage/reward", json={"reward": 0.5},
                                 headers={"Authorization": f"Bearer {key_b}"}) as r:
                assert r.status == 200 and b.reward == 0.5 and a.reward is None
        assert b.records == [] and b.calls == 0  # nothing of b's was touched by the bad requests

    asyncio.run(_with_gateway(tool_engine.url, tool_model, go, open_keys=False))


def test_whitebox_episode(tool_engine, tool_model):
    async def go():
        chat = ChatTokens(AutoTokenizer.from_pretrained(tool_model), tool_model)
        router = Router([tool_engine.url])
        try:
            ctx = AgentContext(PolicyLLM(router, chat, GREEDY), chat, registry_for(ROW.tools), AgentLimits())
            traj = await run_episode(tool_loop, ctx, ROW, get_task("calculator"))
            limited = AgentContext(PolicyLLM(router, chat, GREEDY), chat, registry_for(ROW.tools), AgentLimits(max_turns=1))
            cut = await run_episode(tool_loop, limited, ROW, get_task("calculator"))
            async def broken(ctx, task):
                await ctx.generate()
                raise KeyError("oops")
            crashed = await run_episode(broken, AgentContext(PolicyLLM(router, chat, GREEDY), chat, registry_for(ROW.tools),
                                                             AgentLimits()), ROW, get_task("calculator"))
            return traj, cut, crashed, chat
        finally:
            await router.aclose()

    traj, cut, crashed, chat = asyncio.run(go())
    assert traj.status == "ok" and traj.answer == "The answer is 42" and traj.reward == 1.0
    assert traj.info["turns"] == 2 and traj.info["tool_calls"] == 1
    (chain,) = traj.chains
    full = ROW.prompt + chain.messages[1:]
    assert chain.ids == chat.prompt_ids(full, ROW.tools)[:len(chain.ids)]  # held ids == the template's, exactly
    (s,) = traj.to_samples(0, 0, "calc")
    inserted = chat.tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m], skip_special_tokens=False)
    assert inserted == "\n<|im_start|>tool\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert cut.status == "truncated" and "max_turns=1" in cut.reason and cut.reward == 0.0
    assert crashed.status == "failed" and "KeyError" in crashed.reason and crashed.chains[0].model_tokens > 0


def test_a_white_box_rollout_offers_configured_tools_to_rows_that_declare_none(tool_engine, tool_model):
    """agent.offer_tools: a math-style row without tools gets the calculator in its prompt and the
    tool runs (without the offer the call meets no implementation)."""
    import dataclasses

    from loongsage.agentflow.config import AgentConfig
    from loongsage.agentflow.rollouts import make_rollout
    from loongsage.rollout.single_turn import RolloutSetup

    bare = dataclasses.replace(ROW, tools=None)

    async def episode(offer):
        router = Router([tool_engine.url])
        tok = AutoTokenizer.from_pretrained(tool_model)
        rollout = make_rollout(RolloutSetup(router, tok, tool_model, get_task("calculator"), GREEDY, 64,
                                            AgentConfig(kind="whitebox", offer_tools=offer)))
        try:
            await rollout.start()
            return await rollout.episode(bare, "offer", GREEDY), ChatTokens(tok, tool_model)
        finally:
            await rollout.stop()
            await router.aclose()

    (offered, chat), (plain, _) = asyncio.run(episode(["calculator"])), asyncio.run(episode([]))
    assert offered.chains[0].ids[:len(chat.prompt_ids(ROW.prompt, ROW.tools))] == chat.prompt_ids(ROW.prompt, ROW.tools)
    assert offered.reward == 1.0 and offered.chains[0].messages[2]["content"] == "42"
    assert plain.chains[0].ids[:len(chat.prompt_ids(ROW.prompt, []))] == chat.prompt_ids(ROW.prompt, [])
    assert plain.reward == 0.0


AGENTS = {
    "crash": "import sys; sys.stdin.read(); sys.exit(3)",
    "hang": "import time; time.sleep(60)",
    "silent": "print('42')",
    "garbage": ("import os, json, sys, urllib.request; sys.stdin.read(); req = urllib.request.Request("
                "os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps({'messages': [{'role': 'user', "
                "'content': 'x'}]}).encode(), {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
                "'Content-Type': 'application/json'}); urllib.request.urlopen(req).read(); "
                "sys.stdout.buffer.write(b'\\xff\\xfe\\x00 garbage')"),
    "flood": "import sys; sys.stdin.read()\nwhile True: sys.stdout.write('x' * 65536)",
}


@pytest.mark.parametrize("preload", [False, True], ids=["subprocess", "forkserver"])
def test_blackbox_agents(tool_engine, tool_model, tmp_path, preload):
    spec = get_task("calculator")
    scripts = {"example": str(ROOT / "examples" / "calc_agent_openai.py")}
    for name, code in AGENTS.items():
        (tmp_path / f"{name}.py").write_text(code)
        scripts[name] = str(tmp_path / f"{name}.py")

    async def go(gw, server):
        runners = []

        async def runner(name, timeout_s=30.0):
            r = await BlackBoxRunner(server, [sys.executable, scripts[name]], timeout_s=timeout_s, concurrency=4,
                                     preload=["openai"] if preload else None).start()
            runners.append(r)
            return r

        try:
            example = await runner("example")
            good = await asyncio.gather(*[example.run(ROW, spec, f"ep{i}") for i in range(2)])
            crash, hang, silent, garbage, flood = await asyncio.gather(
                (await runner("crash")).run(ROW, spec, "crash"), (await runner("hang", timeout_s=2)).run(ROW, spec, "hang"),
                (await runner("silent")).run(ROW, spec, "silent"), (await runner("garbage")).run(ROW, spec, "garbage"),
                (await runner("flood")).run(ROW, spec, "flood"))
            assert len(gw.sessions) == 0  # every episode's gateway session closed
            return good, crash, hang, silent, garbage, flood
        finally:
            for r in runners:
                await r.stop()

    agent_dirs = set(Path(tempfile.gettempdir()).glob("loongsage-agent-*"))
    good, crash, hang, silent, garbage, flood = asyncio.run(_with_gateway(tool_engine.url, tool_model, go,
                                                                          open_keys=False))
    for t in good:
        assert t.status == "ok" and t.answer == "The answer is 42" and t.reward == 1.0
        assert t.info["calls"] == 2 and t.info["drifted_calls"] == 0 and t.info["tool_calls"] == 1
        (s,) = t.to_samples(0, 0, "calc")  # two calls merged into one loss-masked sample
        assert sum(s.loss_mask) < len(s.loss_mask) and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
    assert crash.status == "failed" and "exited with code 3" in crash.reason
    assert hang.status == "failed" and hang.reason.startswith("timeout")
    assert silent.status == "failed" and silent.reason == "agent made no model call"
    assert garbage.status == "failed" and "unreadable output" in garbage.reason and garbage.info["calls"] == 1
    assert flood.status == "failed" and "flooded its output: more than 1048576 bytes" in flood.reason
    assert not processes_mentioning(str(tmp_path))  # no agent outlives its episode
    assert set(Path(tempfile.gettempdir()).glob("loongsage-agent-*")) <= agent_dirs  # nor its output files


def test_loongsage_serve(tool_model, tmp_path):
    """`loongsage serve`: engine + gateway as a command; the official client calls it with any key as
    the session name and every call lands in RECORD_DIR/calls.jsonl."""
    import subprocess

    from openai import OpenAI

    from loongsage.rollout.launcher import free_port

    port = free_port()
    scratch = set(glob.glob(f"{tempfile.gettempdir()}/loongsage-engine-*"))
    proc = subprocess.Popen([sys.executable, "-m", "loongsage.cli", "serve", "--model", tool_model, "--port", str(port),
                             "--record-dir", str(tmp_path), "--context-length", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="carol", max_retries=0)
        for _ in range(600):
            try:
                client.models.list()
                break
            except Exception:
                if proc.poll() is not None:
                    raise AssertionError(proc.stdout.read()) from None
                import time
                time.sleep(0.1)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "6*7=?"}],
                                           tools=[CALCULATOR_TOOL], temperature=0)
        assert r.choices[0].message.tool_calls[0].function.name == "calculator"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 143  # stopped through Python: its engine was stopped and its folder removed
    assert set(glob.glob(f"{tempfile.gettempdir()}/loongsage-engine-*")) == scratch
    (line,) = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert line["session"] == "carol" and line["weight_version"] == 0
    assert len(line["output_ids"]) == len(line["output_logprobs"]) == r.usage.completion_tokens


def test_an_agent_that_goes_away_mid_call_stops_the_engine_work(long_model):
    """A black-box agent killed during a model call (its connection closes): the gateway cancels the
    call and the engine stops generating, long before the 4000 tokens it asked for (~10 s)."""
    import time

    import httpx

    from loongsage.rollout.launcher import launch_engine

    with launch_engine(long_model, extra_args=["--max-running", "4", "--context-length", "4096"]) as ep:
        def generated() -> tuple[int, int]:
            info = httpx.get(ep.url + "/get_server_info", timeout=5).json()
            return info["running"], info["generated_tokens"]

        async def go(gw, server):
            body = {"model": "policy", "messages": [{"role": "user", "content": "count"}]}
            async with httpx.AsyncClient() as client:
                with pytest.raises(httpx.TimeoutException):  # the agent gives up (or is killed)
                    await client.post(server.base_url + "/chat/completions", json=body, timeout=1.5,
                                      headers={"Authorization": "Bearer bob"})
            deadline = time.time() + 3
            while generated()[0] and time.time() < deadline:
                await asyncio.sleep(0.1)
            stopped = generated()
            await asyncio.sleep(1.0)
            return stopped, generated()
        stopped, later = asyncio.run(_with_gateway(ep.url, long_model, go, sampling={
            "temperature": 1.0, "max_new_tokens": 4000, "ignore_eos": True}))
    assert stopped[0] == 0 and later[1] == stopped[1] < 4000, (stopped, later)
