"""Small helpers shared by tests: a synchronous view of the async client, HF reference logprobs, and
a seeded policy batch for trainer tests."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from loongsage.rollout.client import EngineClient
from loongsage.sample import Sample
from loongsage.trainer.batch import TrainBatch, collate


def run(coro):
    return asyncio.run(coro)


def fresh_python(script: str, without_env: tuple[str, ...] = (), timeout: float = 300):
    """Runs `script` (dedented) in a new interpreter whose environment lacks `without_env` (what a
    process imports first, or a Ray it starts, must not depend on this test session's), and returns
    the JSON value its last line of output prints."""
    env = {k: v for k, v in os.environ.items() if k not in without_env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


async def with_client(url: str, fn):
    client = EngineClient(url)
    try:
        return await fn(client)
    finally:
        await client.aclose()


def call(url: str, fn):
    """call(url, lambda c: c.generate(...)) from synchronous test code."""
    return run(with_client(url, fn))


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """Full-sequence logprobs from transformers: row t scores token t+1."""
    model = hf_model(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def policy_batch(seed: int = 0, n: int = 6) -> TrainBatch:
    """n samples of growing prompt/response lengths, behaviour logprobs near log(1/100), advantages -1/0/1."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = torch.randint(10, 100, (3 + i,), generator=g).tolist()
        r = torch.randint(10, 100, (2 + 2 * i,), generator=g).tolist()
        samples.append(Sample(p, r, [1] * len(r), torch.randn(len(r), generator=g).mul(0.1).sub(4.6).tolist(),
                              [0] * len(r), advantage=float(i % 3 - 1)))
    return collate(samples, 0)


MALFORMED_CALL = '<tool_call>{"name": "calculator", "arguments": {</tool_call>'


def scripted_tool_model(out_dir: str, steps: int = 280) -> str:
    """A tiny Qwen3 trained (seconds, plain torch) to one calculator episode: to a question it calls
    `calculator` with "6*7"; after a tool result it answers "The answer is 42"; to "oops=?" it writes a
    malformed call. Greedy decoding then gives deterministic tool calls, so gateway and agent tests see
    real parsed (and unparsable) calls from a real engine."""
    from transformers import AutoTokenizer

    from loongsage.agentflow.chat_tokens import ChatTokens
    from loongsage.agentflow.trajectory import demonstration_chain
    from loongsage.models.config import TinyModelSpec
    from loongsage.models.factory import build_tiny_model
    from loongsage.tasks.calculator import CALCULATOR_TOOL

    path = str(build_tiny_model(out_dir, TinyModelSpec(max_position_embeddings=512, seed=3)))
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatTokens(tok, path)
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    demo = [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "42"},
            {"role": "assistant", "content": "The answer is 42"}]
    chains = [demonstration_chain(chat, [{"role": "user", "content": q}], [CALCULATOR_TOOL], demo)
              for q in ("6*7=?", "What is 6 times 7?", "12*3=?")]
    chains.append(demonstration_chain(chat, [{"role": "user", "content": "oops=?"}], [CALCULATOR_TOOL],
                                      [{"role": "assistant", "content": MALFORMED_CALL}]))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rows = [torch.tensor([c.ids]) for c in chains]
    masks = [torch.tensor([[0] * (len(c.prompt_ids) - 1) + c.loss_mask], dtype=torch.float32) for c in chains]
    torch.manual_seed(0)
    for step in range(steps):
        i = step % len(rows)
        logits = model(rows[i]).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, rows[i][0, 1:], reduction="none")
        loss = (nll * masks[i][0]).sum() / masks[i].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    return path


class ListeningSockets:
    """Watches, in a thread, the TCP sockets that this process and its descendants (Ray's processes,
    actors, engines, the gateway) listen on, while a `with` block runs."""

    def __init__(self, every_s: float = 0.3):

        self.every_s, self.seen, self._stop = every_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                for c in p.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN:
                        self.seen[(c.laddr.ip, c.laddr.port)] = p.name()
            except psutil.Error:  # ended meanwhile
                pass

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> ListeningSockets:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def beyond_loopback(self) -> dict:
        from loongsage.cluster.network import is_loopback

        return {addr: name for addr, name in self.seen.items() if not is_loopback(addr[0])}


def processes_mentioning(text: str) -> list[str]:
    """Command lines of the processes (other than pytest) that mention `text`."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and "pytest" not in args:
            out.append(args)
    return out


def undocumented_metrics(records: list[dict]) -> set[str]:
    """The metric names in `records` that docs/metrics.md does not explain (its tables' first column:
    backticked names, where <x> stands for one path segment)."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    names = [n for line in page.splitlines() if line.startswith("| `")
             for n in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    patterns = [re.compile(re.sub(r"<[a-z]+>", "[^/]+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">")) + "$")
                for n in names]
    return {k for r in records for k in r if not any(p.match(k) for p in patterns)}
