"""/generate on a real engine server: exact logprobs, continuous batching, sampling, stopping."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import torch

from helpers import call, reference_logprobs, run, with_client


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 100) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def test_logprobs_match_full_forward_for_requests_joining_mid_flight(engine, tiny_model):
    prompts = _prompts(10)

    async def go(client):
        tasks = []
        for i, ids in enumerate(prompts):
            sp = {"max_new_tokens": 4 + 5 * i, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i}
            tasks.append(asyncio.create_task(client.generate(ids, sp, logprob_start_len=0)))
            await asyncio.sleep(0.01 * (i % 3))  # later requests join a batch that is already decoding
        return await asyncio.gather(*tasks)

    outs = run(with_client(engine.url, go))
    worst = 0.0
    for ids, out in zip(prompts, outs):
        full = ids + out.output_ids
        ref = reference_logprobs(tiny_model, full)
        P = len(ids)
        assert len(out.output_logprobs) == len(out.output_ids) == out.finish_reason["length"]
        for j, tok in enumerate(out.output_ids):
            worst = max(worst, abs(ref[P - 1 + j, tok].item() - out.output_logprobs[j]))
        assert out.input_logprobs[0] is None and len(out.input_logprobs) == P
        for p in range(1, P):
            worst = max(worst, abs(ref[p - 1, ids[p]].item() - out.input_logprobs[p]))
    assert worst < 1e-4, worst


def test_short_requests_are_not_held_back_by_a_long_one(engine):
    async def go(client):
        done: dict[str, float] = {}

        async def one(name, n):
            await client.generate([11, 12, 13], {"max_new_tokens": n, "ignore_eos": True, "temperature": 0})
            done[name] = time.perf_counter()

        long = asyncio.create_task(one("long", 200))
        await asyncio.sleep(0.05)
        await asyncio.gather(*[one(f"short{i}", 3) for i in range(4)])
        await long
        return done

    done = run(with_client(engine.url, go))
    assert all(done[f"short{i}"] < done["long"] for i in range(4))


def test_greedy_is_deterministic_and_seeds_reproduce(engine):
    ids = [20, 21, 22, 23]
    g = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    a, b = call(engine.url, lambda c: c.generate_batch([ids, ids], g))
    assert a.output_ids == b.output_ids
    s = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    x = call(engine.url, lambda c: c.generate(ids, s))
    y = call(engine.url, lambda c: c.generate(ids, s))
    z = call(engine.url, lambda c: c.generate(ids, {**s, "sampling_seed": 8}))
    assert x.output_ids == y.output_ids
    assert x.output_ids != z.output_ids


def _first_tokens(url, ids, sp, n):
    body = {"input_ids": ids, "sampling_params": {**sp, "max_new_tokens": 1, "n": n, "ignore_eos": True}}
    res = call(url, lambda c: c.generate_raw(body))
    assert len(res) == n
    return Counter(r["output_ids"][0] for r in res)


def test_temperature_top_k_top_p_are_honoured(engine, tiny_model):
    ids = [30, 31, 32]
    probs = reference_logprobs(tiny_model, ids)[-1].exp()
    n = 1000
    # temperature T: the mean base-logprob of sampled tokens matches its expectation under
    # softmax(logits / T) within 4 standard errors, and differs between temperatures.
    base_lp = probs.log()
    means = {}
    for temp in (0.5, 2.0):
        target = torch.softmax(base_lp / temp, dim=-1)
        expected = (target * base_lp).sum().item()
        std = ((target * (base_lp - expected) ** 2).sum().item()) ** 0.5
        counts = _first_tokens(engine.url, ids, {"temperature": temp}, n)
        means[temp] = sum(base_lp[t].item() * c for t, c in counts.items()) / n
        assert abs(means[temp] - expected) < 4 * std / n**0.5, (temp, means[temp], expected)
    assert means[0.5] > means[2.0]
    # top_k = 3: only the three most likely tokens ever appear
    top3 = set(probs.topk(3).indices.tolist())
    assert set(_first_tokens(engine.url, ids, {"temperature": 1.0, "top_k": 3}, 300)) <= top3
    # top_p: only the smallest set of tokens whose mass reaches p
    sorted_p, order = probs.sort(descending=True)
    k = int((sorted_p.cumsum(0) < 0.1).sum()) + 1
    nucleus = set(order[:k].tolist())
    got = _first_tokens(engine.url, ids, {"temperature": 1.0, "top_p": 0.1}, 300)
    assert set(got) <= nucleus and len(nucleus) < len(probs) // 4
    # min_p = 1: only the arg-max survives
    assert set(_first_tokens(engine.url, ids, {"temperature": 1.0, "min_p": 1.0}, 50)) == {int(probs.argmax())}


def test_stop_tokens_stop_strings_and_length(engine):
    ids = [40, 41, 42]
    g = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    base = call(engine.url, lambda c: c.generate(ids, g))
    assert base.finish_reason == {"type": "length", "length": 12}
    stop_tok = base.output_ids[3]
    first = base.output_ids.index(stop_tok)
    out = call(engine.url, lambda c: c.generate(ids, {**g, "stop_token_ids": [stop_tok]}))
    assert out.finish_reason == {"type": "stop", "matched": stop_tok}
    assert out.output_ids == base.output_ids[: first + 1]
    # a stop string: generation ends once the text contains it, and the text is cut before it
    stop_str = base.text[4:6]
    out = call(engine.url, lambda c: c.generate(ids, {**g, "stop": [stop_str]}))
    assert out.finish_reason == {"type": "stop", "matched": stop_str}
    assert stop_str not in out.text and base.text.startswith(out.text)


def test_eos_ends_generation_unless_ignored(engine):
    info = call(engine.url, lambda c: c.model_info())
    eos = info["eos_token_ids"]
    # Find a prompt whose greedy continuation reaches an EOS by forcing it through stop_token_ids,
    # then check that the same id ends generation as EOS (matched id, included in output_ids).
    ids = [50, 51, 52]
    out = call(engine.url, lambda c: c.generate(ids, {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": 3}))
    if out.finish_reason["type"] == "stop":
        assert out.output_ids[-1] in eos and out.finish_reason["matched"] in eos
    ignored = call(engine.url, lambda c: c.generate(ids, {"max_new_tokens": 64, "temperature": 1.0,
                                                         "sampling_seed": 3, "ignore_eos": True}))
    assert ignored.finish_reason["type"] == "length" and len(ignored.output_ids) == 64


def test_batch_n_rid_text_and_top_logprobs(engine):
    body = {"input_ids": [[60, 61], [62, 63, 64]], "rid": ["a", "b"], "return_logprob": True,
            "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}}
    res = call(engine.url, lambda c: c.generate_raw(body))
    assert [r["meta_info"]["id"] for r in res] == ["a-0", "a-1", "b-0", "b-1"]
    for r in res:
        m = r["meta_info"]
        assert len(m["output_top_logprobs"]) == 3 and all(len(t) == 3 for t in m["output_top_logprobs"])
        for (lp, _tok, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
            assert lp <= top[0][0] + 1e-6  # the best of the top list bounds the chosen token
        assert m["weight_version"] == "0" and m["output_token_weight_versions"] == [0, 0, 0]
    text = call(engine.url, lambda c: c.generate_raw({"text": "12+34=", "sampling_params": {"max_new_tokens": 2}}))
    assert text["meta_info"]["prompt_tokens"] == 6


def test_streaming_sends_cumulative_chunks_then_done(engine):
    async def go(client):
        chunks = []
        async for chunk in client.generate_stream([70, 71], {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}):
            chunks.append(chunk)
        return chunks

    chunks = run(with_client(engine.url, go))
    assert len(chunks) == 6
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    whole = call(engine.url, lambda c: c.generate([70, 71], {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}))
    assert chunks[-1]["output_ids"] == whole.output_ids


def test_prefix_reuse_across_turns_keeps_logprobs_exact(engine, tiny_model):
    g = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    first = [80, 81, 82, 83, 84, 85, 86, 87]
    t1 = call(engine.url, lambda c: c.generate(first, g))
    second = first + t1.output_ids + [88, 89]
    t2 = call(engine.url, lambda c: c.generate(second, g))
    assert t2.cached_tokens >= len(first)
    ref = reference_logprobs(tiny_model, second + t2.output_ids)
    for j, tok in enumerate(t2.output_ids):
        assert abs(ref[len(second) - 1 + j, tok].item() - t2.output_logprobs[j]) < 1e-4


def test_bad_requests_get_400_naming_the_problem_and_the_server_goes_on(engine):
    url = engine.url + "/generate"
    cases = [
        (b"{not json", "malformed JSON"),
        (json.dumps({"input_ids": [1, 2], "bogus": 1}), "bogus: unknown field"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}), "sampling_params.temperature"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}), "frequency_penalty"),
        (json.dumps({"input_ids": [1, 100000]}), "outside the vocabulary"),
        (json.dumps({"input_ids": list(range(10, 60)) * 6}), "context length"),
        (json.dumps({"input_ids": []}), "empty"),
        (json.dumps({"sampling_params": {}}), "exactly one of input_ids or text"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}), "top_k"),
        (json.dumps({"input_ids": [1, 2], "logprob_start_len": 5}), "logprob_start_len"),
    ]
    for body, needle in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert needle in r.json()["error"]["message"], (needle, r.text)
    ok = call(engine.url, lambda c: c.generate([1, 2, 3], {"max_new_tokens": 2}))
    assert len(ok.output_ids) >= 1
    r = httpx.post(engine.url + "/pause_generation", json={"mode": "sideways"}, timeout=10)
    assert r.status_code == 400 and "mode" in r.text


def test_health_and_model_info(engine, tiny_model):
    assert httpx.get(engine.url + "/health", timeout=5).status_code == 200
    info = httpx.get(engine.url + "/model_info", timeout=5).json()
    assert info["model_path"] == tiny_model and info["architectures"] == ["Qwen3ForCausalLM"]
    assert info["is_generation"] is True and info["context_length"] == 256


def test_engine_freezes_its_long_lived_heap(engine):
    """The model, tokenizer and server are out of the cyclic GC's full passes (heap.py): without the
    freeze each full collection walked them all, ~200 ms with the GIL held, stalling generation."""
    info = call(engine.url, lambda c: c.server_info())
    assert info["gc_frozen_objects"] > 100_000


def test_a_client_that_goes_away_stops_the_engine_work(long_model):
    """A non-streaming request whose client disconnects is aborted on the engine: generated tokens
    stop growing long before the request could have finished on its own (4000 tokens, ~10 s here)."""
    from loongsage.rollout.launcher import launch_engine

    with launch_engine(long_model, extra_args=["--max-running", "4", "--context-length", "4096"]) as ep:
        def info():
            return httpx.get(ep.url + "/get_server_info", timeout=5).json()

        body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        try:
            httpx.post(ep.url + "/generate", json=body, timeout=1.0)
        except httpx.TimeoutException:
            pass  # the client gives up and closes its connection
        started = info()["generated_tokens"]
        assert 0 < started < 4000
        deadline = time.time() + 3  # far sooner than 4000 tokens take
        while info()["running"] and time.time() < deadline:
            time.sleep(0.1)
        stopped = info()
        time.sleep(1.0)
        assert stopped["running"] == 0 and info()["generated_tokens"] == stopped["generated_tokens"] < 4000
