"""Spreads requests over engines: least outstanding requests, and a conversation (session) sticks
to the engine that holds its prefix cache. It knows which engine holds every request in flight, so
an abort goes to that engine only. A request an engine aborts that nobody cancelled is continued
from where it stopped (`rollout/resume.py`).

Engines fail: a call that an engine could not serve (unreachable, went away, HTTP 5xx) is sent
again, to another engine while one is up, as a new attempt (`<rid>.<attempt>`, so an engine never
sees one id twice), after the tokens a stream already delivered. The engine is reported to
`on_engine_failure` (the supervisor, which checks it and restarts it when it is dead or hung); an
engine marked down gets no requests until `replace` brings its successor in."""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from loongsage.rollout import protocol as P
from loongsage.rollout.client import EngineClient
from loongsage.rollout.coalesce import Call, RequestCoalescer
from loongsage.rollout.resume import continuation_params, joined, system_failure


class EngineUnavailable(RuntimeError):
    """No engine came up within the wait (every one is down and none was brought back)."""


class Router:
    def __init__(self, urls: list[str], max_sessions: int = 100_000, api_key: str | None = None,
                 clients: list[EngineClient] | None = None, abort_retries: int = 2, engine_retries: int = 3,
                 engine_wait_s: float = 300.0, coalesce_prompts: int = 0):
        """`clients`: ready-made clients (another InferenceClient implementation) instead of `urls`;
        `abort_retries`: continuations of a request the system aborted (0: return it aborted);
        `engine_retries`: new attempts of a call an engine failed; `engine_wait_s`: how long a call
        waits for an engine to be up when all are down; `coalesce_prompts`: `generate` calls made
        together with the same parameters go out as batches of up to this many prompts
        (`rollout/coalesce.py`; 0: a request each)."""
        self.clients = clients or [EngineClient(u, api_key) for u in urls]
        if not self.clients:
            raise ValueError("router needs at least one engine")
        self.outstanding = [0] * len(self.clients)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.max_sessions = max_sessions
        self.inflight: dict[str, tuple[str | None, int]] = {}  # rid -> (session, engine index)
        self.abort_retries = abort_retries
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # sessions aborted on purpose (abort_where)
        self._rids = itertools.count()
        self.engine_retries, self.engine_wait_s = engine_retries, engine_wait_s
        self.up = [True] * len(self.clients)
        self._changed: asyncio.Condition | None = None  # made in the running loop
        self.on_engine_failure: Callable[[int, BaseException], None] | None = None
        self.retried = 0  # calls sent again after an engine failed them (samples/retried)
        self._sending: asyncio.Event | None = None  # cleared while held (colocated engines release memory)
        self.coalescer = RequestCoalescer(self._send_calls, coalesce_prompts) if coalesce_prompts > 1 else None

    # ---- engines up and down -------------------------------------------------------------
    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def mark_down(self, idx: int) -> None:
        """Engine `idx` gets no new requests (its successor comes in with `replace`)."""
        self.up[idx] = False

    async def mark_up(self, idx: int) -> None:
        self.up[idx] = True
        async with self._condition():
            self._condition().notify_all()

    async def replace(self, idx: int, client: EngineClient) -> None:
        """Engine `idx`'s successor serves from now on; its conversations start over there."""
        old, self.clients[idx] = self.clients[idx], client
        await old.aclose()
        for session in [s for s, i in self.sessions.items() if i == idx]:
            del self.sessions[session]
        await self.mark_up(idx)

    async def on_each_up(self, call: Callable[[EngineClient], Awaitable]) -> None:
        """`call(client)` on every engine that is up, at once. An engine that fails it (unreachable,
        5xx) is marked down and reported like a failed request, so the supervisor replaces it; a
        4xx (the call itself was wrong) is raised."""
        idxs = [i for i, up in enumerate(self.up) if up]
        results = await asyncio.gather(*[call(self.clients[i]) for i in idxs], return_exceptions=True)
        for i, result in zip(idxs, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception) or system_failure(result) is None:
                    raise result
                self._report(i, result)  # first: the supervisor checks an engine it finds up (and marks it down)
                self.mark_down(i)

    # ---- held while colocated engines give their devices to the trainer ----------------------
    def _gate(self) -> asyncio.Event:
        if self._sending is None:
            self._sending = asyncio.Event()
            self._sending.set()
        return self._sending

    async def hold(self) -> None:
        """From now on no call goes out until `reopen` (calls wait, they do not fail); returns once
        the calls in flight have ended, so the engines are idle."""
        self._gate().clear()
        while any(self.outstanding):
            await asyncio.sleep(0.005)

    def reopen(self) -> None:
        self._gate().set()

    async def _may_send(self) -> None:
        if not self._gate().is_set():
            await self._gate().wait()

    async def _wait_up(self) -> None:
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: any(self.up)), self.engine_wait_s)
            except asyncio.TimeoutError:
                raise EngineUnavailable(f"no inference engine up for {self.engine_wait_s:.0f}s "
                                        "(rollout.health.engine_wait_s)") from None

    def pick(self, session: str | None = None, avoid: frozenset[int] = frozenset()) -> int:
        """The session's engine while it is up, else the up engine with the fewest requests (not one
        in `avoid` when another is up)."""
        held = self.sessions.get(session) if session is not None else None
        if held is not None and self.up[held] and held not in avoid:
            self.sessions.move_to_end(session)
            return held
        live = [i for i in range(len(self.clients)) if self.up[i]] or list(range(len(self.clients)))
        idx = min([i for i in live if i not in avoid] or live, key=lambda i: self.outstanding[i])
        if session is not None:
            self.sessions[session] = idx
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return idx

    def _begin(self, callers: list[tuple[str | None, str]], avoid: frozenset[int] = frozenset()) -> int:
        """The engine for one request (its first caller's session picks it), each caller's
        (session, id) held in flight there, where `abort_where` finds it."""
        idx = self.pick(callers[0][0], avoid)
        self.outstanding[idx] += 1
        self.inflight.update({rid: (session, idx) for session, rid in callers})
        return idx

    def _end(self, idx: int, rids: list[str]) -> None:
        self.outstanding[idx] -= 1
        for rid in rids:
            self.inflight.pop(rid, None)

    async def generate(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                       rid: str | None = None, **kw) -> list[P.GenerateOutput]:
        """One prompt; returns a list (n samples when sampling_params has n > 1), each continued
        if the system aborted it."""
        if self.coalescer is not None:
            outs = await self.coalescer.generate(input_ids, sampling_params, session, rid or self._new_rid(session), kw)
        else:
            outs = await self._generate_once(input_ids, sampling_params, session, rid, **kw)
        if any(self._resumable(o, sampling_params, session) for o in outs):
            outs = list(await asyncio.gather(*[self._resume(input_ids, sampling_params, o, session, kw) for o in outs]))
        return outs

    async def generate_batch(self, batch: list[list[int]], sampling_params: dict, rid: str | None = None,
                             **kw) -> list[P.GenerateOutput]:
        """Several prompts in one call (SGLang's batch form; per-prompt values such as
        `logprob_start_len` may be lists), one output per prompt and sample (a prompt's samples
        together), sent again like one prompt when an engine fails it. An output the system aborted
        is continued alone, as `generate` continues one (a prefill-only scoring has nothing to
        continue): a teacher's group or an evaluation's rows in one request instead of one each."""
        outs = await self._generate_once(batch, sampling_params, None, rid, **kw)
        again = [i for i, o in enumerate(outs) if self._resumable(o, sampling_params, None)]
        if again:
            n = len(outs) // len(batch)
            done = await asyncio.gather(*[self._resume(batch[i // n], sampling_params, outs[i], None,
                                                       {k: v[i // n] if isinstance(v, list) else v for k, v in kw.items()})
                                          for i in again])  # a per-prompt value (a list): this prompt's
            for i, out in zip(again, done):
                outs[i] = out
        return outs

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, session: str | None = None,
                              rid: str | None = None, **kw) -> AsyncIterator[P.GenerateOutput]:
        """One prompt, one sample, as cumulative snapshots while it is generated (the last is final;
        a system abort is continued in the same stream, and so is a stream an engine failed)."""
        done: P.GenerateOutput | None = None
        params, base, attempt, avoid = sampling_params, rid or self._new_rid(session), 0, set()
        rid = base
        while True:
            last = None
            try:
                async with aclosing(self._stream_once(input_ids + (done.output_ids if done else []), params, session,
                                                      rid, avoid, **kw)) as chunks:
                    async for out in chunks:
                        last = out if done is None else joined(done, out)
                        if last.finish_reason and self._resumable(last, sampling_params, session):
                            break  # not final: the continuation follows
                        yield last
            except Exception as exc:
                if not self._retryable(exc, attempt, session):
                    raise
                attempt += 1
                await self._before_retry(attempt)
                done = last or done  # what the failed stream delivered stays; the rest is generated anew
                params = continuation_params(sampling_params, len(done.output_ids)) if done else sampling_params
                if params is None:
                    raise
                rid = f"{base}.{attempt}"
                continue
            if last is None or not self._resumable(last, sampling_params, session):
                return
            done, rid = last, self._new_rid(session)
            params = continuation_params(sampling_params, len(done.output_ids))

    async def _resume(self, input_ids: list[int], params: dict, out: P.GenerateOutput, session: str | None,
                      kw: dict) -> P.GenerateOutput:
        while self._resumable(out, params, session):
            rest = await self._generate_once(input_ids + out.output_ids,
                                             continuation_params(params, len(out.output_ids)), session, None, **kw)
            out = joined(out, rest[0])
        return out

    def _resumable(self, out: P.GenerateOutput, params: dict, session: str | None) -> bool:
        """Aborted by the system (not by `abort_where`), retries left, tokens left to generate."""
        return (out.finish_type == "abort" and out.resumed < self.abort_retries and session not in self.cancelled
                and continuation_params(params, len(out.output_ids)) is not None)

    def _new_rid(self, session: str | None) -> str:
        return f"{session or 'r'}-{next(self._rids)}"

    def _retryable(self, exc: Exception, attempt: int, session: str | None) -> bool:
        """An engine failed the call (not the request's own fault), nobody cancelled it, attempts left."""
        return (system_failure(exc) is not None and session not in self.cancelled
                and attempt < self.engine_retries)

    async def _before_retry(self, attempt: int) -> None:
        self.retried += 1
        await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))
        if not any(self.up):
            await self._wait_up()

    def _report(self, idx: int, exc: Exception) -> None:
        if self.on_engine_failure is not None and system_failure(exc) is not None:
            self.on_engine_failure(idx, exc)

    async def _generate_once(self, input_ids: list[int] | list[list[int]], sampling_params: dict, session: str | None,
                             rid: str | None, **kw) -> list[P.GenerateOutput]:
        """One call (one prompt, or a batch under one id: its prompts `<id>/<i>`)."""
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        ids = (lambda r: [f"{r[0]}/{i}" for i in range(len(input_ids))]) if batch else (lambda r: r[0])
        return await self._send(input_ids, sampling_params, [(session, rid or self._new_rid(session))], ids, **kw)

    async def _send_calls(self, calls: list[Call], params: dict, kw: dict) -> list[list[P.GenerateOutput]]:
        """Coalesced calls as one batch, each prompt under its caller's id and session."""
        seeded = any("sampling_seed" in c.params for c in calls)
        outs = await self._send([c.input_ids for c in calls], [c.params for c in calls] if seeded else params,
                                [(c.session, c.rid) for c in calls], lambda r: r, **kw)
        n = params.get("n", 1)
        return [outs[i * n:(i + 1) * n] for i in range(len(calls))]

    async def _send(self, prompts: list[int] | list[list[int]], params: dict | list[dict], callers: list[tuple[str | None, str]],
                    payload_rid: Callable[[list[str]], str | list[str]], **kw) -> list[P.GenerateOutput]:
        """One request for `callers` (session, id), each id held in flight on the engine that serves it;
        sent again (new attempt ids `<id>.<attempt>`, another engine while one is up) when an engine
        fails it and a caller is still wanted."""
        avoid, attempt, sessions = set(), 0, [s for s, _ in callers]
        if not any(self.up):
            await self._wait_up()
        while True:
            await self._may_send()
            rids = [r if attempt == 0 else f"{r}.{attempt}" for _, r in callers]
            idx = self._begin(list(zip(sessions, rids)), frozenset(avoid))
            try:
                res = await self.clients[idx].generate_raw(P.build_generate(prompts, params, rid=payload_rid(rids), **kw))
                break
            except Exception as exc:
                self._report(idx, exc)
                if not any(self._retryable(exc, attempt, s) for s in sessions):
                    raise
            finally:
                self._end(idx, rids)
            attempt += 1
            avoid.add(idx)
            await self._before_retry(attempt)
        return [P.parse_generate(r) for r in (res if isinstance(res, list) else [res])]

    async def _stream_once(self, input_ids: list[int], sampling_params: dict, session: str | None,
                           rid: str | None, avoid: set[int], **kw) -> AsyncIterator[P.GenerateOutput]:
        """`avoid`: engines that failed this request (the one that fails now is added)."""
        if not any(self.up):
            await self._wait_up()
        await self._may_send()
        rid = rid or self._new_rid(session)
        idx = self._begin([(session, rid)], frozenset(avoid))
        try:
            async for chunk in self.clients[idx].generate_stream(input_ids, sampling_params, rid=rid, **kw):
                yield P.parse_generate(chunk)
        except Exception as exc:
            self._report(idx, exc)
            avoid.add(idx)
            raise
        finally:
            self._end(idx, [rid])

    async def abort_where(self, session_matches: Callable[[str | None], bool]) -> int:
        """Aborts every request in flight whose session matches, on the engine that holds it;
        returns how many were aborted."""
        per_engine: dict[int, list[str]] = {}
        for rid, (session, idx) in list(self.inflight.items()):
            if session_matches(session):
                per_engine.setdefault(idx, []).append(rid)
                if session is not None:  # its aborted requests are not to be continued
                    self.cancelled[session] = None
                    if len(self.cancelled) > self.max_sessions:
                        self.cancelled.popitem(last=False)
        for idx, rids in per_engine.items():
            await self.clients[idx].abort(rids)
        return sum(len(r) for r in per_engine.values())

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
