"""EngineConfig: every engine setting, validated once at the edge with messages a user can act on."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache.spec import default_block_size

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
BACKENDS = ("auto", "triton", "torch")
MAX_SCHEDULER_STEPS = 16


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
    cpu_kv_cache_gib: float = 2.0
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
    # decode steps per scheduling round while only greedy decodes run and nothing waits
    # (scheduler/policy.py Scheduler._steps); needs the decode graphs, else 1
    num_scheduler_steps: int = 4
    seed: int = 0

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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            positive(name)
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
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
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError("cpu_kv_cache_gib must be > 0")
        if (isinstance(self.prefill_hold_ms, bool) or not isinstance(self.prefill_hold_ms, (int, float))
                or not 0 <= self.prefill_hold_ms <= 10_000):
            raise ValueError(f"prefill_hold_ms must be a number of milliseconds in [0, 10000]; got {self.prefill_hold_ms!r}")
