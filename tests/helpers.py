"""Small helpers shared by tests: a synchronous view of the async client, and HF reference logprobs."""
from __future__ import annotations

import asyncio
import functools

import torch
from transformers import AutoModelForCausalLM

from loongsage.rollout.client import EngineClient


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
