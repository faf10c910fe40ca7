"""Weight updates, pause/continue, abort and memory release on real engine servers."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from helpers import call, run, with_client
from loongsage.cluster.network import Rendezvous
from loongsage.models.config import TinyModelSpec
from loongsage.models.factory import build_tiny_model
from loongsage.rollout.client import EngineError
from loongsage.rollout.launcher import launch_engine
from loongsage.transfer.broadcast import broadcast, new_weight_group, wire_bucket
from loongsage.transfer.dtypes import dtype_name
from loongsage.transfer.tensor_handles import serialize_flattened_bucket, serialize_named_tensors

PROBE = [[20, 21, 22], [33, 34, 35, 36, 37, 38], [90, 91]]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def _fingerprint(url):
    outs = call(url, lambda c: c.generate_batch(PROBE, GREEDY))
    return [o.output_ids for o in outs], [o.output_logprobs for o in outs], outs[0].weight_version


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(f"{model_dir}/model.safetensors")


def _assert_same(a, b):
    assert a[0] == b[0]
    worst = max(abs(x - y) for la, lb in zip(a[1], b[1]) for x, y in zip(la, lb))
    assert worst < 1e-5, worst


@pytest.fixture
def reset_engine(engine, tiny_model):
    """Engine A back on its own weights (version 0), shown to differ from engine B's."""
    call(engine.url, lambda c: c.update_weights_from_disk(tiny_model, weight_version=0))
    yield engine
    call(engine.url, lambda c: c.update_weights_from_disk(tiny_model, weight_version=0))


def test_update_from_disk_equals_fresh_engine(reset_engine, engine_b, tiny_model_b):
    want = _fingerprint(engine_b.url)
    assert _fingerprint(reset_engine.url)[0] != want[0]
    res = call(reset_engine.url, lambda c: c.update_weights_from_disk(tiny_model_b, weight_version=3))
    assert res["success"] and res["num_paused_requests"] == 0
    got = _fingerprint(reset_engine.url)
    _assert_same(got, want)
    assert got[2] == 3


@pytest.mark.parametrize("flattened", [False, True])
def test_update_from_tensor_handles_equals_fresh_engine(reset_engine, engine_b, tiny_model_b, flattened):
    named = _weights(tiny_model_b)
    if flattened:
        handle = serialize_flattened_bucket(named)
        res = call(reset_engine.url, lambda c: c.update_weights_from_tensor(handle, 5, "flattened_bucket"))
    else:
        handle = serialize_named_tensors(named)
        res = call(reset_engine.url, lambda c: c.update_weights_from_tensor(handle, 5))
    assert res["success"]
    got = _fingerprint(reset_engine.url)
    _assert_same(got, _fingerprint(engine_b.url))
    assert got[2] == 5


@pytest.mark.parametrize("flattened", [False, True])
def test_update_from_distributed_gloo_equals_fresh_engine(reset_engine, engine_b, tiny_model_b, flattened):
    named = _weights(tiny_model_b)
    rdv = Rendezvous.open("127.0.0.1")
    port = rdv.port
    group_name = f"wg-{int(flattened)}"

    async def go(client):
        holder = {}
        t = threading.Thread(target=lambda: holder.update(
            pg=new_weight_group("gloo", "127.0.0.1", port, 0, 2, group_name, rendezvous=rdv)))
        t.start()
        res = await client.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                                      world_size=2, group_name=group_name)
        t.join()
        assert res["success"]
        pg = holder["pg"]
        names = list(named)
        req = asyncio.create_task(client.update_weights_from_distributed(
            names=names, dtypes=[dtype_name(named[n].dtype) for n in names],
            shapes=[list(named[n].shape) for n in names], weight_version=7, group_name=group_name,
            flattened=flattened))
        if flattened:
            await asyncio.to_thread(broadcast, pg, wire_bucket([named[n] for n in names], None, "cpu"))
        else:
            for n in names:
                await asyncio.to_thread(broadcast, pg, named[n].contiguous())
        res = await req
        await client.destroy_weights_update_group(group_name)
        return res

    assert run(with_client(reset_engine.url, go))["success"]
    got = _fingerprint(reset_engine.url)
    _assert_same(got, _fingerprint(engine_b.url))
    assert got[2] == 7


