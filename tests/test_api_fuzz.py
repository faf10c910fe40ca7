"""The engine's and the gateway's HTTP APIs fuzzed from their own OpenAPI documents (schemathesis):
every generated request (valid, invalid, hostile) gets an answer below 500, the server stays up
and serves a normal request afterwards, and its memory stays bounded."""
from __future__ import annotations

import asyncio
import threading

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from loongsage.rollout.launcher import launch_engine

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Routes that hold the engine on purpose until another call releases it (a fuzzed pause would stall
# every later case for its timeout), or join a collective at a fuzzed address: exercised elsewhere.
HOLDING = ["/pause_generation", "/release_memory_occupation", "/init_weights_update_group"]


def _fuzz(document: dict, base_url: str, headers: dict, examples: int, exclude: list[str] = ()) -> dict[str, int]:
    """Every operation of the OpenAPI `document`, `examples` generated cases each, sent to
    `base_url`; returns status counts and raises on the first 5xx (with the request that caused it)."""
    schema = schemathesis.openapi.from_dict(document)
    statuses: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in exclude:
            continue

        @given(case=op.as_strategy())
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def one(case):
            response = case.call(base_url=base_url, headers=headers, timeout=60)
            statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        one()
    return statuses


def test_the_engine_api_survives_fuzzing(tiny_model):
    with launch_engine(tiny_model, extra_args=["--max-running", "8", "--context-length", "64"], api_key=KEY) as ep:
        proc = psutil.Process(ep.proc.pid)
        httpx.post(f"{ep.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}},
                   headers=AUTH, timeout=60).raise_for_status()
        rss_before = proc.memory_info().rss
        document = httpx.get(f"{ep.url}/openapi.json", headers=AUTH, timeout=10).json()
        statuses = _fuzz(document, ep.url, AUTH, examples=25, exclude=HOLDING)
        rss_after = proc.memory_info().rss
        assert ep.proc.poll() is None and httpx.get(f"{ep.url}/health", timeout=10).status_code == 200
        out = httpx.post(f"{ep.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
                         headers=AUTH, timeout=60).json()
        assert out["meta_info"]["completion_tokens"] >= 1
        unauthorised = httpx.post(f"{ep.url}/generate", json={"input_ids": [1]}, timeout=10)
    assert statuses.get("200", 0) > 10 and statuses.get("400", 0) + statuses.get("422", 0) > 10, statuses
    assert unauthorised.status_code == 401
    assert rss_after - rss_before < 256 * 2**20, (rss_before, rss_after)


@pytest.fixture
def gateway_url(tool_engine, tool_model):
    """A gateway (open keys: each caller's key is its session) in a thread with its own event loop,
    so that the fuzzer's blocking calls do not stall it."""
    from transformers import AutoTokenizer

    from loongsage.agentflow.chat_tokens import ChatTokens
    from loongsage.agentflow.gateway import Gateway, GatewayServer
    from loongsage.agentflow.llm import PolicyLLM
    from loongsage.agentflow.sessions import SessionStore
    from loongsage.rollout.router import Router

    ready, stop = threading.Event(), None
    box: dict = {}

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        chat = ChatTokens(AutoTokenizer.from_pretrained(tool_model), tool_model)
        router = Router([tool_engine.url])
        gw = Gateway(PolicyLLM(router, chat, {"temperature": 0.0}), chat, SessionStore(open_keys=True),
                     policy_sampling={"max_new_tokens": 8})
        server = await GatewayServer(gw).start()
        box["url"], box["loop"] = f"http://{server.host}:{server.port}", asyncio.get_running_loop()
        box["document"] = gw.app().openapi()  # the gateway serves no /openapi.json (agents need none)
        ready.set()
        await stop.wait()
        await server.stop()
        await router.aclose()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)
    yield box["url"], box["document"]
    box["loop"].call_soon_threadsafe(stop.set)
    thread.join(30)


def test_the_gateway_api_survives_fuzzing(gateway_url):
    gateway_url, document = gateway_url
    statuses = _fuzz(document, gateway_url, {"Authorization": "Bearer agent-1"}, examples=40)
    assert statuses.get("200", 0) > 5 and statuses.get("400", 0) > 5, statuses
    health = httpx.get(f"{gateway_url}/health", timeout=10)
    answer = httpx.post(f"{gateway_url}/v1/chat/completions", headers={"Authorization": "Bearer agent-2"}, timeout=60,
                        json={"model": "policy", "messages": [{"role": "user", "content": "6*7=?"}]})
    assert health.status_code == 200 and answer.status_code == 200, answer.text


def _raw_post(url: str, path: str, headers: dict[str, str], body: bytes, timeout_s: float = 20.0) -> bytes:
    """A POST over a plain socket (so the declared length can lie), returning what the server
    answers before the client sends anything more."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout_s) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\n{head}\r\n".encode() + body)
        answer = b""  # the whole response: its head and body may come in separate packets
        while True:
            chunk = sock.recv(65536)
            answer += chunk
            top, sep, rest = answer.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in top.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if not chunk or (sep and length is not None and len(rest) >= length):
                return answer


def test_an_oversized_body_is_refused_by_its_declared_length_before_it_is_read(engine):
    """200 MB declared, 20 bytes sent: the engine answers 400 at once (were it reading the body
    first, the call would wait for bytes that never come and time out)."""
    answer = _raw_post(engine.url, "/generate", {"Content-Type": "application/json", "Content-Length": "200000000"},
                       b'{"input_ids": [1, 2,')
    assert answer.startswith(b"HTTP/1.1 400") and b"exceeds the limit" in answer, answer[:300]


def test_the_gateway_refuses_a_body_over_its_limit(gateway_url):
    gateway_url, _ = gateway_url
    big = {"model": "policy", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json=big, headers={"Authorization": "Bearer agent-3"},
                   timeout=60)
    assert r.status_code == 413 and "larger than" in r.text
    answer = _raw_post(gateway_url, "/v1/chat/completions",
                       {"Authorization": "Bearer agent-3", "Content-Type": "application/json",
                        "Content-Length": "200000000"}, b'{"model":')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
