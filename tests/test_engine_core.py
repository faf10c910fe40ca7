"""The engine core in-process (no HTTP): a group's shared prefill, batched slot moves and the
vectorised prefix cache keep every logprob exact while doing less work."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from helpers import reference_logprobs
from loongsage.engine.core import EngineCore
from loongsage.engine.prefix_cache import CacheEntry, PrefixCache
from loongsage.engine.sampling import SamplingParams
from loongsage.engine.sequence import SeqRequest, SeqSnapshot


@pytest.fixture(scope="module")
def core(tiny_model):
    c = EngineCore(tiny_model, max_running=24, context_length=128)
    c.start()
    yield c
    c.shutdown()


def _run(core: EngineCore, reqs: list[SeqRequest]) -> dict[str, SeqSnapshot]:
    done: dict[str, SeqSnapshot] = {}
    event = threading.Event()

    def update(snap: SeqSnapshot) -> None:
        if snap.finish is not None:
            done[snap.rid] = snap
            if len(done) == len(reqs):
                event.set()

    for r in reqs:
        r.on_update = update
    core.submit(reqs)
    assert event.wait(60), f"{len(done)}/{len(reqs)} finished"
    return done


def _req(rid: str, ids: list[int], n_new: int, seed: int | None, **kw) -> SeqRequest:
    return SeqRequest(rid=rid, group_rid=rid.split("/")[0], input_ids=ids, return_logprob=True,
                      params=SamplingParams(max_new_tokens=n_new, ignore_eos=True, sampling_seed=seed), **kw)


def _worst_error(model: str, ids: list[int], snap: SeqSnapshot) -> float:
    ref = reference_logprobs(model, ids + snap.output_ids)
    return max(abs(ref[len(ids) - 1 + j, t].item() - lp)
               for j, (t, lp) in enumerate(zip(snap.output_ids, snap.output_logprobs)))


def test_a_group_prefills_its_prompt_once_and_each_sample_stays_exact(core, tiny_model):
    ids = [random.Random(1).randrange(10, 100) for _ in range(30)]
    before = core.stats.prefill_tokens
    group = [_req(f"g/{j}", ids, 6, 100 + j, logprob_start_len=0) for j in range(8)]
    outs = _run(core, group)
    assert core.stats.prefill_tokens - before == len(ids)  # not 8 x 30
    assert len({tuple(o.output_ids) for o in outs.values()}) > 1  # each sample draws with its own seed
    for o in outs.values():
        assert _worst_error(tiny_model, ids, o) < 1e-4
        assert o.input_logprobs == outs["g/0"].input_logprobs and len(o.input_logprobs) == len(ids)
    # the same seeds one at a time (each prefilling for itself) give the same samples
    alone = {}
    for j in range(8):
        core.call(core.flush_cache).result()
        alone.update(_run(core, [_req(f"a{j}/{j}", ids, 6, 100 + j, logprob_start_len=0)]))
    assert [outs[f"g/{j}"].output_ids for j in range(8)] == [alone[f"a{j}/{j}"].output_ids for j in range(8)]


def test_many_sequences_leaving_at_different_steps_keep_exact_logprobs(core, tiny_model):
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 100) for _ in range(rng.randint(2, 20))] for _ in range(40)]  # > max_running
    reqs = [_req(f"m{i}", p, rng.randint(1, 12), i) for i, p in enumerate(prompts)]
    outs = _run(core, reqs)
    worst = max(_worst_error(tiny_model, p, outs[f"m{i}"]) for i, p in enumerate(prompts))
    assert worst < 1e-4, worst
    # a second round reuses the cached prompts that survived in free slots, still exactly
    again = _run(core, [_req(f"r{i}", p + [7], 3, i) for i, p in enumerate(prompts)])
    assert sum(o.cached_tokens for o in again.values()) > 0
    worst = max(_worst_error(tiny_model, p + [7], again[f"r{i}"]) for i, p in enumerate(prompts))
    assert worst < 1e-4, worst


def test_prefix_cache_finds_the_longest_prefix_and_the_oldest_entry():
    cache = PrefixCache(True, slots=6, context_len=8)
    cache.put(2, CacheEntry(np.array([1, 2, 3, 4]), used=5))
    cache.put(4, CacheEntry(np.array([1, 2, 9]), used=3))
    assert cache.lookup([1, 2, 3, 4, 5], limit=10) == (2, 4)
    assert cache.lookup([1, 2, 3, 4, 5], limit=3) in ((2, 3),)
    assert cache.lookup([1, 2, 9, 9], limit=10) == (4, 3)
    assert cache.lookup([5, 6], limit=10) == (None, 0)
    assert cache.least_recent() == 4 and cache.least_recent(above=3) == 4 and cache.least_recent(exclude={4}) == 2
    assert cache.least_recent(above=4) is None
    assert cache.free_slot(1) == 5 and cache.free_slot(2) == 5 and cache.free_slot(5) is None
    cache.pop(2)
    assert cache.lookup([1, 2, 3, 4], limit=10) == (4, 2)
    cache.clear()
    assert cache.lookup([1, 2, 9], limit=10) == (None, 0) and len(cache) == 0
    short = PrefixCache(True, slots=2, context_len=8, min_tokens=3)  # a common prefix shorter than 3 is no hit
    short.put(1, CacheEntry(np.array([1, 2, 3, 4]), used=1))
    assert short.lookup([1, 2, 3, 9], limit=10) == (1, 3) and short.lookup([1, 2, 9], limit=10) == (None, 0)


def test_engine_throughput_benchmark_runs_both_workloads(tmp_path):
    """benchmarks/engine_throughput.py, small: both workloads run and report their ratios (the
    benchmark's numbers are for the closing note, not asserted here: the machine is shared), and
    leave nothing in the temporary folder (models, engines' logs)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/engine_throughput.py", "--waves", "2", "--n", "4",
                          "--requests", "8", "--hf-batch", "8", "--hidden", "64", "--layers", "1"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["short_ratio"] > 0 and result["mixed_ratio"] > 0 and result["requests"] == 8, result


@pytest.mark.parametrize("window", [None, 3])
def test_slot_attention_matches_plain_attention_on_every_path(window):
    """Decode rows, same-length fresh prompts (one causal block), other fresh prompts (a pack) and a
    prompt after a cached prefix, in one call, each against softmax attention over its own slot's K/V
    (with a sliding window: only the last `window` positions)."""
    import types

    import torch

    from loongsage.engine.kv_pool import BatchPlan, KVPool, Prefill, slot_attention

    torch.manual_seed(0)
    H, kvh, D = 4, 2, 8
    pool = KVPool(1, 8, kvh, 16, D, torch.float32, "cpu")
    pool.k[0].normal_()
    pool.v[0].normal_()  # slots 0-1 decode at positions 5 and 9; slot 6 holds a cached prefix of 3 tokens
    prefills = [Prefill(2, 6, 2, 0), Prefill(8, 6, 3, 0), Prefill(14, 6, 4, 0), Prefill(20, 4, 5, 0), Prefill(24, 5, 6, 3)]
    plan = BatchPlan(2, torch.tensor([5, 9]), list(prefills))
    assert [b.length for b in plan.blocks] == [6] and len(plan.packs) == 1 and len(plan.prefills) == 1
    pool.plan = plan
    module = types.SimpleNamespace(_loongsage_pool=pool, layer_idx=0, sliding_window=window)
    q, k, v = torch.randn(1, H, 29, D), torch.randn(1, kvh, 29, D), torch.randn(1, kvh, 29, D)
    out = slot_attention(module, q, k, v, None, scaling=D ** -0.5)[0][0]  # [29, H, D]
    rows = [(0, 0, 5), (1, 1, 9)] + [(p.offset + i, p.slot, p.start + i) for p in prefills for i in range(p.length)]
    for row, slot, pos in rows:
        lo = max(0, pos - window + 1) if window else 0
        keys = pool.k[0][slot, :, lo:pos + 1].repeat_interleave(H // kvh, 0)  # [H, n, D]: after the call's writes
        values = pool.v[0][slot, :, lo:pos + 1].repeat_interleave(H // kvh, 0)
        p = torch.softmax((q[0, :, row, None, :] * keys).sum(-1) * D ** -0.5, -1)  # [H, n]
        expected = (p[..., None] * values).sum(1)
        assert torch.allclose(out[row], expected, atol=1e-5), (row, slot, pos)
    for p in prefills:  # the new tokens' K/V are in their slots
        assert torch.equal(pool.k[0][p.slot, :, p.start:p.start + p.length], k[0, :, p.offset:p.offset + p.length])
