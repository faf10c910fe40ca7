"""The rollout producer against real engines: groups that can no longer make the staleness window
at a weight update are aborted on the engine that holds them (not finished, not on other engines),
counted as cancelled, never buffered."""
from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from helpers import run
from loongsage.agentflow.config import AgentConfig
from loongsage.agentflow.rollouts import make_rollout
from loongsage.buffer import SampleBuffer
from loongsage.controller.producer import RolloutProducer
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.client import EngineClient
from loongsage.rollout.router import Router
from loongsage.rollout.single_turn import RolloutSetup
from loongsage.tasks.base import TaskRow, get_task


class CountingClient(EngineClient):
    """An engine client that remembers the aborts it sent."""

    def __init__(self, url: str):
        super().__init__(url)
        self.aborted: list = []

    async def abort(self, rid=None, abort_all=False):
        self.aborted.append(rid)
        return await super().abort(rid, abort_all)


def _producer(router, tiny_model, rows, agent: AgentConfig, sampling, buffer, mask_failures=True):
    spec = get_task("arithmetic")
    rollout = make_rollout(RolloutSetup(router, AutoTokenizer.from_pretrained(tiny_model), tiny_model, spec, sampling,
                                        sampling["max_new_tokens"], agent))
    return RolloutProducer(rollout, PromptSampler(rows, 0), buffer, n=2, mask_failures=mask_failures)


async def _until_running(clients, counts):
    while [(await c.server_info())["running"] for c in clients] != counts:
        await asyncio.sleep(0.02)


def test_groups_too_old_at_an_update_are_aborted_on_their_engine_only(engine, engine_b, tiny_model):
    """Two groups on two engines (least outstanding requests puts one on each): cancelling them sends
    each abort to the engine that holds the group, and generation stops there at once."""
    rows = get_task("arithmetic").generate(8, digits=2)
    buffer = SampleBuffer(max_staleness=0, batch_groups=2)
    long = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0}

    async def go():
        clients = [CountingClient(engine.url), CountingClient(engine_b.url)]
        router = Router([], clients=clients)
        producer = _producer(router, tiny_model, rows, AgentConfig(), long, buffer)
        before = [await c.server_info() for c in clients]
        admitting = asyncio.create_task(producer.run())
        await _until_running(clients, [2, 2])  # one group (2 samples) on each engine
        admitting.cancel()  # no further admissions; the two group tasks keep running
        held = {session: idx for session, idx in router.inflight.values()}
        buffer.advance()  # the trainer moved on: version-0 groups are out of a k = 0 window
        cancelled = await producer.cancel_too_old()
        await asyncio.gather(*list(producer._tasks.values()), return_exceptions=True)
        after = [await c.server_info() for c in clients]
        await router.aclose()
        generated = sum(a["generated_tokens"] - b["generated_tokens"] for a, b in zip(after, before))
        return producer, cancelled, generated, [a["running"] for a in after], held, [c.aborted for c in clients]

    producer, cancelled, generated, running, held, aborted = run(go())
    assert cancelled == 2 and buffer.cancelled == 2 and buffer.running == 0 and buffer.buffered() == 0
    assert not producer._tasks and running == [0, 0]
    assert generated < 4 * 240  # aborted mid-flight, not generated to the end
    assert sorted(held) == ["g0", "g1"] and sorted(held.values()) == [0, 1]
    for session, idx in held.items():  # each abort went to the engine holding that group, and only there
        assert aborted[idx] == [[session]] and aborted[1 - idx] != [[session]]


def test_agent_groups_too_old_at_an_update_are_cancelled_and_counted(engine, tiny_model):
    """White-box agent episodes in flight when their group falls out of the window: their requests
    are aborted on the engine, the episode tasks cancelled, counted, never buffered."""
    rows = [TaskRow(prompt=[{"role": "user", "content": f"{i}+1=?"}], answer=str(i + 1)) for i in range(8)]
    buffer = SampleBuffer(max_staleness=0, batch_groups=2)
    long = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}

    async def go():
        client = EngineClient(engine.url)
        router = Router([engine.url])
        producer = _producer(router, tiny_model, rows, AgentConfig(kind="whitebox"), long, buffer, mask_failures=False)
        admitting = asyncio.create_task(producer.run())
        await _until_running([client], [4])
        admitting.cancel()
        buffer.advance()
        cancelled = await producer.cancel_too_old()
        await asyncio.gather(*list(producer._tasks.values()), return_exceptions=True)
        for _ in range(100):
            if (await client.server_info())["running"] == 0:
                break
            await asyncio.sleep(0.05)
        running = (await client.server_info())["running"]
        await router.aclose()
        await client.aclose()
        return producer, cancelled, running

    producer, cancelled, running = run(go())
    assert cancelled == 2 and buffer.cancelled == 2 and buffer.running == 0
    assert buffer.buffered() == 0 and not producer._tasks
    assert running == 0
