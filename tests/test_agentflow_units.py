"""AgentFlow pieces without an engine: tool-call parsing, exact token continuation through the chat
template, gateway session placement (merge vs sibling), tools and the sandbox, trajectories."""
from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.sessions import Session, SessionStore
from loongsage.agentflow.toolcalls import ToolCall, parse_tool_calls
from loongsage.agentflow.tools import ToolRegistry, calculator_tool, python_tool, registry_for
from loongsage.agentflow.trajectory import Chain, Trajectory, demonstration_chain
from loongsage.tasks.calculator import CALCULATOR_TOOL

TOOLS = [CALCULATOR_TOOL]


@pytest.fixture(scope="module")
def chat(tiny_model) -> ChatTokens:
    return ChatTokens(AutoTokenizer.from_pretrained(tiny_model), tiny_model)


def test_parse_tool_calls():
    t = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert t.content == "ok" and t.malformed == 0
    assert [(c.name, c.arguments) for c in t.tool_calls] == [("calculator", {"expression": "2*3"})]
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
                           '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [(c.name, c.arguments) for c in two.tool_calls] == [("a", {"x": 1}), ("b", {})]
    for bad in ['<tool_call>{"name": "a", "arguments": {</tool_call>',  # not JSON
                '<tool_call>{"arguments": {}}</tool_call>',  # no name
                '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
                'x <tool_call>{"name": "a", "arguments": {}}']:  # unclosed
        t = parse_tool_calls(bad)
        assert t.tool_calls == [] and t.malformed == 1 and t.content == bad.strip()
    assert parse_tool_calls("just text\n").content == "just text"


def _model_turn(chat: ChatTokens, chain: Chain, msg: dict) -> None:
    """What the engine would have produced for `msg` (ids up to the end token), appended to the chain."""
    ids = chat.assistant_ids(chain.messages, msg, chain.tools)
    chain.add_model_turn(ids, [-1.0] * len(ids), [0] * len(ids))
    chain.last_stop = ids[-1]
    chain.messages.append(msg)


