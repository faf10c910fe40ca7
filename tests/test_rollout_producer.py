"""The rollout producer against a real engine: groups that can no longer make the staleness window
at a weight update are aborted on the engine (not finished), counted as cancelled, never buffered."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from transformers import AutoTokenizer

from helpers import run
from loongsage.agentflow.config import AgentConfig
from loongsage.agentflow.runner import EpisodeRunner
from loongsage.buffer import StalenessWindow
from loongsage.controller.producer import RolloutProducer
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.router import Router
from loongsage.tasks.base import get_task


def test_groups_too_old_at_an_update_are_aborted_on_the_engine_and_counted(engine, tiny_model):
    spec = get_task("arithmetic")
    rows = spec.generate(8, digits=2)
    window = StalenessWindow(max_staleness=0, batch_groups=2)
    long = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0}

    async def go():
        router = Router([engine.url])
        client = router.clients[0]
        runner = EpisodeRunner(AgentConfig(), router, AutoTokenizer.from_pretrained(tiny_model), tiny_model, spec,
                               long, long["max_new_tokens"])
        producer = RolloutProducer(SimpleNamespace(router=router), runner, PromptSampler(rows, 0), window, n=2)
        before = await client.server_info()
        admitting = asyncio.create_task(producer.run())
        while (await client.server_info())["running"] < 4:  # both groups (2 x 2 samples) generating
            await asyncio.sleep(0.02)
        admitting.cancel()  # no further admissions; the two group tasks keep running
        window.advance()  # the trainer moved on: version-0 groups are out of a k = 0 window
        cancelled = await producer.cancel_too_old()
        await asyncio.gather(*list(producer._tasks.values()))
        after = await client.server_info()
        await router.aclose()
        return producer, cancelled, after["generated_tokens"] - before["generated_tokens"], after["running"]

    producer, cancelled, generated, running = run(go())
    assert cancelled == 2 and window.cancelled == 2 and window.running == 0
    assert producer.buffer.empty() and not producer.inflight
    assert running == 0
    assert generated < 4 * 240  # aborted mid-flight, not generated to the end


def test_agent_groups_too_old_at_an_update_are_cancelled_and_counted(engine, tiny_model):
    """White-box agent episodes in flight when their group falls out of the window: the episode tasks
    are cancelled (their engine requests dropped with the connection), counted, never buffered."""
    from loongsage.tasks.base import TaskRow

    spec = get_task("arithmetic")
    rows = [TaskRow(prompt=[{"role": "user", "content": f"{i}+1=?"}], answer=str(i + 1)) for i in range(8)]
    window = StalenessWindow(max_staleness=0, batch_groups=2)
    long = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}

    async def go():
        router = Router([engine.url])
        client = router.clients[0]
        runner = EpisodeRunner(AgentConfig(kind="whitebox"), router, AutoTokenizer.from_pretrained(tiny_model),
                               tiny_model, spec, long, long["max_new_tokens"])
        producer = RolloutProducer(SimpleNamespace(router=router), runner, PromptSampler(rows, 0), window, n=2,
                                   mask_failures=False)
        admitting = asyncio.create_task(producer.run())
        while (await client.server_info())["running"] < 4:
            await asyncio.sleep(0.02)
        admitting.cancel()
        window.advance()
        cancelled = await producer.cancel_too_old()
        await asyncio.gather(*list(producer._tasks.values()), return_exceptions=True)
        for _ in range(100):  # the engine drops the requests whose connections went away
            if (await client.server_info())["running"] == 0:
                break
            await asyncio.sleep(0.05)
        running = (await client.server_info())["running"]
        await router.aclose()
        return producer, cancelled, running

    producer, cancelled, running = run(go())
    assert cancelled == 2 and window.cancelled == 2 and window.running == 0
    assert producer.buffer.empty() and not producer.inflight and not producer._tasks
    assert running == 0
