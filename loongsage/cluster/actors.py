"""Helpers for groups of Ray actors."""
from __future__ import annotations

import ray


def stop_actors(actors: list, method: str, timeout_s: float = 30.0) -> None:
    """Asks each actor to clean up through `method` (best effort), then kills it."""
    for actor in actors:
        try:
            ray.get(getattr(actor, method).remote(), timeout=timeout_s)
        except Exception:  # a dead or hung actor is killed below all the same
            pass
        ray.kill(actor)
