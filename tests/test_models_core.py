"""Tiny models of real architectures, the char tokenizer, and the engine core in-process on each."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from loongsage.engine.core import EngineCore
from loongsage.engine.sampling import SamplingParams, sample, seeded_uniforms
from loongsage.engine.sequence import SeqRequest
from loongsage.models.config import TinyModelSpec
from loongsage.models.factory import build_tiny_model
from loongsage.models.tokenizer import build_char_tokenizer


def test_char_tokenizer_round_trips_and_renders_tool_calls(tmp_path):
    tok = build_char_tokenizer()
    text = "What is 12*34?\n\t ok <|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.padding_side == "left"
    msgs = [{"role": "user", "content": "7*8?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7*8"}}}]},
            {"role": "tool", "content": "56"}]
    out = again.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "calculator"}}],
                                    add_generation_prompt=True, tokenize=False)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call><|im_end|>\n' in out
    assert "<|im_start|>tool\n<tool_response>56</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n") and '"name": "calculator"' in out.split("<|im_start|>user")[0]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_factory_is_deterministic_and_the_core_matches_transformers(tmp_path, arch):
    spec = TinyModelSpec(arch=arch, num_kv_heads=2, seed=5)
    a, b = build_tiny_model(tmp_path / "a", spec), build_tiny_model(tmp_path / "b", spec)
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    model = AutoModelForCausalLM.from_pretrained(a).eval()
    assert type(model).__name__.lower().startswith(arch)
    core = EngineCore(str(a), max_running=4, context_length=128)
    core.start()
    done: dict[str, object] = {}
    ev = threading.Event()

    def cb(snap):
        if snap.finish is not None:
            done[snap.rid] = snap
            if len(done) == 6:
                ev.set()

    prompts = [[10 + i + j for j in range(3 + 4 * i)] for i in range(6)]  # 6 requests, 4 slots
    core.submit([SeqRequest(str(i), str(i), p, SamplingParams(max_new_tokens=6 + i, ignore_eos=True),
                            return_logprob=True, on_update=cb) for i, p in enumerate(prompts)])
    assert ev.wait(60)
    core.shutdown()
    for i, p in enumerate(prompts):
        snap = done[str(i)]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + snap.output_ids])).logits[0], -1)
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(snap.output_ids)]
        assert max(abs(x - y) for x, y in zip(ref, snap.output_logprobs)) < 1e-4


def test_sampling_filters_row_by_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    params = [SamplingParams(top_k=1, sampling_seed=0), SamplingParams(top_p=0.6, sampling_seed=1),
              SamplingParams(temperature=0.0, sampling_seed=2)]
    seen = [set(), set(), set()]
    for k in range(200):
        res = sample(logits, params, [k] * 3)
        for i in range(3):
            seen[i].add(int(res.tokens[i]))
    assert seen[0] == {0} and seen[1] == {0, 1} and seen[2] == {0}
    res = sample(logits, [SamplingParams(temperature=2.0)] * 3, top_logprobs_num=2)
    expected = torch.log_softmax(logits / 2.0, -1).gather(1, res.tokens[:, None]).squeeze(1)
    assert torch.allclose(res.logprobs, expected) and res.top_ids.shape == (3, 2)


def test_a_seeded_draw_depends_on_its_seed_and_token_index_alone_and_follows_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(4, 1)
    seeded = [SamplingParams(sampling_seed=s) for s in (11, 12, 13)]
    counts = torch.zeros(4)
    for k in range(3000):
        a = sample(logits[:3], seeded, [k, k, k]).tokens
        # the same rows elsewhere in a batch, beside an unseeded row: the same tokens
        b = sample(logits, [SamplingParams(), *reversed(seeded)], [0, k, k, k]).tokens
        assert b[1:].flip(0).tolist() == a.tolist()
        counts += torch.bincount(a, minlength=4)
    freq = counts / counts.sum()
    assert (freq - p).abs().max() < 0.02, freq  # 9000 draws: a standard error of <= 0.0053
    tokens = [int(sample(logits[:1], seeded[:1], [k]).tokens[0]) for k in range(40)]
    assert len(set(tokens)) > 1  # each token index draws anew
    again = [int(sample(logits[:1], seeded[:1], [k]).tokens[0]) for k in range(40)]
    assert tokens == again
    u = seeded_uniforms(torch.full((4000,), 5), torch.arange(4000))
    assert bool(((u > 0) & (u < 1)).all()) and abs(u.mean().item() - 0.5) < 0.02 and abs(u.var().item() - 1 / 12) < 0.005
    assert torch.equal(u[:10], seeded_uniforms(torch.full((10,), 5), torch.arange(10)))


def test_bfloat16_engine_runs_and_stays_close(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec())
    core = EngineCore(str(path), dtype="bfloat16", max_running=2, context_length=64)
    core.start()
    box = {}
    ev = threading.Event()
    core.submit([SeqRequest("x", "x", [10, 11, 12], SamplingParams(max_new_tokens=5, ignore_eos=True),
                            return_logprob=True, on_update=lambda s: (box.update(s=s), ev.set()) if s.finish else None)])
    assert ev.wait(30)
    core.shutdown()
    snap = box["s"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([[10, 11, 12] + snap.output_ids])).logits[0], -1)
    diffs = [abs(lp[2 + j, t].item() - snap.output_logprobs[j]) for j, t in enumerate(snap.output_ids)]
    assert 0 < max(diffs) < 0.1  # a real but small train-inference gap
    time.sleep(0)


def test_a_sampling_seed_beyond_64_bits_is_a_clear_request_error():
    from loongsage.engine.schema import RequestError, parse_sampling

    assert parse_sampling({"sampling_seed": 2**63 - 1}).sampling_seed == 2**63 - 1
    with pytest.raises(RequestError, match="sampling_seed"):
        parse_sampling({"sampling_seed": 2**64})
