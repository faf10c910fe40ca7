"""Embedded engine vs transformers `generate` on the same model and prompts, side by side, on two
workloads, one torch thread each:

- short: the arith recipe's wave (its model; 32 prompts x n = 8 samples of 3..5 tokens, a new set
  of prompts every wave). The engine gets one /generate per group (`n`, as the rollout sends it);
  transformers one padded batch of all 256 rows (`num_return_sequences`-style repeated prompts).
  Here the cost is per request and per step, not per token.
- mixed: 64 requests whose natural output lengths differ (8..128 tokens); transformers generates
  them in padded batches (the best of --hf-batch), the engine batches continuously.

In both, transformers ends each row at its own length with an EOS forced by a logits processor,
exactly as a natural EOS would, and only the useful tokens count for both.

    python benchmarks/engine_throughput.py [--waves 8] [--requests 64] [--hf-batch 64 16]

The last line is one JSON object with short_ratio and mixed_ratio (engine tokens/s over HF's).
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


def short_waves(waves: int, groups: int = 32, seed: int = 1):
    """Per wave: `groups` prompts like the arith task's (8..12 tokens) and each group's length."""
    rng = random.Random(seed)
    return [([[rng.randrange(10, 100) for _ in range(rng.randint(8, 12))] for _ in range(groups)],
             [rng.randint(3, 5) for _ in range(groups)]) for _ in range(waves)]


async def run_engine_short(url: str, waves, n: int) -> tuple[float, int]:
    client = EngineClient(url)
    try:
        await client.generate_batch([waves[0][0][0]] * 2, {"max_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        tokens = 0
        for prompts, lengths in waves:  # one wave at a time, as a synchronous rollout step
            outs = await asyncio.gather(*[
                client.generate_raw({"input_ids": p, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": k, "ignore_eos": True, "temperature": 1.0, "n": n}})
                for p, k in zip(prompts, lengths)])
            tokens += sum(len(o["output_ids"]) for group in outs for o in group)
        elapsed = time.perf_counter() - t0
    finally:
        await client.aclose()
    assert tokens == n * sum(sum(ls) for _, ls in waves)
    return elapsed, tokens


def run_hf_short(model_dir: str, waves, n: int) -> tuple[float, int]:
    model, tok = _hf(model_dir)
    t0 = time.perf_counter()
    useful = 0
    for prompts, lengths in waves:
        rows = [p for p in prompts for _ in range(n)]
        useful += _hf_batch(model, tok, rows, [k for k in lengths for _ in range(n)])
    return time.perf_counter() - t0, useful


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


def _hf(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generate(torch.tensor([[11, 12]]), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    return model, tok


def _hf_batch(model, tok, ps: list[list[int]], ls: list[int]) -> int:
    """One padded `generate` call, each row ended by a forced EOS at its length; its useful tokens."""
    eos = tok.eos_token_id
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
    return sum(ls)


def run_hf(model_dir: str, prompts, lengths, batch: int) -> tuple[float, int]:
    model, tok = _hf(model_dir)
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        useful += _hf_batch(model, tok, prompts[i:i + batch], lengths[i:i + batch])
    return time.perf_counter() - t0, useful


def bench_short(waves: int, n: int) -> float:
    """The arith recipe's model and wave; returns engine / HF tokens per second."""
    spec = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512,
                         vocab_size=128, max_position_embeddings=64)
    work = short_waves(waves)
    print(f"short: arith model (Qwen3 hidden 128 x 2 layers); {waves} waves of 32 prompts x n={n}, 3..5 tokens")
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_dir = str(build_tiny_model(tmp, spec))
        with launch_engine(model_dir, threads=1, extra_args=["--max-running", str(32 * n), "--context-length", "64"]) as ep:
            e_s, e_tok = asyncio.run(run_engine_short(ep.url, work, n))
        h_s, h_tok = run_hf_short(model_dir, work, n)
    print(f"  engine (HTTP, one /generate per group): {e_tok} tokens in {e_s:.2f}s = {e_tok / e_s:,.0f} tok/s "
          f"({e_s / waves * 1000:.0f} ms a wave)")
    print(f"  transformers generate, one batch of {32 * n}: {h_tok} tokens in {h_s:.2f}s = {h_tok / h_s:,.0f} tok/s "
          f"({h_s / waves * 1000:.0f} ms a wave)")
    ratio = (e_tok / e_s) / (h_tok / h_s)
    print(f"  ratio engine / HF: {ratio:.2f}x")
    return ratio


def bench_mixed(args) -> tuple[float, int, dict[int, float]]:
    """Uneven lengths on a wider model; returns the engine's tokens per second, its output tokens,
    and HF's tokens per second for each padded batch size."""
    prompts, lengths = workload(args.requests)
    print(f"mixed: Qwen3 hidden {args.hidden} x {args.layers} layers; {args.requests} requests, "
          f"{sum(lengths)} output tokens (lengths {min(lengths)}..{max(lengths)})")
    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=4,
                         intermediate_size=2 * args.hidden)
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_dir = str(build_tiny_model(tmp, spec))
        with launch_engine(model_dir, threads=1, extra_args=["--max-running", str(args.requests)]) as ep:
            e_s, e_tok = asyncio.run(run_engine(ep.url, prompts, lengths))
        engine_tok_s = e_tok / e_s
        print(f"  engine (continuous batching, HTTP): {e_tok} tokens in {e_s:.2f}s = {engine_tok_s:,.0f} tok/s")
        hf = {}
        for b in args.hf_batch:
            h_s, h_tok = run_hf(model_dir, prompts, lengths, b)
            hf[b] = h_tok / h_s
            print(f"  transformers generate, padded batches of {b}: {h_tok} tokens in {h_s:.2f}s = {hf[b]:,.0f} tok/s")
    return engine_tok_s, e_tok, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=8, help="short workload: waves of 32 groups")
    ap.add_argument("--n", type=int, default=8, help="short workload: samples per prompt")
    ap.add_argument("--requests", type=int, default=64, help="mixed workload: requests")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--hidden", type=int, default=256, help="mixed workload: model width")
    ap.add_argument("--layers", type=int, default=4, help="mixed workload: model depth")
    args = ap.parse_args()
    torch.set_num_threads(1)
    short_ratio = bench_short(args.waves, args.n)
    engine_tok_s, e_tok, hf = bench_mixed(args)
    best = max(hf, key=hf.get)
    mixed_ratio = engine_tok_s / hf[best]
    print(f"  ratio engine / best HF (batch {best}): {mixed_ratio:.2f}x")
    print(json.dumps({"short_ratio": round(short_ratio, 3), "mixed_ratio": round(mixed_ratio, 3),
                      "mixed_engine_tok_s": round(engine_tok_s, 1), "mixed_hf_tok_s": round(hf[best], 1),
                      "mixed_hf_batch": best, "requests": args.requests, "output_tokens": e_tok}))


if __name__ == "__main__":
    main()
