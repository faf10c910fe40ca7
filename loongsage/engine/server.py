"""The embedded engine's HTTP server: SGLang's routes and fields over an `EngineCore`.

Handlers only parse, validate and translate; all model work happens on the core's thread.
Every client error is a 400 naming the problem, and the server keeps serving the others.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import time
import uuid
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from loongsage.engine import schema as S
from loongsage.engine.core import EngineCore
from loongsage.engine.mapped_weights import MappedWeights
from loongsage.engine.security import BearerAuth, EngineSecurity
from loongsage.engine.sequence import SeqRequest, SeqSnapshot
from loongsage.cluster.network import LOOPBACK
from loongsage.transfer.checksum import weights_checksum
from loongsage.transfer.collective import broadcast, dtype_from_name, new_weight_group
from loongsage.transfer.buckets import plan_buckets
from loongsage.transfer.tensor_handles import SharedBuckets, deserialize_named_tensors, unflatten_bucket

log = logging.getLogger("loongsage.engine")
MAX_BODY_BYTES = 64 * 1024 * 1024


def json_response(obj) -> Response:
    """Already-JSON data straight to bytes: FastAPI's jsonable_encoder walks every element in Python
    first, which on a batch's logprobs cost the HTTP thread more than the step thread's forward, and
    with one core and one GIL every such millisecond stalls generation."""
    return Response(json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                    media_type="application/json")


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def create_app(core: EngineCore, served_model_name: str | None = None,
               security: EngineSecurity | None = None, host: str = LOOPBACK) -> FastAPI:
    security = security or EngineSecurity()
    app = FastAPI(title="LoongSage embedded engine (SGLang protocol)")
    if security.api_key:
        app.add_middleware(BearerAuth, api_key=security.api_key)
    app.state.shared = SharedBuckets(prefix=security.shm_prefix)  # relay fan-out buffers; released at shutdown
    app.state.mapped = None  # MappedWeights once a same-host trainer mapped them; released at shutdown
    app.state.host = host  # the address the server binds (its weight-group sockets bind it too)
    groups: dict[str, Any] = {}
    state = {"healthy": True}

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise S.RequestError(f"request body of {len(raw)} bytes exceeds the limit of {MAX_BODY_BYTES}")
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise S.RequestError(f"malformed JSON: {exc}") from None

    async def on_core(fn, *args):
        return await asyncio.wrap_future(core.call(fn, *args))

    @app.exception_handler(S.RequestError)
    async def _bad_request(_: Request, exc: S.RequestError):
        return error(400, str(exc))

    # ---- generation ----------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        req = S.parse(S.GenerateRequest, await body_of(request))
        seqs, single = _expand(req, core)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SeqSnapshot] = asyncio.Queue()
        for s in seqs:
            s.on_update = lambda snap: loop.call_soon_threadsafe(queue.put_nowait, snap)
        index = {s.rid: i for i, s in enumerate(seqs)}
        t0 = time.perf_counter()
        core.submit(seqs)

        def render(snap: SeqSnapshot) -> dict:
            return _render(snap, seqs[index[snap.rid]], core, req.return_text_in_logprobs, time.perf_counter() - t0)

        if req.stream:
            async def events():
                done = 0
                try:
                    while done < len(seqs):
                        snap = await queue.get()
                        out = render(snap)
                        if len(seqs) > 1:
                            out["index"] = index[snap.rid]
                        done += snap.finish_reason is not None
                        yield f"data: {json.dumps(out)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if done < len(seqs):
                        for s in seqs:
                            core.call(core.abort, s.rid, False, "client disconnected")
            return StreamingResponse(events(), media_type="text/event-stream")

        results: dict[str, dict] = {}
        try:
            while len(results) < len(seqs):
                snap = await queue.get()
                if snap.finish_reason is not None:
                    results[snap.rid] = render(snap)
        except asyncio.CancelledError:
            for s in seqs:
                core.call(core.abort, s.rid, False, "client disconnected")
            raise
        ordered = [results[s.rid] for s in seqs]
        return json_response(ordered[0] if single else ordered)

    # ---- weights -------------------------------------------------------------------------
    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        req = S.parse(S.UpdateFromTensor, await body_of(request))
        if len(req.serialized_named_tensors) != 1:
            return error(400, f"serialized_named_tensors: expected one entry (tp_size 1), got {len(req.serialized_named_tensors)}")
        try:
            payload = deserialize_named_tensors(req.serialized_named_tensors[0], security.shm_prefix)
            named = unflatten_bucket(payload) if req.load_format == "flattened_bucket" else payload
        except ValueError as exc:
            return error(400, str(exc))
        return await _apply(lambda r: r.load_weights(named), req.weight_version, req.flush_cache, req.abort_all_requests)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        req = S.parse(S.UpdateFromDisk, await body_of(request))
        try:
            path = security.weights_path(req.model_path, core.model_path)
        except ValueError as exc:
            return error(403, str(exc))
        res = await _apply(lambda r: r.load_from_disk(path), req.weight_version, req.flush_cache,
                           req.abort_all_requests)
        if isinstance(res, dict):
            res["num_paused_requests"] = 0
        return res

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        req = S.parse(S.InitGroup, await body_of(request))
        if req.group_name in groups:
            return error(400, f"group_name: a group named {req.group_name!r} already exists")
        try:
            groups[req.group_name] = req.backend, await asyncio.to_thread(
                new_weight_group, req.backend, req.master_address, req.master_port, req.rank_offset,
                req.world_size, req.group_name, own_address=app.state.host)
        except Exception as exc:
            return error(400, f"cannot join weight update group {req.group_name!r}: {exc}")
        return {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        req = S.parse(S.UpdateFromDistributed, await body_of(request))
        backend, group = groups.get(req.group_name, (None, None))
        if group is None:
            return error(400, f"group_name: no weight update group {req.group_name!r}; call /init_weights_update_group first")
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            return error(400, "names, dtypes and shapes must have the same length")
        try:
            dtypes = [dtype_from_name(d) for d in req.dtypes]
        except ValueError as exc:
            return error(400, f"dtypes: {exc}")

        def receive(runner):
            dev = runner.device if backend == "nccl" else torch.device("cpu")
            if req.load_format == "flattened_bucket":
                if len(set(dtypes)) != 1:
                    raise ValueError("flattened_bucket needs one dtype for all tensors")
                sizes = [int(torch.Size(s).numel()) for s in req.shapes]
                flat = torch.empty(sum(sizes), dtype=dtypes[0], device=dev)
                broadcast(group, flat)
                parts = flat.split(sizes)
                named = [(n, p.view(s)) for n, p, s in zip(req.names, parts, req.shapes)]
            else:
                named = []
                for n, d, s in zip(req.names, dtypes, req.shapes):
                    t = torch.empty(s, dtype=d, device=dev)
                    broadcast(group, t)
                    named.append((n, t))
            return runner.load_weights(named)

        return await _apply(receive, req.weight_version, req.flush_cache, req.abort_all_requests)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        req = S.parse(S.DestroyGroup, await body_of(request))
        if groups.pop(req.group_name, None) is None:
            return error(400, f"group_name: no weight update group {req.group_name!r}")
        return {"success": True, "message": f"destroyed {req.group_name}"}

    async def _apply(load, version, flush_cache, abort_all):
        try:
            n = await on_core(core.set_weights, load, None if version is None else str(version), flush_cache, abort_all)
        except Exception as exc:
            return error(400, f"weight update failed: {exc}")
        return {"success": True, "message": f"updated {n} tensors; weight_version={core.weight_version}"}

    # ---- control -------------------------------------------------------------------------
    @app.post("/pause_generation")
    async def pause(request: Request):
        req = S.parse(S.PauseRequest, await body_of(request))
        return {"status": "ok", "message": await on_core(core.pause, req.mode)}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await body_of(request)
        return {"status": "ok", "message": await on_core(core.resume_generation)}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = S.parse(S.AbortRequest, await body_of(request))
        if not req.abort_all and req.rid is None:
            return error(400, "rid: required unless abort_all is true")
        rids = req.rid if isinstance(req.rid, list) else [req.rid]
        n = 0
        for rid in rids:
            n += await on_core(core.abort, rid, req.abort_all)
        return {"success": True, "num_aborted": n}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        try:
            await on_core(core.flush_cache)
        except RuntimeError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        return PlainTextResponse("Cache flushed.")

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        req = S.parse(S.MemoryRequest, await body_of(request))
        try:
            await on_core(core.release_memory, req.tags)
        except RuntimeError as exc:
            return error(400, str(exc))
        return {"success": True}

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        req = S.parse(S.MemoryRequest, await body_of(request))
        await on_core(core.resume_memory, req.tags)
        return {"success": True}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        req = S.parse(S.WeightVersionRequest, await body_of(request))

        def bump():
            if req.abort_all_requests:
                core.abort(None, abort_all=True, message="aborted for a weight version update")
            core.weight_version = str(req.new_version)
        await on_core(bump)
        return {"success": True, "message": f"weight_version={core.weight_version}"}

    # ---- info ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return PlainTextResponse("ok") if state["healthy"] else PlainTextResponse("unhealthy", status_code=503)

    @app.get("/health_generate")
    async def health_generate():
        if core.memory_released:
            return PlainTextResponse("memory released", status_code=503)
        return PlainTextResponse("ok")

    @app.api_route("/model_info", methods=["GET"])
    @app.api_route("/get_model_info", methods=["GET"])
    async def model_info():
        cfg = core.runner.config
        return {
            "model_path": core.model_path, "tokenizer_path": core.model_path, "is_generation": True,
            "weight_version": core.weight_version, "architectures": cfg.architectures,
            "served_model_name": served_model_name or core.model_path, "context_length": core.context_length,
            "vocab_size": core.vocab_size, "dtype": str(core.runner.dtype).removeprefix("torch."),
            "max_running_requests": core.max_running, "paused": core.paused,
            "memory_released": core.memory_released, "eos_token_ids": sorted(core.eos_ids),
        }

    @app.get("/weights_checksum")
    async def checksum():
        """LoongSage extension (TransferMesh verification): the exact checksum of the served weights."""
        def compute(runner):
            params = runner.named_parameters()
            return core.weight_version, weights_checksum(params, list(params))
        version, value = await on_core(lambda: compute(core.runner))
        return {"weight_version": version, "checksum": str(value)}

    @app.post("/share_weights")
    async def share_weights(request: Request):
        """LoongSage extension (TransferMesh relay): copies the served weights into reused shared-memory
        buckets and returns, per bucket, one `flattened_bucket` handle per same-host receiver."""
        req = S.parse(S.ShareWeights, await body_of(request))

        def pack():
            params = list(core.runner.named_parameters().items())
            meta = [(n, str(t.dtype), list(t.shape)) for n, t in params]
            buckets = plan_buckets(meta, int(req.bucket_mb * 2**20), params[0][1].element_size())
            held = app.state.shared.fill([[params[i] for i in b] for b in buckets])
            return core.weight_version, app.state.shared.handles(req.receivers), held
        version, handles, held = await on_core(pack)
        return {"weight_version": version, "handles": handles, "bytes": held}

    @app.post("/map_weights")
    async def map_weights():
        """LoongSage extension (one-copy same-host sync): the weights move into two shared buffers (the
        active one and a standby one); returns a handle for each and which one is active."""
        def build():
            if app.state.mapped is None:
                app.state.mapped = MappedWeights(core.runner.named_parameters(), security.shm_prefix)
            m = app.state.mapped
            return {"handles": m.handles(), "active": m.active, "bytes": m.nbytes}
        try:
            return await on_core(build)
        except ValueError as exc:
            return error(400, str(exc))

    @app.post("/flip_weights")
    async def flip_weights(request: Request):
        """LoongSage extension: serve the standby buffer (written by the trainer) from the next step on."""
        req = S.parse(S.FlipWeights, await body_of(request))
        if app.state.mapped is None:
            return error(400, "no mapped weights; call /map_weights first")
        return await _apply(lambda r: app.state.mapped.flip(r.named_parameters(), req.standby), req.weight_version,
                            req.flush_cache, False)

    @app.get("/get_server_info")
    async def server_info():
        st = core.stats
        return {"weight_version": core.weight_version, "running": len(core.running), "waiting": len(core.waiting),
                "steps": st.steps, "generated_tokens": st.generated_tokens, "prefill_tokens": st.prefill_tokens,
                "cached_tokens": st.cached_tokens, "busy_s": st.busy_s,
                "gc_frozen_objects": gc.get_freeze_count()}  # LoongSage extension (heap.py)

    return app


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
        if len(ids) >= core.context_length:
            raise S.RequestError(f"{where}: prompt of {len(ids)} tokens does not fit the context length "
                                 f"{core.context_length} (at least one token must be generated)")
        sp_in = S.parse_sampling(_per_item(raw_sp, i, count, "sampling_params") if raw_sp else None,
                                 i if isinstance(raw_sp, list) else None)
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
                p = type(params)(**{**params.__dict__, "sampling_seed": params.sampling_seed + j})
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
    fr = snap.finish_reason
    if fr and fr.get("type") == "stop" and isinstance(fr.get("matched"), str):
        cut = text.find(fr["matched"])
        text = text[:cut] if cut >= 0 else text
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": fr,
        "prompt_tokens": snap.prompt_tokens,
        "completion_tokens": len(snap.output_ids),
        "cached_tokens": snap.cached_tokens,
        "weight_version": snap.weight_version,
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
