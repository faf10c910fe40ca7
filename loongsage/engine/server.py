"""The embedded engine's HTTP server: SGLang's routes and fields over an `EngineCore`, composed of
one router per concern (generation, control, info) plus every weight route's engine side
(`loongsage/transfer/receivers.py`) over the engine's `WeightHost`.

Handlers only parse, validate and translate; all model work happens on the core's thread.
Every client error is a 4xx naming the problem, and the server keeps serving the others.
"""
from __future__ import annotations

from fastapi import FastAPI, Request

from loongsage.cluster.network import LOOPBACK
from loongsage.engine.core import EngineCore
from loongsage.engine.faults import InjectedErrors
from loongsage.engine.routes_control import control_routes
from loongsage.engine.routes_generate import generation_routes
from loongsage.engine.routes_info import info_routes
from loongsage.engine.security import BearerAuth, EngineSecurity
from loongsage.engine.weight_host import EngineWeights
from loongsage.transfer.receivers import receivers_for
from loongsage.wire import RequestError, error


def create_app(core: EngineCore, served_model_name: str | None = None,
               security: EngineSecurity | None = None, host: str = LOOPBACK, inject_errors: str | None = None) -> FastAPI:
    """`app.state.receivers` hold what the weight routes keep (shared buffers, groups): the launcher
    releases them at shutdown. `inject_errors`: engine/faults.py."""
    security = security or EngineSecurity()
    app = FastAPI(title="LoongSage embedded engine (SGLang protocol)")
    if inject_errors:
        app.add_middleware(InjectedErrors, spec=inject_errors)
    if security.api_key:
        app.add_middleware(BearerAuth, api_key=security.api_key)

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError):
        return error(400, str(exc))

    app.include_router(generation_routes(core))
    app.include_router(control_routes(core))
    app.include_router(info_routes(core, served_model_name))
    app.state.receivers = receivers_for(EngineWeights(core, host, security))
    for receiver in app.state.receivers:
        app.include_router(receiver.routes())
    return app


def release(app: FastAPI) -> None:
    for receiver in app.state.receivers:
        receiver.release()
