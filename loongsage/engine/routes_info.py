"""Information routes: health, model info, server counters (no side effects)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from loongsage.engine.core import EngineCore
from loongsage.heap import FROZEN


def info_routes(core: EngineCore, served_model_name: str | None = None) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @router.get("/health_generate")
    async def health_generate():
        if core.memory_released:
            return PlainTextResponse("memory released", status_code=503)
        return PlainTextResponse("ok")

    @router.api_route("/model_info", methods=["GET"])
    @router.api_route("/get_model_info", methods=["GET"])
    async def model_info():
        cfg = core.runner.config
        return {
            "model_path": core.model_path, "tokenizer_path": core.model_path, "is_generation": True,
            "weight_version": str(core.weight_version), "architectures": cfg.architectures,
            "served_model_name": served_model_name or core.model_path, "context_length": core.context_length,
            "vocab_size": core.vocab_size, "dtype": str(core.runner.dtype).removeprefix("torch."),
            "max_running_requests": core.max_running, "paused": core.paused,
            "memory_released": core.memory_released, "eos_token_ids": sorted(core.eos_ids),
            "weight_bytes": core.weight_bytes,  # LoongSage extension: what the served weights occupy
        }

    @router.get("/get_server_info")
    async def server_info():
        st = core.stats
        return {"weight_version": str(core.weight_version), "running": len(core.running), "waiting": len(core.waiting),
                "steps": st.steps, "generated_tokens": st.generated_tokens, "prefill_tokens": st.prefill_tokens,
                "cached_tokens": st.cached_tokens, "busy_s": st.busy_s,
                # LoongSage extension: where the engine's time went (core.EngineStats)
                "prefill_s": st.prefill_s, "decode_s": st.decode_s, "sample_s": st.sample_s,
                "schedule_s": st.schedule_s, "http_s": st.http_s,
                "gc_frozen_objects": FROZEN["objects"]}  # LoongSage extension (heap.py)
    return router
