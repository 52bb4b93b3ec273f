"""The OpenAI-compatible HTTP API: create_app(engine, config) builds a FastAPI app around an engine.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET, DELETE
/v1/responses/{id}), POST /v1/embeddings, POST /v1/score, POST /v1/rerank, GET /v1/models,
GET /v1/models/{model}, GET /health, GET /metrics, and vLLM's POST /tokenize, POST /detokenize,
GET /version.
The app owns an AsyncEngine (scheduler/loop.py), started and drained by the app's lifespan. The
engine is serve.build.Engine (its core steps on a thread of this process) or, for `--engine-loop
process`, serve.engine_process.ProcessEngine (its core runs in a child process).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.loop import AsyncEngine, EngineUnavailable, LoopConfig, QueueFull, RequestStream
from scheduler.lora import UnknownAdapter, load_lora, loaded_adapters, undo_lora_load, unload_lora
from scheduler.policy import RequestRejected
from serve.errors import APIError, install_error_handlers
from serve.generation_config import model_folder, sampling_defaults
from serve.grammar_check import GrammarChecker
from serve.guards import ApiKeyGuard, BodyLimit
from serve.metrics import RECEIVED, HttpMetricsMiddleware, Metrics
from serve.openai_format import ChatFormat, CompletionFormat, Format, TokenStrings, usage
from serve.prompts import Draft, Plan, RequestPlanner
from serve.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                            DetokenizeRequest, DetokenizeResponse, Embedding, EmbeddingRequest, EmbeddingResponse,
                            EmbeddingUsage, ErrorResponse, LoadLoraAdapterRequest, ModelCard, ModelList, RerankDocument,
                            RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData, ScoreRequest,
                            ScoreResponse, TokenizeRequest, TokenizeResponse, UnloadLoraAdapterRequest)
from serve.api_processes import RESPONSES_DIR_ENV
from serve.disagg import DisaggregatedEngine, DisaggregatedSet
from serve.embeddings import Pooling, PoolingConfigError, encode_vector, finish_vector, model_pooling
from serve.replicas import ReplicaSet, ReplicatedEngine
from serve.responses import ResponseStore, chat_request, check_supported, input_items, renamed, without_oldest_turn
from serve.responses_format import ResponsesFormat, response_events
from serve.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from serve.server_config import ServerConfig
from serve.streaming import ClientGone, EngineStreamingResponse, collect_while_connected, sse_events
from serve.tokenize_pool import TokenizePool, TokenizerGone

if TYPE_CHECKING:
    from serve.build import Engine
    from serve.engine_process import ProcessEngine

log = logging.getLogger("pagedserve")
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in ((400, "bad request"), (401, "missing or wrong API key"), (404, "unknown model"),
                       (413, "body too large"), (429, "queue full; see Retry-After"), (500, "generation failed"),
                       (503, "shutting down, or the engine failed"))}


@dataclass
class ServerState:
    engine: "Engine | ProcessEngine | ReplicatedEngine | DisaggregatedEngine"
    loop: AsyncEngine | ReplicaSet | DisaggregatedSet
    metrics: Metrics
    config: ServerConfig
    planner: RequestPlanner
    strings: TokenStrings
    model_name: str
    started: float
    # Tokenizing a text prompt (~1 ms for 512 tokens) would stall every stream on the event loop:
    # processes encode where the planner takes the Rust tokenizer's ids (serve/tokenize_pool.py),
    # else one thread plans text requests beside the loop
    tokenizers: TokenizePool | None
    tokenize: ThreadPoolExecutor
    grammars: GrammarChecker  # structured output's grammars, compiled off the loop with a time limit
    adapters: list[tuple[str, str]]  # LoRA adapters of --lora-modules (name, folder): a "model" may name one
    runtime_loras: bool  # --enable-lora: adapters load and unload while serving (scheduler/lora.py)
    responses: ResponseStore  # /v1/responses with store: true (serve/responses.py)
    pooling: Pooling | PoolingConfigError  # how /v1/embeddings pools, or why it can't (serve/embeddings.py)


class Companion(Protocol):
    """Processes that serve beside this app (serve/api_processes.py): started() once the engine
    loop runs (the app accepts connections after it), stopping() after the drain and before the
    engine stops."""

    async def started(self) -> None: ...
    async def stopping(self) -> None: ...


def create_app(engine: "Engine | ProcessEngine | ReplicatedEngine | DisaggregatedEngine",
               config: ServerConfig | None = None, companion: Companion | None = None) -> FastAPI:
    config = config or ServerConfig()
    loop_config = LoopConfig(config.max_waiting_requests, config.max_request_rate)
    several = isinstance(engine, (ReplicatedEngine, DisaggregatedEngine))
    loop = engine.loop(loop_config) if several else AsyncEngine(engine.core, loop_config,
                                                                seq_ids=getattr(engine, "seq_ids", None))
    name = config.served_model_name or engine.model_name
    defaults = sampling_defaults(config.generation_config, model_folder(getattr(engine, "config", None)))
    if defaults:
        log.info("requests that leave them out take the model's generation_config.json defaults %s "
                 "(--generation-config vllm: pagedserve's own)", defaults)
    planner = RequestPlanner(engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len, config, defaults)
    pool = TokenizePool.for_tokenizer(engine.tokenizer) if planner.thread_safe else None
    state = ServerState(engine, loop, Metrics(name, loop, getattr(engine, "api_process", None)), config, planner,
                        TokenStrings(engine.tokenizer), name, time.time(), pool,
                        ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenize"),
                        GrammarChecker(engine, config.grammar_timeout_s),
                        list(getattr(getattr(engine, "config", None), "lora_modules", ())),
                        bool(getattr(getattr(engine, "config", None), "enable_lora", False)),
                        ResponseStore(os.environ.get(RESPONSES_DIR_ENV)), _pooling(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            await pool.start()
        await loop.start()
        state.grammars.warm()
        if companion is not None:
            await companion.started()
        try:
            yield
        finally:
            await loop.drain(config.shutdown_timeout_s)
            if companion is not None:
                await companion.stopping()
            await loop.stop()
            if pool is not None:
                pool.close()
            state.tokenize.shutdown(wait=False, cancel_futures=True)
            state.grammars.shutdown()
            state.responses.close()

    app = FastAPI(title="pagedserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    _add_routes(app, state)
    # The last added runs first: answer CORS preflights (which carry no key), count every response,
    # then check the key, then the body size.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyGuard, api_key=config.api_key)
    app.add_middleware(HttpMetricsMiddleware, metrics=state.metrics)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    return app


def _add_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        lora = _check_model(st, body.model)
        text = isinstance(body.prompt, str) or bool(body.prompt) and isinstance(body.prompt[0], str)
        plan = await _planned(st, st.planner.completion_draft, body) if text else st.planner.completion(body)
        await st.grammars.check(plan.grammars)
        return await _serve(st, request, plan, CompletionFormat(plan, lora or st.model_name, st.strings,
                                                                st.engine.tokenizer), lora)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        lora = _check_model(st, body.model)
        plan = await _planned(st, st.planner.chat_draft, body)
        await st.grammars.check(plan.grammars)
        return await _serve(st, request, plan, ChatFormat(plan, lora or st.model_name, st.strings), lora)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _embed(st, request, body)

    @app.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await _score(st, request, body)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await _rerank(st, request, body)

    @app.post("/v1/responses", response_model=ResponseObject, responses=ERROR_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await _respond(st, request, body)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERROR_RESPONSES)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(_stored(st, response_id)[0])

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        if not st.responses.delete(response_id):
            raise _no_response(response_id, "response_id")
        return DeletedResponse(id=response_id)

    def card(adapter: tuple[str, str] | None = None, name: str | None = None) -> ModelCard:
        if adapter is not None:
            return ModelCard(id=adapter[0], created=int(st.started), max_model_len=st.engine.max_model_len,
                             root=adapter[1], parent=st.model_name)
        return ModelCard(id=name or st.model_name, created=int(st.started), max_model_len=st.engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        names = [card(name=n) for n in (st.model_name, *st.config.model_aliases)]
        return ModelList(data=names + [card(a) for a in await _adapters(st)])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def model(model: str) -> ModelCard:
        if model == st.model_name or model in st.config.model_aliases:
            return card(name=model)
        for adapter in await _adapters(st):
            if adapter[0] == model:
                return card(adapter)
        raise _unknown_model(st, model)

    @app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        _check_runtime_loras(st)
        if body.lora_name == st.model_name or body.lora_name in st.config.model_aliases:
            raise APIError(400, f"{body.lora_name!r} is the served model's name; name the adapter otherwise",
                           param="lora_name")
        token = uuid.uuid4().hex
        try:
            await _on_engines(st, partial(load_lora, body.lora_name, body.lora_path, token))
        except APIError:  # all or none: take it back where this load brought it in (other replicas, engines)
            try:
                await _on_engines(st, partial(undo_lora_load, body.lora_name, token))
            except APIError:
                pass  # an engine that stopped meanwhile holds nothing to take back
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        _check_runtime_loras(st)
        await _on_engines(st, partial(unload_lora, body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        _check_model(st, body.model)
        ids = await asyncio.get_running_loop().run_in_executor(st.tokenize, st.planner.tokenize, body)
        strs = st.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=st.engine.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        _check_model(st, body.model)
        text = await asyncio.get_running_loop().run_in_executor(st.tokenize, st.planner.detokenize, body)
        return DetokenizeResponse(prompt=text)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.get("/health")
    async def health() -> JSONResponse:
        if isinstance(st.loop, (ReplicaSet, DisaggregatedSet)):
            status, body = st.loop.health()
            return JSONResponse(body, status_code=status)
        if st.loop.accepting:
            return JSONResponse({"status": "ok"})
        if st.loop.failure:
            return JSONResponse({"status": "failed", "error": st.loop.failure}, status_code=503)
        return JSONResponse({"status": "shutting down" if st.loop.running else "stopped"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _planned(st: ServerState, draft: Callable[[Any], Draft], body: Any) -> Plan:
    """The request's plan: checked (and its chat template rendered) on the loop, its texts encoded
    in the tokenizing processes; without them, planned whole on the tokenizing thread. The loop
    streams other requests meanwhile."""
    pool = st.tokenizers
    if pool is None or not pool.alive:
        return await asyncio.get_running_loop().run_in_executor(st.tokenize, lambda: st.planner.encode_here(draft(body)))
    d = draft(body)
    try:
        ids = await pool.encode(d.texts, d.add_special_tokens) if d.texts else []
    except ValueError as e:  # the tokenizer refused a text
        raise APIError(400, str(e), param="prompt") from None
    except TokenizerGone as e:
        raise APIError(503, f"{e}; send the request again", code="unavailable", headers={"Retry-After": "1"}) from None
    return d.finish(ids)


def _version() -> str:
    """The installed package's version ("unknown" when run from a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def _check_model(st: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's model field names (None: the served model). With runtime loading
    the engine decides whether it is loaded (UnknownAdapter: 404 then)."""
    if model is None or model == st.model_name or model in st.config.model_aliases:
        return None
    if st.runtime_loras or any(model == name for name, _ in st.adapters):
        return model
    raise _unknown_model(st, model)


def _unknown_model(st: ServerState, model: str, why: str = "") -> APIError:
    served = ", ".join(repr(n) for n in [st.model_name, *st.config.model_aliases] + [name for name, _ in st.adapters])
    return APIError(404, why or f"model {model!r} is not served here; this server serves {served}",
                    param="model", code="model_not_found")


async def _adapters(st: ServerState) -> list[tuple[str, str]]:
    """The LoRA adapters the engine holds now, (name, folder)."""
    if not st.runtime_loras:
        return st.adapters
    return (await _on_engines(st, loaded_adapters))[0]


def _check_runtime_loras(st: ServerState) -> None:
    if not st.runtime_loras:
        raise APIError(404, "this server loads LoRA adapters only at start-up; start it with --enable-lora to load "
                            "and unload them while it serves")


async def _on_engines(st: ServerState, fn: Callable[[Any], Any]) -> list[Any]:
    """fn(core) on every engine (replicas, prefill and decode engines) -> their results; a
    ValueError of one (an adapter that can't load, is not loaded, is in use) is a 400 or 404."""
    try:
        out = await st.loop.call(fn)
    except UnknownAdapter as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name") from None
    except EngineUnavailable as e:
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": "5"}) from None
    return out if isinstance(st.loop, (ReplicaSet, DisaggregatedSet)) else [out]


async def _submit(st: ServerState, request: Request, plan: Plan, lora: str | None) -> RequestStream:
    sequences = plan.sequences()
    if lora is not None:
        sequences = [(ids, replace(params, lora_name=lora)) for ids, params in sequences]
    try:
        return await st.loop.add_requests(sequences, request.scope.get(RECEIVED))
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
    except EngineUnavailable as e:
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": "5"}) from None
    except UnknownAdapter as e:
        raise _unknown_model(st, lora or "", str(e)) from None
    except RequestRejected as e:
        raise APIError(400, str(e)) from None


async def _serve(st: ServerState, request: Request, plan: Plan, fmt: Format, lora: str | None = None) -> Any:
    stream = await _submit(st, request, plan, lora)
    if plan.stream:
        return EngineStreamingResponse(sse_events(plan, stream, fmt), on_close=stream.abort)
    try:
        choices = await collect_while_connected(request, plan, stream)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the status only shows in logs
    finally:
        stream.abort()
    return fmt.response(choices, usage(plan, choices))


def _no_response(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response has id {response_id!r} (responses are stored with store: true, for "
                         "as long as the server runs)", param=param, code="not_found")


def _stored(st: ServerState, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    hit = st.responses.get(response_id)
    if hit is None:
        raise _no_response(response_id, param)
    return hit


async def _fitted(st: ServerState, body: ResponsesRequest, conversation: list[dict[str, Any]]) -> Plan:
    """The plan of the conversation; with truncation "auto", of its latest turns that fit the context."""
    while True:
        try:
            return await _planned(st, st.planner.chat_draft, chat_request(body, conversation))
        except APIError as e:
            shorter = without_oldest_turn(conversation) if body.truncation == "auto" else None
            if e.code != "context_length_exceeded" or shorter is None:
                raise
            conversation = shorter


async def _respond(st: ServerState, request: Request, body: ResponsesRequest) -> Any:
    """POST /v1/responses: the conversation (a stored one continued, then this input) served as a chat
    request, answered as the Responses API's output items; stored when body.store."""
    lora = _check_model(st, body.model)
    check_supported(body)
    history = _stored(st, body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
    items = input_items(body)
    try:
        plan = await _fitted(st, body, history + items)
        if plan.logprobs is not None and (plan.tool_parser is not None or plan.reasoning_parser is not None):
            raise APIError(400, "logprobs (include message.output_text.logprobs, top_logprobs) cannot go with tools "
                                "or a reasoning parser", param="include")
        await st.grammars.check(plan.grammars)
    except APIError as e:
        raise renamed(e) from None
    params = plan.params[0]
    envelope = dict(instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                    previous_response_id=body.previous_response_id, parallel_tool_calls=body.parallel_tool_calls,
                    temperature=params.temperature, top_p=params.top_p, top_logprobs=body.top_logprobs,
                    tool_choice=body.tool_choice or "auto", tools=body.tools or [],
                    text=body.text or {"format": {"type": "text"}}, reasoning=body.reasoning, store=body.store,
                    metadata=body.metadata or {}, user=body.user, truncation=body.truncation or "disabled")
    fmt = ResponsesFormat(plan, envelope, lora or st.model_name, st.strings)

    def done(response: ResponseObject) -> None:
        if body.store:
            out = response.model_dump(mode="json")
            st.responses.put(out, history + items + out["output"])

    stream = await _submit(st, request, plan, lora)
    if plan.stream:
        return EngineStreamingResponse(response_events(plan, stream, fmt, done), on_close=stream.abort)
    try:
        choices = await collect_while_connected(request, plan, stream)
    except ClientGone:
        return Response(status_code=499)
    finally:
        stream.abort()
    response = fmt.final(choices[0])
    done(response)
    return response


def _pooling(engine: Any) -> Pooling | PoolingConfigError:
    try:
        return model_pooling(model_folder(getattr(engine, "config", None)))
    except PoolingConfigError as e:
        log.warning("/v1/embeddings is off: %s", e)
        return e


async def _pooled(st: ServerState, request: Request, body: EmbeddingRequest) -> tuple[list[array], int, str]:
    """Each input's pooled final hidden state (not normalized), the prompt tokens they took and the
    model name to answer with; ClientGone if the client left meanwhile."""
    lora = _check_model(st, body.model)
    pooling = st.pooling
    if isinstance(pooling, PoolingConfigError):
        raise APIError(400, f"this model does not serve embeddings: {pooling}", param="model")
    try:
        plan = await _planned(st, partial(st.planner.embedding_draft, pooling=pooling.how), body)
    except APIError as e:
        if e.param == "prompt":
            e.param = "input"
        raise
    stream = await _submit(st, request, plan, lora)
    try:
        choices = await collect_while_connected(request, plan, stream)
    finally:
        stream.abort()
    if any(c.embedding is None for c in choices):
        raise APIError(500, "the engine returned no embedding", code="generation_failed")
    return [c.embedding for c in choices], sum(len(p.token_ids) for p in plan.prompts), lora or st.model_name


async def _embed(st: ServerState, request: Request, body: EmbeddingRequest) -> Any:
    """POST /v1/embeddings: each input's pooled final hidden state, cut to dimensions and normalized."""
    hidden = st.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(400, f"dimensions is {body.dimensions} but this model's embeddings have {hidden}",
                       param="dimensions")
    try:
        pooled, tokens, model = await _pooled(st, request, body)
    except ClientGone:
        return Response(status_code=499)
    pooling = st.pooling
    assert isinstance(pooling, Pooling)
    normalize = pooling.normalize if body.normalize is None else body.normalize
    vectors = [finish_vector(v, body.dimensions, normalize) for v in pooled]
    data = [Embedding(index=i, embedding=encode_vector(v, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=model,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def _similarities(st: ServerState, request: Request, model: str | None, firsts: list[str], seconds: list[str],
                        truncate: int | None, priority: int) -> tuple[list[float], int, str]:
    """The cosine similarity of each first text to its second one, from their embeddings (as vLLM
    scores with an embedding model); a text that appears twice is embedded once."""
    texts = list(dict.fromkeys(firsts + seconds))
    body = EmbeddingRequest(model=model, input=texts, truncate_prompt_tokens=truncate, priority=priority)
    pooled, tokens, name = await _pooled(st, request, body)
    unit = {t: finish_vector(v, None, True) for t, v in zip(texts, pooled)}
    return [float(unit[a] @ unit[b]) for a, b in zip(firsts, seconds)], tokens, name


async def _score(st: ServerState, request: Request, body: ScoreRequest) -> Any:
    """POST /v1/score: text_1 against each of text_2, or the two lists pair by pair."""
    firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not firsts or not seconds:
        raise APIError(400, "text_1 and text_2 need at least one text each", param="text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or as many "
                            "as text_2 (scored pair by pair)", param="text_2")
    try:
        scores, tokens, model = await _similarities(st, request, body.model, firsts, seconds,
                                                    body.truncate_prompt_tokens, body.priority)
    except ClientGone:
        return Response(status_code=499)
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                         data=[ScoreData(index=i, score=v) for i, v in enumerate(scores)],
                         usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def _rerank(st: ServerState, request: Request, body: RerankRequest) -> Any:
    """POST /v1/rerank: the documents by their similarity to the query, best first (top_n of them)."""
    try:
        scores, tokens, model = await _similarities(st, request, body.model, [body.query] * len(body.documents),
                                                    body.documents, body.truncate_prompt_tokens, body.priority)
    except ClientGone:
        return Response(status_code=499)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model,
                          usage=RerankUsage(total_tokens=tokens), results=results)
