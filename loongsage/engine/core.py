"""The engine core: continuous batching over KV slots, run in one thread that owns the model.

Every scheduler iteration (a) admits waiting sequences into free slots (reusing a cached prefix
when one matches), (b) runs ONE forward pass over all running sequences — one token for each
decoding sequence plus the whole new part of each admitted one — and (c) samples, appends and
retires finished sequences. Sequences therefore join and leave at every step, and a long one never
holds short ones back. Control operations (weight updates, pause, abort, memory release) are
queued and executed by the same thread between steps, so they never race with a forward pass.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from loongsage.engine.config import PREFIX_CACHE_MIN_TOKENS
from loongsage.engine.kv_pool import BatchPlan, Prefill
from loongsage.engine.model_runner import ModelRunner
from loongsage.engine.prefix_cache import CacheEntry, PrefixCache
from loongsage.engine.sampling import sample
from loongsage.engine.sequence import Finish, FinishKind, SeqRequest, Sequence

log = logging.getLogger("loongsage.engine")


@dataclass
class EngineStats:
    """Cumulative counters (GET /get_server_info); the controller logs their per-step differences.
    busy_s = prefill_s + decode_s + sample_s + schedule_s: model forwards of steps that prefilled
    (SGLang's prefill batches) and of decode-only steps, sampling, and the rest of the step
    (admission, slot moves, finishing). http_s is the server's request parsing and response building."""
    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    busy_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    schedule_s: float = 0.0
    http_s: float = 0.0


class EngineCore:
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str = "cpu",
        max_running: int = 64,
        context_length: int | None = None,
        max_prefill_tokens: int = 4096,
        weight_version: int = 0,
        enable_prefix_cache: bool = True,
        prefix_cache_min_tokens: int = PREFIX_CACHE_MIN_TOKENS,
    ):
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.runner = ModelRunner(model_path, dtype, device, max_running, context_length)
        self.eos_ids = _eos_ids(self.runner.model, self.tokenizer)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.runner.named_parameters().values())
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = int(weight_version)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cache = PrefixCache(enable_prefix_cache, max_running, self.runner.context_length, prefix_cache_min_tokens)
        self.paused = False
        self.stats = EngineStats()
        self._tick = 0
        self._weights_epoch = 0  # +1 at every weight update: K/V of an older epoch is never cached
        self._inbox: list[Sequence] = []
        self._copies: list[tuple[int, int, int]] = []  # queued slot moves (src, dst, length) of an admission
        self._copy_dsts: set[int] = set()
        self._fill_to = 0  # slots below it may be filled by the admission under way
        self._commands: list[tuple[Callable, tuple, Future]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- public, thread-safe -----------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="loongsage-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout=30)

    def submit(self, requests: list[SeqRequest]) -> None:
        with self._cond:
            self._inbox.extend(Sequence(r) for r in requests)
            self._cond.notify_all()

    def call(self, fn: Callable, *args) -> Future:
        """Runs `fn(*args)` on the engine thread between two steps."""
        fut: Future = Future()
        with self._cond:
            self._commands.append((fn, args, fut))
            self._cond.notify_all()
        return fut

    # ---- control operations (engine thread only, through `call`) ------------------------
    def pause(self, mode: str) -> str:
        if mode == "abort":
            n = self.abort(None, abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            retracted = list(self.running)  # in slot order; they go back to the queue's front
            n = len(retracted)
            for seq in reversed(retracted):
                self._remove(seq, keep_cache=False)
                seq.kv_len = 0
            self.waiting.extendleft(reversed(retracted))
        elif mode == "in_place":
            n = len(self.running)
        else:
            raise ValueError(f"mode: expected 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True
        return f"paused ({mode}); {n} requests affected"

    def resume_generation(self) -> str:
        self.paused = False
        return "generation continued"

    def abort(self, rid: str | None, abort_all: bool = False, message: str = "aborted") -> int:
        victims = [s for s in list(self.running) + list(self.waiting)
                   if abort_all or s.req.rid == rid or s.req.group_rid == rid]
        for seq in sorted(victims, key=lambda s: -s.slot):
            seq.finish = Finish(FinishKind.ABORT, message=message)
            if seq.slot >= 0:
                self._remove(seq, keep_cache=False)
            else:
                self.waiting.remove(seq)
            self._notify(seq)
        return len(victims)

    def flush_cache(self) -> None:
        if self.running:
            raise RuntimeError(f"cannot flush the cache while {len(self.running)} requests are running")
        self.cache.clear()

    def set_weights(self, load: Callable[[], Any], version: int | None, flush_cache: bool = True,
                    abort_all: bool = False) -> Any:
        """Applies a weight update; cached prefixes computed by old weights are always dropped."""
        if abort_all:
            self.abort(None, abort_all=True, message="aborted for a weight update")
        result = load()
        self.cache.clear()
        self._weights_epoch += 1  # requests running on (paused in place) hold K/V of the old weights
        if version is not None:
            self.weight_version = int(version)
        return result

    def release_memory(self, tags: list[str] | None) -> None:
        if self.running or self.waiting:
            raise RuntimeError("cannot release memory while requests are running or waiting")
        tags = tags or ["weights", "kv_cache"]
        if "kv_cache" in tags:
            self.cache.clear()
            self.runner.pool.free()
        if "weights" in tags:
            self.runner.release_weights()

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "kv_cache" in tags and not self.runner.pool.allocated:
            self.runner.pool.allocate()
        if "weights" in tags:
            self.runner.resume_weights()

    @property
    def memory_released(self) -> bool:
        return self.runner.weights_released or not self.runner.pool.allocated

    # ---- the loop ----------------------------------------------------------------------
    def _runnable(self) -> bool:
        return not self.paused and not self.memory_released and bool(self.running or self.waiting)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._commands or self._inbox or self._runnable()):
                    self._cond.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                commands, self._commands = self._commands, []
            self.waiting.extend(inbox)
            for fn, args, fut in commands:
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # the caller turns it into an HTTP error
                    fut.set_exception(exc)
            if self._runnable():
                try:
                    self._step()
                except Exception as exc:  # a bug must not take the server down: fail the batch
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self.abort(None, abort_all=True, message=f"engine error: {exc}")

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._tick += 1
        self._admit()
        if not self.running:
            return
        nd = 0
        while nd < len(self.running) and self.running[nd].kv_len == self.running[nd].num_tokens - 1:
            nd += 1
        tokens = [s.last_token for s in self.running[:nd]]
        positions = [s.kv_len for s in self.running[:nd]]
        sample_rows = list(range(nd))
        keep = list(range(nd))
        prefills, prompt_rows, followers = [], {}, []
        row_of = {id(s): i for i, s in enumerate(self.running[:nd])}
        for seq in self.running[nd:]:
            if seq.share_from is not None:
                followers.append(seq)
                sample_rows.append(row_of[id(seq.share_from)])
                continue
            new = seq.all_ids[seq.kv_len:]
            offset = len(tokens)
            prefills.append(Prefill(offset, len(new), seq.slot, seq.kv_len))
            tokens += new
            positions += range(seq.kv_len, seq.kv_len + len(new))
            first = self._prompt_logprob_from(seq)
            if first is not None:  # rows that predict prompt tokens first..end, then the next token
                lo = offset + (first - 1 - seq.kv_len)
                prompt_rows[seq.req.rid] = (len(keep), first)
                keep += range(lo, offset + len(new))
            else:
                keep.append(offset + len(new) - 1)
            sample_rows.append(len(keep) - 1)
            row_of[id(seq)] = len(keep) - 1
            self.stats.prefill_tokens += len(new)
        plan = BatchPlan(nd, torch.tensor(positions[:nd], dtype=torch.long, device=self.runner.device), prefills)
        t_fwd = time.perf_counter()
        logits = self.runner.forward(tokens, positions, plan, keep)
        if followers:
            self.runner.pool.copy_many([f.share_from.slot for f in followers], [f.slot for f in followers],
                                       max(f.num_tokens for f in followers))
        top_n = max((s.req.top_logprobs_num for s in self.running if s.req.return_logprob), default=0)
        params = [s.req.params for s in self.running]
        t_sample = time.perf_counter()
        result = sample(logits[sample_rows], params, [len(s.output_ids) for s in self.running], top_n)
        t_post = time.perf_counter()
        new_tokens, new_logprobs = result.tokens.tolist(), result.logprobs.tolist()  # not one tensor read a row
        version = self.weight_version
        finished = []
        generated = 0
        for i, seq in enumerate(self.running):
            if seq.req.rid in prompt_rows:
                self._record_prompt_logprobs(seq, logits, *prompt_rows[seq.req.rid])
            if seq.share_from is not None:
                self._take_shared_prompt(seq)
            seq.kv_len = seq.num_tokens
            if seq.req.params.max_new_tokens == 0:  # prefill only (scoring given tokens): nothing sampled
                seq.finish = Finish(FinishKind.LENGTH, length=0)
                finished.append(seq)
                continue
            generated += 1
            tok = new_tokens[i]
            seq.output_ids.append(tok)
            seq.output_logprobs.append(new_logprobs[i])
            seq.output_versions.append(version)
            if seq.req.return_logprob and seq.req.top_logprobs_num > 0:
                k = seq.req.top_logprobs_num
                seq.output_top.append(list(zip(result.top_logprobs[i, :k].tolist(), result.top_ids[i, :k].tolist())))
            seq.finish = self._finish(seq, tok)
            if seq.finish is not None:
                finished.append(seq)
            elif seq.req.stream:
                self._notify(seq)
        self.stats.generated_tokens += generated
        self._remove_many(finished, keep_cache=True)
        for seq in finished:
            self._notify(seq)
        st, t_end = self.stats, time.perf_counter()
        st.steps += 1
        st.busy_s += t_end - t0
        if prefills:
            st.prefill_s += t_sample - t_fwd
        else:
            st.decode_s += t_sample - t_fwd
        st.sample_s += t_post - t_sample
        st.schedule_s += (t_fwd - t0) + (t_end - t_post)

    # ---- helpers -----------------------------------------------------------------------
    def _notify(self, seq: Sequence) -> None:
        if seq.req.on_update is not None:
            seq.req.on_update(seq.snapshot(self.weight_version))

    def _prompt_logprob_from(self, seq: Sequence) -> int | None:
        """First prompt position whose logprob this prefill must produce, or None."""
        if not seq.req.return_logprob or seq.req.logprob_start_len < 0 or seq.input_logprobs is not None:
            return None
        return max(seq.req.logprob_start_len, 1)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, row0: int, first: int) -> None:
        ids = seq.req.input_ids
        n = len(ids) - first
        temp = seq.req.params.temperature if not seq.req.params.greedy else 1.0
        lp = torch.log_softmax(logits[row0:row0 + n].float() / temp, dim=-1)
        target = torch.tensor(ids[first:], device=lp.device)
        values = lp.gather(1, target[:, None]).squeeze(1).tolist() if n else []
        lead = [None] if seq.req.logprob_start_len == 0 else []
        seq.input_logprobs = lead + values
        if seq.req.top_logprobs_num > 0:
            k = seq.req.top_logprobs_num
            tv, ti = lp.topk(min(k, lp.shape[-1]), dim=-1) if n else (torch.empty(0, k), torch.empty(0, k))
            seq.input_top = lead + [list(zip(a, b)) for a, b in zip(tv.tolist(), ti.tolist())]

    def _take_shared_prompt(self, seq: Sequence) -> None:
        leader, seq.share_from = seq.share_from, None
        seq.input_logprobs, seq.input_top = leader.input_logprobs, leader.input_top
        seq.cached_tokens = seq.num_tokens
        self.stats.cached_tokens += seq.num_tokens

    def _finish(self, seq: Sequence, tok: int) -> Finish | None:
        p = seq.req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return Finish(FinishKind.STOP, matched=tok)
        if p.stop:
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(seq.output_ids[-(longest + 8):], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    return Finish(FinishKind.STOP, matched=s)
        if len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.context_length:
            return Finish(FinishKind.LENGTH, length=len(seq.output_ids))
        return None

    def _admit(self) -> None:
        """Fills free slots from the queue within the prefill budget. A sequence whose prompt equals
        one admitted in this step (a group's n samples) shares it: it prefills nothing, gets a copy of
        the first one's K/V and samples its first token from the same logits with its own seed."""
        budget = self.max_prefill_tokens
        leaders: dict[tuple, Sequence] = {}
        self._fill_to = min(len(self.running) + len(self.waiting), self.max_running)
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            key = _share_key(seq)
            leader = leaders.get(key) if key is not None else None
            need = 0 if leader is not None else seq.num_tokens - seq.kv_len
            if need > budget and budget < self.max_prefill_tokens:
                break  # this one waits for the next step; at least one is always admitted
            self.waiting.popleft()
            self._place(seq, leader)
            if leader is None:
                budget -= seq.num_tokens - seq.kv_len
                if key is not None:
                    leaders[key] = seq
        self._flush_copies()

    def _defer_copy(self, src: int, dst: int, length: int) -> None:
        """Queues a cache entry's move out of a slot being filled; an admission's moves run as one
        indexed copy per tensor (a move that touches a queued one flushes the queue first)."""
        if src in self._copy_dsts or dst in self._copy_dsts:
            self._flush_copies()
        self._copies.append((src, dst, length))
        self._copy_dsts.add(dst)

    def _flush_copies(self) -> None:
        if self._copies:
            src, dst, lengths = zip(*self._copies)
            self.runner.pool.copy_many(list(src), list(dst), max(lengths))
            self._copies, self._copy_dsts = [], set()

    def _place(self, seq: Sequence, leader: Sequence | None = None) -> None:
        """Puts `seq` into slot n = len(running), moving cache entries out of the way; with a
        `leader`, its K/V will be copied from the leader's slot after the forward pass."""
        n = len(self.running)
        pool = self.runner.pool
        limit = seq.num_tokens - 1
        first = self._prompt_logprob_from(seq)
        if first is not None:  # prompt logprobs must be computed, not read from the cache
            limit = min(limit, first - 1)
        seq.share_from = leader
        hit, reuse = self.cache.lookup(seq.all_ids, limit) if leader is None else (None, 0)
        occupant = self.cache.get(n)
        if hit is not None:
            self._flush_copies()  # the hit's K/V may be one of them
            entry = self.cache.pop(hit)
            if hit != n:
                if occupant is not None:
                    pool.swap(hit, len(entry.tokens), n, len(occupant.tokens))
                    self.cache.put(hit, self.cache.pop(n))
                else:
                    pool.copy(hit, n, len(entry.tokens))
            seq.kv_len = reuse
            seq.cached_tokens = reuse
            self.stats.cached_tokens += reuse
        else:
            if occupant is not None:
                # It moves above the slots this admission may fill (to a free slot, else over the least
                # recently used entry there), so the admission's moves never chain; no room: dropped.
                self.cache.pop(n)
                above = self._fill_to - 1
                free = self.cache.free_slot(above)
                if free is None:
                    free = self.cache.least_recent(above, exclude=self._copy_dsts)
                    if free is not None:
                        self.cache.pop(free)
                if free is not None:
                    self._defer_copy(n, free, len(occupant.tokens))
                    self.cache.put(free, occupant)
            seq.kv_len = 0
        seq.slot = n
        seq.kv_epoch = self._weights_epoch  # its K/V: cached from this epoch, or computed from now on
        self.running.append(seq)

    def _remove(self, seq: Sequence, keep_cache: bool) -> None:
        self._remove_many([seq], keep_cache)

    def _remove_many(self, seqs: list[Sequence], keep_cache: bool) -> None:
        """Takes `seqs` out of the running set, keeping slots 0..n-1 dense: the survivors in the last
        slots move into the holes below, exchanged with the leavers' K/V in one indexed copy per
        tensor; a leaver's K/V stays in its final slot as a prefix-cache entry when `keep_cache`."""
        pool = self.runner.pool
        leaving = {s.slot: s for s in seqs}
        n = len(self.running) - len(seqs)
        holes = sorted(slot for slot in leaving if slot < n)
        movers = [s for s in self.running[n:] if s.slot not in leaving]
        if holes:
            length = max(s.kv_len for s in movers + [leaving[h] for h in holes])
            if length > 0 and pool.allocated:
                pool.exchange(holes, [m.slot for m in movers], length)
            for hole, mover in zip(holes, movers):
                leaving[hole].slot, mover.slot = mover.slot, hole
                self.running[hole] = mover
        del self.running[n:]
        for seq in seqs:
            if (keep_cache and self.cache.enabled and seq.kv_len > 0 and pool.allocated
                    and seq.kv_epoch == self._weights_epoch):  # K/V partly from old weights is not reused
                self.cache.put(seq.slot, CacheEntry(np.asarray(seq.all_ids[:seq.kv_len]), self._tick))
            seq.slot = -1


def _share_key(seq: Sequence) -> tuple | None:
    """What two fresh sequences must have in common to share one prefill (None: never shares)."""
    r = seq.req
    if seq.kv_len or seq.output_ids or len(r.input_ids) < 2:
        return None
    return tuple(r.input_ids), r.return_logprob, r.logprob_start_len, r.top_logprobs_num


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}