def test_continuation_equals_full_rendering(chat):
    """Held ids + appended messages == the template's rendering of the whole conversation."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*34=?"}]
    call = ToolCall("calculator", {"expression": "12*34"}, "call_1")
    chain = Chain(chat.prompt_ids(prompt, TOOLS), messages=list(prompt), tools=TOOLS)
    _model_turn(chat, chain, {"role": "assistant", "content": "", "tool_calls": [call.to_openai()]})
    tool = [{"role": "tool", "tool_call_id": "call_1", "content": "408"}, {"role": "user", "content": "sure?"}]
    chain.add_inserted(chat.continuation_ids(chain.messages, tool, TOOLS, chain.last_stop))
    chain.messages += tool
    assert chain.ids == chat.prompt_ids(chain.messages, TOOLS)
    # the trained tokens are exactly the model turn: the tool call and its end token
    trained = [t for t, m in zip(chain.response_ids, chain.loss_mask) if m]
    assert chat.tok.decode(trained, skip_special_tokens=False) == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call><|im_end|>')


def test_demonstration_chain_masks_only_assistant_turns(chat):
    demo = [{"role": "assistant", "content": "", "tool_calls": [ToolCall("calculator", {"expression": "2*2"}).to_openai()]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    c = demonstration_chain(chat, [{"role": "user", "content": "2*2=?"}], TOOLS, demo)
    assert c.ids == chat.prompt_ids([{"role": "user", "content": "2*2=?"}] + demo, TOOLS)[:len(c.ids)]
    inserted = chat.tok.decode([t for t, m in zip(c.response_ids, c.loss_mask) if not m], skip_special_tokens=False)
    assert inserted == "\n<|im_start|>tool\n<tool_response>4</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_session_merges_extensions_and_splits_rewrites(chat):
    s = Session("a")
    first = [{"role": "user", "content": "12*34=?"}]
    chain, extends = s.place(chat, first, TOOLS)
    assert not extends and len(s.chains) == 1
    call = ToolCall("calculator", {"expression": "12*34"})
    _model_turn(chat, chain, {"role": "assistant", "content": "", "tool_calls": [call.to_openai()]})
    s.calls += 1
    # the client echoes the turn as the SDK does (content None, arguments as a JSON string) plus a tool result
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [{"id": call.id, "type": "function",
                              "function": {"name": "calculator", "arguments": json.dumps({"expression": "12*34"})}}]}
    nxt = first + [echoed, {"role": "tool", "tool_call_id": call.id, "content": "408"}]
    again, extends = s.place(chat, nxt, TOOLS)
    assert extends and again is chain and chain.ids == chat.prompt_ids(nxt, TOOLS)
    s.calls += 1
    s.extended += 1
    # a rewritten history (different arguments than the model produced) is a sibling, and is drift
    rewritten = first + [{**echoed, "tool_calls": [{**echoed["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression": "12*35"}'}}]}, nxt[-1]]
    other, extends = s.place(chat, rewritten, TOOLS)
    s.calls += 1
    assert not extends and other is not chain and len(s.chains) == 2
    assert s.drift_rate == pytest.approx(0.5)
    # a chain with a call in flight is never extended by a parallel call
    s.busy.add(id(chain))
    assert s.place(chat, nxt + [{"role": "user", "content": "x"}], TOOLS)[1] is False


def test_session_store_keys():
    store = SessionStore()
    key, session = store.open("episode-1")
    assert key.startswith("lsk-") and len(key) > 30 and store.lookup(key) is session
    assert store.lookup("guess") is None and store.lookup("") is None
    assert store.close(key) is session and store.lookup(key) is None
    open_store = SessionStore(open_keys=True)
    assert open_store.lookup("alice").name == "alice" and open_store.lookup("alice") is open_store.lookup("alice")
    assert open_store.lookup("") is None


def test_tools_and_registry():
    reg = ToolRegistry().add(calculator_tool())
    run = lambda call: asyncio.run(reg.execute(call))
    assert run(ToolCall("calculator", {"expression": "12*(3+4)"})) == "84"
    assert run(ToolCall("calculator", {"expression": "__import__('os')"})).startswith("error: unsupported syntax")
    assert run(ToolCall("calculator", {"expr": "1"})).startswith("error: bad arguments for calculator")
    assert run(ToolCall("search", {})).startswith("error: unknown tool 'search'")
    assert reg.calls == 4 and reg.errors == 3
    assert [t["function"]["name"] for t in registry_for([CALCULATOR_TOOL]).specs()] == ["calculator"]
    with pytest.raises(ValueError, match="no implementation"):
        registry_for([{"type": "function", "function": {"name": "teleport"}}])
    py = ToolRegistry().add(python_tool(timeout_s=2))
    assert asyncio.run(py.execute(ToolCall("python", {"code": "print(6*7)"}))) == "42\n"


def test_tools_offered_to_rows_that_declare_none():
    from loongsage.agentflow.config import AgentConfig
    from loongsage.agentflow.tools import offered_specs

    cfg = AgentConfig(kind="whitebox", offer_tools=["python", "calculator"])
    specs = offered_specs(cfg.offer_tools, cfg.tools)
    assert [s["function"]["name"] for s in specs] == ["python", "calculator"]
    assert sorted(registry_for(specs).tools) == ["calculator", "python"]
    assert offered_specs([], {}) is None
    with pytest.raises(ValueError, match=r"agent.offer_tools: no implementation of \['search'\]"):
        AgentConfig(kind="whitebox", offer_tools=["search"])
    with pytest.raises(ValueError, match="agent.offer_tools needs agent.kind=whitebox"):
        AgentConfig(kind="blackbox", command=["x"], offer_tools=["python"])


def test_trajectory_samples():
    c = Chain([1, 2], messages=[])
    c.add_model_turn([3, 4], [-0.5, -0.6], [2, 3])
    c.add_inserted([5])
    c.add_model_turn([6], [-0.1], [3])
    empty = Chain([1])
    t = Trajectory([c, empty], reward=1.0, answer="x", info={"turns": 2})
    (s,) = t.to_samples(group=7, rollout=3, tag="calc")
    assert s.response_ids == [3, 4, 5, 6] and s.loss_mask == [1, 1, 0, 1] and s.versions == [2, 3, -1, 3]
    assert s.min_version == 2 and s.reward == 1.0 and s.info["rollout"] == 3 and s.group == 7
    assert t.fail("boom").status == "failed" and t.reward == 0.0


def test_stream_shows_only_what_is_surely_content():
    from loongsage.agentflow.openai_protocol import visible_content

    assert visible_content("Let me compute") == "Let me compute"
    assert visible_content("ok <tool_call>{\"name\"") == "ok "
    assert visible_content("ok <tool_c") == "ok "  # might become a tool call: held back
    assert visible_content("a < b") == "a < b"


def test_a_turn_cut_short_gets_the_end_marker_inserted(chat):
    prompt = [{"role": "user", "content": "hi"}]
    chain = Chain(chat.prompt_ids(prompt), messages=list(prompt))
    cut = chat.encode("Hello the")  # max_new_tokens reached: no end token sampled
    chain.add_model_turn(cut, [0.0] * len(cut), [0] * len(cut))
    chain.messages.append({"role": "assistant", "content": "Hello the"})
    more = [{"role": "user", "content": "go on"}]
    chain.add_inserted(chat.continuation_ids(chain.messages, more, None, None))
    assert chain.ids == chat.prompt_ids(prompt + [{"role": "assistant", "content": "Hello the"}] + more)


def test_a_chain_carries_each_model_turns_temperature_into_its_sample():
    """Model turns keep the temperature they were sampled at (the trainer scores them under it);
    inserted tokens are 1; a chain sampled at T = 1 throughout carries none."""
    chain = Chain([1, 2])
    chain.add_model_turn([3, 4], [-0.1, -0.2], [0, 0], temperature=0.7)
    chain.add_inserted([5])
    chain.add_model_turn([6], [-0.3], [1], temperature=0.7)
    plain = Chain([1, 2])
    plain.add_model_turn([3], [-0.1], [0])
    sample, plain_sample = Trajectory([chain, plain]).to_samples(group=0, rollout=0, tag="t")
    assert sample.temperatures == [0.7, 0.7, 1.0, 0.7]
    assert plain_sample.temperatures is None
