"""Teacher Manager under a memory budget: four teachers (tiny Qwen3s with different weights, each its
own embedded engine) score an async stream of groups that go to the teachers in turn, once with a
budget of one teacher's weights (the others released and resumed on demand) and once with all four
resident, side by side in one run.

    python benchmarks/teacher_memory.py [--groups 64] [--group-size 8] [--in-flight 8]

Prints a table, then one JSON object as the last line:
{"teachers": 4, "one_teacher_bytes", "peak_resident_bytes", "peak_over_one", "swaps",
 "samples_per_s_budget", "samples_per_s_all_resident", "ratio": budget / all resident}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from contextlib import ExitStack

from loongsage.models.config import TinyModelSpec
from loongsage.models.factory import build_tiny_model
from loongsage.rollout.launcher import launch_engine
from loongsage.rollout.router import Router
from loongsage.sample import Group, Sample
from loongsage.teachers.config import TeacherConfig
from loongsage.teachers.manager import Teacher, TeacherManager


def workload(groups: int, size: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(10, 100) for _ in range(16)]
        samples = []
        for _ in range(size):
            n = rng.randrange(8, 40)
            samples.append(Sample(prompt, [rng.randrange(10, 100) for _ in range(n)], [1] * n, [0.0] * n, [0] * n))
        out.append(Group(samples, [0.0] * size))
    return out


async def run(urls: list[str], models: list[str], budget: float | None, groups: list[Group], in_flight: int,
              top_k: int) -> dict:
    teachers = [Teacher(TeacherConfig(name=f"t{i}", model=m), Router([u]), 0) for i, (u, m) in enumerate(zip(urls, models))]
    for t in teachers:
        t.weight_bytes = int((await t.router.clients[0].model_info())["weight_bytes"])
        await t.router.clients[0].resume_memory()  # every run starts with all weights in memory
    mgr = await TeacherManager(teachers, budget, top_k).start()
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, g: Group) -> None:
        async with gate:
            await mgr.score_group(g, {f"t{i % len(teachers)}": 1.0})
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, g) for i, g in enumerate(groups)])
    seconds = time.perf_counter() - t0
    metrics = mgr.metrics()
    await mgr.close()
    samples = sum(len(g.samples) for g in groups)
    return {"seconds": round(seconds, 3), "samples_per_s": round(samples / seconds, 2),
            "swaps": int(metrics["teacher/swaps"]), "peak_resident_bytes": int(metrics["teacher/peak_resident_bytes"]),
            "one_teacher_bytes": teachers[0].weight_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teachers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=8, help="groups being scored at once (the async pipeline)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=4, intermediate_size=4 * args.hidden,
                         max_position_embeddings=128)
    groups = workload(args.groups, args.group_size)
    with ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-teachers-"))
        models = [str(build_tiny_model(f"{root}/t{i}", spec.model_copy(update={"seed": 100 + i})))
                  for i in range(args.teachers)]
        engines = [stack.enter_context(launch_engine(m, extra_args=["--max-running", "128", "--context-length", "128"]))
                   for m in models]
        urls = [e.url for e in engines]
        one = asyncio.run(run(urls, models, None, groups[:2], 1, args.top_k))["one_teacher_bytes"]
        budget = asyncio.run(run(urls, models, one, groups, args.in_flight, args.top_k))
        resident = asyncio.run(run(urls, models, None, groups, args.in_flight, args.top_k))
    print(f"{'mode':<14}{'samples/s':>10}{'swaps':>7}{'peak resident MB':>18}")
    for name, r in (("budget of one", budget), ("all resident", resident)):
        print(f"{name:<14}{r['samples_per_s']:>10}{r['swaps']:>7}{r['peak_resident_bytes'] / 2**20:>18.2f}")
    print(json.dumps({"teachers": args.teachers, "one_teacher_bytes": one,
                      "peak_resident_bytes": budget["peak_resident_bytes"],
                      "peak_over_one": round(budget["peak_resident_bytes"] / one, 3), "swaps": budget["swaps"],
                      "samples_per_s_budget": budget["samples_per_s"],
                      "samples_per_s_all_resident": resident["samples_per_s"],
                      "ratio": round(budget["samples_per_s"] / resident["samples_per_s"], 3)}))


if __name__ == "__main__":
    main()
