"""Turn a validated API request into engine work: token ids per prompt and SamplingParams per choice.

Everything a client can get wrong that pydantic cannot see (unsupported options, lengths against
the context, token ids against the vocabulary, invalid Unicode, the server's limits) is checked
here and raised as APIError(400) with a message that says what to change.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from engine.grammar import after_thinking
from scheduler.request import SamplingParams
from serve.errors import APIError
from serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, SamplingFields,
                            TokenizeRequest)
from serve.reasoning import OPENED_ONLY, prompt_closes_thinking, prompt_opens_thinking, think_token_ids
from serve.server_config import ServerConfig
from serve.structured import request_grammar
from serve.tools import ToolFormat, ToolPlan, chat_messages, plan_tools, resolve_tool_parser, template_renders_tools

log = logging.getLogger("pagedserve")

MAX_CHARS_PER_TOKEN = 64

# The methods of a transformers fast tokenizer that tokenizer.encode(text) goes through: where a
# tokenizer class overrides one of them outside transformers' base modules, its ids may differ from
# the Rust tokenizer's, and the planner keeps calling tokenizer.encode.
ENCODE_PATH = ("encode", "__call__", "_encode_plus", "_batch_encode_plus", "encode_plus", "_call_one",
               "set_truncation_and_padding", "_convert_encoding", "_get_padding_truncation_strategies")
PROBE_TEXTS = ("Hello, world!", "  two  spaces\tand a tab\n", "naïve café 北京 🚀", "1234567 + 89 = ?", "")
Encoder = Callable[[str, bool], list[int]]


def rust_encoder(tokenizer: Any) -> Encoder | None:
    """tokenizer.encode(text, add_special_tokens=...) straight from the Rust tokenizer behind a
    transformers fast tokenizer, or None where the ids could differ (the planner then calls
    tokenizer.encode).

    Through Tokenizer.encode_batch_fast: it lets go of the GIL while it works, and skips the
    character offsets nobody reads. Tokenizer.encode, the other way in, holds the GIL for the whole
    encode (~1-2 ms for 512 tokens on a CPU core), and the transformers wrapper adds ~30-50 us of Python
    a call. The Rust tokenizer is never changed by this path, so several threads may call it at once.

    The same ids as the wrapper's where the wrapper adds nothing of its own: no truncation or padding
    set on the Rust tokenizer (the wrapper turns them off for a plain encode), special tokens split
    alike, every method of the encode path transformers' own; and the two agree on probe texts, the
    special tokens among them, with and without add_special_tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if fast is None or any(getattr(backend, name, None) is not None for name in ("truncation", "padding")):
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if split != bool(getattr(backend, "encode_special_tokens", False)):
        return None
    for name in ENCODE_PATH:
        if name in getattr(tokenizer, "__dict__", {}):  # replaced on this object
            return None
        method = getattr(type(tokenizer), name, None)
        if method is not None and not getattr(method, "__module__", "").startswith("transformers.tokenization_utils"):
            return None

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return fast([text], add_special_tokens=add_special_tokens)[0].ids

    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str)][:16]
    probes = (*PROBE_TEXTS, " ".join(specials), "x" + "".join(specials) + "y")
    try:
        for text in probes:
            for add in (True, False):
                if encode(text, add) != list(tokenizer.encode(text, add_special_tokens=add)):
                    return None
    except Exception:  # noqa: BLE001 - a tokenizer that cannot even encode the probes keeps its own path
        return None
    return encode


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None  # the prompt as sent, when it was text


@dataclass
class Plan:
    """The engine sequences of one request: every prompt times n choices, prompt-major."""

    prompts: list[PromptInput]
    params: list[SamplingParams]  # one per choice index within a prompt
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) only; one token made, unshown
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: the response lists them
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    tool_parser: str | None = None  # chat with tools: the format the output's tool calls are parsed in
    tool_params: dict[str, dict[str, str]] | None = None  # qwen3_coder: each function's parameters' types
    reasoning_parser: str | None = None  # chat, --reasoning-parser: the output's thinking is split from its answer
    thinking_opened: bool = False  # the rendered prompt left a <think> open for the model (serve/reasoning.py)
    # (grammar, the request field it comes from, whether decoding needs it): each must compile before the
    # request runs (serve/api.py); one not needed only checks the tools' schemas (tool_choice "auto")
    grammars: list[tuple[str, str, bool]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.params)

    def sequences(self) -> list[tuple[list[int], SamplingParams]]:
        return [(p.token_ids, sp) for p in self.prompts for sp in self.params]


