"""The Teacher Manager: scores the student's samples with the teachers of their data source, inside
the async pipeline, keeping at most a byte budget of teacher weights resident.

    producer task (a group finished) ─► score(group, {teacher: weight}) ─► per-teacher queue
    scheduler task: resident teachers' queues are sent at once, groups batched into prefill requests
        of up to BATCH_SAMPLES (at most REQUESTS_PER_ENGINE in flight per engine, so groups that
        complete meanwhile go together); each sample the student's exact ids, max_new_tokens 0,
        logprobs from the response on, top-k when needed;
        a teacher that is not resident waits until idle residents can be released
        (/release_memory_occupation) to make room, then is resumed (/resume_memory_occupation) and
        its whole queue is sent: requests are batched per teacher, the resident one served first, so
        swaps are few
    teachers that follow the student (self-distillation) are TransferMesh receivers: every K steps
        the trainer's weights are pushed to them (brought resident first)

Metrics (per step): `teacher/swaps`, `teacher/score_s` (wall time with any scoring in flight),
`teacher/resident_bytes` (now) and `teacher/peak_resident_bytes`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from loongsage.rollout import protocol as P
from loongsage.rollout.client import EngineError
from loongsage.rollout.router import Router
from loongsage.sample import Group, Sample, TeacherScores
from loongsage.teachers.config import TeacherConfig

log = logging.getLogger("loongsage.teachers")

BATCH_SAMPLES = 64  # samples in one scoring request at most (a group is never split)
REQUESTS_PER_ENGINE = 2  # scoring requests in flight per teacher engine: groups that complete meanwhile
#   queue and go together in the next request (one sample a group, n = 1, would otherwise be one
#   request each: the HTTP work of 256 requests a step cost as much as the teacher's forwards)


@dataclass
class Teacher:
    cfg: TeacherConfig
    router: Router
    weight_bytes: int
    engines: object = None  # the EngineGroup (Ray actors) serving it
    resident: bool = True
    inflight: int = 0  # jobs sent and not answered
    requests: int = 0  # batched scoring requests in flight
    last_used: float = 0.0
    queue: list = field(default_factory=list)  # (samples, weight, future, time queued)

    @property
    def name(self) -> str:
        return self.cfg.name


class TeacherManager:
    def __init__(self, teachers: list[Teacher], budget_bytes: float | None, top_k: int = 0, timeline=None):
        """`top_k`: how many top tokens per position each teacher returns (0: the sampled token's
        logprob only; the vocabulary size for full-vocabulary signals)."""
        self.teachers = {t.name: t for t in teachers}
        self.budget, self.top_k, self.timeline = budget_bytes, top_k, timeline
        self.swaps = 0
        self.peak_resident = 0
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._active = 0
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._last = {"swaps": 0, "busy": 0.0}
        self.residency = asyncio.Lock()  # one swap at a time (the scheduler and follow_student both swap)
        self.follow: dict = {}  # teacher name -> WeightMesh from the trainer (teachers that follow the student)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> TeacherManager:
        """Releases teachers beyond the budget (the first ones in order stay), then schedules."""
        if self.budget is not None:
            if max(t.weight_bytes for t in self.teachers.values()) > self.budget:
                raise ValueError(f"teacher_memory_mb: {self.budget / 2**20:.1f} MB cannot hold the largest teacher "
                                 f"({max(t.weight_bytes for t in self.teachers.values()) / 2**20:.1f} MB)")
            held = 0
            for t in self.teachers.values():
                if held + t.weight_bytes <= self.budget:
                    held += t.weight_bytes
                else:
                    await self._release(t)
        self.peak_resident = self.resident_bytes()
        self._scheduler = asyncio.create_task(self._schedule())
        return self

    async def ensure_resident(self, name: str) -> None:
        """Brings a teacher resident (waiting for idle residents to make room)."""
        t = self.teachers[name]
        while not await self._make_room(t):
            await asyncio.sleep(0.01)

    async def follow_student(self, version: int) -> dict[str, float]:
        """Pushes the trainer's weights (`version`) to every teacher that follows the student and is
        due; a released one is brought resident first (its queued work waits meanwhile)."""
        seconds = 0.0
        for name, mesh in self.follow.items():
            t = self.teachers[name]
            if version % t.cfg.follow_student_every:
                continue
            await self.ensure_resident(name)
            seconds += (await mesh.push(version))["time/weight_sync_s"]
        return {"teacher/follow_sync_s": seconds} if self.follow else {}

    async def close(self) -> None:
        for mesh in self.follow.values():
            await mesh.aclose()
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        for t in self.teachers.values():
            for _, _, fut, _ in t.queue:
                if not fut.done():
                    fut.cancel()
            await t.router.aclose()

    def resident_bytes(self) -> int:
        return sum(t.weight_bytes for t in self.teachers.values() if t.resident)

    # ---- scoring ------------------------------------------------------------------------------
    async def score_group(self, group: Group, teachers: dict[str, float]) -> None:
        """Fills `Sample.teacher[name]` of every sample of `group` for each of its source's teachers."""
        samples = [s for s in group.samples if s.response_ids]
        if not samples or not teachers:
            return
        await asyncio.gather(*[self.score(name, samples, weight) for name, weight in teachers.items()])

    async def score(self, name: str, samples: list[Sample], weight: float = 1.0) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.teachers[name].queue.append((samples, weight, fut, time.perf_counter()))
        self._wake.set()
        await fut

    async def _schedule(self) -> None:
        """Teachers with queued work in the order of their oldest job: a resident one gets its whole
        queue at once (in requests of up to BATCH_SAMPLES samples) unless REQUESTS_PER_ENGINE are
        already in flight on each of its engines (the queue then waits for one to finish); one that
        is not resident is brought in when idle residents can make room, and until then no younger
        work is sent to the residents (they drain, so the swap comes)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            for t in sorted((t for t in self.teachers.values() if t.queue), key=lambda t: t.queue[0][3]):
                if t.resident:
                    if t.requests < REQUESTS_PER_ENGINE * len(t.router.clients):
                        self._dispatch(t)
                elif await self._make_room(t):
                    self._dispatch(t)
                else:
                    break

    async def _make_room(self, teacher: Teacher) -> bool:
        """Releases idle resident teachers (least recently used first) until `teacher` fits; resumes
        it. False when the residents it needs gone are still busy (the scheduler retries when they
        finish)."""
        async with self.residency:
            if teacher.resident:
                return True
            return await self._swap_in(teacher)

    async def _swap_in(self, teacher: Teacher) -> bool:
        budget = float("inf") if self.budget is None else self.budget
        need = teacher.weight_bytes - (budget - self.resident_bytes())
        if need > 0:
            # a resident with nothing in flight may go, even with work queued (younger than what waits here)
            idle = sorted((t for t in self.teachers.values() if t.resident and t.inflight == 0 and t is not teacher),
                          key=lambda t: t.last_used)
            victims, freed = [], 0
            for t in idle:
                if freed >= need:
                    break
                victims.append(t)
                freed += t.weight_bytes
            if freed < need:
                return False
            for t in victims:
                await self._release(t)
        await self._resume(teacher)
        return True

    async def _release(self, t: Teacher) -> None:
        await asyncio.gather(*[c.release_memory() for c in t.router.clients])
        t.resident = False

    async def _resume(self, t: Teacher) -> None:
        await asyncio.gather(*[c.resume_memory() for c in t.router.clients])
        t.resident = True
        self.swaps += 1
        self.peak_resident = max(self.peak_resident, self.resident_bytes())

    def _dispatch(self, t: Teacher) -> None:
        jobs, t.queue = t.queue, []
        chunk, size = [], 0
        for job in jobs:
            if chunk and size + len(job[0]) > BATCH_SAMPLES:
                self._send(t, chunk)
                chunk, size = [], 0
            chunk.append(job)
            size += len(job[0])
        self._send(t, chunk)

    def _send(self, t: Teacher, jobs: list) -> None:
        t.inflight += len(jobs)
        t.requests += 1
        self._busy(+1)
        asyncio.create_task(self._run(t, jobs))

    async def _run(self, t: Teacher, jobs: list) -> None:
        t0 = time.perf_counter()
        try:
            try:
                await self._score_samples(t, [(s, w) for samples, w, _, _ in jobs for s in samples])
                results: list = [None] * len(jobs)
            except EngineError as exc:
                if len(jobs) == 1 or exc.status >= 500:
                    raise
                # a request error (e.g. one sequence longer than the teacher's context) fails its own group only
                results = await asyncio.gather(*[self._score_samples(t, [(s, w) for s in samples])
                                                 for samples, w, _, _ in jobs], return_exceptions=True)
        except Exception as exc:
            results = [exc] * len(jobs)
        finally:
            t.inflight -= len(jobs)
            t.requests -= 1
            t.last_used = time.perf_counter()
            self._busy(-1)
            if self.timeline is not None:
                self.timeline.add(f"teacher: {t.name}", f"score {len(jobs)}", t0, time.perf_counter())
            self._wake.set()
        for (_, _, fut, _), res in zip(jobs, results):
            if not fut.done():
                fut.set_exception(res) if isinstance(res, BaseException) else fut.set_result(None)

    async def _score_samples(self, t: Teacher, samples: list[tuple[Sample, float]]) -> None:
        """(sample, its teacher weight) pairs scored in one batched request."""
        scored = [scored_length(s) for s, _ in samples]
        outs = await t.router.generate_batch(
            [s.prompt_ids + s.response_ids[:n] for (s, _), n in zip(samples, scored)],
            {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
            logprob_start_len=[len(s.prompt_ids) for s, _ in samples], top_logprobs_num=self.top_k)
        if len(outs) != len(samples):
            raise RuntimeError(f"teacher {t.name!r} answered {len(outs)} outputs for {len(samples)} samples")
        for (s, weight), n, out in zip(samples, scored, outs):
            s.teacher[t.name] = pad_scores(teacher_scores(out, n, self.top_k, weight), len(s.response_ids))

    def _busy(self, delta: int) -> None:
        now = time.perf_counter()
        if self._active == 0 and delta > 0:
            self._busy_since = now
        self._active += delta
        if self._active == 0 and self._busy_since is not None:
            self._busy_total += now - self._busy_since
            self._busy_since = None

    # ---- metrics ------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Since the last call: swaps and scoring wall time; and the resident bytes now and at peak."""
        busy = self._busy_total + (time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0)
        out = {"teacher/swaps": float(self.swaps - self._last["swaps"]), "teacher/score_s": busy - self._last["busy"],
               "teacher/resident_bytes": float(self.resident_bytes()),
               "teacher/peak_resident_bytes": float(self.peak_resident)}
        self._last = {"swaps": self.swaps, "busy": busy}
        return out


def scored_length(s: Sample) -> int:
    """Response tokens up to the last trained one: what follows it (e.g. the tool result of an agent's
    last call) is never distilled, and can make the sequence longer than the agent's token limit and
    a teacher's context."""
    return max((i + 1 for i, m in enumerate(s.loss_mask) if m), default=min(1, len(s.response_ids)))


def pad_scores(sc: TeacherScores, n: int) -> TeacherScores:
    """Scores of the first tokens extended to all `n` response tokens by repeating the last position's
    (the padded positions have loss mask 0: finite placeholders the loss multiplies by zero)."""
    extra = n - len(sc.logprobs)
    if extra <= 0:
        return sc
    top_ids = sc.top_ids and sc.top_ids + [sc.top_ids[-1]] * extra
    top_lps = sc.top_logprobs and sc.top_logprobs + [sc.top_logprobs[-1]] * extra
    return TeacherScores(sc.logprobs + [0.0] * extra, top_ids, top_lps, sc.weight)


def teacher_scores(out: P.GenerateOutput, n: int, top_k: int, weight: float) -> TeacherScores:
    """A prefill's answer as the teacher's scores of the `n` response tokens."""
    lps = out.input_logprobs or []
    if len(lps) != n or any(v is None for v in lps):
        raise RuntimeError(f"teacher returned {len(lps)} input logprobs for {n} response tokens")
    top_ids = top_lps = None
    if top_k:
        tops = out.input_top or []
        if len(tops) != n or any(p is None or len(p) < top_k for p in tops):
            raise RuntimeError(f"teacher returned no top-{top_k} logprobs for some of the {n} response tokens")
        top_lps = [[t[0] for t in p[:top_k]] for p in tops]  # one value a comprehension: ~7x faster than pairs
        top_ids = [[t[1] for t in p[:top_k]] for p in tops]
    return TeacherScores(lps, top_ids, top_lps, weight)
