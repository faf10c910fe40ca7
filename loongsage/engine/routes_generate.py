"""The generation route, `/generate` (single or batch, n samples, streaming), over an `EngineCore`:
parse and validate (engine/schema.py), hand sequences to the engine thread, build SGLang's response
from each snapshot. The wire format (string versions, finish_reason dicts) exists only here."""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from loongsage.engine import schema as S
from loongsage.engine.core import EngineCore
from loongsage.engine.sequence import SeqRequest, SeqSnapshot
from loongsage.wire import ClientGone, body_of, dumps, error, json_response, openapi_body, unless_client_leaves


def generation_routes(core: EngineCore) -> APIRouter:
    router = APIRouter()

    @router.post("/generate", openapi_extra=openapi_body(S.GenerateRequest))
    async def generate(request: Request):
        body = await body_of(request)
        t_parse = time.perf_counter()
        req = S.parse(S.GenerateRequest, body)
        if core.memory_released:  # it would wait for /resume_memory_occupation, which may never come
            return error(503, "memory released (/release_memory_occupation): nothing can run until "
                              "/resume_memory_occupation")
        seqs, single = _expand(req, core)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SeqSnapshot] = asyncio.Queue()
        for s in seqs:
            s.on_update = lambda snap: loop.call_soon_threadsafe(queue.put_nowait, snap)
        index = {s.rid: i for i, s in enumerate(seqs)}
        t0 = time.perf_counter()
        core.stats.http_s += t0 - t_parse
        core.submit(seqs)

        def abort_all() -> None:
            for s in seqs:
                core.call(core.abort, s.rid, False, "client disconnected")

        def render(snap: SeqSnapshot) -> dict:
            t = time.perf_counter()
            out = _render(snap, seqs[index[snap.rid]], core, req.return_text_in_logprobs, t - t0)
            core.stats.http_s += time.perf_counter() - t
            return out

        if req.stream:
            async def events():
                done = 0
                try:
                    while done < len(seqs):
                        snap = await queue.get()
                        out = render(snap)
                        if len(seqs) > 1:
                            out["index"] = index[snap.rid]
                        done += snap.finish is not None
                        yield b"data: " + dumps(out) + b"\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if done < len(seqs):
                        abort_all()
            return StreamingResponse(events(), media_type="text/event-stream")

        results: dict[str, dict] = {}

        async def collect() -> None:
            while len(results) < len(seqs):
                snap = await queue.get()
                if snap.finish is not None:
                    results[snap.rid] = render(snap)
        try:
            await unless_client_leaves(request, collect())
        except (asyncio.CancelledError, ClientGone) as exc:
            abort_all()
            if isinstance(exc, ClientGone):
                return error(499, "client closed the request")
            raise
        ordered = [results[s.rid] for s in seqs]
        t = time.perf_counter()
        response = json_response(ordered[0] if single else ordered)
        core.stats.http_s += time.perf_counter() - t
        return response

    return router


_rid_counter = itertools.count()


def _per_item(value, i: int, count: int, name: str):
    if isinstance(value, list):
        if len(value) != count:
            raise S.RequestError(f"{name}: expected {count} entries (one per prompt), got {len(value)}")
        return value[i]
    return value


