"""Async HTTP transport for one inference server (SGLang or the embedded engine).

aiohttp rather than httpx: the controller sends thousands of small /generate calls per minute, and
httpx's per-request overhead (async-library sniffing, pool bookkeeping) measured at ~55% of the
controller's CPU in async runs, CPU the engine and trainer need on a 2-core machine."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from loongsage.rollout import protocol as P


class EngineError(RuntimeError):
    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        """`api_key`: the engine's key (`--api-key`), sent as `Authorization: Bearer` on every call."""
        self.base_url = base_url.rstrip("/")
        self.api_key, self.timeout_s = api_key, timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        """One session per client, made on first use inside the running event loop."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False,
                # Idle connections are dropped after 3 s, before a server's keep-alive timeout (uvicorn's
                # default, SGLang's too, is 5 s) can close one under a request about to reuse it.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0), json_serialize=json.dumps,
                headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        for attempt in (0, 1):
            try:
                async with self._http().request(method, self.base_url + path, json=body) as r:
                    return await self._result(r)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A pooled connection the server had just closed: control calls are idempotent, so one
                # retry on a fresh connection; generation is not retried (it could run twice).
                if attempt or path == "/generate":
                    raise

    async def _post(self, path: str, body: dict | None = None) -> Any:
        return await self._request("POST", path, body or {})

    async def _result(self, r: aiohttp.ClientResponse) -> Any:
        body = await r.read()
        if r.status >= 400:
            text = body.decode(errors="replace")
            try:
                msg = json.loads(text).get("error", {}).get("message", text)
            except (ValueError, AttributeError):
                msg = text
            raise EngineError(r.status, msg, str(r.url))
        # orjson: a teacher's full-vocabulary logprobs parse ~5x faster than with the json module
        return orjson.loads(body) if "json" in r.headers.get("content-type", "") else body.decode(errors="replace")

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
        async with self._http().post(self.base_url + "/generate", json=body) as r:
            if r.status >= 400:
                await self._result(r)
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                yield orjson.loads(data)

    # ---- control -------------------------------------------------------------------------
    async def health(self) -> bool:
        return await self.health_status() == 200

    async def health_status(self) -> int | None:
        """GET /health's status code, or None when nothing answers (the server is gone)."""
        try:
            async with self._http().get(self.base_url + "/health") as r:
                return r.status
        except aiohttp.ClientError:
            return None

    async def model_info(self) -> dict:
        return await self._request("GET", "/model_info")

    async def weights_checksum(self) -> dict:
        """LoongSage extension: {"weight_version", "checksum"} of the served weights."""
        return await self._request("GET", "/weights_checksum")

    async def server_info(self) -> dict:
        return await self._request("GET", "/get_server_info")

    async def pause(self, mode: str = "abort") -> dict:
        return await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        return await self._post("/continue_generation")

    async def abort(self, rid: str | list[str] | None = None, abort_all: bool = False) -> dict:
        return await self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> str:
        return await self._post("/flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/resume_memory_occupation", {"tags": tags})

    async def update_weight_version(self, version: str | int, abort_all_requests: bool = False) -> dict:
        """Relabel the served weights (SGLang's route; it aborts running requests unless told not to)."""
        return await self._post("/update_weight_version", {"new_version": str(version),
                                                           "abort_all_requests": abort_all_requests})

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

    async def share_weights(self, receivers: int, bucket_mb: float = 64.0) -> dict:
        """LoongSage extension (relay engines): {"weight_version", "handles": per bucket, per receiver}."""
        return await self._post("/share_weights", {"receivers": receivers, "bucket_mb": bucket_mb})

    async def map_weights(self) -> dict:
        """LoongSage extension (one-copy same-host sync): {"handles": [2], "active", "bytes"}."""
        return await self._post("/map_weights")

    async def flip_weights(self, standby: int, weight_version: str | int | None = None) -> dict:
        body: dict[str, Any] = {"standby": standby}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/flip_weights", body)

    async def init_weights_update_group(self, **kw) -> dict:
        return await self._post("/init_weights_update_group", P.build_init_group(**kw))

    async def update_weights_from_distributed(self, **kw) -> dict:
        return await self._post("/update_weights_from_distributed", P.build_update_from_distributed(**kw))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})
