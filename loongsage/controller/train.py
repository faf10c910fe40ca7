"""`loongsage train`: the RL run loop, top to bottom.

    producer task (controller/producer.py) ──────────────── consumer: this loop
      waits for room in the buffer, admits a prompt           takes B in-window groups worth training
      ─► rollout.group (single-turn, white-box or black-box:    from the buffer (buffer.take)
         router ─► engines, Ray actors over HTTP):            ─► advantages ─► TrainBatch
         n samples + behaviour logprobs + per-token versions  ─► trainer ranks (Ray, FSDP2 / Megatron):
         + rewards                                               train_step (proximal = its own forward) ─► v+1
      ─► buffer.put (or fail / cancel)                        ─► weight update task (overlaps the next
                                                                 train step): TransferMesh delivers v+1
                                                                 (receivers held by the pause mode,
                                                                 version confirmed, checksums when due);
                                                                 then buffer.advance(), and too-old
                                                                 in-flight groups are cancelled

Batch t + 1 is taken from the buffer and collated while step t trains, so the trainer goes from one
step to the next without waiting on the controller. With colocated placement (synchronous only) the
engines hand their devices to the trainer around each train step (controller/colocation.py).

Back-pressure is the sample buffer's window (loongsage/buffer.py, strategies in window.py): at most
(k + 1 + v) * B groups are ever admitted by version v, so generation runs at most k versions ahead of
training. With k = 0 nothing is admitted until the weights of the previous step are on the engines:
the synchronous schedule, by the same code path. Groups found stale anyway are evicted and counted
(`samples/dropped_stale`). The producer only puts into the buffer; this loop only takes from it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections import Counter, defaultdict

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoTokenizer

from loongsage.agentflow.rollouts import make_rollout
from loongsage.algo import advantages as adv
from loongsage.algo.config import LossConfig
from loongsage.config import RunConfig, dump_config
from loongsage.controller.bootstrap import ensure_base_policy, teacher_models
from loongsage.controller.checkpoint import controller_state, latest_checkpoint, read_state, save_checkpoint
from loongsage.controller.colocation import Colocation
from loongsage.controller.ledger import PromptLedger
from loongsage.controller.runtime import (
    SHM_RECORD,
    Runtime,
    record_shm_prefix,
    record_transfer_plan,
    remove_crashed_shm,
)
from loongsage.controller.sources import admissions_held, evaluate_sources, source_metrics, start_sources, stratify
from loongsage.controller.supervisor import EngineSupervisor, Fleet, recover_weight_update
from loongsage.metrics import MetricsWriter, read_metrics, truncate_metrics
from loongsage.rollout.engine_times import ENGINE_SPLIT, EngineTimes
from loongsage.rollout.resume import system_failure
from loongsage.rollout.single_turn import RolloutSetup
from loongsage.sample import Group, Sample
from loongsage.tasks.base import task_spec
from loongsage.teachers.launch import launch_teacher_engines, replace_teacher_engine, start_teachers, stop_teachers
from loongsage.timeline import Timeline
from loongsage.trainer.batch import collate


async def train(cfg: RunConfig, resume: bool = False) -> dict:
    """`resume`: continue `cfg.run_dir` from its last complete checkpoint (`controller/checkpoint.py`)."""
    console = Console()
    run_dir = cfg.resolve_run_dir()
    ckpt = latest_checkpoint(run_dir) if resume else None
    state = read_state(ckpt, cfg) if ckpt else None
    dump_config(cfg, run_dir / "config.yaml")
    base = await ensure_base_policy(cfg, console)
    teacher_dirs = await teacher_models(cfg, str(base), console) if cfg.teachers else []
    timeline = Timeline()  # its first track is the start-up
    t_start = timeline.t0  # wall clock from here includes start-up (Ray, engines), not the bootstraps
    tok = AutoTokenizer.from_pretrained(base)
    remove_crashed_shm(run_dir)
    logs = str(run_dir / "logs")  # the engines' servers' logs
    rt = await Runtime.start(str(ckpt or base), cfg.trainer, cfg.engine, cfg.rollout, cfg.ray,
                             with_reference=cfg.algo.loss.kl_coef > 0, transfer=cfg.transfer, reference_dir=str(base),
                             placement=cfg.placement, teachers=cfg.teachers,
                             launch_teachers=functools.partial(launch_teacher_engines, cfg, teacher_dirs,
                                                               log_dir=logs) if cfg.teachers else None,
                             log_dir=logs)  # teachers' engines start beside the run's own
    start = 0 if state is None else state.step
    for phase, t0, t1 in rt.startup:
        timeline.add("start-up", phase, t0, t1)
    record_shm_prefix(run_dir, rt.shm_prefix)
    record_transfer_plan(run_dir, rt.sync)
    if state is not None:
        truncate_metrics(run_dir, state.step)
    metrics = MetricsWriter(run_dir, cfg.metrics, resumed_at=state.step if state else None, run_name=run_dir.name,
                            config=cfg.model_dump(mode="json"))
    ledger = PromptLedger(run_dir / "prompts.jsonl", state.ledger_lines if state else 0,
                          state.settled if state else None)
    teachers = sources = watching = None
    producing: list[asyncio.Task] = []
    main = asyncio.current_task()
    colocation = Colocation(rt.router, rt.trainers, timeline) if cfg.placement.mode == "colocated" else None
    replace_engine = colocation.replacing(rt.replace_engine) if colocation else rt.replace_engine
    supervisor = EngineSupervisor([Fleet("engine", rt.router, replace_engine)], cfg.rollout.health,
                                  lambda exc: main.cancel(), console, timeline)
    pending = upcoming = None
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if cfg.teachers:  # teachers score each group as it completes, inside the producers' tasks
            groups, rt.teacher_engines = rt.teacher_engines, None  # the manager stops them from here on
            with timeline.span("start-up", "Teacher Manager"):
                teachers = await start_teachers(cfg, teacher_dirs, str(base), rt.shm_prefix, rt.trainers, timeline,
                                                rt.placement, groups)
            for name, t in teachers.teachers.items():  # their engines are watched and restarted too
                supervisor.add(Fleet(f"teacher-{name}", t.router,
                                     functools.partial(replace_teacher_engine, cfg, teachers, rt.trainers, name)))
        if cfg.train.controller_cpu_affinity and cores is not None:  # after start-up: Ray's processes keep all cores
            os.sched_setaffinity(0, cfg.train.controller_cpu_affinity)
        score = (lambda group, src: teachers.score_group(group, src.teachers)) if teachers else None
        t_sources = time.perf_counter()
        sources = start_sources(cfg, rt.router, tok, str(base), timeline, after_group=score)
        for src in sources:
            src.producer.ledger = ledger
        if cfg.rollout.health.check_every_s > 0:  # engines that die or hang are restarted
            watching = asyncio.create_task(supervisor.run())
        keep = group_filter(cfg)
        batch_spec = (tok.pad_token_id, [t.name for t in cfg.teachers], teachers.top_k if teachers else 0)
        summary: dict = {"run_dir": str(run_dir), "base_policy": str(base)}
        for src in sources:
            await src.rollout.start()
        timeline.add("start-up", "data sources, rollouts", t_sources, time.perf_counter())
        if state is None:
            t_eval = time.perf_counter()
            with timeline.span("eval", "eval 0"):
                first = await evaluate_sources(sources, cfg.train.eval_temperature)
            metrics.write({"step": 0, "version": 0, **first, "time/eval_s": time.perf_counter() - t_eval,
                           "time/elapsed_s": time.perf_counter() - t_start})
        else:  # trainer state, engine version, samplers and windows as the checkpoint left them
            first = await _resume(state, ckpt, rt, sources, run_dir, console)
        summary["eval_before"] = first["eval/accuracy"]
        console.print(f"held-out accuracy before training: {first['eval/accuracy']:.3f}")
        producing = [asyncio.create_task(src.producer.run()) for src in sources]
        engine_times = EngineTimes(lambda: rt.router.clients)
        await engine_times.refresh()  # the baseline: the evaluation before training is not a step's
        clock = _Clock([src.producer.busy for src in sources], t_start, [teachers, supervisor, engine_times])
        # `pending`: (record, weight-update task) of the step whose weights are in flight
        with _progress(console) as bar:
            task = bar.add_task("train", total=cfg.train.steps, reward=0.0, rate=0.0, completed=start)
            upcoming = asyncio.create_task(_next_batch(start + 1, cfg, sources, keep, batch_spec, timeline))
            for step in range(start + 1, cfg.train.steps + 1):
                prepared = await _batch_unless_update_fails(upcoming, pending)
                if colocation is not None:  # the engines give their devices to the trainer for this step
                    if pending is not None:
                        await _finish(await _delivered(pending), clock, metrics, bar, task, timeline)
                        pending = None
                    await colocation.hand_to_trainer()
                training = asyncio.create_task(_train(step, cfg, rt, prepared, timeline))  # overlaps `pending`
                if step < cfg.train.steps:  # batch step + 1 is taken and collated while this step trains
                    upcoming = asyncio.create_task(_next_batch(step + 1, cfg, sources, keep, batch_spec, timeline))
                record = await training
                if colocation is not None:  # and get them back before the weight update
                    await colocation.hand_to_engines()
                    record.update(colocation.metrics())
                for src in sources:  # the batch's groups met their fate
                    for seq in prepared[3].get(src.name, ()):
                        src.producer.settle(seq, "skipped" if record["train/skipped_no_signal"] else "trained", step)
                if pending is not None:
                    await _finish(await _delivered(pending), clock, metrics, bar, task, timeline)
                pending = (record, await _start_weight_update(step, cfg, rt, sources, teachers, timeline,
                                                              changed=not record["train/skipped_no_signal"],
                                                              supervisor=supervisor if watching else None))
                evaluate_now = step % cfg.train.eval_every == 0 or step == cfg.train.steps
                out_of_time = cfg.train.max_minutes and time.perf_counter() - t_start > 60 * cfg.train.max_minutes
                if evaluate_now or out_of_time or (cfg.train.save_every and step % cfg.train.save_every == 0):
                    with admissions_held(sources) if evaluate_now else contextlib.nullcontext():
                        record, pending = await _delivered(pending), None  # the engines serve version `step`
                        if evaluate_now:
                            t_eval = time.perf_counter()
                            with timeline.span("eval", f"eval {step}"):
                                record.update(await evaluate_sources(sources, cfg.train.eval_temperature))
                            record["time/eval_s"] = time.perf_counter() - t_eval
                    await _finish(record, clock, metrics, bar, task, timeline)
                    if cfg.train.save_every and step % cfg.train.save_every == 0:
                        await save_checkpoint(run_dir, f"step_{step}", controller_state(step, cfg, sources, ledger),
                                              rt.trainers)
                if out_of_time:
                    console.print(f"stopping: train.max_minutes={cfg.train.max_minutes} reached at step {step}")
                    break
                if cfg.train.target_accuracy and record.get("eval/accuracy", 0.0) >= cfg.train.target_accuracy:
                    console.print(f"stopping: held-out accuracy {record['eval/accuracy']:.3f} reached "
                                  f"train.target_accuracy={cfg.train.target_accuracy} at step {step}")
                    break
        await save_checkpoint(run_dir, "final", controller_state(step, cfg, sources, ledger), rt.trainers)
        await _stop_producers(producing, sources)  # the engines are free for the final evaluation
        producing = []
        if "eval/accuracy" not in record:  # always end with a held-out evaluation
            record = {"step": step, "version": step, **await evaluate_sources(sources, cfg.train.eval_temperature)}
            metrics.write(record)
        summary.update(eval_after=record["eval/accuracy"], steps=step, train_seconds=time.perf_counter() - t_start)
        summary["sources"] = await source_summary(cfg, sources, first, record, teachers, tok, teacher_dirs)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        console.print(f"held-out accuracy: {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} "
                      f"after {step} steps ({summary['train_seconds']:.0f}s); run dir {run_dir}")
    except asyncio.CancelledError:
        if supervisor.error is not None:  # the engines could not be kept up: the run stops with why
            raise supervisor.error from None
        raise
    finally:
        if watching is not None:
            watching.cancel()
        supervisor.close()  # engines stopped from here on are not failures
        if upcoming is not None:
            upcoming.cancel()
        if pending is not None:
            pending[1].cancel()
        await _stop_producers(producing, sources or [])
        timeline.save(run_dir / "timeline.json")
        metrics.close()
        ledger.close()
        for src in sources or []:
            await src.rollout.stop()
        if teachers is not None:
            await stop_teachers(teachers)
        await rt.close()
        (run_dir / SHM_RECORD).unlink(missing_ok=True)  # its buffers are gone
        if cfg.train.controller_cpu_affinity and cores is not None:
            os.sched_setaffinity(0, cores)
    return summary


async def _resume(state, ckpt, rt: Runtime, sources, run_dir, console: Console) -> dict:
    """Trainer state from `ckpt`, the engines' weights relabelled to its step, each source's sampler
    at its cursor and window at its version; returns the run's first evaluation (step 0)."""
    await rt.trainers.load(str(ckpt))
    await rt.sync.relabel(state.step)
    for src in sources:
        src.producer.sampler.skip_to(state.cursors[src.name])
        src.producer.skip = set(state.settled.get(src.name, ()))
        src.buffer.resume_at(state.step)
    console.print(f"resuming {run_dir} at step {state.step} from {ckpt.name}")
    return next(r for r in read_metrics(run_dir) if r["step"] == 0)


