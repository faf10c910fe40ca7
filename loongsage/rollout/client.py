"""Async HTTP transport for one inference server (SGLang or the embedded engine)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx

from loongsage.rollout import protocol as P


class EngineError(RuntimeError):
    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict | None = None) -> Any:
        r = await self._http.post(path, json=body or {})
        return self._result(r)

    def _result(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", {}).get("message", r.text)
            except (ValueError, AttributeError):
                msg = r.text
            raise EngineError(r.status_code, msg, str(r.url))
        ctype = r.headers.get("content-type", "")
        return r.json() if "json" in ctype else r.text

    # ---- generation ----------------------------------------------------------------------
    async def generate_raw(self, body: dict) -> Any:
        return await self._post("/generate", body)

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **kw) -> P.GenerateOutput:
        return P.parse_generate(await self._post("/generate", P.build_generate(input_ids, sampling_params, **kw)))

    async def generate_batch(self, batch: list[list[int]], sampling_params: dict | list | None = None,
                             **kw) -> list[P.GenerateOutput]:
        res = await self._post("/generate", P.build_generate(batch, sampling_params, **kw))
        return [P.parse_generate(o) for o in res]

    async def generate_stream(self, input_ids: list[int], sampling_params: dict | None = None,
                              **kw) -> AsyncIterator[dict]:
        body = P.build_generate(input_ids, sampling_params, stream=True, **kw)
        async with self._http.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                self._result(r)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                yield json.loads(data)

    # ---- control -------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict:
        return self._result(await self._http.get("/model_info"))

    async def server_info(self) -> dict:
        return self._result(await self._http.get("/get_server_info"))

    async def pause(self, mode: str = "abort") -> dict:
        return await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        return await self._post("/continue_generation")

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return await self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> str:
        return await self._post("/flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/resume_memory_occupation", {"tags": tags})

    # ---- weights -------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None) -> dict:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_disk", body)

    async def update_weights_from_tensor(self, handle: str, weight_version: str | int | None = None,
                                         load_format: str | None = None) -> dict:
        body: dict[str, Any] = {"serialized_named_tensors": [handle], "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_tensor", body)

    async def init_weights_update_group(self, **kw) -> dict:
        return await self._post("/init_weights_update_group", P.build_init_group(**kw))

    async def update_weights_from_distributed(self, **kw) -> dict:
        return await self._post("/update_weights_from_distributed", P.build_update_from_distributed(**kw))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})