def test_bad_weight_updates_are_400_and_weights_unchanged(reset_engine, tmp_path):
    before = _fingerprint(reset_engine.url)
    with pytest.raises(EngineError, match="no \\*.safetensors"):  # an allowed folder without weights
        call(reset_engine.url, lambda c: c.update_weights_from_disk(str(tmp_path), weight_version=9))
    bad = serialize_named_tensors({"model.embed_tokens.weight": torch.zeros(3, 3)})
    with pytest.raises(EngineError, match="shape"):
        call(reset_engine.url, lambda c: c.update_weights_from_tensor(bad, 9))
    with pytest.raises(EngineError, match="not valid base64|cannot load"):
        call(reset_engine.url, lambda c: c.update_weights_from_tensor("!!garbage!!", 9))
    r = httpx.post(reset_engine.url + "/update_weights_from_distributed",
                   json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "missing"}, timeout=10)
    assert r.status_code == 400 and "missing" in r.text
    _assert_same(_fingerprint(reset_engine.url), before)


def _stream_with_pause(url, mode, ids, sp, min_tokens=8, pause_s=0.4):
    """Streams one request, pauses after `min_tokens`, checks nothing runs while paused, continues."""
    async def go(client):
        control = type(client)(client.base_url)
        chunks, stalled = [], {}
        try:
            async for chunk in client.generate_stream(ids, sp):
                chunks.append(chunk)
                if len(chunks) == min_tokens:
                    await control.pause(mode)
                    a = (await control.server_info())["generated_tokens"]
                    await asyncio.sleep(pause_s)
                    stalled["delta"] = (await control.server_info())["generated_tokens"] - a
                    await control.resume()
        finally:
            await control.aclose()
        return chunks, stalled

    return run(with_client(url, go))


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_continue_loses_and_duplicates_no_token(engine, mode):
    ids = [44, 45, 46]
    sp = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
    reference = call(engine.url, lambda c: c.generate(ids, sp))
    chunks, stalled = _stream_with_pause(engine.url, mode, ids, sp)
    final = chunks[-1]
    assert stalled["delta"] == 0  # no decode step ran while paused
    assert final["output_ids"] == reference.output_ids
    assert len(final["output_ids"]) == 150 and final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["meta_info"]["output_token_logprobs"]) == 150
    assert final["meta_info"]["output_token_weight_versions"] == [0] * 150


async def _stream_until(client, ids, sp, after_chunks, action, **kw):
    """Streams a request; once `after_chunks` chunks arrived, awaits `action()`; returns all chunks."""
    chunks = []
    async for chunk in client.generate_stream(ids, sp, **kw):
        chunks.append(chunk)
        if len(chunks) == after_chunks:
            await action()
    return chunks


def test_pause_abort_returns_partial_output(engine):
    ids = [47, 48, 49]
    sp = {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}

    async def go(client):
        control = type(client)(client.base_url)
        try:
            chunks = await _stream_until(client, ids, sp, 5, lambda: control.pause("abort"))
            await control.resume()
            after = await client.generate(ids, {**sp, "max_new_tokens": 3})
            return chunks[-1], after
        finally:
            await control.aclose()

    last, after = run(with_client(engine.url, go))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(last["output_ids"]) < 240
    assert len(last["meta_info"]["output_token_logprobs"]) == len(last["output_ids"])
    assert len(after.output_ids) == 3  # serving again after continue