@dataclass
class Draft:
    """A request checked, its chat template rendered, before its texts are encoded (wherever the
    caller encodes them): finish(their ids, in order) -> the Plan."""
    texts: list[str]
    add_special_tokens: bool
    finish: Callable[[list[list[int]]], Plan]


def check_text(value: str, name: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{name} contains invalid Unicode (a lone surrogate such as \\ud800); send valid UTF-8 text",
                       param=name) from None
    return value


# apply_chat_template's own arguments, which the request's fields set: not for chat_template_kwargs
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class RequestPlanner:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, config: ServerConfig,
                 defaults: dict[str, Any] | None = None) -> None:
        """defaults: the model's sampling defaults for fields a request leaves out (serve/generation_config.py)."""
        self.tokenizer = tokenizer
        self.defaults = defaults or {}
        # plain encodes straight from the Rust tokenizer where that gives the same ids (None: tokenizer.encode)
        self.rust_encode = rust_encoder(tokenizer)
        # the template chat requests render with: --chat-template's, else the tokenizer's (None: none)
        self.chat_template = getattr(tokenizer, "chat_template", None)
        if config.chat_template is not None:
            if hasattr(tokenizer, "apply_chat_template"):
                self.chat_template = config.chat_template
            else:
                log.warning("--chat-template is not used: this model folder has no tokenizer (token-id prompts only)")
        # its text (None for the tokenizer's dict of named templates, which it chooses from itself)
        self.template_text = self.chat_template if isinstance(self.chat_template, str) else None
        self.tool_parser = resolve_tool_parser(config.tool_parser, self.template_text)
        self.tool_format = ToolFormat.of(self.tool_parser, tokenizer, self.template_text)
        self.template_has_tools = template_renders_tools(self.template_text)
        self.think_tokens = think_token_ids(tokenizer, config.reasoning_parser) if config.reasoning_parser else None
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.config = config
        self.max_tokens_limit = min(config.max_tokens_limit or max_model_len, max_model_len)

    # -- the two endpoints ---------------------------------------------------------------------

    def completion(self, req: CompletionRequest) -> Plan:
        return self.encode_here(self.completion_draft(req))

    def chat(self, req: ChatCompletionRequest) -> Plan:
        return self.encode_here(self.chat_draft(req))

    def encode_here(self, draft: Draft) -> Plan:
        """A draft finished with its texts encoded in this thread."""
        return draft.finish([self._encode(text, draft.add_special_tokens) for text in draft.texts])

    def completion_draft(self, req: CompletionRequest) -> Draft:
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be left out): picking the best of several samples is not supported",
                           param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens is 0: nothing would be generated; send max_tokens >= 1, or echo: true to "
                                "score the prompt", param="max_tokens")
        prompts = self._prompt_list(req.prompt)
        self._check_count(len(prompts), req.n)  # before tokenizing what may be a huge list
        texts = [self._encodable(check_text(p, "prompt")) for p in prompts if isinstance(p, str)]

        def finish(ids: list[list[int]]) -> Plan:
            inputs = self._inputs(prompts, ids)
            echo_only = req.max_tokens == 0
            return self._plan(req, inputs, 1 if echo_only else req.max_tokens, req.logprobs, echo=req.echo,
                              echo_only=echo_only)
        return Draft(texts, True, finish)

    def chat_draft(self, req: ChatCompletionRequest) -> Draft:
        tools = plan_tools(req, self.tool_format)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.echo:
            raise APIError(400, "echo is not supported on /v1/chat/completions; leave it out", param="echo")
        self._check_continue(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them", param="max_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        text = self._encodable(self._chat_text(req, tools))
        reasoning = self.config.reasoning_parser

        def finish(ids: list[list[int]]) -> Plan:
            plan = self._plan(req, [PromptInput(ids[0])], max_tokens, logprobs, tools=tools)
            if reasoning is not None:
                plan.reasoning_parser, plan.thinking_opened = reasoning, prompt_opens_thinking(text, reasoning)
                if reasoning == "mistral":  # [THINK] and [/THINK] are special tokens of its tokenizer: keep them
                    plan.params = [replace(p, skip_special_tokens=False) for p in plan.params]
                if plan.params[0].grammar is not None and not prompt_closes_thinking(text, reasoning):
                    self._grammar_after_thinking(plan)
            return plan
        return Draft([text], False, finish)

    def embedding_draft(self, req: EmbeddingRequest, pooling: str) -> Draft:
        """The inputs of /v1/embeddings as prompts that each make one (unshown) token and return
        their final hidden states pooled (SamplingParams.pooling)."""
        inputs = self._prompt_list(req.input, "input")
        if any(len(p) == 0 for p in inputs):
            raise APIError(400, "input is empty: send a non-empty string, a list of them, or token ids", param="input")
        limit = self.config.max_waiting_requests
        if len(inputs) > limit:
            raise APIError(400, f"input holds {len(inputs)} items; this server embeds at most {limit} in one request",
                           param="input")
        texts = [self._encodable(check_text(p, "input")) for p in inputs if isinstance(p, str)]

        def finish(ids: list[list[int]]) -> Plan:
            prompts = self._truncated(self._inputs(inputs, ids), req.truncate_prompt_tokens)
            for p in prompts:
                self._check_length(len(p.token_ids), 1)
            return Plan(prompts, [SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, priority=req.priority)])
        return Draft(texts, req.add_special_tokens, finish)

    def _grammar_after_thinking(self, plan: Plan) -> None:
        """A reasoning model's structured output: the grammar holds from the end of its thinking (the
        `</think>` token) instead of from its first token, where `<think>` and `</think>` are tokens."""
        if self.think_tokens is None:
            return
        open_id, close_id = self.think_tokens
        # as serve/reasoning.py reads the output: qwen3 and mistral think only where their tag opens it
        wrap = partial(after_thinking, close_id=close_id, open_id=None if plan.thinking_opened else open_id,
                       must_open=plan.reasoning_parser in OPENED_ONLY)
        plan.params = [replace(p, grammar=wrap(p.grammar)) for p in plan.params]
        plan.grammars = [(wrap(g) if needed else g, name, needed) for g, name, needed in plan.grammars]

    @staticmethod
    def _check_continue(req: ChatCompletionRequest | TokenizeRequest) -> None:
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")
        if req.continue_final_message and req.messages and req.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """/tokenize: the prompt's token ids, or those of the messages through the chat template
        (where the template adds the special tokens, unless add_special_tokens says otherwise)."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt (a string) or messages", param="prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            return self._encode(self._encodable(check_text(req.prompt, "prompt")), add)
        if not req.messages:
            raise APIError(400, "messages is empty; send at least one message", param="messages")
        self._check_continue(req)
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message, tools=req.tools,
                                     chat_template_kwargs=req.chat_template_kwargs)
        text = self._chat_text(chat, plan_tools(chat, self.tool_format))
        return self._encode(self._encodable(text), bool(req.add_special_tokens))

    def detokenize(self, req: DetokenizeRequest) -> str:
        self._id_prompt(req.tokens)  # the ids' range
        return self.tokenizer.decode(req.tokens)

    # -- prompts -------------------------------------------------------------------------------

    @staticmethod
    def _prompt_list(prompt: Any, param: str = "prompt") -> list[str | list[int]]:
        """A request's prompt field (a string, strings, token ids or lists of them) as a list of prompts."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, f"{param} is empty: send a non-empty string or list of token ids", param=param)
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def _inputs(self, prompts: list[str | list[int]], ids: list[list[int]]) -> list[PromptInput]:
        """The prompts as PromptInputs: the texts' encoded ids in order, token-id prompts checked."""
        encoded = iter(ids)
        return [PromptInput(next(encoded), p) if isinstance(p, str) else self._id_prompt(p) for p in prompts]

    @staticmethod
    def _truncated(prompts: list[PromptInput], keep: int | None) -> list[PromptInput]:
        """truncate_prompt_tokens (vLLM's): each prompt's last `keep` tokens."""
        if keep is None:
            return prompts
        return [p if len(p.token_ids) <= keep else PromptInput(p.token_ids[-keep:]) for p in prompts]

    def _id_prompt(self, prompt: list[int]) -> PromptInput:
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in the prompt is outside the vocabulary (0..{self.vocab_size - 1})",
                           param="prompt")
        return PromptInput(list(prompt))

    @property
    def thread_safe(self) -> bool:
        """Whether encodes may run anywhere else (other threads, the server's tokenizing
        processes): they go to the Rust tokenizer, which nothing changes (the transformers wrapper
        may set its truncation or padding)."""
        return self.rust_encode is not None

    def _encodable(self, text: str) -> str:
        # Refuse text that could not fit anyway before spending time on it. No real tokenizer
        # averages anywhere near this many characters per token.
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters, far more than the model's context length of "
                                f"{self.max_model_len} tokens can hold; shorten it", param="prompt",
                           code="context_length_exceeded")
        return text

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            if self.rust_encode is not None:
                return self.rust_encode(text, add_special_tokens)
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except ValueError as e:  # e.g. a model folder without a tokenizer
            raise APIError(400, str(e), param="prompt") from None

    def _chat_text(self, req: ChatCompletionRequest, tools: ToolPlan) -> str:
        if not self.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        messages = []
        # OpenAI's "developer" role (its newer name for system) where the template knows no such role
        developer = "developer" if self.template_text is None or "developer" in self.template_text else "system"
        for i, m in enumerate(req.messages):
            role = developer if m.role == "developer" else m.role
            messages.append({"role": role, "content": check_text(m.text(), f"messages[{i}].content"),
                             **({"name": check_text(m.name, f"messages[{i}].name")} if m.name else {})})
        messages = chat_messages(messages, req.messages, tools, self.tool_parser, self.template_has_tools)
        extra = {"tools": tools.tools} if tools.tools and self.template_has_tools else {}
        kwargs = req.chat_template_kwargs or {}
        taken = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(400, f"chat_template_kwargs: {taken[0]} is set by the request itself; send it as its own "
                                "field (or leave it out)", param="chat_template_kwargs")
        extra.update(kwargs)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      continue_final_message=req.continue_final_message,
                                                      tokenize=False, chat_template=self.template_text, **extra)
        except Exception as e:  # the template's own raise_exception(), or a template error
            reason = str(e).splitlines()[0][:200] if str(e) else "it raised an error"
            raise APIError(400, f"the chat template cannot render these messages: {reason}", param="messages") from None
        return text

    # -- shared checks -------------------------------------------------------------------------

    def _plan(self, req: SamplingFields, prompts: list[PromptInput], max_tokens: int | None,
              logprobs: int | None, echo: bool = False, tools: ToolPlan | None = None, echo_only: bool = False) -> Plan:
        self._check_unsupported(req)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs cannot be streamed; send stream: false (or, on /v1/completions, "
                                "echo: true with logprobs)", param="prompt_logprobs")
        asked = request_grammar(req)
        grammar = asked[0] if asked is not None else None
        tools = tools or ToolPlan()
        if grammar is not None and tools.grammar is not None:
            raise APIError(400, "tool_choice \"required\" or a named function decides the output's form; leave out "
                                "response_format and the guided_* fields", param="tool_choice")
        checks = [(*asked, True)] if asked is not None else []
        if tools.check is not None:
            checks.append((tools.check, "tools", tools.grammar is not None))
        grammar = grammar or tools.grammar
        if grammar is not None and req.ignore_eos:
            raise APIError(400, "ignore_eos cannot go with structured output: the grammar ends the output", param="ignore_eos")
        if grammar is not None and req.min_tokens:
            raise APIError(400, "min_tokens cannot go with structured output: the grammar ends the output",
                           param="min_tokens")
        if grammar is not None and req.allowed_token_ids:
            raise APIError(400, "allowed_token_ids cannot go with structured output: the grammar decides the tokens",
                           param="allowed_token_ids")
        self._check_count(len(prompts), req.n)
        prompts = self._truncated(prompts, req.truncate_prompt_tokens)  # echo shows the tokens kept
        if max_tokens is not None and max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens is {max_tokens} but this server allows at most {self.max_tokens_limit}",
                           param="max_tokens")
        for p in prompts:
            self._check_length(len(p.token_ids), max_tokens)
        if max_tokens is None and self.max_tokens_limit < self.max_model_len:
            max_tokens = self.max_tokens_limit
        # the engine computes prompt logprobs for the response's prompt_logprobs and for echo's logprobs
        wanted = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
        try:
            base = replace(self._sampling_params(req, max_tokens, logprobs), grammar=grammar,
                           prompt_logprobs=max(wanted) if wanted else None)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        if tools.parser == "mistral":  # [TOOL_CALLS] is a special token of Mistral's tokenizers: keep it in the text
            base = replace(base, skip_special_tokens=False)
        # n samples of one prompt must differ: choice i draws from seed + i.
        params = [base if req.seed is None or i == 0 else replace(base, seed=req.seed + i) for i in range(req.n)]
        opts = req.stream_options
        return Plan(prompts, params, logprobs=logprobs, echo=echo, echo_only=echo_only,
                    prompt_logprobs=req.prompt_logprobs, stream=req.stream,
                    include_usage=bool(req.stream and opts and opts.include_usage),
                    continuous_usage=bool(req.stream and opts and opts.continuous_usage_stats),
                    return_token_ids=req.return_token_ids, tool_parser=tools.parser, tool_params=tools.param_types,
                    grammars=checks)

    def _sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        d = self.defaults

        def given(name: str, default: Any) -> Any:  # the request's value, else the model's, else ours
            value = getattr(req, name)
            return d.get(name, default) if value is None else value

        top_k = given("top_k", -1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=top_k if top_k and top_k < self.vocab_size else -1,  # >= vocab: no filter
            seed=req.seed,
            stop=self._stop_list(req.stop),
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=list(self._vocabulary_ids(req.stop_token_ids, "stop_token_ids") or []),
            min_tokens=req.min_tokens or 0,
            logit_bias=self._logit_bias(req.logit_bias),
            repetition_penalty=given("repetition_penalty", 1.0),
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            min_p=given("min_p", 0.0),
            allowed_token_ids=self._vocabulary_ids(req.allowed_token_ids, "allowed_token_ids"),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            priority=req.priority,
        )

    def _check_count(self, num_prompts: int, n: int) -> None:
        cfg = self.config
        if n > cfg.max_n:
            raise APIError(400, f"n is {n} but this server allows at most {cfg.max_n} choices", param="n")
        if num_prompts * n > cfg.max_sequences_per_request:
            raise APIError(400, f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; this server "
                                f"allows at most {cfg.max_sequences_per_request} per request", param="prompt")

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> None:
        ctx = self.max_model_len
        if num_prompt == 0:
            raise APIError(400, "the prompt is empty (0 tokens); send at least one token", param="prompt")
        if num_prompt >= ctx:
            raise APIError(400, f"the prompt has {num_prompt} tokens but the model's context length is {ctx} tokens "
                                f"(prompt plus completion); shorten the prompt to at most {ctx - 1} tokens",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > ctx:
            raise APIError(400, f"the model's context length is {ctx} tokens, but {num_prompt + max_tokens} were "
                                f"requested ({num_prompt} in the prompt, {max_tokens} for the completion); lower "
                                f"max_tokens to at most {ctx - num_prompt} or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")

    @staticmethod
    def _check_unsupported(req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")

    def _stop_list(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        cfg = self.config
        if len(stops) > cfg.max_stop_strings:
            raise APIError(400, f"{len(stops)} stop strings given; at most {cfg.max_stop_strings} are allowed", param="stop")
        for s in stops:
            if not s:
                raise APIError(400, "stop strings must not be empty", param="stop")
            if len(s) > cfg.max_stop_string_chars:
                raise APIError(400, f"a stop string has {len(s)} characters; at most {cfg.max_stop_string_chars} are allowed",
                               param="stop")
            check_text(s, "stop")
        return stops

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias: token ids (as JSON object keys) -> a bias between -100 and 100."""
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias: {key[:40]!r} is not a token id; the keys are token ids, "
                                    "such as \"50256\"", param="logit_bias") from None
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"logit_bias: token {token} is outside the vocabulary (0..{self.vocab_size - 1})",
                               param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias: the bias of token {token} is {value}; biases lie between -100 "
                                    "and 100", param="logit_bias")
            out[token] = value
        return out

    def _vocabulary_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        """ids as they are, once each lies in the vocabulary (a 400 naming param otherwise)."""
        bad = next((t for t in ids or [] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)
        return ids
