"""Requests the system aborted are continued, not scored.

An engine aborts a request for reasons that are none of the policy's doing: a weight update with
`pause_mode: abort` (or SGLang's `update_weight_version`), a pause, an engine draining or failing
a batch. Scoring such a rollout as the agent's failure punishes the policy for the system. So
the router continues a request the engine aborted, when nobody cancelled it, from the tokens it
already produced: the prompt plus those tokens go back with the rest of the token budget, and the
output is the two parts joined (a partial rollout: every token keeps its logprob and the version
that sampled it). A request still aborted after `abort_retries` continuations stays aborted; the
rollouts mark it `aborted` and the producer masks its group and counts it in
`samples/aborted_by_system`.

Joined text is the two decoded parts concatenated; a stop string that would have spanned the cut
is not seen (the token ids, which are what trains, are exact).
"""
from __future__ import annotations

from dataclasses import replace

from loongsage.rollout.protocol import GenerateOutput

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang generates when sampling_params has no max_new_tokens


def continuation_params(params: dict, done: int) -> dict | None:
    """The sampling params of the rest of a request `done` tokens in (one sample); None when its
    budget is spent (or it generated nothing by design, as a prefill-only scoring request)."""
    limit = int(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))
    if limit - done <= 0:
        return None
    rest = {**params, "n": 1, "max_new_tokens": limit - done}
    rest.pop("sampling_seed", None)  # the seed's noise would start over (and be shared by the n samples)
    if params.get("min_new_tokens"):
        rest["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - done)
    return rest


def joined(first: GenerateOutput, rest: GenerateOutput) -> GenerateOutput:
    """`first` (aborted) continued by `rest`: one output, with per-token versions kept (the
    continuation may run on newer weights) and the finish of `rest`."""
    logprobs = None
    if first.output_logprobs is not None and rest.output_logprobs is not None:
        logprobs = first.output_logprobs + rest.output_logprobs
    return replace(rest, rid=first.rid, output_ids=first.output_ids + rest.output_ids, text=first.text + rest.text,
                   output_logprobs=logprobs, output_versions=first.versions + rest.versions,
                   input_logprobs=first.input_logprobs, input_top=first.input_top,
                   prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                   resumed=first.resumed + 1)


def system_failure(exc: BaseException) -> str | None:
    """Why `exc`, raised by a model call, is the inference system's failure rather than the
    caller's (an engine error, HTTP 5xx; an engine that cannot be reached or went away), or None
    when it is not (a 4xx: the request itself was wrong)."""
    import aiohttp

    from loongsage.rollout.client import EngineError

    if isinstance(exc, EngineError):
        return None if exc.status < 500 else f"inference engine error: {exc.message}"
    if isinstance(exc, (aiohttp.ClientError, ConnectionError)):
        return f"inference engine unreachable: {type(exc).__name__}: {exc}"
    return None
