"""Runs one of our HTTP servers (the embedded engine, `loongsage serve`) in the foreground so that a
SIGTERM ends it through Python: the caller's `finally` and `with` blocks run.

uvicorn shuts down gracefully on SIGTERM and then raises the signal again; with the default handler
that ends the process on the spot, after the server but before any cleanup of the caller's (a
`loongsage serve` left its engine's temporary folder behind, and an engine its shared buffers'
release). Here the re-raised SIGTERM becomes `SystemExit(143)` instead.
"""
from __future__ import annotations

import signal
import threading

import uvicorn


def _exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def run_server(app, **uvicorn_kwargs) -> None:
    """`uvicorn.run(app, **uvicorn_kwargs)`; a SIGTERM that stopped it raises SystemExit(143)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit) if main else None
    try:
        uvicorn.run(app, **uvicorn_kwargs)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
