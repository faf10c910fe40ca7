"""Aborts the system makes are not the policy's failures: a request an engine aborts (a weight
update, a pause) that nobody cancelled is continued from its tokens, each keeping the version that
sampled it; one that stays aborted marks its rollout `aborted`, and the group is masked and counted
(`samples/aborted_by_system`), never scored as the agent's failure. A cancelled request is not
continued."""
from __future__ import annotations

import asyncio
import sys

import pytest
from transformers import AutoTokenizer

from helpers import with_client as _with_client
from loongsage.agentflow.blackbox import BlackBoxRunner
from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.config import AgentConfig, AgentLimits
from loongsage.agentflow.context import AgentContext, GenerationAborted, run_episode
from loongsage.agentflow.gateway import Gateway, GatewayServer
from loongsage.agentflow.llm import PolicyLLM
from loongsage.agentflow.rollouts import make_rollout
from loongsage.agentflow.sessions import SessionStore
from loongsage.agentflow.tools import registry_for
from loongsage.buffer import SampleBuffer
from loongsage.controller.producer import RolloutProducer
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.client import EngineClient
from loongsage.rollout.protocol import GenerateOutput
from loongsage.rollout.resume import continuation_params, joined
from loongsage.rollout.router import Router
from loongsage.rollout.single_turn import RolloutSetup
from loongsage.tasks.base import TaskRow, get_task

LONG = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}
PROMPT = [11, 12, 13, 14]


def _out(ids, versions, finish, lps=None, resumed=0):
    return GenerateOutput("r", list(ids), "".join(f"<{i}>" for i in ids), {"type": finish}, lps or [-0.5] * len(ids),
                          list(versions), None, 4, 0, versions[-1] if versions else 0, resumed=resumed)


def test_continuation_params_and_joined_outputs():
    assert continuation_params({"max_new_tokens": 10, "n": 4, "min_new_tokens": 6, "temperature": 0.7}, 4) == \
        {"max_new_tokens": 6, "n": 1, "min_new_tokens": 2, "temperature": 0.7}
    assert continuation_params({"max_new_tokens": 10}, 10) is None  # budget spent
    assert continuation_params({"max_new_tokens": 0}, 0) is None  # prefill-only scoring: nothing to continue
    assert continuation_params({}, 28)["max_new_tokens"] == 100  # SGLang's default budget of 128
    first = _out([5, 6, 7], [3, 3, 3], "abort", [-1.0, -2.0, -3.0])
    rest = _out([8, 9], [4, 4], "length", [-4.0, -5.0])
    both = joined(first, rest)
    assert both.output_ids == [5, 6, 7, 8, 9] and both.output_logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert both.versions == [3, 3, 3, 4, 4] and both.finish_type == "length" and both.resumed == 1
    assert both.text == "<5><6><7><8><9>" and both.prompt_tokens == 4
    stock = GenerateOutput("r", [5, 6], "", {"type": "abort"}, None, None, None, 4, 0, 2)  # stock SGLang: no per-token versions
    assert joined(stock, rest).versions == [2, 2, 4, 4] and joined(stock, rest).output_logprobs is None


async def _once_generating(client: EngineClient, at_least: int = 8) -> None:
    """Returns once the engine runs a request that has produced some tokens."""
    start = (await client.server_info())["generated_tokens"]
    while True:
        info = await client.server_info()
        if info["running"] and info["generated_tokens"] - start >= at_least:
            return
        await asyncio.sleep(0.01)


class StockSGLangView(EngineClient):
    """The embedded engine as a stock SGLang server answers: one weight version per response, no
    per-token versions (LoongSage's protocol extension dropped)."""

    async def _post(self, path, body=None):
        out = await super()._post(path, body)
        for o in out if isinstance(out, list) else [out]:
            if isinstance(o, dict):
                o.get("meta_info", {}).pop("output_token_weight_versions", None)
        return out


