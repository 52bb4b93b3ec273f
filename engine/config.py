"""The engine's configuration, validated once at the edge with messages a user can act on: ModelConfig
(what the engine needs from a Hugging Face config.json) and EngineConfig (every engine setting)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.quant import QUANTIZATION_METHODS, QuantizationError, WeightFormat, checkpoint_format
from kvcache.calc import pipeline_parallel_problem, tensor_parallel_problem
from kvcache.spec import DTYPE_BYTES, default_block_size
from scheduler.request import SpeculativeConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
# checkpoints of the base model without its LM head, as embedding models ship (e5-mistral, gte-Qwen2):
# served as the model with the head tied to the embedding, tensors named without the "model." prefix
HEADLESS_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                          "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# config keys of DeepSeek-style shared experts, which engine/models/moe.py lacks (Qwen2-MoE's one
# gated shared expert it has: shared_expert_intermediate_size)
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts")


class ModelConfigError(ValueError):
    """A model folder or config.json the engine can't use; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    torch_dtype: str = "bfloat16"
    # mixture of experts (engine/models/moe.py): 0 experts = every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP in a mixture-of-experts model
    shared_expert_size: int = 0  # Qwen2-MoE: a dense MLP of this width beside the experts, its output gated
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant: WeightFormat | None = None  # a quantized checkpoint's format: FP8 or 4-bit (engine/quant.py)
    headless: bool = False  # the checkpoint is the base model alone (HEADLESS_ARCHITECTURES): no LM head of its own
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        headless = arch is None and any(a in HEADLESS_ARCHITECTURES for a in archs)
        if headless:
            arch = HEADLESS_ARCHITECTURES[next(a for a in archs if a in HEADLESS_ARCHITECTURES)]
        if arch is None:
            got = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
            raise ModelConfigError(f"unsupported architecture {got}; pagedserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // num_heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            model_type = cfg.get("model_type", "")
            moe = _moe_fields(cfg, arch)
            try:
                quant = checkpoint_format(cfg)
            except QuantizationError as e:
                raise ModelConfigError(str(e)) from None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=headless or bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")
                                                                           or arch in ("Qwen2ForCausalLM",
                                                                                       "Qwen2MoeForCausalLM")))),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                torch_dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quant=quant,
                headless=headless,
                raw=cfg,
                **moe,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """From a model folder or a config.json file."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise ModelConfigError(f"no config.json in {path}: pass a Hugging Face model folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    @property
    def max_context_len(self) -> int:
        """The longest context the engine serves: max_position_embeddings (stretched by linear and
        YaRN rope scaling, whose configs keep the original length there, as vLLM reads them), or the
        sliding window where one applies (there is no sliding-window attention here, so stay inside it)."""
        longest = self.max_position_embeddings
        rs = self.rope_scaling or {}
        kind = rs.get("rope_type", rs.get("type"))
        if kind in ("linear", "yarn") and rs.get("factor"):
            original = rs.get("original_max_position_embeddings") if kind == "yarn" else None
            longest = int((original or longest) * float(rs["factor"]))
        window = self.raw.get("sliding_window")
        if window and self.raw.get("use_sliding_window", self.architecture == "MistralForCausalLM"):
            return min(longest, int(window))
        return longest

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tensor_parallel(self, size: int, expert_parallel: bool = False) -> None:
        """Raise ValueError unless `size` ranks can split this model (kvcache/calc.py says which can)."""
        if expert_parallel and not self.num_experts:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {self.architecture} has no experts")
        why = tensor_parallel_problem(self, size, expert_parallel)
        if why is not None:
            raise ValueError(f"tensor_parallel_size {why}")

    def check_pipeline_parallel(self, size: int) -> None:
        """Raise ValueError unless `size` stages can each own at least one layer."""
        why = pipeline_parallel_problem(self, size)
        if why is not None:
            raise ValueError(f"pipeline_parallel_size {why}")

    def check_draft(self, draft: "ModelConfig", name: str) -> None:
        """Raise ModelConfigError unless `draft` (speculative decoding's draft model, named `name`) can
        propose tokens for this model: an LM head, and ids within this model's vocabulary."""
        if draft.headless:
            raise ModelConfigError(f"speculative_config's draft model {name!r} has no LM head (an embedding model)")
        if draft.vocab_size > self.vocab_size:
            raise ModelConfigError(f"speculative_config's draft model {name!r} has a larger vocabulary "
                                   f"({draft.vocab_size}) than the model ({self.vocab_size}): a draft model "
                                   "shares the model's tokenizer")

    def check_quantization(self, method: str | None) -> None:
        """Raise ModelConfigError if `method` (--quantization) would quantize a checkpoint whose
        weights are quantized already: it would otherwise be silently ignored."""
        if method is not None and self.quant is not None:
            name = getattr(self.quant, "method", "").upper()
            raise ModelConfigError(f"--quantization {method} quantizes 16-bit weights, but this checkpoint's are "
                                   f"{self.quant.label}{f' ({name})' if name else ''} already; drop --quantization")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers)) if self.num_experts else 0

    @property
    def expert_params(self) -> int:
        """One expert's parameters (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def num_params(self, experts_per_layer: float | None = None) -> int:
        """Parameter count from the shapes (embedding and lm_head counted once when tied); with
        experts_per_layer, the parameters a token reads when each MoE layer touches that many
        experts (the router's weight always)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        moe = self.num_moe_layers
        experts = self.num_experts if experts_per_layer is None else experts_per_layer
        moe_mlp = round(moe * (experts * self.expert_params + self.num_experts * h))
        if self.shared_expert_size:  # the shared expert and its gate
            moe_mlp += moe * (3 * h * self.shared_expert_size + h)
        per_layer = attn + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + (self.num_layers - moe) * 3 * h * i + moe_mlp + embed + h

    def projection_params(self) -> int:
        """The weights of the dense layers' q/k/v, o, gate/up and down projections: what a
        quantized model holds in FP8 or 4 bits (engine/quant.py)."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return self.num_layers * attn + (self.num_layers - self.num_moe_layers) * 3 * h * self.intermediate_size

    def active_params(self) -> int:
        """The parameters one token's forward reads: top-k experts of each MoE layer."""
        return self.num_params(self.num_experts_per_tok if self.num_experts else None)

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params() * DTYPE_BYTES[dtype]

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 per weight of the matmuls (the embedding lookup is free,
        the lm_head is not) plus attention's QK^T and PV over context_len positions."""
        matmul_params = self.active_params() - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)
        attn = 4 * self.num_layers * self.q_size * context_len
        return 2.0 * matmul_params + attn


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a config.json of transformers 4 or 5."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    shared = [k for k in SHARED_EXPERT_KEYS if cfg.get(k)]
    if shared:
        raise ModelConfigError(f"{arch} with a shared expert ({shared[0]}={cfg[shared[0]]}) is not supported; "
                               "pagedserve serves mixtures of experts without one")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ModelConfigError(f"config.json of {arch} lacks num_experts (or num_local_experts) "
                               "and num_experts_per_tok")
    experts, top_k = int(experts), int(top_k)
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":  # every layer sparse; the experts' width is intermediate_size
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(int(i) for i in cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step != 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if arch == "Qwen2MoeForCausalLM" else 0)


DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
BACKENDS = ("auto", "triton", "torch")
MAX_SCHEDULER_STEPS = 16
AUTO_SCHEDULER_STEPS = 4


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face folder (or config.json with load_format dummy); None = default
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: kvcache/spec.py default_block_size (16; 32 for fp8/int8)
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    load_format: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    piecewise_graphs: bool = True  # CUDA graphs around attention for steps with prefill tokens
    # steps with prefill tokens of up to this many tokens replay one whole-step graph, attention
    # included (engine/step_graph.py; needs the piecewise graphs); 0: off
    step_graph_max_tokens: int = 2304
    backend: str = "auto"  # kernels: triton on a GPU, the plain-torch reference on the CPU
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs; None: on with a GPU
    # Triton kernels with programmatic dependent launch; None: where the GPU can (compute capability >= 9.0)
    pdl: bool | None = None
    prefill_hold_ms: float = 0.0  # the quiet time that ends a burst of new prompts (scheduler/policy.py)
    # the latency target of a step that carries prompt tokens beside decodes (engine/cost_model.py);
    # None: twice the decodes' own step
    max_step_ms: float | None = None
    # decode steps per scheduling round while only greedy decodes run and nothing waits
    # (scheduler/policy.py Scheduler._steps); needs the decode graphs. None: AUTO_SCHEDULER_STEPS
    # where the decode graphs run, else 1
    num_scheduler_steps: int | None = None
    # ranks that split each layer (engine/parallel/): one process per GPU, or per share of the CPU
    tensor_parallel_size: int = 1
    # stages that each own a contiguous range of layers (engine/parallel/stage.py); the world is
    # tensor_parallel_size x pipeline_parallel_size ranks
    pipeline_parallel_size: int = 1
    # mixture-of-experts layers: each tensor-parallel rank holds whole experts (num_experts / size
    # of them) instead of a slice of every expert's width; attention stays tensor parallel
    enable_expert_parallel: bool = False
    # tensor parallelism on GPUs: small all-reduces take NCCL instead of the one-shot kernel over
    # peer memory (engine/parallel/peer_allreduce.py)
    disable_custom_all_reduce: bool = False
    seed: int = 0
    # GiB of host memory for a second tier of the prefix cache (kvcache/host_tier.py), per GPU (each
    # tensor/pipeline-parallel rank keeps its shard); 0: off
    kv_offload_gib: float = 0.0
    # "fp8": a 16-bit checkpoint's projections quantized to FP8 as they load (engine/quant.py); None:
    # the checkpoint's own weights (an FP8 checkpoint stays FP8)
    quantization: str | None = None
    # speculative decoding (scheduler/ngram.py): vLLM's speculative_config, a dict or SpeculativeConfig
    speculative_config: SpeculativeConfig | dict | None = None
    # LoRA adapters served beside the base model (engine/lora.py): (name, PEFT folder) pairs, or a
    # dict of them; numbered by their place here, from 1 (SamplingParams.lora; adapters loaded later
    # take the next numbers: scheduler/lora.py)
    lora_modules: tuple[tuple[str, str], ...] | dict = ()
    # adapters loaded while serving too (LLM.generate's LoRARequest): slots on every projection for
    # max_loras adapters (0: 1, or as many as lora_modules) of rank up to max_lora_rank (0: 16, or
    # lora_modules' largest); without it the slots are lora_modules' own
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0

    def __post_init__(self) -> None:
        def choice(name: str, options: tuple[str, ...]) -> None:
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {', '.join(options)}; got {getattr(self, name)!r}")

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")

        choice("dtype", DTYPES)
        choice("device", DEVICES)
        if self.kv_cache_dtype in ("fp8_e4m3", "bf16", "fp16"):
            object.__setattr__(self, "kv_cache_dtype", {"fp8_e4m3": "fp8", "bf16": "bfloat16", "fp16": "float16"}[self.kv_cache_dtype])
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        choice("load_format", LOAD_FORMATS)
        choice("backend", BACKENDS)
        if self.quantization is not None:
            choice("quantization", QUANTIZATION_METHODS)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            positive(name)
        if self.num_scheduler_steps is not None:
            positive("num_scheduler_steps")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be at most {MAX_SCHEDULER_STEPS}; got {self.num_scheduler_steps}")
        if self.block_size & (self.block_size - 1) or not 8 <= self.block_size <= 256:
            raise ValueError(f"block_size must be a power of two between 8 and 256; got {self.block_size}")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        if (isinstance(self.step_graph_max_tokens, bool) or not isinstance(self.step_graph_max_tokens, int)
                or self.step_graph_max_tokens < 0):
            raise ValueError(f"step_graph_max_tokens must be an integer >= 0; got {self.step_graph_max_tokens!r}")
        if self.max_model_len is not None:
            positive("max_model_len")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 1.0]; got {self.gpu_memory_utilization}")
        if self.max_step_ms is not None and (isinstance(self.max_step_ms, bool) or not isinstance(self.max_step_ms, (int, float))
                                             or not 0 < self.max_step_ms <= 60_000):
            raise ValueError(f"max_step_ms must be a number of milliseconds in (0, 60000]; got {self.max_step_ms!r}")
        if (isinstance(self.kv_offload_gib, bool) or not isinstance(self.kv_offload_gib, (int, float))
                or not 0 <= self.kv_offload_gib < float("inf")):
            raise ValueError(f"kv_offload_gib must be a number of GiB >= 0 (0: no host tier); got {self.kv_offload_gib!r}")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib needs prefix caching: the host tier keeps the blocks the prefix cache evicts")
        if (isinstance(self.prefill_hold_ms, bool) or not isinstance(self.prefill_hold_ms, (int, float))
                or not 0 <= self.prefill_hold_ms <= 10_000):
            raise ValueError(f"prefill_hold_ms must be a number of milliseconds in [0, 10000]; got {self.prefill_hold_ms!r}")
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        object.__setattr__(self, "lora_modules", lora_pairs(self.lora_modules))
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: the default); got {v!r}")
        if self.speculative_config is not None and (self.num_scheduler_steps or 1) > 1:
            raise ValueError("speculative decoding takes the place of multi-step rounds (a draft needs its sequence's "
                             "last token); drop num_scheduler_steps")


def lora_pairs(modules: Any) -> tuple[tuple[str, str], ...]:
    """LoRA adapters as (name, folder) pairs, in order, from pairs or a dict; ValueError says what is wrong."""
    pairs = tuple(modules.items()) if isinstance(modules, dict) else tuple(tuple(p) for p in modules)
    names = set()
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(v, str) and v for v in pair):
            raise ValueError(f"a LoRA adapter is a name and a folder; got {pair!r}")
        if pair[0] in names:
            raise ValueError(f"two LoRA adapters are named {pair[0]!r}")
        names.add(pair[0])
    return pairs
