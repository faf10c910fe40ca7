"""Who may call an engine and what its control routes may touch.

SGLang's `--api-key` semantics: with a key set, every route but /health* needs
`Authorization: Bearer <key>` (401 otherwise); a run gives each of its engines a random key.
Weight loading from disk reads only below the configured roots (and the served model's folder),
and shared-memory handles name only files under the run's prefix (transfer/tensor_handles.py).
"""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

from loongsage.transfer.shm_names import SHM_PREFIX

API_KEY_ENV = "LOONGSAGE_ENGINE_API_KEY"  # how a run hands an engine its key (not on the command line)


@dataclass(frozen=True)
class EngineSecurity:
    api_key: str | None = None
    weight_roots: tuple[str, ...] = ()  # /update_weights_from_disk reads only below these (and the model)
    shm_prefix: str = SHM_PREFIX

    def weights_path(self, path: str, model_path: str) -> str:
        """`path` resolved (symlinks followed) if it lies below an allowed root; else ValueError."""
        real = os.path.realpath(path)
        roots = [os.path.realpath(r) for r in (*self.weight_roots, model_path)]
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            raise ValueError(f"model_path: {path!r} is outside the folders this engine may load weights from "
                             f"({', '.join(roots)}; `loongsage engine --weight-roots` adds more)")
        return real


class BearerAuth:
    """ASGI middleware (not a BaseHTTPMiddleware: it must not buffer streamed responses or hide a
    client's disconnect from the handler)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/health") or self._authorized(scope):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "Unauthorized: this engine needs 'Authorization: Bearer <api key>'",
                                     "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)