def _interrupted(url: str, start, interrupt=None, retries: int = 2, client=EngineClient):
    """Runs `start(router)` and, once the engine is generating for it, `interrupt(control, router)`
    (default: abort every request, as a pause does); returns what `start` returned and the tokens
    the engine generated meanwhile."""
    async def go():
        control, router = EngineClient(url), Router([], clients=[client(url)], abort_retries=retries)
        try:
            before = (await control.server_info())["generated_tokens"]
            task = asyncio.create_task(start(router))
            await _once_generating(control)
            await (interrupt(control, router) if interrupt else control.abort(abort_all=True))
            result = await task
            return result, (await control.server_info())["generated_tokens"] - before
        finally:
            await control.aclose()
            await router.aclose()
    return asyncio.run(go())


@pytest.mark.parametrize("client", [EngineClient, StockSGLangView], ids=["per_token_versions", "stock_sglang"])
def test_a_system_abort_is_continued_and_each_token_keeps_its_version(engine, client):
    """A weight-version update that aborts running requests (SGLang's default, and pause_mode abort,
    which a run with SGLang engines always uses) mid-generation: the router continues the request on
    the new version; the caller gets all 200 tokens, the first ones of version 0 and the rest of
    version 7, with a logprob each; the engine's work is one request's. Exact also where the engine
    reports one version per response (stock SGLang): each segment ran under one version."""
    try:
        (out,), work = _interrupted(engine.url, lambda r: r.generate(PROMPT, LONG, session="s", return_logprob=True),
                                    lambda c, r: c.update_weight_version(7, abort_all_requests=True), client=client)
    finally:
        asyncio.run(_with_client(engine.url, lambda c: c.update_weight_version(0)))
    assert out.finish_type == "length" and out.resumed == 1
    assert len(out.output_ids) == len(out.output_logprobs) == len(out.versions) == 200
    cut = out.versions.index(7)
    assert 0 < cut < 200 and set(out.versions[:cut]) == {0} and set(out.versions[cut:]) == {7}
    assert work == 200  # the continuation did not regenerate the tokens it had
    async def probe():
        c = client(engine.url)
        try:
            return await c.generate(PROMPT, {"max_new_tokens": 2})
        finally:
            await c.aclose()
    short = asyncio.run(probe())
    assert (short.output_versions is None) == (client is StockSGLangView)  # the view drops them indeed


def test_a_batched_call_continues_each_aborted_prompt_alone(engine):
    """`generate_batch` (an evaluation's rows, a teacher's group in one request): outputs the system
    aborted mid-generation are continued one prompt each, as `generate` continues one, from their
    tokens (the engine's work is the two outputs' own)."""
    second = [21, 22, 23]
    try:
        outs, work = _interrupted(engine.url, lambda r: r.generate_batch([PROMPT, second], LONG, return_logprob=True),
                                  lambda c, r: c.update_weight_version(7, abort_all_requests=True))
    finally:
        asyncio.run(_with_client(engine.url, lambda c: c.update_weight_version(0)))
    assert [o.finish_type for o in outs] == ["length", "length"] and [o.resumed for o in outs] == [1, 1]
    assert [len(o.output_ids) for o in outs] == [200, 200] and [o.prompt_tokens for o in outs] == [4, 3]
    assert all(o.versions[0] == 0 and o.versions[-1] == 7 for o in outs)
    assert work == 400


def test_a_cancelled_request_is_not_continued(engine):
    async def cancel(control, router):
        assert await router.abort_where(lambda s: s == "g3-r0") == 1

    (out,), _ = _interrupted(engine.url, lambda r: r.generate(PROMPT, LONG, session="g3-r0", return_logprob=True),
                             cancel)
    assert out.finish_type == "abort" and out.resumed == 0 and 0 < len(out.output_ids) < 200


def test_a_streamed_call_is_continued_in_the_same_stream(engine):
    async def consume(router):
        return [o async for o in router.generate_stream(PROMPT, LONG, session="st", return_logprob=True)]

    chunks, _ = _interrupted(engine.url, consume)
    assert all(c.finish_type != "abort" for c in chunks)  # the abort never reaches the caller
    lengths = [len(c.output_ids) for c in chunks]
    assert lengths == sorted(lengths) and chunks[-1].finish_type == "length" and lengths[-1] == 200
    assert chunks[-1].resumed == 1 and len(chunks[-1].output_logprobs) == 200


