"""The OpenAI-compatible wire format: pydantic models of requests, responses and stream chunks.

Requests are strict (a string is not an integer, true is not 1) and forbid NaN and infinities, so a
wrong type is a 400 with the field's name, never a surprise later. Unknown fields are ignored, as
OpenAI clients add new ones over time; known fields this server cannot honour are rejected in
serve/prompts.py with a message that says so.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

StrictInt = Annotated[int, Field(strict=True)]
TokenIds = list[StrictInt]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", protected_namespaces=())


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


class StructuredOutputs(RequestModel):
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension; -1 or 0 = disabled")
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1, description="a 64-bit signed integer")
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, description="extension")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past end-of-sequence tokens")
    skip_special_tokens: bool = Field(True, description="extension")
    return_token_ids: bool = Field(False, description="extension: each choice and chunk carries its token ids")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="subtracted once from a token's logit if "
                                                                              "it is in the output; default 0")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="times a token's count in the output, "
                                                                               "subtracted from its logit; default 0")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias (-100..100) added to its logit")
    include_stop_str_in_output: bool = Field(False, description="extension (vLLM): the stop string ends the text")
    truncate_prompt_tokens: int | None = Field(None, ge=1,
                                               description="extension (vLLM): keep the prompt's last N tokens")
    repetition_penalty: float | None = Field(None, gt=0.0, description="extension (vLLM): a logit of a token in "
                                                                       "the prompt or output is divided by it (if "
                                                                       "positive) or multiplied; default 1")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension (vLLM): drop tokens less likely than "
                                                                  "min_p times the most likely one; default 0")
    min_tokens: int | None = Field(None, ge=0, description="extension (vLLM): no stop token or stop string ends the "
                                                           "output before this many tokens; default 0")
    allowed_token_ids: list[StrictInt] | None = Field(None, min_length=1,
                                                      description="extension (vLLM): only these tokens may be sampled")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="extension (vLLM): each prompt token's "
                                                                       "logprob, rank and this many top tokens")
    user: str | None = None
    priority: StrictInt = Field(0, ge=-2**31, le=2**31 - 1, description="extension (vLLM): a lower value is "
                                                                     "served sooner, before higher ones")
    # structured output (serve/structured.py): at most one of these
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}}}')
    structured_outputs: StructuredOutputs | None = Field(None, description="extension (vLLM): one of json, regex, "
                                                                           "choice, grammar")
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM): a JSON schema")
    guided_regex: str | None = Field(None, description="extension (vLLM): a regular expression")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM): the output is one of these strings")
    guided_grammar: str | None = Field(None, description="extension (vLLM): a Lark or GBNF grammar")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt scored, nothing generated")
    logprobs: int | None = Field(None, ge=0, le=20, description="log probabilities of this many top tokens")
    echo: bool = False
    best_of: int | None = Field(None, ge=1, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class CalledFunction(RequestModel):
    name: str
    arguments: str


class MessageToolCall(RequestModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        # null content belongs only to an assistant message that carries tool_calls; any other
        # message without content would be rendered as an empty turn
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts); got null")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="letters, digits, _ . -; at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (the default with tools), "none", "required", or {"type": "function", '
                          '"function": {"name": ...}}')
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = Field(True, description="extension (vLLM): end the prompt with the assistant's turn")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extension (vLLM): more variables for "
                                                                         "the chat template, such as enable_thinking")
    continue_final_message: bool = Field(False, description="extension (vLLM): the reply continues the last "
                                                            "(assistant) message instead of starting a new turn")
    echo: bool = Field(False, description="extension (vLLM): not supported")


# --- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with --reasoning-parser

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "completion_tokens_details")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's logprobs: one per token id listed."""
    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its entry
PromptLogprobsField = list[dict[str, PromptLogprob] | None]


def _drop_none(out: dict[str, Any], *names: str) -> dict[str, Any]:
    """A serialized model without the optional fields named that are unset (kept off the wire)."""
    for name in names:
        if out.get(name) is None:
            out.pop(name, None)
    return out


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobsField | None = None  # with prompt_logprobs

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # --reasoning-parser: the thinking before the answer, under vLLM's name and its earlier one
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "tool_calls", "reasoning", "reasoning_content")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobsField | None = None  # with prompt_logprobs

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), "prompt_logprobs")


class _NoNones(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_NoNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_NoNones):
    """A tool call's first delta carries its id, type and name; the later ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # A delta names only what it adds: the role once, then content.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings (OpenAI's, with vLLM's extensions)."""
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions (then normalize)")
    user: str | None = None
    normalize: bool | None = Field(None, description="extension (vLLM): unit length; default: as the model's "
                                                     "sentence-transformers config says, else true")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="extension (vLLM): keep each input's last "
                                                                       "N tokens")
    add_special_tokens: bool = Field(True, description="extension (vLLM): a text input's BOS and the like")
    priority: StrictInt = Field(0, ge=-2**31, le=2**31 - 1, description="extension (vLLM): a lower value is "
                                                                     "served sooner, before higher ones")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ScoreRequest(RequestModel):
    """POST /v1/score (vLLM's): the similarity of text_1 to each of text_2 (or pair by pair)."""
    model: str | None = None
    text_1: str | list[str] = Field(description="a text, or a list as long as text_2 (pair by pair)")
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep each text's last N tokens")
    priority: StrictInt = Field(0, ge=-2**31, le=2**31 - 1)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestModel):
    """POST /v1/rerank (the Jina and Cohere shape, as vLLM serves it): documents by relevance to the query."""
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1, description="return the best N (default: all)")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep each text's last N tokens")
    priority: StrictInt = Field(0, ge=-2**31, le=2**31 - 1)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class LoadLoraAdapterRequest(RequestModel):
    """vLLM's /v1/load_lora_adapter (serve run --enable-lora)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(RequestModel):
    """vLLM's /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages (the "
                                                              "template adds them)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(None, description="with messages: rendered as the chat endpoint renders them")
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
