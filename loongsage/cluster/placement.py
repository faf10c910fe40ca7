"""Placement by config: every actor of a run in one Ray placement group, each in a named bundle.

    disaggregated   [trainer-0] [trainer-1] .. [engine-0] [engine-1] .. [teacher-a-0] ..
    colocated       [trainer-0 + engine-0] [trainer-1 + engine-1] .. [teacher-a-0] ..

A bundle holds what its members request (a token of CPU each, their GPUs) and the Ray custom
resources they name (which pin it to the nodes that offer them); Ray reserves all bundles at once or none
(`placement.strategy` packs or spreads them over nodes), so a run that cannot be placed fails at
start-up with what it asked for, not halfway through. In `colocated` mode a trainer rank and an
engine time-share one bundle's devices: the controller releases the engine's weights and KV cache
while the rank trains and offloads the optimizer state while the engine generates
(controller/colocation.py); the TransferMesh planner sees them on one node and device and plans the
shared-memory / CUDA IPC route. The KL reference's ranks share their trainer rank's bundle.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MEMBER_CPUS = 0.01  # what each actor reserves of its bundle: a token, so that Ray accounts for it there


class PlacementConfig(BaseModel):
    """The `placement` section of a run config."""
    model_config = ConfigDict(extra="forbid")
    mode: Literal["disaggregated", "colocated"] = Field("disaggregated", description=(
        "disaggregated: trainer ranks, engines and teachers in bundles of their own (generation overlaps "
        "training: async); colocated: engine i shares trainer rank i's bundle and devices, its memory "
        "released while the rank trains (needs rollout.max_staleness 0)"))
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "how Ray spreads the bundles over nodes (PACK: as few nodes as possible)"))
    timeout_s: float = Field(120.0, gt=0, description="how long start-up waits for Ray to reserve every bundle")


@dataclass
class Member:
    """One actor's request: what it reserves, and from which bundle."""
    name: str  # trainer-0, reference-0, engine-0, teacher-a-0
    bundle: int
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class Layout:
    """Bundles and the members placed in each: the pure part of placement (no Ray)."""
    mode: str
    members: dict[str, Member]

    def bundles(self) -> list[dict[str, float]]:
        """Each bundle's resources: the sum of its members' CPUs and GPUs, and the custom resources
        they name (once: they pin the bundle to the nodes that offer them)."""
        out: list[dict[str, float]] = [defaultdict(float) for _ in range(1 + max(m.bundle for m in self.members.values()))]
        for m in self.members.values():
            b = out[m.bundle]
            b["CPU"] += MEMBER_CPUS
            if m.gpus:
                b["GPU"] += m.gpus
            for k, v in m.resources.items():
                b[k] = max(b[k], v)
        return [{k: round(v, 6) for k, v in b.items()} for b in out]

    def together(self, a: str, b: str) -> bool:
        return self.members[a].bundle == self.members[b].bundle

    def describe(self) -> str:
        by_bundle = defaultdict(list)
        for m in self.members.values():
            by_bundle[m.bundle].append(m.name)
        return "\n".join(f"bundle {i}: {' + '.join(names)}  {self.bundles()[i]}" for i, names in sorted(by_bundle.items()))


def layout(mode: str, trainer, rollout, teachers=(), with_reference: bool = False) -> Layout:
    """Bundles for `trainer` (TrainerConfig), `rollout` (RolloutConfig: the policy's engines) and
    `teachers` (TeacherConfig, each with its engines). The KL reference's rank r joins trainer rank
    r's bundle, and in colocated mode so does engine r: members of a bundle on GPUs time-share the
    largest of their GPU needs, each reserving an equal share of it."""
    on_gpu = trainer.device.startswith("cuda")
    engine_gpus = rollout.engine_gpus if (rollout.engine == "sglang" or on_gpu) else 0.0
    members: dict[str, Member] = {}
    for r in range(trainer.world_size):
        members[f"trainer-{r}"] = Member(f"trainer-{r}", r, trainer.gpus_per_rank if on_gpu else 0.0,
                                         dict(trainer.resources))
        if with_reference:  # frozen, one forward pass per step: beside its rank
            members[f"reference-{r}"] = Member(f"reference-{r}", r, members[f"trainer-{r}"].gpus, dict(trainer.resources))
    nxt = trainer.world_size
    for i in range(rollout.num_engines):
        members[f"engine-{i}"] = Member(f"engine-{i}", i if mode == "colocated" else nxt, engine_gpus,
                                        dict(rollout.engine_resources))
        nxt += mode != "colocated"
    for t in teachers:
        gpus = 1.0 if (t.kind == "sglang" or t.engine.device.startswith("cuda")) else 0.0
        for i in range(t.num_engines):
            members[f"teacher-{t.name}-{i}"] = Member(f"teacher-{t.name}-{i}", nxt, gpus, dict(t.resources))
            nxt += 1
    _share_gpus(members.values())
    return Layout(mode, members)


def _share_gpus(members) -> None:
    by_bundle = defaultdict(list)
    for m in members:
        by_bundle[m.bundle].append(m)
    for group in by_bundle.values():
        users = [m for m in group if m.gpus]
        if len(users) > 1:
            share = max(m.gpus for m in users) / len(users)
            for m in users:
                m.gpus = share


def check_colocation(mode: str, trainer, rollout, max_staleness: int) -> None:
    """What colocated mode needs of the rest of the config (ValueError naming the key)."""
    if mode != "colocated":
        return
    if max_staleness != 0:
        raise ValueError(f"placement.mode=colocated with rollout.max_staleness={max_staleness}: a colocated engine's "
                         "memory is released while its trainer rank trains, so generation cannot overlap training; "
                         "use max_staleness 0 (synchronous) or placement.mode=disaggregated")
    if rollout.num_engines > trainer.world_size:
        raise ValueError(f"placement.mode=colocated puts engine i beside trainer rank i: rollout.num_engines "
                         f"({rollout.num_engines}) must be at most trainer.world_size ({trainer.world_size})")
    if trainer.resources and rollout.engine_resources and set(trainer.resources) != set(rollout.engine_resources):
        raise ValueError(f"placement.mode=colocated: trainer.resources {trainer.resources} and rollout.engine_resources "
                         f"{rollout.engine_resources} pin a rank and its engine to different nodes")


class RunPlacement:
    """The run's Ray placement group (Ray must be up) and each member's actor options."""

    def __init__(self, plan: Layout, cfg: PlacementConfig, name: str | None = None):
        import ray
        from ray.util.placement_group import placement_group

        self.layout, self.cfg = plan, cfg
        self.group = placement_group(plan.bundles(), strategy=cfg.strategy, name=name or "")
        try:
            ray.get(self.group.ready(), timeout=cfg.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise RuntimeError(
                f"Ray could not reserve the run's placement group in {cfg.timeout_s:.0f}s "
                f"(placement.strategy={cfg.strategy}, placement.timeout_s): bundles\n{plan.describe()}\n"
                f"cluster resources: {ray.cluster_resources()}") from None

    def options(self, member: str) -> dict:
        """Keyword arguments of `ActorClass.options` that put `member` in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        m = self.layout.members[member]
        return {"num_cpus": MEMBER_CPUS, "num_gpus": m.gpus, "resources": {},  # the bundle's node has them
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=m.bundle)}

    def has(self, member: str) -> bool:
        return member in self.layout.members

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception:  # Ray already shut down: the group went with it
            pass


def placement_group_of_this_actor() -> str | None:
    """The id of the placement group Ray scheduled this actor in (None: none)."""
    import ray

    return ray.get_runtime_context().get_placement_group_id()
