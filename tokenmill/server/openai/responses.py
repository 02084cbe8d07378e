"""OpenAI Responses API: ``POST /v1/responses``.

``instructions`` (a system message) and ``input`` (a string: one user message; or message,
``function_call`` and ``function_call_output`` items) go through the model's chat template as chat
messages: a developer message is a system message, a function call joins the assistant message
before it (or starts one), a function call's output is a ``tool`` message. Function ``tools`` are
offered and their calls parsed as in chat (:func:`~tokenmill.server.shared.tools.tool_setup`);
``tool_choice`` "required" or a named function constrains the output to one call, and
``text.format`` "json_schema" or "json_object" constrains it to JSON, as chat's ``tool_choice`` and
``response_format`` do (never both). Parsed calls are ``function_call`` output items after the
message, which is left out when it would hold only whitespace.

``status`` is "completed", or "incomplete" with ``incomplete_details.reason`` "max_output_tokens"
when the output stopped at ``max_output_tokens`` or the context limit; a request the server aborts
(shutdown, an admin abort) ends in an error (503, or an ``error`` event mid-stream). Streaming sends
OpenAI's event sequence, each event with its ``sequence_number``: response.created,
response.in_progress, then per output item output_item.added, (content_part.added,
output_text.delta*, output_text.done, content_part.done | function_call_arguments.delta,
function_call_arguments.done), output_item.done, and response.completed or response.incomplete.

Responses are not stored: ``previous_response_id`` is refused (400) and ``store`` is ignored.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.request import FinishReason, RequestOutput, StructuredOutputsParams, accumulate
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.server.http.json_body import json_response
from tokenmill.server.http.sse import SSEResponse, sse_event
from tokenmill.server.http.state import State
from tokenmill.server.openai.output import raise_on_error
from tokenmill.server.openai.protocol import InputMessage, ResponsesRequest, TextFormat
from tokenmill.server.shared.content_text import joined_text
from tokenmill.server.shared.generation import Generation, until_disconnected
from tokenmill.server.shared.params import OutputConstraint, sampling_params, with_constraint_name
from tokenmill.server.shared.tool_constraint import output_constraint
from tokenmill.server.shared.tool_parser import ToolCall, ToolCallStream, parse_tool_calls
from tokenmill.server.shared.tools import json_object_or_text, tool_setup

router = APIRouter()

# engine parameter name -> this route's name for it (error ``param``)
ALIASES = {"prompt": "input", "max_tokens": "max_output_tokens"}
TEXT_PARTS = ("input_text", "output_text")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    lora_name = state.check_model(body.model)
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server does not store responses; "
            "send the whole conversation as input",
            param="previous_response_id",
        )
    chat_tools = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
        for t in body.tools or []
    ]
    tools, tool_names = tool_setup(chat_tools, body.tool_choice)
    with engine_errors(ALIASES):
        given, chat_template = _text_format(body), state.tokenizer.hf.chat_template
        constraint = await state.async_engine.run_tokenizer(  # a forced call's grammar is built off the event loop
            lambda: output_constraint(given, tools, tool_names, body.tool_choice, chat_template)
        )
    prompt = await state.render_chat(_template_messages(body), tools, param="input")
    rid = f"resp_{uuid.uuid4().hex}"
    with engine_errors(with_constraint_name(ALIASES, constraint)):
        fields = {"temperature": body.temperature, "top_p": body.top_p}
        fields["structured_outputs"] = constraint.spec if constraint else None
        params = sampling_params(fields, body.max_output_tokens)
        start = Generation.start(state, [prompt], [params], rid, arrival, lora_name)
        generation = await until_disconnected(request, start)
    reply = _Reply(rid, body.model, body, tool_names)
    if body.stream:
        return SSEResponse(reply.events(generation), on_close=generation.close)
    try:
        (output,) = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    return await json_response(reply.whole(output))


def _text_format(body: ResponsesRequest) -> OutputConstraint | None:
    """``text.format`` as an output constraint (named ``text`` in errors); None for plain text."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return OutputConstraint("text", StructuredOutputsParams(json_object=True))
    return OutputConstraint("text", StructuredOutputsParams(json=text_format.schema_))