def _expand(req: S.GenerateRequest, core: EngineCore) -> tuple[list[SeqRequest], bool]:
    """Turns one /generate body into sequences (prompts x n); `single` when one dict is returned."""
    if (req.text is None) == (req.input_ids is None):
        raise S.RequestError("exactly one of input_ids or text is required")
    if req.input_ids is not None:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = req.input_ids if batch else [req.input_ids]
    else:
        batch = isinstance(req.text, list)
        texts = req.text if batch else [req.text]
        prompts = [core.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    count = len(prompts)
    if count == 0:
        raise S.RequestError("input_ids: empty batch")
    raw_sp = req.sampling_params
    rids = req.rid if isinstance(req.rid, list) else None
    if rids is not None and len(rids) != count:
        raise S.RequestError(f"rid: expected {count} entries (one per prompt), got {len(rids)}")
    out: list[SeqRequest] = []
    for i, ids in enumerate(prompts):
        where = "input_ids" if not batch else f"input_ids[{i}]"
        if not ids:
            raise S.RequestError(f"{where}: empty prompt")
        bad = next((t for t in ids if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise S.RequestError(f"{where}: token id {bad} is outside the vocabulary [0, {core.vocab_size})")
        sp_in = S.parse_sampling(_per_item(raw_sp, i, count, "sampling_params") if raw_sp else None,
                                 i if isinstance(raw_sp, list) else None)
        scoring = sp_in.max_new_tokens == 0  # prefill only: the whole prompt may fill the context
        if len(ids) > core.context_length or (len(ids) == core.context_length and not scoring):
            raise S.RequestError(f"{where}: prompt of {len(ids)} tokens does not fit the context length "
                                 f"{core.context_length}" + ("" if scoring else " (at least one token must be generated)"))
        try:
            params = sp_in.to_params()
        except ValueError as exc:
            raise S.RequestError(str(exc)) from None
        bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < core.vocab_size), None)
        if bad_stop is not None:
            raise S.RequestError(f"sampling_params.stop_token_ids: {bad_stop} is outside the vocabulary")
        start = _per_item(req.logprob_start_len, i, count, "logprob_start_len")
        if start >= len(ids) or start < -1:
            raise S.RequestError(f"logprob_start_len: {start} is outside [-1, {len(ids) - 1}] for a prompt of {len(ids)} tokens")
        top_n = _per_item(req.top_logprobs_num, i, count, "top_logprobs_num")
        if top_n < 0:
            raise S.RequestError("top_logprobs_num: must be >= 0")
        base = (rids[i] if rids else (req.rid if isinstance(req.rid, str) and count == 1 else None)) \
            or f"{uuid.uuid4().hex[:12]}-{next(_rid_counter)}"
        for j in range(sp_in.n):
            p = params
            if sp_in.n > 1 and params.sampling_seed is not None:
                seed = (params.sampling_seed + j + 2**63) % 2**64 - 2**63  # sample j: seed + j, within 64 bits
                p = type(params)(**{**params.__dict__, "sampling_seed": seed})
            out.append(SeqRequest(
                rid=base if sp_in.n == 1 else f"{base}-{j}", group_rid=req.rid if isinstance(req.rid, str) else base,
                input_ids=list(ids), params=p,
                return_logprob=bool(_per_item(req.return_logprob, i, count, "return_logprob")),
                logprob_start_len=start, top_logprobs_num=top_n, stream=req.stream,
            ))
    return out, (not batch and len(out) == 1)


def _triples(core: EngineCore, pairs, with_text: bool) -> list:
    return [[lp, tok, core.tokenizer.decode([tok]) if with_text else None] for lp, tok in pairs]


def _render(snap: SeqSnapshot, seq: SeqRequest, core: EngineCore, with_text: bool, latency: float) -> dict:
    p = seq.params
    text = core.tokenizer.decode(snap.output_ids, skip_special_tokens=p.skip_special_tokens)
    fin = snap.finish
    fr = None if fin is None else fin.to_wire()
    if fin is not None and isinstance(fin.matched, str):
        cut = text.find(fin.matched)
        text = text[:cut] if cut >= 0 else text
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": fr,
        "prompt_tokens": snap.prompt_tokens,
        "completion_tokens": len(snap.output_ids),
        "cached_tokens": snap.cached_tokens,
        "weight_version": str(snap.weight_version),
        "e2e_latency": latency,
        # LoongSage extension: the policy version that produced each output token (partial rollouts).
        "output_token_weight_versions": snap.output_versions,
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = _triples(core, zip(snap.output_logprobs, snap.output_ids), with_text)
        if snap.input_logprobs is not None:
            first = seq.logprob_start_len
            ids = seq.input_ids[first:]
            meta["input_token_logprobs"] = _triples(core, zip(snap.input_logprobs, ids), with_text)
        else:
            meta["input_token_logprobs"] = []
        if seq.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_triples(core, top, with_text) for top in snap.output_top]
            if snap.input_top is not None:
                meta["input_top_logprobs"] = [None if top is None else _triples(core, top, with_text)
                                              for top in snap.input_top]
    return {"text": text, "output_ids": snap.output_ids, "meta_info": meta}
