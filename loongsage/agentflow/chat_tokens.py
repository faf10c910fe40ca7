"""Conversations as the exact token ids the model saw, extended turn by turn.

The held ids are never re-rendered: a model turn keeps the ids the engine sampled, and new messages
(tool results, user turns) append the chat template's rendering of just those messages. That
rendering is the template's own output for the whole conversation minus its output for the
conversation so far (the template stays the single source of truth, for tiny and real models), plus
the text the template puts after a model turn's end token (Qwen: the "\n" after <|im_end|>).
"""
from __future__ import annotations

from typing import Any

from transformers import GenerationConfig


class ChatTemplateError(ValueError):
    """The template cannot append messages without re-rendering earlier turns."""


class ChatTokens:
    def __init__(self, tokenizer, model_dir: str | None = None):
        self.tok = tokenizer
        self.stop_ids = _stop_ids(tokenizer, model_dir)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                            tokenize=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def continuation_ids(self, history: list[dict], new: list[dict], tools: list[dict] | None = None,
                         ended_with: int | None = None) -> list[int]:
        """Ids to append after a model turn (the last message of `history`, whose last sampled token
        was `ended_with`) so that the held ids continue as the template renders `history + new`,
        ending with the generation prompt. A turn cut short (`ended_with` None) gets the template's
        end-of-turn marker inserted."""
        before = self.render(history, tools, add_generation_prompt=False)
        after = self.render(history + new, tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError("the chat template renders earlier turns differently once messages are "
                                    "appended; the conversation cannot be extended token for token")
        glue = ""
        if ended_with is not None:
            end = self.tok.decode([ended_with], skip_special_tokens=False)
            cut = before.rfind(end) if end else -1
            glue = before[cut + len(end):] if cut >= 0 else ""
        elif history and history[-1].get("role") == "assistant":
            ends = [before.rfind(self.tok.decode([t], skip_special_tokens=False)) for t in self.stop_ids]
            cut = max(ends, default=-1)
            glue = before[cut:] if cut >= 0 else ""
        return self.encode(glue + after[len(before):])

    def assistant_ids(self, history: list[dict], message: dict, tools: list[dict] | None = None) -> list[int]:
        """The ids a model would sample for `message` after `history` (up to its end-of-turn token):
        targets for demonstrations."""
        before = self.render(history, tools, add_generation_prompt=True)
        after = self.render(history + [message], tools, add_generation_prompt=False)
        if not after.startswith(before):
            raise ChatTemplateError("the chat template renders the generation prompt differently from an assistant turn")
        ids = self.encode(after[len(before):])
        ends = [i for i, t in enumerate(ids) if t in self.stop_ids]
        return ids[: ends[-1] + 1] if ends else ids

    def turn_text(self, output_ids: list[int]) -> str:
        """A model turn's text with its markup (e.g. <tool_call>) kept and the final stop token dropped."""
        ids = output_ids[:-1] if output_ids and output_ids[-1] in self.stop_ids else output_ids
        return self.tok.decode(ids, skip_special_tokens=False)


def _stop_ids(tokenizer, model_dir: str | None) -> set[int]:
    ids: set[int] = set()
    if model_dir is not None:
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def normalize_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The parts of an OpenAI message that reach the template, in one canonical form, for comparing
    a request's history with what the model actually said."""
    from loongsage.agentflow.toolcalls import call_from_openai

    content = msg.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": msg.get("role"), "content": (content or "").strip()}
    if msg.get("tool_calls"):
        out["tool_calls"] = [(c.name, c.arguments) for c in map(call_from_openai, msg["tool_calls"])]
    return out