async def _stop_producers(producing: list[asyncio.Task], sources) -> None:
    for t in producing:
        t.cancel()
    for src in sources:
        await src.producer.stop()


async def source_summary(cfg: RunConfig, sources, first: dict, last: dict, teachers, tok, teacher_dirs) -> dict:
    """Per source: held-out accuracy before and after, and each of its teachers' on the same rows
    with the same decoding (the teacher served through the source's own rollout kind)."""
    key = (lambda n: "eval/accuracy") if len(sources) == 1 else (lambda n: f"eval/{n}/accuracy")
    out = {}
    dirs = {t.name: d for t, d in zip(cfg.teachers, teacher_dirs)}
    for src in sources:
        entry = {"eval_before": first[key(src.name)], "eval_after": last[key(src.name)]}
        for name in src.cfg.teachers:
            await teachers.ensure_resident(name)
            rollout = make_rollout(RolloutSetup(teachers.teachers[name].router, tok, dirs[name],
                                                task_spec(src.cfg.task), src.cfg.sampling.sampling_params(),
                                                src.cfg.sampling.max_new_tokens, src.cfg.agent))
            await rollout.start()
            try:
                entry.setdefault("teacher_accuracy", {})[name] = \
                    (await rollout.evaluate(src.eval_rows, cfg.train.eval_temperature))["eval/accuracy"]
            finally:
                await rollout.stop()
        out[src.name] = entry
    return out


