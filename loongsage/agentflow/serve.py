"""`loongsage serve`: a local model behind the OpenAI API, every call recorded.

Point any OpenAI client or agent SDK at it to see, before training, exactly what a run would record
for that agent: one JSON line per model call in RECORD_DIR/calls.jsonl (session, prompt_ids,
output_ids, output_logprobs, weight_version, ...). Here the API key only names the session.
"""
from __future__ import annotations

import os
import secrets
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from transformers import AutoTokenizer

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.gateway import Gateway
from loongsage.agentflow.llm import PolicyLLM
from loongsage.agentflow.sessions import CallRecorder, SessionStore
from loongsage.http_server import run_server
from loongsage.rollout.launcher import launch_engine
from loongsage.rollout.router import Router


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, record_dir: str | None = None,
          engine_url: str | None = None, threads: int = 1, context_length: int | None = None,
          max_new_tokens: int = 512, model_name: str | None = None, engine_api_key: str | None = None) -> None:
    """`engine_api_key`: the key of the engine at `engine_url`; an engine started here gets a random one."""
    console = Console()
    if not Path(model, "config.json").is_file():
        raise FileNotFoundError(f"--model {model}: not an HF model folder (no config.json)")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning: binding {host}: anyone who can reach it can use the model "
                      "(any key is accepted by serve)[/yellow]")
    name = model_name or Path(model).resolve().name
    extra = ["--context-length", str(context_length)] if context_length else []
    engine = (launch_engine(model, threads=threads, extra_args=extra, api_key=secrets.token_urlsafe(32))
              if engine_url is None else nullcontext())
    with engine as ep:
        url, key = (engine_url, engine_api_key) if engine_url else (ep.url, ep.api_key)
        chat = ChatTokens(AutoTokenizer.from_pretrained(model), model)
        recorder = CallRecorder(record_dir) if record_dir else None
        gateway = Gateway(PolicyLLM(Router([url], api_key=key), chat, {"max_new_tokens": max_new_tokens}), chat,
                          SessionStore(open_keys=True), model_name=name, recorder=recorder)
        console.print(f"serving {name} (engine {url}) at http://{host}:{port}/v1"
                      + (f"; recording to {recorder.path}" if recorder else ""))
        console.print(f"  OPENAI_BASE_URL=http://{host}:{port}/v1 OPENAI_API_KEY=<any name for the session>")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        run_server(gateway.app(), host=host, port=port, log_level="warning", timeout_keep_alive=60)