def test_abort_request_by_rid_and_flush_cache_refused_while_running(engine):
    status = {}

    async def go(client):
        control = type(client)(client.base_url)

        async def flush_then_abort():
            try:
                await control.flush_cache()
                status["flush"] = 200
            except EngineError as exc:
                status["flush"] = exc.status
            await control.abort("victim")
        try:
            return await _stream_until(client, [12, 13], {"max_new_tokens": 240, "ignore_eos": True}, 3,
                                       flush_then_abort, rid="victim")
        finally:
            await control.aclose()

    chunks = run(with_client(engine.url, go))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort" and len(chunks[-1]["output_ids"]) < 240
    assert status["flush"] == 400
    assert httpx.post(engine.url + "/flush_cache", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def big_engine(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=2048)
    path = build_tiny_model(tmp_path_factory.mktemp("big"), spec)
    with launch_engine(str(path), extra_args=["--max-running", "8", "--context-length", "128"]) as ep:
        yield ep


def test_release_and_resume_memory_frees_rss_and_keeps_outputs(big_engine):
    proc = psutil.Process(big_engine.proc.pid)
    before = _fingerprint(big_engine.url)
    info = call(big_engine.url, lambda c: c.model_info())
    rss_0 = proc.memory_info().rss
    call(big_engine.url, lambda c: c.release_memory(None))
    time.sleep(0.2)
    rss_released = proc.memory_info().rss
    assert httpx.get(big_engine.url + "/health_generate", timeout=5).status_code == 503
    refused = httpx.post(big_engine.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}}, timeout=5)
    assert refused.status_code == 503 and "memory released" in refused.json()["error"]["message"]  # not a hang
    weight_bytes = 33_000_000 * 4
    assert rss_0 - rss_released > 0.8 * weight_bytes, (rss_0, rss_released)
    call(big_engine.url, lambda c: c.resume_memory(None))
    _assert_same(_fingerprint(big_engine.url), before)
    assert info["memory_released"] is False


async def _swap_mid_stream(client, mode: str, weights: str, ids, sp) -> list[dict]:
    """Streams `ids`; after 10 tokens pauses (`mode`), loads `weights` as version 1, continues."""
    control = type(client)(client.base_url)

    async def swap_weights():
        await control.pause(mode)
        await control.update_weights_from_disk(weights, weight_version=1)
        await control.resume()
    try:
        return await _stream_until(client, ids, sp, 10, swap_weights, return_logprob=True)
    finally:
        await control.aclose()


def test_partial_rollout_spans_a_weight_update_with_exact_per_version_logprobs(reset_engine, tiny_model, tiny_model_b):
    """retract mode: the in-flight request keeps its tokens, its KV is recomputed with the new weights,
    and every recorded logprob is exactly that of the version that produced the token."""
    from helpers import reference_logprobs

    ids = [21, 22, 23, 24]
    sp = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}

    final = run(with_client(reset_engine.url, lambda c: _swap_mid_stream(c, "retract", tiny_model_b, ids, sp)))[-1]
    versions = final["meta_info"]["output_token_weight_versions"]
    out = final["output_ids"]
    cut = versions.index(1)
    assert len(out) == 60 and versions == [0] * cut + [1] * (60 - cut) and cut >= 10
    lps = [t[0] for t in final["meta_info"]["output_token_logprobs"]]
    ref_a = reference_logprobs(tiny_model, ids + out)
    ref_b = reference_logprobs(tiny_model_b, ids + out)
    P = len(ids)
    for j, tok in enumerate(out):
        ref = ref_a if versions[j] == 0 else ref_b
        assert abs(ref[P - 1 + j, tok].item() - lps[j]) < 1e-4, (j, versions[j])


def test_kv_of_a_request_that_spans_a_weight_update_is_never_reused(reset_engine, tiny_model, tiny_model_b):
    """in_place mode: a request paused across an update keeps its old-weight KV (SGLang's semantics),
    but when it finishes that KV does not enter the prefix cache (the update emptied it of old
    weights): the next request with the same prompt reuses nothing and its logprobs are exactly
    the new weights'."""
    from helpers import reference_logprobs

    ids = [31, 32, 33, 34, 35, 36]
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def go(client):
        await _swap_mid_stream(client, "in_place", tiny_model_b, ids, sp)
        return await client.generate(ids, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True)

    after = run(with_client(reset_engine.url, go))
    assert after.cached_tokens == 0 and after.versions == [1] * 4
    ref_b = reference_logprobs(tiny_model_b, ids + after.output_ids)
    for j, tok in enumerate(after.output_ids):
        assert abs(ref_b[len(ids) - 1 + j, tok].item() - after.output_logprobs[j]) < 1e-4, j
