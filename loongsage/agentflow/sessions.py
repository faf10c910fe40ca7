"""Gateway sessions: who an API key is, and the exact token record of every call it made.

Each call either extends one of the session's chains (its messages are that chain's history,
including the model's last turn exactly as returned, plus new messages) or starts a sibling chain
(the agent rewrote its history: retokenization drift, counted). A chain that is generating cannot be
extended: a parallel call with the same history becomes a sibling, never an interleaving.
"""
from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongsage.agentflow.chat_tokens import ChatTemplateError, ChatTokens, normalize_message
from loongsage.agentflow.trajectory import Chain


@dataclass
class Session:
    name: str
    chains: list[Chain] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None  # posted by the agent
    calls: int = 0
    extended: int = 0  # calls that continued a chain token for token
    malformed_tool_calls: int = 0
    busy: set[int] = field(default_factory=set)  # ids of chains with a call in flight
    sampling: dict[str, Any] | None = None  # overrides the gateway's policy sampling (e.g. greedy evaluation)
    system_errors: list[str] = field(default_factory=list)  # calls the inference system failed (not the agent)
    resumed_calls: int = 0  # calls continued after a system abort (rollout/resume.py)

    def place(self, chat: ChatTokens, messages: list[dict], tools: list[dict] | None) -> tuple[Chain, bool]:
        """The chain this call generates on (extended by the new messages), and whether it extends one."""
        want = [normalize_message(m) for m in messages]
        for chain in reversed(self.chains):
            n = len(chain.messages)
            if (id(chain) in self.busy or chain.tools != tools or len(want) <= n
                    or want[:n] != [normalize_message(m) for m in chain.messages]):
                continue
            try:
                ids = chat.continuation_ids(chain.messages, messages[n:], tools, chain.last_stop)
            except ChatTemplateError:
                break
            chain.add_inserted(ids)
            chain.messages += messages[n:]
            return chain, True
        chain = Chain(chat.prompt_ids(messages, tools), messages=list(messages), tools=tools)
        self.chains.append(chain)
        return chain, False

    @property
    def drift_rate(self) -> float:
        """Of the calls after a session's first, the share that could not extend a chain."""
        later = self.calls - 1
        return 0.0 if later <= 0 else (later - self.extended) / later


class SessionStore:
    """Keys -> sessions. `open_keys`: any non-empty key names its own session (interactive serve);
    otherwise only keys handed out by `open()` are accepted (training runs)."""

    def __init__(self, open_keys: bool = False):
        self.open_keys = open_keys
        self._by_key: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Sessions open now (each episode closes its own: none may outlive it)."""
        return len(self._by_key)

    def open(self, name: str, sampling: dict[str, Any] | None = None) -> tuple[str, Session]:
        key = "lsk-" + secrets.token_urlsafe(24)
        session = Session(name, sampling=sampling)
        with self._lock:
            self._by_key[key] = session
        return key, session

    def close(self, key: str) -> Session | None:
        with self._lock:
            return self._by_key.pop(key, None)

    def lookup(self, key: str | None) -> Session | None:
        if not key:
            return None
        with self._lock:
            session = self._by_key.get(key)
            if session is None and self.open_keys:
                session = self._by_key[key] = Session(key)
            return session


class CallRecorder:
    """One JSON line per model call in RECORD_DIR/calls.jsonl (flushed per line, so nothing written is
    lost if the process dies)."""

    def __init__(self, record_dir: str | Path):
        self.path = Path(record_dir) / "calls.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
