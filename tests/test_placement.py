"""Placement by config: the run's Ray placement group, bundles per mode, colocated time-sharing."""
from __future__ import annotations

import asyncio

import pytest
import torch

from loongsage.cluster.placement import PlacementConfig, layout
from loongsage.config import ConfigError, load_config
from loongsage.rollout.config import RolloutConfig
from loongsage.teachers.config import TeacherConfig
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.offload import move_optimizer_state


def test_disaggregated_gives_every_actor_its_bundle_and_the_reference_its_ranks():
    plan = layout("disaggregated", TrainerConfig(world_size=2, resources={"node_a": 1}),
                  RolloutConfig(num_engines=2, engine_resources={"node_b": 1}),
                  [TeacherConfig(name="t", model="/m", num_engines=1, resources={"node_c": 1})], with_reference=True)
    bundle = {n: m.bundle for n, m in plan.members.items()}
    assert bundle == {"trainer-0": 0, "reference-0": 0, "trainer-1": 1, "reference-1": 1, "engine-0": 2,
                      "engine-1": 3, "teacher-t-0": 4}
    assert plan.bundles() == [{"CPU": 0.02, "node_a": 1}, {"CPU": 0.02, "node_a": 1}, {"CPU": 0.01, "node_b": 1},
                              {"CPU": 0.01, "node_b": 1}, {"CPU": 0.01, "node_c": 1}]


def test_colocated_puts_engine_i_beside_rank_i_sharing_its_gpus():
    plan = layout("colocated", TrainerConfig(world_size=2, device="cuda", gpus_per_rank=1.0),
                  RolloutConfig(num_engines=2, engine="sglang", engine_gpus=1.0), with_reference=True)
    assert plan.together("trainer-0", "engine-0") and plan.together("trainer-1", "engine-1")
    assert not plan.together("trainer-0", "engine-1")
    assert plan.bundles() == [{"CPU": 0.03, "GPU": 1.0}, {"CPU": 0.03, "GPU": 1.0}]  # one GPU each, time-shared
    assert all(m.gpus == pytest.approx(1 / 3) for m in plan.members.values())


@pytest.mark.parametrize("overrides, message", [
    (["placement.mode=colocated", "rollout.max_staleness=1"], "generation cannot overlap training"),
    (["placement.mode=colocated", "rollout.num_engines=2"], "must be at most trainer.world_size"),
    (["placement.mode=colocated", "trainer.resources={a: 1}", "rollout.engine_resources={b: 1}"], "different nodes"),
    (["placement.mode=beside"], "placement.mode"),
])
def test_impossible_placements_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("recipes/arith_grpo.yaml", overrides)


def test_optimizer_state_moves_whole_including_wrapped_optimizers():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    class Chained:  # the shape of Megatron's ChainedOptimizer(MegatronOptimizer(torch optimizer))
        chained_optimizers = [type("Wrapped", (), {"optimizer": opt})()]

    moved = move_optimizer_state(Chained(), "meta")
    assert moved == 2 * (12 + 3) * 4  # exp_avg and exp_avg_sq of weight and bias, fp32
    states = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    assert states and all(v.device.type == "meta" for v in states)
    assert move_optimizer_state(opt, "meta") == 0  # already there


@pytest.mark.slow
def test_a_colocated_runtime_places_its_actors_and_time_shares_the_engine(ray_session, tiny_model):
    """Every actor in the run's placement group; handing the devices to the trainer really frees
    the engine's memory and holds (not fails) calls until the engines have them back."""
    import ray

    from loongsage.cluster.config import RayConfig
    from loongsage.controller.colocation import Colocation
    from loongsage.controller.runtime import Runtime
    from loongsage.engine.config import EngineConfig
    from loongsage.timeline import Timeline

    async def go():
        rt = await Runtime.start(tiny_model, TrainerConfig(lr=1e-2), EngineConfig(max_running=8, context_length=64),
                                 RolloutConfig(), RayConfig(), with_reference=True,
                                 placement=PlacementConfig(mode="colocated"))
        try:
            group = rt.placement.group.id.hex()
            actors = [rt.trainers.rank0, rt.reference.rank0, rt.engines.actors[0]]
            assert ray.get([a.placement_group.remote() for a in actors]) == [group] * 3
            assert [r.transport for r in rt.sync.plan.routes] == ["shm"]  # same node and device: shared memory
            # over a staging buffer: a colocated engine keeps no second copy of its weights (no mapped double buffer)
            assert type(rt.sync.parts["shm"]).__name__ == "ShmWeightSync"
            client = rt.router.clients[0]
            before = await client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0})
            col = Colocation(rt.router, rt.trainers, Timeline())
            await col.hand_to_trainer()
            assert (await client.model_info())["memory_released"]
            waiting = asyncio.create_task(rt.router.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0}))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # held at the router, not sent to a released engine
            await col.hand_to_engines()
            assert not (await client.model_info())["memory_released"]
            after = (await waiting)[0]
            assert after.output_ids == before.output_ids  # the same weights came back
            assert col.metrics()["time/colocate_release_s"] > 0
            # an engine that dies while released: the hand-back goes on without it (marked down) ...
            await col.hand_to_trainer()
            ray.kill(rt.engines.actors[0])
            for _ in range(300):  # ray.kill returns before the process is gone
                try:
                    await client.model_info()
                except Exception:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the killed engine still answers")
            await col.hand_to_engines()
            assert rt.router.up == [False]
            # ... and its replacement starts in the engines' turn, not on a device the trainer holds
            started = []

            async def replace(idx):
                started.append(idx)
                await rt.replace_engine(idx)
            await col.hand_to_trainer()
            replacing = asyncio.create_task(col.replacing(replace)(0))
            await asyncio.sleep(0.3)
            assert not started
            await col.hand_to_engines()
            await replacing
            assert started == [0] and rt.router.up == [True]
            again = await rt.router.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0})
            assert again[0].output_ids == before.output_ids  # the trainer's weights, on the new engine
        finally:
            await rt.close()
        assert group not in {pg["placement_group_id"] for pg in ray.util.placement_group_table().values()
                             if pg["state"] != "REMOVED"}

    asyncio.run(go())
