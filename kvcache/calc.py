"""KV-cache sizing arithmetic: how many blocks, tokens and sequences fit on a GPU. Torch-free.

The engine sizes its pool with kv_cache_bytes() below, and `serve kv-calc` (serve/kv_calc_cmd.py)
predicts with plan(), so the calculator's prediction and `serve run`'s startup line come from the
same code. Bytes per token and per block come from kvcache/spec.py (the one sizing formula); the
model's shape from any object with ModelShape's fields (engine/config.py's ModelConfig).

    budget    = floor(total GPU bytes x memory utilization)
    KV bytes  = budget - weights (per GPU) - activation peak - CUDA graph pool
    blocks    = floor(KV bytes / bytes per block)

Without a measured activation peak, plan() uses estimate_activation_bytes(): a documented
estimate that `serve kv-calc --measure` replaces with the engine's own profile. The engine's
profile maps onto these terms as: weight_bytes = the parameters' bytes, activation_bytes =
max_memory_allocated() during the profile forward - weight_bytes + memory outside torch's
allocator (total - free - memory_reserved()).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvcache.gpus import GiB, MiB
from kvcache.spec import DTYPE_BYTES, KVCacheSpec, default_block_size, resolve_kv_dtype

# EngineConfig's defaults (a test keeps them equal)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_STEP_GRAPH_MAX_TOKENS = 2304
# Memory outside torch's allocator once CUDA, cuBLAS and the kernels are loaded: 685 MiB measured
# on an H100 80GB HBM3 with torch 2.11 + CUDA 13; rounded up.
RUNTIME_OVERHEAD_BYTES = 768 * MiB
# NCCL's buffers (and the peer all-reduce's) on each GPU of a group, beyond one GPU's runtime: memory
# outside torch measured by `kv-calc --measure` on H100s (2026-11-26): 689 MiB with one GPU (Llama-3-8B);
# Llama-3-70B: 1,535 MiB at TP=2, 1,537 at TP=4, 1,059 at PP=2
TP_COMM_BYTES = 848 * MiB
PP_COMM_BYTES = 370 * MiB
ROPE_TABLE_BYTES_PER_POSITION_DIM = 2 * 4  # the runner's cos and sin table, float32
# The sampler's peak per logit with top-k/top-p and logprobs (the engine profiles it so): the sort's
# float32 values and int64 indices, masks, softmax, cumsum, scatter and the noise, float32 each.
SAMPLER_BYTES_PER_LOGIT = 36


class ModelShape(Protocol):
    """What the sizing reads of a model; engine/config.py's ModelConfig has all of it."""
    @property
    def torch_dtype(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def max_context_len(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    def num_params(self) -> int: ...
    def weight_bytes(self, dtype: str) -> int: ...


class KVCalcError(ValueError):
    """Base of the calculator's errors; every message says what to change."""


class KVCalcInputError(KVCalcError):
    """A value the calculator can't use (non-positive size, unknown dtype, bad TP degree)."""


class DoesNotFitError(KVCalcError):
    """The inputs are valid but leave no room for a KV cache."""


class WeightsDontFitError(DoesNotFitError):
    """The weights alone exceed the memory budget."""


class NoRoomForKVCacheError(DoesNotFitError):
    """The weights fit, but activations and graphs leave less than one block for the KV cache."""


def resolve_model_dtype(dtype: str, model: ModelShape) -> str:
    """--dtype: 'auto' follows the config's torch_dtype."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(dtype.lower(), dtype.lower())
    if name == "auto":
        name = model.torch_dtype
    if name not in DTYPE_BYTES:
        raise KVCalcInputError(f"--dtype must be one of auto, bfloat16, float16, float32; got {dtype!r}")
    return name


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    try:
        return resolve_kv_dtype(kv_cache_dtype.lower(), model_dtype)
    except ValueError:
        raise KVCalcInputError(f"--kv-cache-dtype must be one of auto, bfloat16, float16, fp8, int8; "
                               f"got {kv_cache_dtype!r}") from None


def _moe(model: ModelShape) -> tuple[int, int, int, int]:
    """(experts, experts per token, each expert's width, MoE layers) of a mixture-of-experts
    model; experts 0 for a dense one (a shape object without the MoE fields is dense)."""
    experts = getattr(model, "num_experts", 0)
    if not experts:
        return 0, 0, 0, 0
    return experts, model.num_experts_per_tok, model.moe_intermediate_size, model.num_moe_layers


def tensor_parallel_problem(model: ModelShape, size: int, expert_parallel: bool = False) -> str | None:
    """Why `size` ranks can't split the model ("N must divide ..."), or None: the attention heads and
    the MLP width split evenly, the KV heads evenly or each replicated on size / num_kv_heads ranks;
    a mixture of experts splits each expert's width, or with expert_parallel the experts themselves.
    The vocabulary need not divide (the last rank's rows are padded)."""
    if size < 1:
        return f"{size} must be 1 or more"
    experts, _, moe_width, moe_layers = _moe(model)
    if size == 1:
        return None
    heads, kv = model.num_heads, model.num_kv_heads
    mlp = model.intermediate_size if moe_layers < model.num_layers else 0  # no dense MLP to split
    split, what = (experts, "experts") if expert_parallel else (moe_width, "expert width")

    shared = getattr(model, "shared_expert_size", 0)  # Qwen2-MoE's shared expert: split like the dense MLP

    def fit(n: int) -> bool:
        return (heads % n == 0 and mlp % n == 0 and shared % n == 0 and (kv % n == 0 or n % kv == 0)
                and (not experts or split % n == 0))

    hint = f"; sizes that fit this model: {', '.join(str(n) for n in range(1, heads + 1) if fit(n))}"
    if heads % size:
        return f"{size} must divide the model's {heads} attention heads{hint}"
    if kv % size and size % kv:
        return f"{size} must divide the model's {kv} KV heads or be a multiple of them{hint}"
    if mlp % size:
        return f"{size} must divide the model's MLP width {mlp}{hint}"
    if shared % size:
        return f"{size} must divide the model's shared expert width {shared}{hint}"
    if experts and split % size:
        return f"{size} must divide the model's {split} {what}{hint}"
    return None


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that `tokens` tokens touch in one MoE layer, in expectation, when each picks
    top_k of num_experts uniformly: an expert is missed by one token with probability 1 - k/E."""
    if num_experts == 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _mlp_params(model: ModelShape, tp: int) -> int:
    """One rank's MLP parameters over all layers: dense MLP columns, its share of the experts
    (whole experts or a slice of each: the same count), the whole router, and a shared expert's
    columns and its whole gate."""
    h = model.hidden_size
    experts, _, moe_width, moe_layers = _moe(model)
    dense = (model.num_layers - moe_layers) * 3 * h * (model.intermediate_size // tp)
    shared = getattr(model, "shared_expert_size", 0)
    return dense + moe_layers * (experts * 3 * h * moe_width // tp + experts * h
                                 + (3 * h * shared // tp + h if shared else 0))


def _mlp_activation_elems(model: ModelShape, tp: int, dense_factor: int) -> int:
    """Elements per token of a layer's MLP temporaries beyond its input: a dense MLP's
    (dense_factor x intermediate, which each estimate states); a MoE layer's router logits (float32, two
    copies) and, for each of its k experts, gate_up, the product and the down projection's row."""
    experts, top_k, moe_width, moe_layers = _moe(model)
    dense = dense_factor * -(-model.intermediate_size // tp) if moe_layers < model.num_layers else 0
    moe = top_k * (3 * -(-moe_width // tp) + model.hidden_size) + 4 * experts if experts else 0
    shared = getattr(model, "shared_expert_size", 0)
    if experts and shared:  # the shared expert's gate_up and product, and its output row
        moe += 3 * -(-shared // tp) + model.hidden_size
    return max(dense, moe)


def stage_layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """The layers [start, end) of each pipeline stage: an even split, the first num_layers % stages
    stages one layer more (the last stage also runs the LM head)."""
    assert 1 <= stages <= num_layers, f"{stages} stages for {num_layers} layers"
    per, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for s in range(stages):
        end = start + per + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def pipeline_parallel_problem(model: ModelShape, size: int) -> str | None:
    """Why `size` pipeline stages can't split the model, or None (each stage needs a layer)."""
    if size < 1:
        return f"{size} must be 1 or more"
    if size > model.num_layers:
        return f"{size} is more than the model's {model.num_layers} layers; use at most {model.num_layers} stages"
    return None


def check_tensor_parallel(model: ModelShape, tensor_parallel_size: int) -> None:
    why = tensor_parallel_problem(model, tensor_parallel_size)
    if why is not None:
        raise KVCalcInputError(f"--tensor-parallel-size {why}")


def check_pipeline_parallel(model: ModelShape, pipeline_parallel_size: int) -> None:
    why = pipeline_parallel_problem(model, pipeline_parallel_size)
    if why is not None:
        raise KVCalcInputError(f"--pipeline-parallel-size {why}")


def stage_weight_bytes(model: ModelShape, dtype: str, tensor_parallel_size: int, num_layers: int, first: bool,
                       last: bool) -> int:
    """Weights held by one rank of a pipeline stage of num_layers layers: its share of each layer
    (heads, KV heads kept whole where ranks share one, MLP columns), the embedding's vocabulary rows
    on the first stage, the final norm and the LM head's rows on the last (a tied head there is the
    embedding's copy, unless one stage has both)."""
    tp = tensor_parallel_size
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_heads // tp * hd, max(1, model.num_kv_heads // tp) * hd
    per_layer = h * (q + 2 * kv) + q * h + 2 * h
    if model.attention_bias:
        per_layer += q + 2 * kv
    if model.qk_norm:
        per_layer += 2 * hd
    vocab_rows = -(-model.vocab_size // tp) * h
    mlp = _mlp_params(model, tp) * num_layers // model.num_layers  # a stage's share (MoE: on average)
    params = num_layers * per_layer + mlp + (vocab_rows if first else 0) + (h + vocab_rows if last else 0)
    if first and last and getattr(model, "tie_word_embeddings", False):
        params -= vocab_rows
    return params * DTYPE_BYTES[dtype] - quant_saving(model, dtype, tp, num_layers)


def quant_saving(model: ModelShape, dtype: str, tensor_parallel_size: int = 1, num_layers: int | None = None) -> int:
    """The bytes one rank does not hold where the projections are quantized (engine/quant.py: an
    FP8 or 4-bit checkpoint, or --quantization fp8): the format's bytes a weight instead of dtype's
    (FP8 one, its scales left out; 4-bit half a byte and its groups' scales and zero points), over
    the rank's share of num_layers layers (all of them by default)."""
    quant = getattr(model, "quant", None)
    if quant is None:
        return 0
    layers = model.num_layers if num_layers is None else num_layers
    tp = tensor_parallel_size
    params = model.projection_params() * layers // model.num_layers // tp
    saving = params * (DTYPE_BYTES[dtype] - quant.bytes_per_weight)
    if getattr(quant, "act_order", False) and tp > 1:  # o as wide as the whole weight on every rank
        saving -= layers * model.q_size * model.hidden_size * (tp - 1) // tp * quant.bytes_per_weight
    return int(saving)


def weight_bytes_per_gpu(model: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Weights held by one rank: matmuls and the embedding split across ranks, norms on every
    rank, and KV projections copied to each rank that shares a KV head."""
    tp = tensor_parallel_size
    if tp == 1:
        return model.weight_bytes(dtype) - quant_saving(model, dtype)
    h, hd = model.hidden_size, model.head_dim
    experts, _, _, moe_layers = _moe(model)
    replicated = model.num_layers * (2 * h + (2 * hd if model.qk_norm else 0)) + h + moe_layers * experts * h
    if getattr(model, "shared_expert_size", 0):  # its gate, [1, hidden], on every rank
        replicated += moe_layers * h
    kv_copies = max(1, model.num_kv_heads // tp) * tp - model.num_kv_heads
    kv_copy_params = model.num_layers * 2 * kv_copies * hd * (h + (1 if model.attention_bias else 0))
    sharded = model.num_params() - replicated + kv_copy_params
    return (-(-sharded // tp) + replicated) * DTYPE_BYTES[dtype] - quant_saving(model, dtype, tp)


# the PEFT names of the projections a LoRA adapter may adapt (engine/lora.py maps them to ours)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters as the engine stacks them (engine/lora.py): `slots` adapters of up to `rank`,
    on these PEFT targets (q_proj, ..., down_proj), every packed part and adapter at that rank."""
    slots: int
    rank: int
    targets: frozenset[str]

    def bytes_per_layer(self, model: ModelShape, dtype: str, tp: int = 1) -> int:
        """One layer's stacked A and B on one tensor-parallel rank."""
        h, hd = model.hidden_size, model.head_dim
        q, kv, i = model.num_heads * hd // tp, max(1, model.num_kv_heads // tp) * hd, model.intermediate_size // tp
        t = self.targets
        width = self.slots * self.rank  # a packed part's columns
        elements = 0
        if t & {"q_proj", "k_proj", "v_proj"}:
            elements += 3 * width * (h + q + 2 * kv)  # A [.., hidden], B [this rank's q|k|v rows, ..]
        if "o_proj" in t:
            elements += width * (q + h)  # A [.., this rank's inputs], B [hidden, ..]
        if t & {"gate_proj", "up_proj"}:
            elements += 2 * width * (h + 2 * i)
        if "down_proj" in t:
            elements += width * (i + h)
        return elements * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ActivationEstimate:
    """What one GPU holds beside the weights and the KV cache, as the engine's profile sees it:
    the peak of one forward over the profile's tokens, the rope table, and the memory CUDA holds
    outside torch's allocator. An estimate, not a measurement."""
    profile_tokens: int  # min(max_num_batched_tokens, max_model_len), as the engine profiles
    layer_bytes: int  # the largest layer's live tensors
    logits_bytes: int  # final hidden states, the logits of the sampled rows and the sampler's work
    buffer_bytes: int  # the rope cos/sin table
    runtime_bytes: int

    @property
    def total_bytes(self) -> int:
        return max(self.layer_bytes, self.logits_bytes) + self.buffer_bytes + self.runtime_bytes


def estimate_activation_bytes(model: ModelShape, dtype: str, tensor_parallel_size: int = 1,
                              max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                              max_model_len: int | None = None, pipeline_parallel_size: int = 1) -> ActivationEstimate:
    """Per token, a layer keeps the residual, the layer input and its normed copy (3 x hidden),
    plus either attention's q, k, v and output or the MLP's gate_up, silu(gate) and product
    (4 x intermediate, unfused). Attention itself is flash-style: nothing quadratic in length.
    Checked on an H100 against a torch layer at 8192 tokens (Llama-3-8B and -70B shapes)."""
    tp = tensor_parallel_size
    e = DTYPE_BYTES[dtype]
    max_len = model.max_context_len if max_model_len is None else max_model_len
    tokens = min(max_num_batched_tokens, max_len)
    h = model.hidden_size
    q = model.q_size // tp
    kv = max(1, model.num_kv_heads // tp) * model.head_dim
    attention = 3 * h + (q + 2 * kv) + q
    mlp = 3 * h + _mlp_activation_elems(model, tp, 4)
    layer = tokens * max(attention, mlp) * e
    # the lm_head's output in the model dtype and its float32 copy, over the full vocabulary
    logits = 2 * tokens * h * e + min(max_num_seqs, tokens) * model.vocab_size * (e + 4 + SAMPLER_BYTES_PER_LOGIT)
    rope = max_len * model.head_dim * ROPE_TABLE_BYTES_PER_POSITION_DIM
    runtime = (RUNTIME_OVERHEAD_BYTES + (TP_COMM_BYTES if tp > 1 else 0)
               + (PP_COMM_BYTES if pipeline_parallel_size > 1 else 0))
    return ActivationEstimate(tokens, layer, logits, rope, runtime)


def estimate_graph_bytes(model: ModelShape, dtype: str, max_num_seqs: int, max_model_len: int,
                         block_size: int, tensor_parallel_size: int = 1) -> int:
    """GPU memory the engine sets aside, before sizing the KV pool, for the decode CUDA graphs it
    captures afterwards: the activations of the largest batch bucket (all graphs share one pool),
    the logits in the model dtype and float32, the static inputs (block tables twice: the graphs'
    own and the uploaded inputs they are unpacked from, engine/cuda_graph.py), and a 64 MiB margin. The engine
    calls this same function; a GPU test checks it covers the pool really captured."""
    tp = tensor_parallel_size
    e = DTYPE_BYTES[dtype]
    q, kv = model.q_size // tp, max(1, model.num_kv_heads // tp) * model.head_dim
    per_token = (6 * model.hidden_size + 2 * (q + 2 * kv) + _mlp_activation_elems(model, tp, 3)) * e
    logits = model.vocab_size * (e + 4)
    static = max_num_seqs * (9 * 8 + 2 * 4 * -(-max_model_len // block_size))
    return max_num_seqs * (per_token + logits) + static + 64 * 2**20


def estimate_piecewise_graph_bytes(model: ModelShape, dtype: str, max_num_batched_tokens: int,
                                   tensor_parallel_size: int = 1) -> int:
    """GPU memory for the piecewise graphs of steps with prefill tokens (engine/piecewise.py),
    captured after the KV pool like the decode graphs: their static buffers (ids, positions and
    slots in int64; qkv, attention output, residual and final hidden state in the model dtype) and
    their pool, one piece's temporaries at max_num_batched_tokens rows (o_proj output, two norms'
    outputs and residuals, gate_up, silu(gate) * up, down projection, an fp8/int8 cache's rotated
    q and k), plus a 64 MiB margin. A GPU test checks it covers what is really captured."""
    tp = tensor_parallel_size
    e = DTYPE_BYTES[dtype]
    t = max_num_batched_tokens
    h = model.hidden_size
    q, kv = model.q_size // tp, max(1, model.num_kv_heads // tp) * model.head_dim
    static = t * (3 * 8 + (2 * q + 2 * kv + 2 * h) * e)
    pool = t * (5 * h + _mlp_activation_elems(model, tp, 3) + q + kv) * e
    return static + pool + 64 * 2**20


def estimate_step_graph_bytes(max_num_seqs: int, max_model_len: int, block_size: int, max_tokens: int) -> int:
    """GPU memory for the whole-step graphs (engine/step_graph.py) beyond the piecewise graphs'
    pool, which they share: their static inputs for the next power of two above max_num_seqs
    plus 16 sequences (block tables twice: uploaded and at full width; lengths, query starts,
    three int64 words) and max_tokens tokens (ids, positions, slots, a work item each), and
    2 MiB for what their capture adds to the pool (measured on an H100: 2.0 MiB for the 215
    graphs of Qwen2.5-0.5B at max_num_seqs 256 and of Llama-3-8B, as for 116 before the finer
    token buckets)."""
    seqs = (1 << (max_num_seqs - 1).bit_length()) + 16
    blocks = -(-max_model_len // block_size)
    return seqs * (2 * 4 * blocks + 2 * 4 + 3 * 8) + max_tokens * (3 * 8 + 4) + 2 * 2**20


def kv_cache_bytes(total_gpu_bytes: int, memory_utilization: float, weight_bytes: int,
                   activation_bytes: int, graph_bytes: int = 0) -> int:
    """Bytes left for the KV cache on one GPU (0 when nothing is left). The engine and the
    calculator both call this, so they agree to the byte."""
    if total_gpu_bytes <= 0:
        raise KVCalcInputError(f"GPU memory must be more than 0 bytes; got {total_gpu_bytes}")
    if not 0.0 < memory_utilization <= 1.0:
        raise KVCalcInputError(f"memory utilization must be in (0, 1]; got {memory_utilization}")
    for name, value in (("weight_bytes", weight_bytes), ("activation_bytes", activation_bytes), ("graph_bytes", graph_bytes)):
        if value < 0:
            raise KVCalcInputError(f"{name} must be >= 0; got {value}")
    budget = int(total_gpu_bytes * memory_utilization)
    return max(0, budget - weight_bytes - activation_bytes - graph_bytes)


# On the CPU the pool's pages are allocated as they are first written (kvcache/pool.py), so this share
# of the RAM available at start-up bounds what a full cache can grow to, not what start-up takes.
CPU_KV_RAM_SHARE = 0.125


def cpu_kv_blocks(spec: KVCacheSpec, max_num_seqs: int, max_model_len: int, available_ram_bytes: int) -> int:
    """Blocks of a CPU pool: what max_num_seqs sequences of max_model_len tokens can use at most,
    capped by CPU_KV_RAM_SHARE of the available RAM; at least one block."""
    work = max_num_seqs * spec.blocks_for_tokens(max_model_len)
    return max(1, min(work, spec.num_blocks_for(int(available_ram_bytes * CPU_KV_RAM_SHARE))))


@dataclass(frozen=True)
class KVPlan:
    """The sizing of one GPU's KV cache. All byte counts are per GPU."""
    spec: KVCacheSpec
    dtype: str  # of the weights
    gpu_memory_bytes: int
    memory_utilization: float
    max_model_len: int
    tensor_parallel_size: int
    num_params: int
    weight_bytes: int
    activation_bytes: int
    activation_estimated: bool  # True: estimate_activation_bytes(); False: given (measured)
    graph_bytes: int
    kv_cache_bytes: int
    warnings: tuple[str, ...] = ()
    # with several stages the figures are those of the GPU with the fewest blocks, which every
    # stage's cache then holds (the engine agrees on the smallest)
    pipeline_parallel_size: int = 1
    active_params: int | None = None  # a mixture of experts: the parameters one token's forward reads
    # speculative decoding's draft model, on the first GPU (its weights are in weight_bytes): its KV
    # pool has as many blocks as the model's, each of this layout
    draft_spec: KVCacheSpec | None = None
    draft_weight_bytes: int = 0

    @property
    def kv_dtype(self) -> str:
        return self.spec.dtype

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.memory_utilization)

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def draft_bytes_per_block(self) -> int:
        return self.draft_spec.bytes_per_block if self.draft_spec is not None else 0

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks_for(self.kv_cache_bytes, self.draft_spec)

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        return self.spec.blocks_for_tokens(self.max_model_len)

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences of max_model_len tokens that fit at once (each holds whole blocks)."""
        return self.num_blocks // self.blocks_per_seq

    def with_kv_dtype(self, kv_dtype: str, block_size: int | None = None) -> "KVPlan":
        """The same budget with another KV storage dtype (and block size, if given)."""
        size = block_size or self.block_size
        draft = None if self.draft_spec is None else replace(self.draft_spec, dtype=kv_dtype, block_size=size)
        return replace(self, spec=replace(self.spec, dtype=kv_dtype, block_size=size), draft_spec=draft)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weight_bytes": self.weight_bytes,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "max_tokens": self.max_tokens,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "kv_cache_dtype": self.kv_dtype,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "num_params": self.num_params,
            "active_params": self.active_params,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "memory_utilization": self.memory_utilization,
            "budget_bytes": self.budget_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_estimated": self.activation_estimated,
            "graph_bytes": self.graph_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_layers": self.spec.num_layers,
            "num_kv_heads_per_gpu": self.spec.num_kv_heads,
            "head_dim": self.spec.head_dim,
            "draft_weight_bytes": self.draft_weight_bytes,
            "draft_bytes_per_block": self.draft_bytes_per_block,
            "warnings": list(self.warnings),
        }


MAX_SUGGESTED_TP = 8  # the GPUs of one host


def _smallest_tp_that_fits(model: ModelShape, dtype: str, kv_dtype: str, block_size: int, gpu_memory_bytes: int,
                           memory_utilization: float, activation_bytes: int | None, graph_bytes: int, start: int,
                           max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                           draft_weights: int = 0, draft_spec: KVCacheSpec | None = None) -> int | None:
    """The smallest tensor-parallel degree above start that leaves room for one KV block (and a
    draft model's weights and block on the first GPU)."""
    for tp in range(start + 1, MAX_SUGGESTED_TP + 1):
        try:
            check_tensor_parallel(model, tp)
        except KVCalcInputError:
            continue
        act = (estimate_activation_bytes(model, dtype, tp, max_num_batched_tokens, max_num_seqs, max_model_len).total_bytes
               if activation_bytes is None else activation_bytes)
        spec = KVCacheSpec.for_model(model.num_layers, model.num_kv_heads, model.head_dim, block_size, kv_dtype, tp)
        weights = weight_bytes_per_gpu(model, dtype, tp) + draft_weights
        if spec.num_blocks_for(kv_cache_bytes(gpu_memory_bytes, memory_utilization, weights, act, graph_bytes),
                               draft_spec) >= 1:
            return tp
    return None


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def plan(model: ModelShape, gpu_memory_bytes: int, memory_utilization: float = 0.9,
         kv_cache_dtype: str = "auto", dtype: str = "auto", block_size: int | None = None,
         max_model_len: int | None = None, tensor_parallel_size: int = 1,
         activation_bytes: int | None = None, graph_bytes: int = 0, *,
         max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
         max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, model_name: str = "the model",
         pipeline_parallel_size: int = 1, lora: LoraShape | None = None, draft: ModelShape | None = None) -> KVPlan:
    """Size one GPU's KV cache. Raises KVCalcInputError for unusable values, WeightsDontFitError
    when the weights exceed the budget, NoRoomForKVCacheError when not one block is left. With
    several pipeline stages: the stage whose GPU holds the fewest blocks (each stage's cache holds
    its own layers' KV). lora: LoRA adapters, counted with the weights. draft: speculative decoding's
    draft model, whole on the first GPU (the one with the fewest blocks then) beside its own KV pool
    of as many blocks."""
    weight_dtype = resolve_model_dtype(dtype, model)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, weight_dtype)
    check_tensor_parallel(model, tensor_parallel_size)
    check_pipeline_parallel(model, pipeline_parallel_size)
    if block_size is None:
        block_size = default_block_size(kv_dtype)
    for name, value in (("--block-size", block_size), ("--max-model-len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
        if value is not None and value < 1:
            raise KVCalcInputError(f"{name} must be >= 1; got {value}")
    max_len = model.max_context_len if max_model_len is None else max_model_len
    if max_len > model.max_context_len:
        raise KVCalcInputError(f"--max-model-len {max_len:,} exceeds the model's context length "
                               f"{model.max_context_len:,}")
    spec = KVCacheSpec.for_model(model.num_layers, model.num_kv_heads, model.head_dim, block_size,
                                 kv_dtype, tensor_parallel_size)
    lora_layer = lora.bytes_per_layer(model, weight_dtype, tensor_parallel_size) if lora is not None else 0
    weights = weight_bytes_per_gpu(model, weight_dtype, tensor_parallel_size) + lora_layer * model.num_layers
    draft_spec, draft_weights = None, 0
    if draft is not None:
        if pipeline_parallel_size > 1:
            raise KVCalcInputError("a draft model with pipeline parallelism is not supported")
        draft_spec = KVCacheSpec.for_model(draft.num_layers, draft.num_kv_heads, draft.head_dim, block_size,
                                           kv_dtype, 1)
        draft_weights = weight_bytes_per_gpu(draft, weight_dtype, 1)
        weights += draft_weights
    estimated = activation_bytes is None
    if activation_bytes is None:
        activation_bytes = estimate_activation_bytes(model, weight_dtype, tensor_parallel_size, max_num_batched_tokens,
                                                     max_num_seqs, max_len, pipeline_parallel_size).total_bytes
    if pipeline_parallel_size > 1:
        spec, weights = _binding_stage(model, weight_dtype, spec, tensor_parallel_size, pipeline_parallel_size,
                                       gpu_memory_bytes, memory_utilization, activation_bytes, graph_bytes, lora_layer)
    kv_bytes = kv_cache_bytes(gpu_memory_bytes, memory_utilization, weights, activation_bytes, graph_bytes)

    budget = int(gpu_memory_bytes * memory_utilization)
    available = f"{_gib(gpu_memory_bytes)} x {memory_utilization:.2f} = {_gib(budget)} is available per GPU"
    if weights >= budget:
        per_gpu = " per GPU" if tensor_parallel_size * pipeline_parallel_size > 1 else ""
        tp = _smallest_tp_that_fits(model, weight_dtype, kv_dtype, block_size, gpu_memory_bytes, memory_utilization,
                                    None if estimated else activation_bytes, graph_bytes, tensor_parallel_size,
                                    max_num_batched_tokens, max_num_seqs, max_len, draft_weights, draft_spec)
        advice = (f"use --tensor-parallel-size {tp} or more" if tp is not None
                  else f"use GPUs with more memory (tensor parallel up to {MAX_SUGGESTED_TP} is not enough)")
        with_draft = " with its draft model" if draft is not None else ""
        raise WeightsDontFitError(f"{model_name}{with_draft} needs {_gib(weights)} of weights in {weight_dtype}"
                                  f"{per_gpu} "
                                  f"but {available}; {advice}")
    block_bytes = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec is not None else 0)
    if kv_bytes < block_bytes:
        what = "estimated" if estimated else "given"
        raise NoRoomForKVCacheError(
            f"{model_name}: {_gib(weights)} of weights + {_gib(activation_bytes)} of activations ({what}) "
            f"+ {_gib(graph_bytes)} of CUDA graphs leave no room for one KV block of {block_bytes:,} B; "
            f"{available}; raise --memory-utilization or --tensor-parallel-size")

    warnings = []
    result = KVPlan(spec, weight_dtype, gpu_memory_bytes, memory_utilization, max_len, tensor_parallel_size,
                    model.num_params(), weights, activation_bytes, estimated, graph_bytes, kv_bytes,
                    pipeline_parallel_size=pipeline_parallel_size,
                    active_params=model.active_params() if getattr(model, "num_experts", 0) else None,
                    draft_spec=draft_spec, draft_weight_bytes=draft_weights)
    if result.max_concurrent_seqs == 0:
        warnings.append(f"the cache holds {result.max_tokens:,} tokens, fewer than one sequence of --max-model-len "
                        f"{max_len:,}; the engine would lower max_model_len to {result.max_tokens:,}")
    return replace(result, warnings=tuple(warnings))


def _binding_stage(model: ModelShape, dtype: str, whole: KVCacheSpec, tp: int, pp: int, gpu_memory_bytes: int,
                   memory_utilization: float, activation_bytes: int, graph_bytes: int,
                   lora_layer_bytes: int = 0) -> tuple[KVCacheSpec, int]:
    """(KV spec, weight bytes, LoRA adapters' included) of the stage whose GPU holds the fewest KV blocks."""
    best: tuple[int, KVCacheSpec, int] | None = None
    for s, (start, end) in enumerate(stage_layer_ranges(model.num_layers, pp)):
        spec = replace(whole, num_layers=end - start)
        weights = stage_weight_bytes(model, dtype, tp, end - start, s == 0, s == pp - 1) + lora_layer_bytes * (end - start)
        blocks = spec.num_blocks_for(kv_cache_bytes(gpu_memory_bytes, memory_utilization, weights, activation_bytes,
                                                    graph_bytes))
        if best is None or (blocks, -weights) < (best[0], -best[2]):
            best = (blocks, spec, weights)
    assert best is not None
    return best[1], best[2]


def table_kv_dtypes(base: KVPlan) -> tuple[str, ...]:
    """The comparison table's rows: the weights' dtype first (the reference), fp8, int8, and the
    chosen KV dtype when it is none of those."""
    rows = [base.dtype, "fp8", "int8"]
    if base.kv_dtype not in rows:
        rows.append(base.kv_dtype)
    return tuple(rows)
