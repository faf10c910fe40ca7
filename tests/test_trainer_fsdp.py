"""FSDP2 trainer ranks as Ray actors: 1 rank == 2 ranks, trainer logprobs == engine logprobs,
weight sync to engines verified against a fresh engine on the trainer's exported checkpoint."""
from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from safetensors.torch import load_file

from helpers import ListeningSockets, call, policy_batch
from loongsage.algo.config import LossConfig
from loongsage.algo.mismatch import train_inference_gap
from loongsage.engine.config import EngineConfig
from loongsage.rollout.client import EngineClient
from loongsage.rollout.config import RolloutConfig
from loongsage.rollout.engine_group import EngineGroup
from loongsage.rollout.launcher import launch_engine
from loongsage.rollout.router import Router
from loongsage.sample import Sample
from loongsage.trainer.batch import collate
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.mesh import WeightMesh
from loongsage.transfer.tensor_handles import serialize_named_tensors
from loongsage.transfer.topology import Endpoint, plan


def _policy_step(group: TrainerGroup, batch, loss_cfg):
    async def go():
        lp, _ = await group.compute_logprobs(batch)
        batch.proximal_logprobs = lp
        return lp, await group.train_step(batch, "policy", loss_cfg)
    return asyncio.run(go())


def test_two_rank_fsdp_step_equals_one_rank_step(ray_session, tiny_model, tmp_path):
    cfg = dict(lr=1e-2, micro_batch_size=2, max_grad_norm=1.0)
    loss_cfg = LossConfig(is_mode="tis", aggregation="token_mean")
    results = {}
    for world in (1, 2):
        group = TrainerGroup(TrainerConfig(world_size=world, **cfg), tiny_model)
        try:
            lp, m = _policy_step(group, policy_batch(), loss_cfg)
            asyncio.run(group.save(str(tmp_path / f"w{world}")))
            results[world] = (lp, m, load_file(str(tmp_path / f"w{world}" / "model.safetensors")))
        finally:
            group.shutdown()
    (lp1, m1, w1), (lp2, m2, w2) = results[1], results[2]
    mask = policy_batch().loss_mask
    assert torch.allclose(lp1 * mask, lp2 * mask, atol=1e-5)  # outside the mask: padding, undefined
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-5)
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-4)
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = max((w1[k] - load_file(f"{tiny_model}/model.safetensors")[k]).abs().max().item() for k in w1)
    # Adam's first step is ~lr * sign(g): summation-order noise in near-zero gradients (micro-batch and
    # rank order differ) shows up as a few percent of one lr step (1e-2) on a handful of weights
    assert worst < 5e-4 and moved > 5e-3, (worst, moved)


def test_proximal_from_the_update_forward_equals_a_recompute_pass(ray_session, tiny_model, tmp_path):
    """Without `recompute_proximal`, the update's own forward supplies the proximal logprobs (and the
    train-inference gap); the step must equal the one taken after a separate no-grad pass."""
    loss_cfg = LossConfig(is_mode="tis", aggregation="token_mean")
    out = {}
    for mode in ("recompute", "fused"):
        group = TrainerGroup(TrainerConfig(world_size=1, lr=1e-2, micro_batch_size=2), tiny_model)
        try:
            batch = policy_batch()
            if mode == "recompute":
                lp, m = _policy_step(group, batch, loss_cfg)
                m["gap"] = train_inference_gap(batch.behavior_logprobs, lp, batch.loss_mask)
            else:
                m = asyncio.run(group.train_step(batch, "policy", loss_cfg))
            asyncio.run(group.save(str(tmp_path / mode)))
            out[mode] = (m, load_file(str(tmp_path / mode / "model.safetensors")))
        finally:
            group.shutdown()
    (m1, w1), (m2, w2) = out["recompute"], out["fused"]
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-6)
    for key, value in m1["gap"].items():
        assert m2[key] == pytest.approx(value, abs=1e-5), key
    assert m2["mismatch/abs_logprob_diff"] > 0.05  # the batch's behaviour logprobs are not the model's
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-6


def test_sft_loss_falls_and_checkpoint_round_trips(ray_session, tiny_model, tmp_path):
    group = TrainerGroup(TrainerConfig(world_size=1, lr=3e-3), tiny_model)
    try:
        batch = policy_batch(1)
        losses = [asyncio.run(group.train_step(batch, "sft", None))["loss/sft"] for _ in range(15)]
        assert losses[-1] < 0.7 * losses[0]
        asyncio.run(group.save(str(tmp_path / "ck")))
        before, _ = asyncio.run(group.compute_logprobs(batch))
        asyncio.run(group.load(tiny_model))  # back to the initial weights (no optimizer state there)
        asyncio.run(group.load(str(tmp_path / "ck")))
        after, _ = asyncio.run(group.compute_logprobs(batch))
        assert torch.allclose(before, after, atol=1e-6)
        assert asyncio.run(group.version()) == 15
    finally:
        group.shutdown()


