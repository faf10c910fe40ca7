"""Engines that fail: the router sends a failed call again elsewhere (new attempt id), the
supervisor restarts an engine that is gone or hung and gives it the current weights, and a run
whose only engine first answers HTTP 500 for a while, is then killed (-9) and later hung (SIGSTOP)
completes with every prompt accounted once and no train-inference gap from the restarted engines."""
from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web
from test_train_e2e import EASY

from helpers import processes_mentioning
from loongsage.controller.supervisor import EngineSupervisor, Fleet, Strikes
from loongsage.rollout.config import EngineHealthConfig
from loongsage.rollout.router import Router


def test_strikes_restart_a_gone_engine_at_once_and_an_unhealthy_one_after_enough_checks():
    s = Strikes(limit=3)
    assert s.verdict(0, "gone") == "restart"
    assert [s.verdict(1, "unhealthy") for _ in range(3)] == ["wait", "wait", "restart"]
    assert s.verdict(2, "unhealthy") == "wait" and s.verdict(2, "ok") == "ok"  # a good check clears the strikes
    assert s.verdict(2, "unhealthy") == "wait"
    s.reported.add(3)  # health says fine, but calls failed on it since: a strike all the same
    assert s.verdict(3, "ok") == "wait" and s.verdict(3, "ok") == "ok"


def test_a_closed_supervisor_takes_no_report_of_engines_stopped_on_purpose():
    """A run's teardown stops its engines while a cancelled producer's abort may still be in flight:
    that failed call must not take the engine out, log a failure, or start a check."""
    async def report_twice():
        router = Router([], clients=[object()])
        supervisor = EngineSupervisor([Fleet("engine", router, None)], EngineHealthConfig(check_every_s=60),
                                      on_fatal=lambda exc: None)
        supervisor._spawn = lambda coro: coro.close()  # the check itself is not what this test is about
        router._report(0, ConnectionError("went away"))
        reported = (router.up[0], set(supervisor.strikes.reported))
        router.up[0] = True
        supervisor.strikes.reported.clear()
        supervisor.close()
        router._report(0, ConnectionError("stopped at the end of the run"))
        return reported, (router.up[0], set(supervisor.strikes.reported))

    while_running, after_close = asyncio.run(report_twice())
    assert while_running == (False, {("engine", 0)})
    assert after_close == (True, set())


async def _failing_server(status: int | None):
    """A real HTTP server that fails every /generate: with `status`, or by dropping the connection."""
    seen: list[str] = []

    async def generate(request: web.Request):
        seen.append((await request.json())["rid"])
        if status is None:
            request.transport.close()
            return web.Response()
        return web.json_response({"error": {"message": "boom"}}, status=status)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize("failure", [500, None, "refused"])
def test_a_call_an_engine_fails_is_sent_again_to_another_engine_with_a_new_attempt_id(engine, failure):
    async def main():
        runner, url, seen = (None, "http://127.0.0.1:9", []) if failure == "refused" \
            else await _failing_server(failure)
        reports = []
        router = Router([url, engine.url], engine_retries=2)
        router.on_engine_failure = lambda idx, exc: reports.append(idx)
        try:
            out = (await router.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0}, rid="call-7"))[0]
            streamed = [o async for o in router.generate_stream([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0},
                                                                rid="call-8")][-1]
        finally:
            await router.aclose()
            if runner is not None:
                await runner.cleanup()
        return out, streamed, router, reports, seen

    out, streamed, router, reports, seen = asyncio.run(main())
    assert len(out.output_ids) == 4 and out.finish_type == "length"
    assert streamed.output_ids == out.output_ids  # greedy: the stream's retry gives the same tokens
    assert router.retried >= 1 and reports and set(reports) == {0}
    if failure != "refused":
        assert seen[0] == "call-7"
    assert router.inflight == {} and router.outstanding == [0, 0]


def test_a_call_waits_for_an_engine_while_none_is_up_and_gives_up_with_the_reason(engine):
    async def main():
        router = Router([engine.url], engine_wait_s=0.5)
        router.mark_down(0)
        with pytest.raises(RuntimeError, match="no inference engine up"):
            await router.generate([1, 2], {"max_new_tokens": 2})
        waiting = asyncio.create_task(router.generate([1, 2], {"max_new_tokens": 2}))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await router.mark_up(0)
        out = await waiting
        await router.aclose()
        return out[0]

    assert len(asyncio.run(main()).output_ids) == 2