def test_an_abort_not_continued_is_the_systems_failure_for_white_box_agents(engine, tiny_model):
    """No continuation left (abort_retries=0): the episode is `aborted`, not failed, even when the
    agent catches the error and answers anyway."""
    chat = ChatTokens(AutoTokenizer.from_pretrained(tiny_model), tiny_model)

    async def stubborn(ctx, task):
        try:
            await ctx.generate()
        except GenerationAborted:
            pass
        return "42"  # would score, were it scored

    def episode(router):
        ctx = AgentContext(PolicyLLM(router, chat, LONG), chat, registry_for(None), AgentLimits(), session="e0")
        return run_episode(stubborn, ctx, TaskRow(prompt="6*7=", answer="42"), get_task("arithmetic"))

    traj, _ = _interrupted(engine.url, episode, retries=0)
    assert traj.status == "aborted" and "aborted" in traj.reason and traj.reward == 0.0
    (s,) = traj.to_samples(0, 0, "t")
    assert s.status == "aborted"


AGENT = ("import os, json, sys, urllib.request; sys.stdin.read(); req = urllib.request.Request("
         "os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps({'messages': [{'role': 'user', "
         "'content': '6*7='}]}).encode(), {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
         "'Content-Type': 'application/json'})\n"
         "try:\n    urllib.request.urlopen(req).read()\nexcept Exception as e:\n"
         "    print(getattr(e, 'code', e), file=sys.stderr); sys.exit(4)\nprint('42')\n")


def test_an_abort_not_continued_is_the_systems_failure_for_black_box_agents(engine, tiny_model, tmp_path):
    """The gateway answers 503 to the agent's call the engine aborted, and the episode is `aborted`
    though the agent then exits with an error (which alone would be the agent's failure)."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)

    chat = ChatTokens(AutoTokenizer.from_pretrained(tiny_model), tiny_model)

    async def episode(router):
        server = await GatewayServer(Gateway(PolicyLLM(router, chat, LONG), chat, SessionStore(),
                                             policy_sampling=LONG)).start()
        runner = await BlackBoxRunner(server, [sys.executable, str(script)], timeout_s=60, concurrency=1).start()
        try:
            return await runner.run(TaskRow(prompt="6*7=", answer="42"), get_task("arithmetic"), "b0")
        finally:
            await runner.stop()
            await server.stop()

    traj, _ = _interrupted(engine.url, episode, retries=0)
    assert traj.status == "aborted" and "aborted the call" in traj.reason and traj.info["calls"] == 0


def test_the_producer_masks_and_counts_groups_the_system_aborted(engine, tiny_model):
    """A single-turn group whose requests are aborted (no continuation): not buffered, counted per
    rollout in `aborted_by_system`; with continuations the same abort costs nothing but a count."""
    rows = get_task("arithmetic").generate(4, digits=2)

    def run_group(retries: int):
        buffer = SampleBuffer(max_staleness=0, batch_groups=1)

        async def group(router):
            rollout = make_rollout(RolloutSetup(router, AutoTokenizer.from_pretrained(tiny_model), tiny_model,
                                                get_task("arithmetic"), LONG, LONG["max_new_tokens"], AgentConfig()))
            producer = RolloutProducer(rollout, PromptSampler(rows, 0), buffer, n=2, mask_failures=False)
            await producer._one(buffer.admit(), rows[0])
            return producer
        producer, _ = _interrupted(engine.url, group, retries=retries)
        return buffer.counts(), producer.take_counts(), producer.take_counts()

    counts, taken, again = run_group(0)
    assert counts["failed"] == 1 and counts["buffered"] == 0
    assert taken == {"aborted_by_system": 2, "resumed_after_abort": 0}
    assert again == {"aborted_by_system": 0, "resumed_after_abort": 0}  # counted once, per step
    counts, taken, _ = run_group(2)
    assert counts["failed"] == 0 and counts["buffered"] == 1
    assert taken == {"aborted_by_system": 0, "resumed_after_abort": 2}