def group_filter(cfg: RunConfig):
    """Whether a finished group is worth training: dynamic sampling (not all rewards equal) and every
    `rollout.filters` entry (module:attr or a registered filter) must keep it."""
    from loongsage.extensions import resolve

    filters = [resolve(f, "filter") for f in cfg.rollout.filters]

    def keep(group: Group) -> bool:
        if cfg.rollout.dynamic_sampling and not adv.keep_informative_groups(torch.tensor([group.rewards]))[0]:
            return False
        return all(f(group) for f in filters)
    return keep


async def _next_batch(step: int, cfg: RunConfig, sources, keep, batch_spec, timeline: Timeline
                      ) -> tuple[dict, object, list[Sample]]:
    """Batch `step`: each source's share taken from its buffer, ordered so that every data-parallel
    shard gets every source in proportion, and collated (while the previous step trains)."""
    with timeline.span("controller: wait for batch", f"batch {step}"):
        groups, sampled, dropped = await _take_batch(step, cfg, sources, keep)
    # every mini-batch's share of every data-parallel rank gets each source in proportion
    samples = stratify([s for g in groups for s in g.samples], cfg.trainer.data_parallel_size * cfg.algo.mini_batches)
    if samples and not has_learning_signal(samples, cfg.algo.loss):
        samples = []
    record: dict = {"step": step, "version": step, "samples/trained": len(samples),
                    "samples/dropped_stale": dropped, "samples/filtered_groups": len(sampled) - len(groups),
                    "train/skipped_no_signal": float(not samples)}
    for src in sources:  # the system's aborts: masked rollouts, and model calls it continued
        for name, n in src.producer.take_counts().items():
            record[f"samples/{name}"] = record.get(f"samples/{name}", 0) + n
    record.update(_reward_metrics(sampled))
    record.update(_agent_metrics(sampled))
    record.update(source_metrics([src.name for src in sources], sampled, samples))
    pad, teachers, top_k = batch_spec
    batch = collate(samples, pad, teachers, top_k, trained_version=step - 1) if samples else None
    seqs = defaultdict(set)  # the groups taken: not trained until this batch is (checkpoints)
    for g in groups:
        seqs[g.source].add(g.seq)
    return record, batch, samples, seqs


def has_learning_signal(samples: list[Sample], loss: LossConfig) -> bool:
    """Whether the batch can move the policy: some advantage is non-zero, or the loss has a KL or
    entropy term. Without one the step is skipped: the gradient would be zero, yet Adam's momentum
    alone would keep pushing the weights the way the last batches did (on a sparse-reward task that
    drift can erase the behaviour that earns rewards before any reward arrives to stop it)."""
    return (loss.kl_coef > 0 or loss.entropy_coef > 0 or loss.distill.active
            or any(s.advantage != 0.0 for s in samples))


async def _train(step: int, cfg: RunConfig, rt: Runtime, prepared: tuple[dict, object, list[Sample]],
                 timeline: Timeline) -> dict:
    record, batch, samples, _ = prepared
    t_train = time.perf_counter()
    # null unless the trainer measures them: nothing trained, or no token of version step - 1
    record.update({"mismatch/kl": None, "mismatch/abs_logprob_diff": None})
    if batch is not None:
        if cfg.algo.needs_proximal_pass:  # otherwise the update's own forward gives them (and the gap)
            batch.proximal_logprobs, _ = await rt.trainers.compute_logprobs(batch)
        if rt.reference is not None:
            batch.ref_logprobs, _ = await rt.reference.compute_logprobs(batch)
        record.update(await rt.trainers.train_steps(batch, cfg.algo.loss, cfg.algo.mini_batches, cfg.algo.epochs))
        record.update(_staleness_metrics(step, samples))
    else:  # no learning signal arrived: no update (the gap is not measured); version and schedule advance
        record.update(await rt.trainers.skip_step())
        record.update({"staleness/mean": 0.0, "staleness/max": 0.0})
    record["time/train_s"] = time.perf_counter() - t_train
    timeline.add("trainer: train", f"train {step}", t_train, time.perf_counter())
    return record