def _engine_pids(prefix: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in args and prefix.encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


async def _when_step(run: Path, step: int, task: asyncio.Task) -> None:
    from loongsage.metrics import read_metrics

    deadline = time.time() + 600
    while not (run / "metrics.jsonl").is_file() or not any(r["step"] >= step and "reward/mean" in r
                                                           for r in read_metrics(run)):
        if task.done():
            task.result()  # the run's own error
            raise AssertionError(f"the run ended before step {step}")
        assert time.time() < deadline
        await asyncio.sleep(0.2)


@pytest.mark.slow
def test_a_run_outlives_its_engine_failing_then_killed_then_hung(ray_session, tmp_path, arith_caches):
    from loongsage.config import load_config
    from loongsage.controller.bootstrap import ensure_base_policy
    from loongsage.controller.ledger import read_ledger
    from loongsage.controller.train import train
    from loongsage.metrics import read_metrics

    run = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    clean = EASY + arith_caches[0] + [
        f"run_dir={run}", "rollout.max_staleness=1", "train.steps=10", "train.eval_every=10",
        "rollout.health.check_every_s=0.5", "rollout.health.timeout_s=5", "rollout.health.failures=2"]
    cfg = load_config("recipes/arith_grpo.yaml", clean + ["engine.inject_errors=40:60"])  # requests 41..100: HTTP 500
    faults = []

    async def main():
        # the session's cached bootstrap, built without the faults when this test is the first to need it
        # (its dev evaluations are a few batched requests: 60 failures in a row would exhaust their retries)
        await ensure_base_policy(load_config("recipes/arith_grpo.yaml", clean))
        task = asyncio.create_task(train(cfg))
        await _when_step(run, 3, task)
        prefix = (run / "shm_prefix").read_text()
        (pid,) = _engine_pids(prefix)
        os.kill(pid, signal.SIGKILL)
        faults.append(("kill -9", pid))
        await _when_step(run, 6, task)
        (pid,) = _engine_pids(prefix)
        assert pid != faults[0][1]
        os.kill(pid, signal.SIGSTOP)  # hung: alive, answers nothing
        faults.append(("SIGSTOP", pid))
        return await task

    summary = asyncio.run(main())
    steps = [r for r in read_metrics(run) if r["step"] > 0 and "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 11)), summary
    restarts = steps[-1]["engine/restarts"]  # the 500s restart it too when they outlast two checks
    assert restarts in (2, 3)
    assert sum(r["samples/retried"] for r in steps) > 0
    gaps = [r["mismatch/abs_logprob_diff"] for r in steps if r["mismatch/abs_logprob_diff"] is not None]
    assert gaps and max(gaps) < 1e-4  # the restarted engines serve the trainer's weights under the right version
    assert all(r["staleness/max"] <= 1 for r in steps)
    ledger = read_ledger(run / "prompts.jsonl")
    assert sorted(x["cursor"] for x in ledger) == list(range(len(ledger)))  # each prompt drawn: one fate
    trained = [x for x in ledger if x["fate"] == "trained"]
    assert len(trained) * 8 == sum(r["samples/trained"] for r in steps)
    print(json.dumps({"faults": ["500 x 60 after 40 requests", *(f for f, _ in faults)], "engine/restarts": restarts,
                      "samples/retried": sum(r["samples/retried"] for r in steps),
                      "samples/aborted_by_system": sum(r.get("samples/aborted_by_system", 0) for r in steps),
                      "ledger": dict(Counter(x["fate"] for x in ledger)), "max_gap": max(gaps),
                      "eval": [summary["eval_before"], summary["eval_after"]]}))
    assert len(set(_started_pids(run / "logs" / "engine-0.log"))) == 1 + restarts  # each server's log, in the run
    assert not processes_mentioning(str(run))  # the hung engine was killed, not left stopped
    assert not [p for p in (faults[1][1],) if Path(f"/proc/{p}").exists()]
    deadline = time.time() + 30
    while set(os.listdir("/dev/shm")) - shm_before and time.time() < deadline:
        time.sleep(0.5)
    assert not set(os.listdir("/dev/shm")) - shm_before  # the killed engine's weight buffers too


def test_a_restarted_engine_serves_the_trainers_current_weights_over_a_rebuilt_mesh(ray_session, tiny_model):
    """Version 2 trained but not yet sent, the engine killed (-9): its successor comes up from the
    initial weights, the rebuilt TransferMesh gives it version 2 (labelled so), its logprobs are the
    trainer's, and the dead engine's shared weight buffers are gone with it."""
    import ray
    import torch

    from helpers import policy_batch
    from loongsage.algo.config import LossConfig
    from loongsage.cluster.config import RayConfig
    from loongsage.controller.runtime import Runtime
    from loongsage.engine.config import EngineConfig
    from loongsage.rollout.config import RolloutConfig
    from loongsage.sample import Sample
    from loongsage.trainer.batch import collate
    from loongsage.trainer.config import TrainerConfig

    async def main():
        rt = await Runtime.start(tiny_model, TrainerConfig(lr=1e-2), EngineConfig(max_running=16, context_length=128),
                                 RolloutConfig(), RayConfig())
        try:
            for v in (1, 2):
                await rt.trainers.train_steps(policy_batch(seed=v), LossConfig(is_mode="none"))
                if v == 1:
                    await rt.sync.push(1)
            shm = lambda: sorted(f for f in os.listdir("/dev/shm") if f.startswith(rt.shm_prefix))
            before = shm()
            os.kill(ray.get(rt.engines.actors[0].pid.remote()), signal.SIGKILL)
            await rt.replace_engine(0)
            after = shm()
            info = await rt.router.clients[0].model_info()
            out = (await rt.router.generate([10, 11, 12], {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True},
                                            return_logprob=True))[0]
            batch = collate([Sample([10, 11, 12], out.output_ids, [1] * 8, out.output_logprobs, out.output_versions)], 0)
            lp, _ = await rt.trainers.compute_logprobs(batch)
            gap = float(((lp - batch.behavior_logprobs).abs() * batch.loss_mask).max())
            return info, out, gap, before, after
        finally:
            await rt.close()

    info, out, gap, before, after = asyncio.run(main())
    assert str(info["weight_version"]) == "2" and set(out.output_versions) == {2}
    assert gap < 1e-5
    assert len(set(before) - set(after)) == 2 and len(set(after) - set(before)) == 2, (before, after)  # 2 buffers each
    assert torch.isfinite(torch.tensor(out.output_logprobs)).all()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
def test_a_run_whose_trainer_dies_stops_naming_the_resume_command(tmp_path, arith_caches):
    """`loongsage train` with its trainer rank killed (-9) after the step-2 checkpoint: the command
    ends (non-zero) within a minute, saying why and how to resume; nothing it started is left."""
    import subprocess
    import sys

    run = tmp_path / "run"
    cfg = EASY + arith_caches[0] + [f"run_dir={run}", "train.steps=40", "train.save_every=2", "train.eval_every=40"]
    proc = subprocess.Popen([sys.executable, "-m", "loongsage.cli", "train", "recipes/arith_grpo.yaml", *cfg],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        tracker, deadline = run / "checkpoints" / "latest", time.time() + 900
        while not (tracker.is_file() and tracker.read_text().strip() == "step_2"):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        (trainer,) = [p for p in _descendants(proc.pid)
                      if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::TrainerRank")]
        os.kill(trainer, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert f"loongsage train --resume {run}" in err and "stopped" in err, err[-3000:]
    assert not processes_mentioning(str(run))


def test_the_stop_message_names_the_resume_command_only_where_a_checkpoint_exists(tmp_path):
    from loongsage.controller.checkpoint import stopped_message

    assert "before its first checkpoint" in stopped_message(tmp_path, RuntimeError("trainer died"))
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_4" / "controller.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    msg = stopped_message(tmp_path, RuntimeError("trainer died"))
    assert "RuntimeError: trainer died" in msg and f"loongsage train --resume {tmp_path}" in msg and "step_4" in msg


def test_a_teacher_engine_killed_comes_back_with_its_weights_and_its_residency(ray_session, tiny_model, tmp_path):
    """A teacher's only engine killed (-9) while it is resident, then again while it is released:
    each time the supervisor restarts it; scoring waits and then gives exactly the scores from
    before; the second successor comes up released, as the Teacher Manager left the teacher. Its
    three servers wrote one log, in the folder given."""
    import functools

    import ray

    from loongsage.controller.supervisor import EngineSupervisor, Fleet
    from loongsage.engine.config import EngineConfig
    from loongsage.rollout.client import EngineClient
    from loongsage.rollout.config import EngineHealthConfig, RolloutConfig
    from loongsage.rollout.engine_group import EngineGroup
    from loongsage.sample import Group, Sample
    from loongsage.teachers.config import TeacherConfig
    from loongsage.teachers.launch import replace_teacher_engine
    from loongsage.teachers.manager import Teacher, TeacherManager

    scratch_before = _engine_scratch_dirs()
    engines = EngineGroup(tiny_model, EngineConfig(max_running=8, context_length=64), RolloutConfig(),
                          role="teacher-a", log_dir=str(tmp_path / "logs"))
    teacher = Teacher(TeacherConfig(name="a", model=tiny_model),
                      Router([], clients=[EngineClient(engines.urls[0], engines.api_key)], engine_wait_s=120), 1,
                      engines)
    manager = TeacherManager([teacher], None, top_k=3)
    errors = []
    health = EngineHealthConfig(check_every_s=0.3, timeout_s=2, failures=2)

    def kill() -> int:
        pid = ray.get(engines.actors[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        return pid

    async def score() -> tuple:
        s = Sample([10, 11, 12], [30, 31, 32], [1, 1, 1], [0.0] * 3, [0] * 3)
        await manager.score_group(Group([s], [0.0]), {"a": 1.0})
        return s.teacher["a"].logprobs, s.teacher["a"].top_logprobs

    async def main():
        await manager.start()
        supervisor = EngineSupervisor([Fleet("teacher-a", teacher.router,
                                             functools.partial(replace_teacher_engine, None, manager, None, "a"))],
                                      health, errors.append)
        watching = asyncio.create_task(supervisor.run())
        try:
            before = await score()
            kill()
            after_kill = await asyncio.wait_for(score(), 120)  # waits for the successor
            await manager._release(teacher)  # the manager swapped it out
            kill()
            while supervisor.restarts < 2 or supervisor.restarting:
                await asyncio.sleep(0.1)
            info = await teacher.router.clients[0].model_info()
            await manager.ensure_resident("a")  # swapped back in on demand
            again = await score()
            return before, after_kill, again, info, supervisor.restarts
        finally:
            watching.cancel()
            await manager.close()
            engines.shutdown()

    before, after_kill, again, info, restarts = asyncio.run(main())
    assert not errors and restarts == 2
    assert before == after_kill == again
    assert info["memory_released"] is True
    assert os.listdir(tmp_path / "logs") == ["teacher-a-0.log"]
    assert len(set(_started_pids(tmp_path / "logs" / "teacher-a-0.log"))) == 3  # first server, two successors
    assert _engine_scratch_dirs() == scratch_before  # the one killed while released had its weights saved there


def _engine_scratch_dirs() -> set[str]:
    return set(glob.glob(f"{tempfile.gettempdir()}/loongsage-engine-*"))


def _started_pids(log: Path) -> list[int]:
    """The pids of the servers that started writing `log` (each says so on its first line)."""
    return [int(line.split("(pid ")[1].split(")")[0]) for line in log.read_text().splitlines()
            if line.startswith("loongsage engine (pid ")]


def test_an_engine_without_a_log_folder_takes_its_temporary_log_with_it(tiny_model):
    from loongsage.rollout.launcher import launch_engine

    with launch_engine(tiny_model, extra_args=["--max-running", "4", "--context-length", "64"]) as ep:
        assert _started_pids(Path(ep.log_path)) == [ep.proc.pid]
        assert Path(ep.log_path).parent == Path(ep.scratch)
    assert not Path(ep.scratch).exists()