def _template_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat-template messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": joined_text(item.content, TEXT_PARTS, "input")})
        elif item.type == "function_call":
            arguments = json_object_or_text(item.arguments)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": joined_text(item.output, TEXT_PARTS, "input")}
            )
    return messages


def _aborted(rid: str) -> str:
    return f"response {rid} was aborted by the server before it finished (shutdown or an admin abort); retry"


class _Reply:
    """Formats one response: as a whole, or as the stream of events that builds it."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, tool_names: set[str] | None) -> None:
        self.id = rid
        self.model = model
        self.body = body
        self.tool_names = tool_names
        self.created_at = int(time.time())

    def envelope(self, output: RequestOutput | None, items: list[dict[str, Any]], status: str) -> dict[str, Any]:
        """The response object; ``usage`` from ``output`` once it is finished."""
        body = self.body
        usage = None
        if output is not None:
            prompt_tokens, output_tokens = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
            usage = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + output_tokens,
            }
        tool_choice = body.tool_choice or "auto"
        text_format = (body.text.format if body.text is not None else None) or TextFormat(type="text")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "output": items,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "usage": usage,
        }

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        raise_on_error(output)
        out = output.outputs[0]
        if out.finish_reason == FinishReason.ABORT.value:
            raise APIError(503, _aborted(self.id), code="aborted")
        text, calls = out.text, []
        if self.tool_names is not None:
            parsed = parse_tool_calls(out.text, self.tool_names)
            text, calls = parsed.content, parsed.tool_calls
        status = _status(out.finish_reason)
        items = [] if calls and not text.strip() else [_message_item(f"msg_{uuid.uuid4().hex}", text, status)]
        items += [_call_item(call) for call in calls]
        return self.envelope(output, items, status)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            return sse_event({"type": kind, **fields, "sequence_number": next(sequence)}, event=kind)

        in_progress = self.envelope(None, [], "in_progress")
        yield event("response.created", response=in_progress)
        yield event("response.in_progress", response=in_progress)
        tool_stream = ToolCallStream(self.tool_names) if self.tool_names is not None else None
        message_id, text, total = f"msg_{uuid.uuid4().hex}", "", None
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        opened = False
        async for _, delta in generation:
            total = accumulate(total, delta)
            out = delta.outputs[0]
            if out.error or out.finish_reason == FinishReason.ABORT.value:
                message = f"generation failed (response {self.id}): {out.error}" if out.error else _aborted(self.id)
                yield event("error", code="engine_error" if out.error else "aborted", message=message, param=None)
                return
            piece = tool_stream.feed(out.text) if tool_stream is not None else out.text
            calls: list[ToolCall] = []
            if out.finish_reason is not None and tool_stream is not None:
                rest, calls = tool_stream.finish()
                piece += rest
                if calls and not (text + piece).strip():  # as in a whole reply: no whitespace-only message
                    piece = ""
            if piece or (out.finish_reason is not None and not opened and not calls):
                if not opened:
                    opened = True
                    yield event(
                        "response.output_item.added",
                        output_index=0,
                        item=_message_item(message_id, None, "in_progress"),
                    )
                    yield event("response.content_part.added", **where, part=_text_part(""))
                if piece:
                    text += piece
                    yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
            if out.finish_reason is None:
                continue
            status, items = _status(out.finish_reason), []
            if opened:
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=_text_part(text))
                items.append(_message_item(message_id, text, status))
                yield event("response.output_item.done", output_index=0, item=items[-1])
            for call in calls:
                index, item = len(items), _call_item(call)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                arguments = {"item_id": item["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **arguments, delta=call.arguments)
                yield event("response.function_call_arguments.done", **arguments, arguments=call.arguments)
                yield event("response.output_item.done", output_index=index, item=item)
                items.append(item)
            final = "response.incomplete" if status == "incomplete" else "response.completed"
            yield event(final, response=self.envelope(total, items, status))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == FinishReason.LENGTH.value else "completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; ``text`` None: no content part yet."""
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }
