"""Small helpers shared by tests: a synchronous view of the async client, HF reference logprobs, and
a seeded policy batch for trainer tests."""
from __future__ import annotations

import asyncio
import functools

import torch
from transformers import AutoModelForCausalLM

from loongsage.rollout.client import EngineClient
from loongsage.sample import Sample
from loongsage.trainer.batch import TrainBatch, collate


def run(coro):
    return asyncio.run(coro)


async def with_client(url: str, fn):
    client = EngineClient(url)
    try:
        return await fn(client)
    finally:
        await client.aclose()


def call(url: str, fn):
    """call(url, lambda c: c.generate(...)) from synchronous test code."""
    return run(with_client(url, fn))


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """Full-sequence logprobs from transformers: row t scores token t+1."""
    model = hf_model(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def policy_batch(seed: int = 0, n: int = 6) -> TrainBatch:
    """n samples of growing prompt/response lengths, behaviour logprobs near log(1/100), advantages -1/0/1."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = torch.randint(10, 100, (3 + i,), generator=g).tolist()
        r = torch.randint(10, 100, (2 + 2 * i,), generator=g).tolist()
        samples.append(Sample(p, r, [1] * len(r), torch.randn(len(r), generator=g).mul(0.1).sub(4.6).tolist(),
                              [0] * len(r), advantage=float(i % 3 - 1)))
    return collate(samples, 0)
