"""Embedded engine vs transformers `generate` on the same model and prompts, side by side.

64 requests whose natural output lengths differ (8..128 tokens, ending in EOS). The engine
serves them over HTTP with continuous batching; transformers generates them in padded batches,
where an EOS forced at each row's length (a logits processor) ends that row exactly as EOS
would. Only the useful tokens (each request's own length) count for both. One torch thread each.

    python benchmarks/engine_throughput.py [--requests 64] [--hf-batch 64 16]

The last line is one JSON object: engine_tok_s, hf_tok_s (best HF batch size), ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from loongsage.models.config import TinyModelSpec
from loongsage.models.factory import build_tiny_model
from loongsage.rollout.client import EngineClient
from loongsage.rollout.launcher import launch_engine


class ForceEosAt(LogitsProcessor):
    """Row i emits EOS as its lengths[i]-th new token (its natural end); padding rows compute on."""

    def __init__(self, prompt_len: int, lengths: list[int], eos: int):
        self.prompt_len, self.lengths, self.eos = prompt_len, torch.tensor(lengths), eos

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len  # tokens generated so far
        end = (self.lengths - 1) == step
        scores[end] = float("-inf")
        scores[end, self.eos] = 0.0
        scores[~end, self.eos] = float("-inf")
        return scores


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 100) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    lengths = [rng.randint(8, 128) for _ in range(n)]
    return prompts, lengths


async def run_engine(url: str, prompts, lengths) -> tuple[float, int]:
    client = EngineClient(url)
    try:
        await client.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[
            client.generate(p, {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}, return_logprob=True)
            for p, n in zip(prompts, lengths)])
        elapsed = time.perf_counter() - t0
    finally:
        await client.aclose()
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == sum(lengths)
    return elapsed, tokens


def run_hf(model_dir: str, prompts, lengths, batch: int) -> tuple[float, int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        ps, ls = prompts[i:i + batch], lengths[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ls), do_sample=True,
                                 temperature=1.0, top_k=0, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                 logits_processor=LogitsProcessorList([ForceEosAt(width, ls, eos)]))
        gen = out[:, width:]
        for row, n in zip(gen.tolist(), ls):
            assert row[n - 1] == eos
            useful += n
    return time.perf_counter() - t0, useful


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="bench-model-"),
                                     TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                                                   num_kv_heads=4, intermediate_size=2 * args.hidden)))
    prompts, lengths = workload(args.requests)
    print(f"model: Qwen3 hidden {args.hidden} x {args.layers} layers; {args.requests} requests, "
          f"{sum(lengths)} output tokens (lengths {min(lengths)}..{max(lengths)})")
    with launch_engine(model_dir, threads=1, extra_args=["--max-running", str(args.requests)]) as ep:
        e_s, e_tok = asyncio.run(run_engine(ep.url, prompts, lengths))
    engine_tok_s = e_tok / e_s
    print(f"engine (continuous batching, HTTP): {e_tok} tokens in {e_s:.2f}s = {engine_tok_s:,.0f} tok/s")
    hf = {}
    for b in args.hf_batch:
        h_s, h_tok = run_hf(model_dir, prompts, lengths, b)
        hf[b] = h_tok / h_s
        print(f"transformers generate, padded batches of {b}: {h_tok} tokens in {h_s:.2f}s = {hf[b]:,.0f} tok/s")
    best = max(hf, key=hf.get)
    ratio = engine_tok_s / hf[best]
    print(f"ratio engine / best HF (batch {best}): {ratio:.2f}x")
    print(json.dumps({"engine_tok_s": round(engine_tok_s, 1), "hf_tok_s": round(hf[best], 1),
                      "hf_batch": best, "ratio": round(ratio, 3), "requests": args.requests,
                      "output_tokens": e_tok}))


if __name__ == "__main__":
    main()
