"""Offline generation: LLM(...).generate(prompts, params) for scripts and tests; LLM(...).embed(prompts)."""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Sequence as Seq

from engine.config import EngineConfig
from scheduler.request import PromptLogprobs, SamplingParams, TokenLogprob
from serve.build import build_engine
from serve.chat_template import check_chat_template
from serve.embeddings import finish_vector, model_pooling
from serve.generation_config import model_folder, sampling_defaults
from serve.lora import LoRARequest, lora_numbers


@dataclass
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: per prompt token a TokenLogprob (None for the first), as vLLM's
    # RequestOutput has them
    prompt_logprobs: PromptLogprobs | None = None
    embedding: array | None = None  # SamplingParams.pooling: the pooled final hidden state

    @property
    def outputs(self) -> list["GenerationOutput"]:
        """vLLM-style access (output.outputs[0].text)."""
        return [self]


@dataclass
class EmbeddingOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]

    @property
    def outputs(self) -> "EmbeddingOutput":
        """vLLM-style access (output.outputs.embedding)."""
        return self


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 kv_cache_dtype: str = "auto", block_size: int | None = None, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, load_format: str = "auto",
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9, seed: int = 0, backend: str = "auto",
                 async_scheduling: bool | None = None, piecewise_graphs: bool = True, pdl: bool | None = None,
                 step_graph_max_tokens: int = EngineConfig.step_graph_max_tokens, num_scheduler_steps: int | None = None,
                 max_step_ms: float | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, enable_expert_parallel: bool = False, kv_offload_gib: float = 0.0,
                 disable_custom_all_reduce: bool = False, quantization: str | None = None,
                 speculative_config: dict | None = None, enable_lora: bool = False,
                 lora_modules: dict[str, str] | None = None, max_loras: int = 0, max_lora_rank: int = 0,
                 generation_config: str = "auto", show_progress: bool = False) -> None:
        """generation_config: where generate() without SamplingParams takes its defaults from
        (serve/generation_config.py): auto, the model's generation_config.json; vllm, SamplingParams()'s.
        lora_modules: LoRA adapters loaded at start-up, {name: PEFT folder} (generate()'s lora_request
        picks one). enable_lora: generate() also loads adapters its LoRARequests name, into
        max_loras slots (default 1) of rank up to max_lora_rank (default 16), as vLLM does."""
        self.config = EngineConfig(model=None if model is None else str(model), dtype=dtype, device=device,
                                   kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                   num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, load_format=load_format,
                                   max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                                   enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization, backend=backend,
                                   async_scheduling=async_scheduling, piecewise_graphs=piecewise_graphs, pdl=pdl,
                                   step_graph_max_tokens=step_graph_max_tokens,
                                   num_scheduler_steps=num_scheduler_steps, max_step_ms=max_step_ms,
                                   tensor_parallel_size=tensor_parallel_size,
                                   pipeline_parallel_size=pipeline_parallel_size, seed=seed,
                                   enable_expert_parallel=enable_expert_parallel, kv_offload_gib=kv_offload_gib,
                                   disable_custom_all_reduce=disable_custom_all_reduce, quantization=quantization,
                                   speculative_config=speculative_config, lora_modules=lora_modules or (),
                                   enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.defaults = sampling_defaults(generation_config, model_folder(self.config))
        self.engine = build_engine(self.config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = False) -> "LLM":
        self = cls.__new__(cls)
        self.config = config
        self.defaults = sampling_defaults("auto", model_folder(config))
        self.engine = build_engine(config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        return self

    def shutdown(self) -> None:
        """Stop the tensor/pipeline-parallel ranks this LLM started (also at exit, or `with LLM(...) as llm:`)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of messages rendered with the tokenizer's chat template (or chat_template, a
        Jinja template's text), ready for a reply (or, continue_final_message, to go on with the last
        assistant message); tools and chat_template_kwargs reach the template."""
        if chat_template is not None:
            check_chat_template(chat_template)
        elif not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tokenize=False,
                                                  chat_template=chat_template, tools=tools,
                                                  **(chat_template_kwargs or {}))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[GenerationOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each rendered with the
        chat template (chat_prompt) and answered by generate(); one output per conversation."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        prompts = [self.chat_prompt(list(c), chat_template, add_generation_prompt, continue_final_message, tools,
                                    chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None) -> list[GenerationOutput]:
        """One output per prompt, in order. prompts: strings or token-id lists. lora_request: the
        LoRA adapter (a LoRARequest or its name) for every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:  # the model's generation_config.json defaults, as vLLM takes them
            params = SamplingParams(**self.defaults)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if lora_request is not None:
            loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
            plist = [replace(p, lora=i) for p, i in zip(plist, lora_numbers(self.engine.core, loras))]
        vocab = self.engine.model_config.vocab_size
        for p in plist:
            for name, ids in (("logit_bias", p.logit_bias), ("allowed_token_ids", p.allowed_token_ids or [])):
                bad = [t for t in ids if t >= vocab]
                if bad:
                    raise ValueError(f"{name}: token {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        core = self.engine.core
        results: dict[int, GenerationOutput] = {}
        order: list[int] = []
        try:
            for prompt, p in zip(prompts, plist):
                ids = self.encode(prompt)
                seq = core.add_request(ids, p)
                results[seq.seq_id] = GenerationOutput(prompt if isinstance(prompt, str) else None, ids)
                order.append(seq.seq_id)
        except Exception:
            for sid in order:
                core.abort(sid)
            raise
        pending = set(order)
        while pending:
            time.sleep(core.hold_wait())  # --prefill-hold-ms: all prompts are in, so this is one quiet period
            for out in core.step():
                r = results.get(out.seq_id)
                if r is None:
                    continue
                r.token_ids.extend(out.new_token_ids)
                r.text += out.new_text
                r.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                if out.embedding is not None:
                    r.embedding = out.embedding
                if out.finished:
                    r.finish_reason = out.finish_reason
                    pending.discard(out.seq_id)
                    if out.error:
                        for sid in pending:  # don't leave this call's other requests in the engine
                            core.abort(sid)
                        if core.lost is not None:  # the engine can't go on: its ranks go now
                            self.shutdown()
                        raise RuntimeError(out.error)
        return [results[sid] for sid in order]

    def embed(self, prompts: str | list[int] | Seq[str | list[int]], pooling: str | None = None,
              normalize: bool | None = None, dimensions: int | None = None,
              lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None) -> list[EmbeddingOutput]:
        """One embedding per prompt, in order: its final hidden states pooled (pooling: last, mean or
        cls; by default as the model folder's sentence-transformers files say, else last), cut to
        the first `dimensions` and scaled to unit length (normalize; by default as those files say,
        else true)."""
        model = model_pooling(model_folder(self.config))
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling or model.how)
        unit = model.normalize if normalize is None else normalize
        out = []
        for r in self.generate(prompts, params, lora_request):
            assert r.embedding is not None, "the engine returned no embedding"
            out.append(EmbeddingOutput(r.prompt, r.prompt_token_ids, finish_vector(r.embedding, dimensions, unit).tolist()))
        return out