async def _finish(record: dict, clock: _Clock, metrics: MetricsWriter, bar: Progress, task,
                  timeline: Timeline) -> None:
    record.update(await clock.lap(record["time/train_s"]))
    timeline.count("engines: time split (s per step)", {k.removeprefix("engine/"): record[k] for k in ENGINE_SPLIT
                                                        if k in record})
    metrics.write(record)
    bar.update(task, advance=1, reward=record["reward/mean"], rate=record["samples/trained"] / record["time/step_s"])


async def _take_batch(step, cfg: RunConfig, sources, keep):
    """Each source's `prompts_per_step` groups in the window worth training (`keep`); stale ones are
    evicted, the rest discarded and replaced, up to a per-step cap; then their advantages."""
    rounds = cfg.rollout.max_sampling_rounds
    taken = await asyncio.gather(*[src.buffer.take(step, src.cfg.prompts_per_step, rounds * src.cfg.prompts_per_step,
                                                   keep) for src in sources])
    groups = [g for t in taken for g in t.groups]
    if groups:
        advantages = adv.compute(cfg.algo.advantage, torch.tensor([g.rewards for g in groups]))
        for g, a in zip(groups, advantages):
            g.assign_advantages(a.tolist())
    return groups, [g for t in taken for g in t.sampled], sum(t.dropped_samples for t in taken)


async def _start_weight_update(step, cfg: RunConfig, rt: Runtime, sources, teachers, timeline: Timeline,
                               changed: bool = True, supervisor: EngineSupervisor | None = None) -> asyncio.Task:
    """Version `step` to the engines: the trainer side is submitted now (ordered before the next
    train step, which then overlaps the transfer); the returned task feeds the engines (held by
    the pause mode), confirms the version, advances every source's window and cancels in-flight
    groups that can no longer be trained in time; teachers that follow the student get it when due.
    A step that trained nothing (`changed` false) sends no weights: the engines relabel theirs.
    The mesh is held from here to the end of the delivery (an engine restart rebuilds it between);
    an engine failing the delivery is the `supervisor`'s to restore."""
    await rt.sync_lock.acquire()
    try:
        begun = rt.sync.begin(step) if changed else None
    except BaseException:
        rt.sync_lock.release()
        raise

    async def deliver() -> dict:
        try:
            try:
                with timeline.span("weight sync", f"sync v{step}"):
                    # receivers held (pause mode) and confirmed by the mesh
                    out = await (rt.sync.deliver(step, begun) if changed else rt.sync.relabel(step))
            finally:
                rt.sync_lock.release()
        except Exception as exc:  # an engine died during the update: restarted, every engine gets current weights
            if supervisor is None or system_failure(exc) is None:
                raise
            out = await recover_weight_update(supervisor, rt, step)
        cancelled = 0
        for src in sources:
            src.buffer.advance()
            cancelled += await src.producer.cancel_too_old() * src.cfg.sampling.n
        out["samples/cancelled"] = cancelled
        if teachers is not None:
            out.update(await teachers.follow_student(step))
        return out

    return asyncio.create_task(deliver())


