"""/v1/chat/completions and /v1/completions on top of the AsyncEngine."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.detokenizer import LogprobText
from specserve.engine.outputs import RequestOutput, TokenLogprob
from specserve.engine.sampling_params import InvalidParameterError, SamplingParams, StructuredOutput
from specserve.engine.stats import acceptance_rate, mean_acceptance_length
from specserve.engine.tokenizer import Tokenizer

from .errors import _TYPES, ApiError
from .logs import USAGE_KEY
from .protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, error_body
from .tool_calls import (
    ParsedToolCall,
    ToolCallFormat,
    ToolCallStream,
    call_grammar,
    format_for,
    new_call_id,
    template_messages,
    template_supports_tools,
)


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    last: RequestOutput | None = None
    tool_stream: ToolCallStream | None = None  # streaming with tools: splits content from calls
    num_tool_calls: int = 0


def _tool_call_payload(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


@dataclass
class _LogprobEntry:
    """One generated token of a logprobs payload, with its alternatives (text, bytes, logprob)."""

    text: str
    raw: bytes
    logprob: float
    offset: int  # characters of the choice's text before this token
    top: list[tuple[str, bytes, float]]

    @classmethod
    def next(cls, lp: TokenLogprob, texts: LogprobText) -> _LogprobEntry:
        top = [(*texts.peek(t), v) for t, v in lp.top]  # alternatives first: they share the position
        offset = texts.offset
        text, raw = texts.add(lp.token_id)
        return cls(text, raw, lp.logprob, offset, top)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        tokenizer: Tokenizer,
        max_waiting: int,
        tool_call_parser: str = "auto",
    ):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.draining = False
        # How this model writes tool calls (api/tool_calls.py); None: no known format in its template.
        self.tool_format: ToolCallFormat | None = format_for(tool_call_parser, tokenizer.chat_template)

    # --- admission ----------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def _check_capacity(self, n: int) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down")
        if n > self.max_waiting:  # could never be admitted: a client error, not "retry later"
            raise ApiError(
                400, f"{n} completions (prompts x n) exceed this server's limit of {self.max_waiting}", "n"
            )
        waiting = self.engine.num_in_flight - self.engine.num_running
        if waiting + n > self.max_waiting:
            raise ApiError(
                503, f"server at capacity: {waiting} requests waiting; retry later", code="server_overloaded"
            )

    def _start(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[str, list[str], list[AsyncIterator[RequestOutput]]]:
        """Validate and submit every choice now, so admission counts them at once (no burst race)."""
        self._check_capacity(len(prompts) * params.n)
        base = uuid.uuid4().hex
        submitted: list[tuple[str, asyncio.Queue]] = []
        try:
            for p_idx, ids in enumerate(prompts):
                for i in range(params.n):
                    choice_params = params
                    if params.seed is not None and params.n > 1:
                        choice_params = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
                    rid = f"{base}-{p_idx}-{i}"
                    submitted.append((rid, self.engine.submit(ids, choice_params, rid)))
        except InvalidParameterError as exc:
            for rid, _ in submitted:
                self.engine.abort(rid)
            raise ApiError(400, str(exc), exc.param) from None
        ids_ = [rid for rid, _ in submitted]
        return base, ids_, [self.engine.stream(q, rid) for rid, q in submitted]

    # --- endpoints ----------------------------------------------------------------------------
    async def chat(self, request: web.Request, body: ChatCompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        tool_format, forced_calls = self._tool_plan(body, tools)
        try:
            messages = template_messages([m.template_dict() for m in body.messages])
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools)
        except Exception as exc:
            raise ApiError(
                400, f"cannot apply the chat template: {str(exc).splitlines()[0]}", "messages"
            ) from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, body.max_completion_tokens or body.max_tokens, logprobs, forced_calls)
        return await self._respond(request, body, [ids], params, chat=True, tool_format=tool_format)

    def _tool_plan(
        self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
    ) -> tuple[ToolCallFormat | None, StructuredOutput | None]:
        """The tool-call format to parse the output with (None: no tools in play) and, for
        tool_choice required or a named function, the grammar that forces a well-formed call."""
        choice = body.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None, None
        if choice == "none":
            return None, None
        if not template_supports_tools(self.tokenizer.chat_template):
            raise ApiError(400, "this model's chat template has no tool support", "tools")
        if self.tool_format is None:
            raise ApiError(
                400,
                "no tool-call format is known for this model's chat template; start the server with"
                " --tool-call-parser (hermes, llama3_json or mistral)",
                "tools",
            )
        if choice is None or choice == "auto":
            return self.tool_format, None
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError(
                400,
                "response_format cannot be combined with tool_choice required or a named function",
                "response_format",
            )
        name = choice.function.name if isinstance(choice, NamedToolChoice) else "required"
        try:
            # A named function is called once (as vLLM does); `required` may call several in parallel.
            parallel = body.parallel_tool_calls and name == "required"
            grammar = call_grammar(self.tool_format, tools, name, parallel, self._marker_token_ids())
        except ValueError as exc:
            raise ApiError(400, str(exc), "tool_choice") from None
        return self.tool_format, StructuredOutput("lark", grammar, "tool_choice")

    async def completions(self, request: web.Request, body: CompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        if body.echo or body.suffix:
            raise ApiError(400, "echo and suffix are not supported", "echo" if body.echo else "suffix")
        prompts = self._completion_prompts(body.prompt)
        params = self._params(body, body.max_tokens or 16, body.logprobs)
        return await self._respond(request, body, prompts, params, chat=False)

    def _marker_token_ids(self) -> dict[str, int]:
        """The tool-call markers this vocabulary holds as single added tokens (Qwen2.5's <tool_call>).
        llguidance treats every added token as special: a grammar must ask for the token itself,
        since spelling the marker as a text literal is not matched by that token."""
        assert self.tool_format is not None
        added = self.tokenizer.hf.get_added_vocab()
        return {m: added[m] for m in self.tool_format.markers if m in added}

    def _params(
        self,
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, structured)
        except InvalidParameterError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]
        else:
            prompts = [list(prompt)]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError(400, "prompt must not be empty", "prompt")
        if len(prompts) > 64:
            raise ApiError(400, "at most 64 prompts per request", "prompt")
        return prompts

    async def _respond(
        self,
        request: web.Request,
        body: Any,
        prompts: list[list[int]],
        params: SamplingParams,
        chat: bool,
        tool_format: ToolCallFormat | None = None,
    ) -> web.StreamResponse:
        base, request_ids, streams = self._start(prompts, params)
        prompt_tokens = sum(len(p) for p in prompts) * params.n
        iters = [s.__aiter__() for s in streams]
        # One pump task per choice merges all choices' outputs into one queue, in arrival order.
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        generated = [0] * len(iters)  # tokens each choice has generated so far (for the access log)
        tasks = [asyncio.create_task(self._pump(i, it, merged, generated)) for i, it in enumerate(iters)]
        try:
            if body.stream:
                return await self._stream(
                    request, base, body, tasks, merged, prompt_tokens, chat, params, tool_format
                )
            return await self._complete(base, tasks, merged, prompt_tokens, chat, params, tool_format)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rid in request_ids:  # no-op for finished ones; frees any a cancelled task never started
                self.engine.abort(rid)
            request[USAGE_KEY] = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(generated)}

    @staticmethod
    async def _pump(
        index: int, it: AsyncIterator[RequestOutput], merged: asyncio.Queue, generated: list[int]
    ) -> None:
        try:
            async for out in it:
                generated[index] = out.num_output_tokens
                await merged.put((index, out))
        except InvalidParameterError as exc:
            await merged.put((index, exc))
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    async def _next(self, merged: asyncio.Queue) -> tuple[int, RequestOutput]:
        index, item = await merged.get()
        if isinstance(item, InvalidParameterError):
            raise ApiError(400, str(item), item.param)
        if isinstance(item, BaseException):
            raise item
        if item.error is not None:
            if self.draining:
                raise ApiError(503, item.error, code="server_shutting_down")
            raise ApiError(500, f"internal error while generating: {item.error}", code="internal_error")
        return index, item

    async def _complete(self, base, tasks, merged, prompt_tokens, chat, params, tool_format) -> web.Response:
        choices = [ChoiceState(i) for i in range(len(tasks))]
        remaining = len(tasks)
        while remaining:
            index, out = await self._next(merged)
            c = choices[index]
            c.text += out.new_text
            c.token_ids += out.new_token_ids
            c.logprobs += out.new_logprobs
            c.last = out
            if out.finished:
                c.finish_reason = out.finish_reason
                remaining -= 1
        payload_choices = []
        for c in choices:
            lp = None
            if params.logprobs is not None:
                lp = self._logprobs_payload(c.logprobs, chat, LogprobText(self.tokenizer))
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish_reason = c.finish_reason
                if tool_format is not None:
                    content, calls = tool_format.parse(c.text)
                    if calls:
                        message = {
                            "role": "assistant",
                            "content": content or None,
                            "tool_calls": [_tool_call_payload(call) for call in calls],
                        }
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                payload_choices.append(
                    {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason}
                )
            else:
                payload_choices.append(
                    {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
                )
        return web.json_response(
            {
                "id": ("chatcmpl-" if chat else "cmpl-") + base,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": payload_choices,
                "usage": self._usage(prompt_tokens, [c.last for c in choices]),
            }
        )

    async def _stream(
        self, request, base, body, tasks, merged, prompt_tokens, chat, params, tool_format
    ) -> web.StreamResponse:
        # Validate before committing to a 200: wait for each choice's first output (or error).
        first: list[tuple[int, RequestOutput]] = []
        pending = len(tasks)
        seen: set[int] = set()
        while len(seen) < pending:
            index, out = await self._next(merged)
            seen.add(index)
            first.append((index, out))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        obj_id = ("chatcmpl-" if chat else "cmpl-") + base
        last: dict[int, RequestOutput] = {}
        started: set[int] = set()
        logprob_texts = [LogprobText(self.tokenizer) for _ in tasks]  # carried across a choice's chunks

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

        tool_states = (
            [ChoiceState(i, tool_stream=tool_format.stream()) for i in range(len(tasks))]
            if (chat and tool_format is not None)
            else None
        )

        options = body.stream_options
        continuous_usage = options is not None and options.continuous_usage_stats

        def chunk(index: int, out: RequestOutput) -> dict:
            lp = None
            if params.logprobs is not None:
                lp = self._logprobs_payload(out.new_logprobs, chat, logprob_texts[index])
            if chat:
                delta: dict[str, Any] = {"content": out.new_text}
                finish_reason = out.finish_reason
                if tool_states is not None:
                    delta, finish_reason = self._tool_delta(tool_states[index], out)
                if index not in started:
                    delta["role"] = "assistant"
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            else:
                choice = {
                    "index": index,
                    "text": out.new_text,
                    "logprobs": lp,
                    "finish_reason": out.finish_reason,
                }
            started.add(index)
            payload: dict[str, Any] = {
                "id": obj_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if continuous_usage:
                completion = sum(o.num_output_tokens for o in last.values())
                payload["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                }
            return payload

        remaining = len(tasks)
        queue_items = list(first)
        try:
            while remaining:
                if queue_items:
                    index, out = queue_items.pop(0)
                else:
                    index, out = await self._next(merged)
                last[index] = out
                if out.new_text or out.finished or out.new_token_ids:
                    await send(chunk(index, out))
                if out.finished:
                    remaining -= 1
        except ApiError as exc:  # the 200 is already sent: report the error in the stream (as vLLM does)
            await send(error_body(exc.message, _TYPES.get(exc.status, "server_error"), exc.param, exc.code))
            await send("[DONE]")
            await response.write_eof()
            return response
        if body.stream_options is not None and body.stream_options.include_usage:
            await send(
                {
                    "id": obj_id,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(prompt_tokens, [last.get(i) for i in range(len(tasks))]),
                }
            )
        await send("[DONE]")
        await response.write_eof()
        return response

    # --- payload helpers ------------------------------------------------------------------------
    @staticmethod
    def _tool_delta(state: ChoiceState, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
        """A streamed chat delta with tools in play: content the parser releases, whole tool calls
        as `tool_calls` entries (OpenAI's shape: index, id, type, function name and arguments)."""
        stream = state.tool_stream
        assert stream is not None
        events = stream.feed(out.new_text)
        if out.finished:
            events += stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = []
        for event in events:
            if isinstance(event, ParsedToolCall):
                calls.append(_tool_call_payload(event, state.num_tool_calls))
                state.num_tool_calls += 1
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = calls
        finish_reason = out.finish_reason
        if finish_reason == "stop" and state.num_tool_calls:
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _usage(self, prompt_tokens: int, finals: list[RequestOutput | None]) -> dict[str, Any]:
        completion = sum(o.num_output_tokens for o in finals if o)
        drafts = sum(o.num_drafts for o in finals if o)
        draft_tokens = sum(o.num_draft_tokens for o in finals if o)
        accepted = sum(o.num_accepted_tokens for o in finals if o)
        decisions = sum(o.num_k_decisions for o in finals if o)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "speculative": {
                "num_drafts": drafts,
                "num_draft_tokens": draft_tokens,
                "num_accepted_tokens": accepted,
                "acceptance_rate": acceptance_rate(accepted, draft_tokens),
                "mean_acceptance_length": mean_acceptance_length(accepted, drafts),
                # Drafts allowed per decode step (the controller's k; 0 while it kept speculation off).
                "mean_k": sum(o.sum_k for o in finals if o) / decisions if decisions else 0.0,
                # Accepted drafts that a grammar forced (structured output); part of num_accepted_tokens.
                "num_forced_tokens": sum(o.num_forced_tokens for o in finals if o),
            },
        }

    @staticmethod
    def _logprobs_payload(logprobs: list[TokenLogprob], chat: bool, texts: LogprobText) -> dict[str, Any]:
        """Chat `content` entries or completions' parallel lists; `texts` continues the choice so far."""
        entries = [_LogprobEntry.next(lp, texts) for lp in logprobs]
        if chat:
            return {
                "content": [
                    {
                        "token": e.text,
                        "logprob": e.logprob,
                        "bytes": list(e.raw),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in e.top],
                    }
                    for e in entries
                ]
            }
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, _, v in e.top} for e in entries],
            "text_offset": [e.offset for e in entries],
        }