PROMPTS, GREEDY = [[20, 21], [30, 31, 32]], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _serves_like_a_fresh_engine(exported: str, outs_per_engine: list) -> None:
    """Synced engines answer exactly as a fresh engine loaded from the trainer's exported checkpoint."""
    with launch_engine(exported) as fresh:
        ref = call(fresh.url, lambda c: c.generate_batch(PROMPTS, GREEDY))
    for outs in outs_per_engine:
        for a, b in zip(outs, ref):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh runs these)")
# transport -> (trainer endpoint, engine endpoint, trainer and engine device); `_handles`: SGLang's way
ROUTES = {"shm": (Endpoint("trainer", "a"), Endpoint("engine-0", "a"), "cpu"),
          "shm_handles": (Endpoint("trainer", "a"), Endpoint("engine-0", "a"), "cpu"),
          "collective": (Endpoint("trainer", "a"), Endpoint("engine-0", "b"), "cpu"),
          "disk": (Endpoint("trainer", "a"), Endpoint("engine-0", "b", transports=("disk",)), "cpu"),
          "cuda_ipc": (Endpoint("trainer", "a", "cuda:0"), Endpoint("engine-0", "a", "cuda:0"), "cuda"),
          "cuda_ipc_handles": (Endpoint("trainer", "a", "cuda:0"), Endpoint("engine-0", "a", "cuda:0"), "cuda"),
          "collective_nccl": (Endpoint("trainer", "a", "cuda:0"), Endpoint("engine-0", "b", "cuda:0"), "cuda")}


@pytest.mark.parametrize("transport", ["collective", "shm", "shm_handles", "disk",
                                       *[pytest.param(t, marks=GPU) for t in
                                         ("cuda_ipc", "cuda_ipc_handles", "collective_nccl")]])
def test_trainer_matches_engine_and_sync_is_verified(ray_session, tiny_model, tmp_path, transport):
    sender, receiver, device = ROUTES[transport]
    gpu = {"gpus_per_rank": 0.4} if device == "cuda" else {}
    trainers = TrainerGroup(TrainerConfig(world_size=1, lr=1e-2, device=device, **gpu), tiny_model)
    engines = EngineGroup(tiny_model, EngineConfig(max_running=16, context_length=128, device=device),
                          RolloutConfig(engine_gpus=0.4), weight_roots=(str(tmp_path / "weights"),))
    try:
        async def go():
            router = Router(engines.urls, api_key=engines.api_key)
            # the engine's host, device and transports decide the route: same GPU -> cuda_ipc, same
            # host -> shm, another host -> collective, nothing in common but files -> disk
            routes = plan(sender, [receiver])
            # shm / cuda_ipc: one copy into the engine's mapped standby buffer; `_handles`: SGLang's way
            # (the trainer's staging buffers, the engine loads them by handle)
            sync = WeightMesh(routes, trainers, {"engine-0": EngineClient(engines.urls[0], engines.api_key)}, "float32",
                              bucket_mb=0.5, backend="nccl" if transport.endswith("nccl") else "gloo", verify_every=1,
                              disk_dir=str(tmp_path / "weights"), extensions=not transport.endswith("_handles"))
            assert list(sync.parts) == [transport.removesuffix("_handles").removesuffix("_nccl")]
            assert len(sync.buckets) > 1 or transport in ("disk", "shm", "cuda_ipc")  # every version checksummed
            await sync.setup()
            gaps = []
            for version in (1, 2):
                outs = await router.generate([10, 11, 12], {"max_new_tokens": 10, "n": 4, "ignore_eos": True})
                samples = [Sample([10, 11, 12], o.output_ids, [1] * 10, o.output_logprobs, o.output_versions,
                                  advantage=float(i % 2) - 0.5) for i, o in enumerate(outs)]
                assert all(s.versions == [version - 1] * 10 for s in samples)
                batch = collate(samples, 0)
                lp, _ = await trainers.compute_logprobs(batch)
                gaps.append(float(((lp - batch.behavior_logprobs).abs() * batch.loss_mask).max()))
                batch.proximal_logprobs = lp
                await trainers.train_step(batch, "policy", LossConfig())
                res = await sync.push(version)
                assert res["weight_sync/bytes"] > 0
            await trainers.save(str(tmp_path / "exported"))
            synced = await router.clients[0].generate_batch(PROMPTS, GREEDY)
            info = await router.clients[0].model_info()
            # one weight changed behind the mesh's back, same version string: verification must catch it
            name = sync.names[0]
            expected = ray.get(trainers.rank0.transfer.remote("verify", "checksum", sync.names, "float32"))
            bad = trainers.full_state_dict_on_rank0()[name].cpu() + 1e-3
            await router.clients[0].update_weights_from_tensor(serialize_named_tensors({name: bad}), weight_version=2)
            with pytest.raises(RuntimeError, match="weight sync to version 2: checksum mismatch"):
                await sync.verifier.check_against(2, expected)
            if transport == "disk":  # only the newest version's folder is kept
                assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"]
            await router.aclose()
            await sync.aclose()
            return gaps, synced, info
        gaps, synced, info = asyncio.run(go())
        assert max(gaps) < 1e-4  # fp32 on both sides: the train-inference gap is ~0
        assert info["weight_version"] == "2"
        if device == "cpu":  # on a GPU the exact checksums above are the check (kernels differ from CPU's)
            _serves_like_a_fresh_engine(str(tmp_path / "exported"), [synced])
    finally:
        engines.shutdown()
        trainers.shutdown()


