"""Control routes: pause / continue, abort, flush the prefix cache, release and resume memory, set
the weight version. Each runs on the engine thread between two steps."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from loongsage.engine import schema as S
from loongsage.engine.core import EngineCore
from loongsage.transfer.receiving import as_version
from loongsage.wire import body_of, error, openapi_body


def control_routes(core: EngineCore) -> APIRouter:
    router = APIRouter()

    async def on_core(fn, *args):
        return await asyncio.wrap_future(core.call(fn, *args))

    @router.post("/pause_generation", openapi_extra=openapi_body(S.PauseRequest))
    async def pause(request: Request):
        req = S.parse(S.PauseRequest, await body_of(request))
        return {"status": "ok", "message": await on_core(core.pause, req.mode)}

    @router.post("/continue_generation")
    async def continue_generation(request: Request):
        await body_of(request)
        return {"status": "ok", "message": await on_core(core.resume_generation)}

    @router.post("/abort_request", openapi_extra=openapi_body(S.AbortRequest))
    async def abort_request(request: Request):
        req = S.parse(S.AbortRequest, await body_of(request))
        if not req.abort_all and req.rid is None:
            return error(400, "rid: required unless abort_all is true")
        rids = req.rid if isinstance(req.rid, list) else [req.rid]
        n = 0
        for rid in rids:
            n += await on_core(core.abort, rid, req.abort_all)
        return {"success": True, "num_aborted": n}

    @router.post("/flush_cache")
    @router.get("/flush_cache", operation_id="flush_cache_get")  # SGLang takes both; one operation id each
    async def flush_cache():
        try:
            await on_core(core.flush_cache)
        except RuntimeError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        return PlainTextResponse("Cache flushed.")

    @router.post("/release_memory_occupation", openapi_extra=openapi_body(S.MemoryRequest))
    async def release_memory(request: Request):
        req = S.parse(S.MemoryRequest, await body_of(request))
        try:
            await on_core(core.release_memory, req.tags)
        except RuntimeError as exc:
            return error(400, str(exc))
        return {"success": True}

    @router.post("/resume_memory_occupation", openapi_extra=openapi_body(S.MemoryRequest))
    async def resume_memory(request: Request):
        req = S.parse(S.MemoryRequest, await body_of(request))
        await on_core(core.resume_memory, req.tags)
        return {"success": True}

    @router.post("/update_weight_version", openapi_extra=openapi_body(S.WeightVersionRequest))
    async def update_weight_version(request: Request):
        req = S.parse(S.WeightVersionRequest, await body_of(request))
        version = as_version(req.new_version)

        def bump():
            if req.abort_all_requests:
                core.abort(None, abort_all=True, message="aborted for a weight version update")
            core.weight_version = version
        await on_core(bump)
        return {"success": True, "message": f"weight_version={core.weight_version}"}
    return router