async def _batch_unless_update_fails(upcoming: asyncio.Task, pending: tuple[dict, asyncio.Task] | None):
    """The next batch; but a weight update that fails meanwhile ends the wait with its error (in a
    synchronous run the batch waits for that update's version, so it would wait forever)."""
    if pending is not None and not pending[1].done():
        await asyncio.wait([upcoming, pending[1]], return_when=asyncio.FIRST_COMPLETED)
    if pending is not None and pending[1].done() and not pending[1].cancelled() and pending[1].exception():
        raise pending[1].exception()
    return await upcoming


async def _delivered(pending: tuple[dict, asyncio.Task]) -> dict:
    record, update = pending
    record.update(await update)
    return record


class _Clock:
    """Per-step wall time (between two finished steps), the busy fractions of generation and
    training within it, and the metrics of the run's machinery (teachers, engine supervision)."""

    def __init__(self, busy: list, t_start: float, machinery: list | None = None):
        self.busy, self.t_start = busy, t_start
        self.machinery = [m for m in machinery or [] if m is not None]  # each with .metrics()
        self._t, self._gen = time.perf_counter(), self._generating()

    def _generating(self) -> float:
        return max(b.now() for b in self.busy)  # sources generate concurrently: the busiest one

    async def lap(self, train_s: float) -> dict[str, float]:
        for part in self.machinery:
            if hasattr(part, "refresh"):
                await part.refresh()
        now, gen = time.perf_counter(), self._generating()
        total = max(now - self._t, 1e-9)
        out = {"time/step_s": total, "time/generate_s": gen - self._gen,
               "time/generate_busy_frac": min(1.0, (gen - self._gen) / total),
               "time/train_busy_frac": min(1.0, train_s / total), "time/elapsed_s": now - self.t_start}
        self._t, self._gen = now, gen
        for part in self.machinery:
            out.update(part.metrics())
        return out


def _staleness_metrics(step: int, samples: list[Sample]) -> dict[str, float]:
    staleness = [(step - 1) - s.min_version for s in samples]
    out = {"staleness/mean": sum(staleness) / len(staleness), "staleness/max": float(max(staleness))}
    for value, count in sorted(Counter(staleness).items()):
        out[f"staleness/hist/{value}"] = count
    return out


def _reward_metrics(groups: list[Group]) -> dict[str, float]:
    by_tag = defaultdict(list)
    for g in groups:
        by_tag[g.tag].extend(g.rewards)
    allr = [r for v in by_tag.values() for r in v]
    out = {"reward/mean": sum(allr) / len(allr) if allr else 0.0}
    for tag, v in by_tag.items():
        out[f"reward/{tag}/mean"] = sum(v) / len(v)
    return out


def _agent_metrics(groups: list[Group]) -> dict[str, float]:
    """Agent episodes of the groups drawn this step: per-rollout means and rates (none for single-turn)."""
    total = Counter()
    for g in groups:
        total.update(g.stats)
    if not total.get("rollouts"):
        return {}
    n = total["rollouts"]
    out = {"agent/turns_mean": total["turns"] / n, "agent/tool_calls_mean": total["tool_calls"] / n,
           "agent/failed_frac": total["failed"] / n, "agent/malformed_tool_calls": float(total["malformed_tool_calls"])}
    if "later_calls" in total:  # black-box: calls that had to start a new chain, of all calls after the first
        out["agent/drift_rate"] = total["drifted_calls"] / total["later_calls"] if total["later_calls"] else 0.0
    return out


def _progress(console: Console) -> Progress:
    """Redrawn twice a second: rich's default of 10 cost the controller ~7 ms of CPU a second,
    taken from the trainer and engines on a machine of a few cores."""
    return Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("reward {task.fields[reward]:.3f}"), TextColumn("{task.fields[rate]:.0f} samples/s"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False,
                    refresh_per_second=2)
