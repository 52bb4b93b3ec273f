"""The wire format of OpenAI's Responses API (POST /v1/responses): the request and the response object.

Input items are checked in serve/responses.py rather than as a pydantic union, so a wrong item is a
400 that names it (input[2].call_id) instead of every branch the union tried. The stream's events are
plain dicts built in serve/responses_format.py around these models.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from serve.protocol import ChatTokenLogprob, SamplingFields


class ResponsesRequest(SamplingFields):
    """The Responses API's fields; the sampling extensions of /v1/chat/completions apply too."""

    input: str | list[dict[str, Any]] = Field(
        description="a string (one user message) or a list of items: messages ({role, content}), function_call "
                    "and function_call_output items, reasoning items (skipped)")
    instructions: str | None = Field(None, description="a system message ahead of the input; not carried over by "
                                                       "previous_response_id")
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = Field(None, description='function tools: {"type": "function", "name": ..., '
                                                                 '"description": ..., "parameters": {...}}')
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description='"auto" (the default with tools), "none", "required", or {"type": "function", "name": ...}')
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text"}}, {"format": {"type": '
                                                          '"json_object"}} or {"format": {"type": "json_schema", '
                                                          '"name": ..., "schema": {...}}}')
    reasoning: dict[str, Any] | None = Field(None, description="accepted and echoed; the model decides how long it thinks")
    store: bool = Field(True, description="keep the response for GET /v1/responses/{id} and previous_response_id")
    previous_response_id: str | None = Field(None, description="continue the conversation of a stored response")
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(None, description='"message.output_text.logprobs" adds the output\'s logprobs')
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["disabled", "auto"] | None = None
    background: bool = False
    conversation: Any = Field(None, description="not supported: use previous_response_id")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extension (vLLM): more variables for the "
                                                                         "chat template, such as enable_thinking")


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None  # as chat completions list them


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | ReasoningItem | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    store: bool = True
    truncation: str = "disabled"
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