def test_two_host_mesh_relays_over_the_collective_and_fans_out(ray_session, tiny_model, tmp_path):
    """Host ids overridden so the planner must route another host through one relay: engine-0 shares
    the trainer's host (shm); engine-1 and engine-2 are on host b, engine-1 gets the collective and
    fans it out to engine-2 over shared memory. Every engine is verified (version, exact checksum) and
    serves exactly what a fresh engine on the exported checkpoint serves."""
    trainers = TrainerGroup(TrainerConfig(world_size=1, lr=1e-2), tiny_model)
    engines = EngineGroup(tiny_model, EngineConfig(max_running=8, context_length=64), RolloutConfig(num_engines=3))
    try:
        routes = plan(Endpoint("trainer", "a"), [Endpoint("engine-0", "a"), Endpoint("engine-1", "b"),
                                                 Endpoint("engine-2", "b")])
        assert [(r.receiver, r.transport, r.relay) for r in routes.routes] == [
            ("engine-0", "shm", None), ("engine-1", "collective", None), ("engine-2", "relay_shm", "engine-1")]

        async def go():
            sync = WeightMesh(routes, trainers, {f"engine-{i}": EngineClient(u, engines.api_key)
                                                 for i, u in enumerate(engines.urls)}, "float32",
                              bucket_mb=0.5, backend="gloo", verify_every=1)
            assert sorted(sync.parts) == ["collective", "relay_shm", "shm"]
            with ListeningSockets() as sockets:  # the weight group's store and gloo sockets among them
                await sync.setup()
                for version in (1, 2):
                    await trainers.train_step(policy_batch(seed=version), "policy", LossConfig())
                    res = await sync.push(version)  # raises unless every engine confirms and checksums match
                    assert res["time/weight_sync_relay_shm_s"] > 0 and res["weight_sync/bytes"] > 0
            assert not sockets.beyond_loopback(), sockets.seen
            await trainers.save(str(tmp_path / "exported"))
            router = Router(engines.urls, api_key=engines.api_key)
            outs = [await c.generate_batch(PROMPTS, GREEDY) for c in router.clients]
            infos = [await c.model_info() for c in router.clients]
            await router.aclose()
            await sync.aclose()
            return outs, infos
        outs, infos = asyncio.run(go())
        assert [i["weight_version"] for i in infos] == ["2", "2", "2"]
        _serves_like_a_fresh_engine(str(tmp_path / "exported"), outs)
    finally:
        engines.shutdown()
        trainers.shutdown()


def test_bucket_plan_respects_size_and_order():
    meta = [("a", "float32", [10]), ("b", "float32", [30]), ("c", "float32", [5]), ("d", "float32", [100])]
    assert plan_buckets(meta, 160, 4) == [[0, 1], [2], [3]]
    assert plan_buckets(meta, 10_000, 4) == [[0, 1, 2, 3]]


def test_bf16_mixed_precision_trains_close_to_fp32(ray_session, tiny_model):
    batch = policy_batch(2)
    out = {}
    for bf16 in (False, True):
        group = TrainerGroup(TrainerConfig(world_size=1, lr=3e-3, bf16=bf16), tiny_model)
        try:
            lp, _ = asyncio.run(group.compute_logprobs(batch))
            losses = [asyncio.run(group.train_step(batch, "sft", None))["loss/sft"] for _ in range(5)]
            out[bf16] = (lp, losses)
        finally:
            group.shutdown()
    (lp32, l32), (lp16, l16) = out[False], out[True]
    mask = batch.loss_mask.bool()
    gap = (lp32 - lp16).abs()[mask].max().item()
    assert 0 < gap < 0.1  # bf16 compute really ran, and stays close
    assert l16[-1] < l16[0] and abs(l16[-1] - l32[-1]) < 0.1 * l32[0]


def test_tokens_sampled_at_a_temperature_train_with_no_gap(ray_session, tiny_model):
    """At T = 0.7 the engine records logprobs of logits / 0.7; the trainer scores each token under the
    temperature it was sampled at, so the gap stays ~0 (and would be large under the raw logits)."""
    trainers = TrainerGroup(TrainerConfig(world_size=1, lr=1e-3, micro_batch_size=4), tiny_model)
    try:
        with launch_engine(tiny_model, extra_args=["--max-running", "16", "--context-length", "128"]) as ep:
            outs = call(ep.url, lambda c: c.generate_batch([[10, 11, 12]] * 8, {"max_new_tokens": 12, "temperature": 0.7,
                                                                               "ignore_eos": True}, return_logprob=True))

        def batch(temperatures):
            return collate([Sample([10, 11, 12], o.output_ids, [1] * 12, o.output_logprobs, o.output_versions,
                                   advantage=float(i % 2) - 0.5, temperatures=temperatures)
                            for i, o in enumerate(outs)], 0)

        async def go():
            raw, _ = await trainers.compute_logprobs(b := batch(None))
            tempered = batch([0.7] * 12)
            metrics = await trainers.train_step(tempered, "policy", LossConfig())
            return float(((raw - b.behavior_logprobs).abs() * b.loss_mask).max()), metrics
        raw_gap, metrics = asyncio.run(go())
        assert metrics["mismatch/max_abs_logprob_diff"] < 1e-4
        assert raw_gap > 0.05  # the same tokens under the raw logits: what training at T != 1 used to see
    finally:
        trainers.shutdown()


def test_mini_batches_take_several_optimizer_steps_against_one_proximal_pass(ray_session, tiny_model):
    """Four mini-batches over two epochs: eight optimizer steps, one version; the first step's ratio
    is exactly 1 (nothing clipped), later steps move off the proximal policy so PPO's clip acts."""
    group = TrainerGroup(TrainerConfig(world_size=1, lr=3e-2, micro_batch_size=8), tiny_model)
    try:
        async def go():
            batch = policy_batch(n=8)
            batch.proximal_logprobs, _ = await group.compute_logprobs(batch)
            return await group.train_steps(batch, LossConfig(is_mode="none", clip_low=0.05, clip_high=0.05),
                                           mini_batches=4, epochs=2), await group.version()
        m, version = asyncio.run(go())
    finally:
        group.shutdown()
    assert m["train/optimizer_steps"] == 8 and version == 1
    assert m["loss/clip_frac_first"] == 0.0 and m["loss/clip_frac_last"] > 0.0
    assert m["loss/approx_kl"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_optimizer_state_offloaded_between_steps_trains_the_same(ray_session, tiny_model, device):
    """Colocated placement: Adam's state leaves the device while the engine generates and comes back
    for the next step (on a CPU device nothing moves); the updates are those of a rank that kept it."""
    batch = policy_batch(2)
    runs = {}
    for offload in (False, True):
        group = TrainerGroup(TrainerConfig(world_size=1, lr=3e-3, device=device,
                                           **({"gpus_per_rank": 0.4} if device == "cuda" else {})), tiny_model)
        try:
            moved, losses = [], []
            for _ in range(3):
                if offload:
                    moved.append(asyncio.run(group.reload_optimizer()))
                losses.append(asyncio.run(group.train_step(batch, "sft", None))["loss/sft"])
                if offload:
                    moved.append(asyncio.run(group.offload_optimizer()))
            runs[offload] = (losses, moved)
        finally:
            group.shutdown()
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    if device == "cpu":
        assert set(runs[True][1]) == {0}
    else:  # both moments of every parameter, fp32, out after each step and back before the next
        assert runs[True][1][0] == 0 and all(m > 0 for m in runs[True][1][1:])
