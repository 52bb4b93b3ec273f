"""Assemble an engine from an EngineConfig: model folder -> config -> runner -> tokenizer -> core."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, ModelConfig, ModelConfigError
from scheduler.core import EngineCore
from scheduler.policy import SchedulerConfig

if TYPE_CHECKING:  # torch: imported by build_engine only, so that `--engine-loop process` keeps it out of the server
    from engine.runner import ModelRunner

log = logging.getLogger("pagedserve")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Engine:
    core: EngineCore
    runner: ModelRunner
    tokenizer: Any
    model_config: ModelConfig
    model_name: str
    config: EngineConfig

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.runner.kv_spec.block_size

    def shutdown(self) -> None:
        """Stop what the engine started besides this process (tensor-parallel ranks)."""
        self.core.close()


class TokenIdTokenizer:
    """Stand-in for model folders without tokenizer files (dummy-weight benchmarks): prompts must
    be token ids, and each generated id decodes to ' <id>'."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._table: list[bytes] | None = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)

    def token_bytes_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's text on its own, for the detokenizer's fast path (scheduler/token_bytes.py);
        None when the vocabulary size is not known."""
        if self._table is None and self.vocab_size is not None:
            self._table = [f" {i}".encode() for i in range(self.vocab_size)]
        return self._table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("this model folder has no tokenizer: send prompts as token ids")

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        raise ValueError("this model folder has no tokenizer: send prompts as token ids")


def resolve_model_path(cfg: EngineConfig, show_progress: bool = True) -> Path:
    if cfg.model is None:
        from engine.default_model import default_model_path
        return default_model_path(quiet=not show_progress)
    p = Path(cfg.model).expanduser()
    if not p.exists() and cfg.load_format == "dummy":
        from engine.default_model import cache_dir
        from engine.presets import preset_folder

        folder = preset_folder(cfg.model, cache_dir() / "presets")
        if folder is not None:
            return folder
    if p.is_file() and p.name.endswith(".json"):
        if cfg.load_format != "dummy":
            raise ModelConfigError(f"{p} is a config file: pass its folder, or add --load-format dummy for random weights")
        return p.parent
    if not p.is_dir():
        from engine.presets import find_model_preset

        hint = ""
        preset = find_model_preset(cfg.model)
        if preset is not None and cfg.load_format != "dummy":
            hint = f"; {cfg.model!r} names the preset shape {preset.name}: add --load-format dummy to serve it with random weights"
        raise ModelConfigError(f"model folder {cfg.model!r} not found (pagedserve loads local Hugging Face folders; "
                               f"it never downloads){hint}")
    return p


def load_tokenizer(path: Path, vocab_size: int | None = None) -> Any:
    """The folder's tokenizer, or a TokenIdTokenizer (of vocab_size ids, if given) when it has none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return TokenIdTokenizer(vocab_size)
    return tokenizer_class(path).from_pretrained(str(path))


def tokenizer_class(path: Path) -> Any:
    """The class tokenizer_config.json names (its fast variant first, as AutoTokenizer picks),
    imported alone; else AutoTokenizer. AutoTokenizer's module pulls in transformers' model and
    generation code, and with it torch._dynamo and scikit-learn: 9 s on the H100 machines
    (2026-11-26, lab/startup_profile.py --imports), which no tokenizer uses."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name,) if name.endswith("Fast") else (name + "Fast", name):
            try:
                cls = getattr(transformers, candidate)
            except (AttributeError, ImportError):  # not in this version; a lazy name that fails to import
                continue
            if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
                return cls
    from transformers import AutoTokenizer
    return AutoTokenizer


def eos_token_ids(path: Path, model_cfg: ModelConfig, tokenizer: Any) -> frozenset[int]:
    ids = set(model_cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def model_folder_config(cfg: EngineConfig, show_progress: bool = True) -> tuple[Path, ModelConfig]:
    """The model folder and its config, checked against the tensor- and pipeline-parallel sizes."""
    path = resolve_model_path(cfg, show_progress)
    model_cfg = ModelConfig.from_path(path)
    model_cfg.check_tensor_parallel(cfg.tensor_parallel_size, cfg.enable_expert_parallel)
    model_cfg.check_pipeline_parallel(cfg.pipeline_parallel_size)
    model_cfg.check_quantization(cfg.quantization)
    return path, model_cfg


def resolve_model(cfg: EngineConfig, show_progress: bool = True) -> tuple[Path, ModelConfig, int]:
    """The model folder, its config and the context length the runner is built for."""
    path, model_cfg = model_folder_config(cfg, show_progress)
    max_len = model_cfg.max_context_len
    if cfg.max_model_len is not None:
        if cfg.max_model_len > max_len:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's context length {max_len}")
        max_len = cfg.max_model_len
    return path, model_cfg, max_len


def resolve_draft(cfg: EngineConfig, model_cfg: ModelConfig, show_progress: bool = True
                  ) -> tuple[ModelConfig, Path] | None:
    """Speculative decoding's draft model (speculative_config's "model"): its config and folder,
    checked against the target's; None without one."""
    spec = cfg.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    if cfg.pipeline_parallel_size > 1:
        raise ValueError("a draft model with pipeline parallelism is not supported yet; use n-gram drafts "
                         '(speculative_config {"method": "ngram", ...}) or tensor parallelism')
    assert spec.model is not None
    try:
        path = resolve_model_path(dataclasses.replace(cfg, model=spec.model), show_progress)
        draft_cfg = ModelConfig.from_path(path)
        draft_cfg.check_quantization(cfg.quantization)
    except ModelConfigError as e:
        raise ModelConfigError(f"speculative_config's draft model: {e}") from None
    model_cfg.check_draft(draft_cfg, spec.model)
    return draft_cfg, path


def is_follower_rank(cfg: EngineConfig) -> bool:
    """A rank other than 0 of a tensor-parallel engine that a launcher (torchrun) started: it serves
    nothing itself, it follows rank 0 (run_follower)."""
    return (cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
            and os.environ.get("RANK", "0") != "0")


def run_follower(cfg: EngineConfig) -> None:
    from engine.parallel.worker import follow_from_env

    path, model_cfg, max_len = resolve_model(cfg, show_progress=False)
    follow_from_env(model_cfg, path, cfg, max_len)


def build_engine(cfg: EngineConfig, show_progress: bool = True, core_class: type[EngineCore] = EngineCore) -> Engine:
    """core_class: EngineCore, or a role of disaggregated serving (scheduler/disagg.py)."""
    from concurrent.futures import ThreadPoolExecutor

    path, model_cfg, max_len = resolve_model(cfg, show_progress)
    if model_cfg.headless:
        log.warning("%s is a base model without an LM head (an embedding model): it serves embeddings; text it "
                    "generates comes from its embedding tied as the head", path)
    draft = resolve_draft(cfg, model_cfg, show_progress)  # before any rank starts
    # The tokenizer (with transformers' import, 1-3 s) loads on a thread while the runner builds,
    # whose start-up mostly waits on the device with the GIL released.
    loader = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    tokenizer = loader.submit(load_tokenizer, path, model_cfg.vocab_size)
    loader.shutdown(wait=False)
    if cfg.tensor_parallel_size > 1 or cfg.pipeline_parallel_size > 1:
        from engine.parallel.executor import start_tensor_parallel

        executor = start_tensor_parallel(model_cfg, path, cfg, max_len, show_progress, draft)
        try:
            return _assemble(cfg, path, model_cfg, max_len, executor.runner, executor, tokenizer.result(), core_class)
        except BaseException:
            executor.close()
            raise
    from engine.runner import ModelRunner

    runner = ModelRunner(model_cfg, path, cfg, max_len, show_progress, draft=draft)
    return _assemble(cfg, path, model_cfg, max_len, runner, runner, tokenizer.result(), core_class)


def _assemble(cfg: EngineConfig, path: Path, model_cfg: ModelConfig, max_len: int, runner: ModelRunner,
              executor: Any, tokenizer: Any, core_class: type[EngineCore] = EngineCore) -> Engine:
    """The core around a built runner; executor: the runner, or the tensor-parallel executor around it."""
    capacity = runner.num_blocks * cfg.block_size
    if capacity < max_len and cfg.num_kv_blocks is None:
        log.warning("the KV cache holds %d tokens, less than the context length %d; lowering max_model_len", capacity, max_len)
        max_len = capacity
    log.debug("start-up: the engine's tokenizer loaded")
    steps = runner.num_scheduler_steps
    if cfg.num_scheduler_steps is not None and cfg.num_scheduler_steps > steps:
        log.warning("num_scheduler_steps %d needs the decode CUDA graphs (a GPU, no --enforce-eager); running %d",
                    cfg.num_scheduler_steps, steps)
    core = core_class(executor, tokenizer,
                      SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len, cfg.enable_prefix_caching,
                                      cfg.prefill_hold_ms / 1e3, steps, runner.prompt_budget,
                                      runner.prompt_budget is not None and runner.cost_model.pipelined,
                                      cfg.speculative_config, cfg.lora_modules, cfg.enable_lora,
                                      getattr(runner, "speculation_ratio", None)),
                      runner.num_blocks, cfg.block_size, eos_token_ids(path, model_cfg, tokenizer))
    if getattr(runner, "offload", None) is not None:
        if core_class is not EngineCore:
            raise ValueError("kv_offload_gib is not supported with disaggregated prefill/decode yet; drop --kv-offload-gib")
        from kvcache.host_pool import layout_key
        from kvcache.host_tier import HostTier

        core.block_manager.attach_host(HostTier(runner.host_blocks, cfg.block_size, layout_key(runner.pool),
                                                runner.kv_spec.bytes_per_block))
    from engine.grammar_mask import build_grammar_masks

    if executor is runner:
        runner.grammar = build_grammar_masks(tokenizer, model_cfg.vocab_size, core.eos_token_ids, runner.device)
    else:  # every rank that samples masks its own rows
        executor.enable_grammar(tokenizer, model_cfg.vocab_size, sorted(core.eos_token_ids))
    name = path.name if cfg.model is not None else "SmolLM2-135M-Instruct"
    log.info("engine started in %.1f s (%s)", sum(runner.startup_s.values()),
             ", ".join(f"{k} {v:.1f} s" for k, v in runner.startup_s.items()))
    return Engine(core, runner, tokenizer, model_cfg, name, cfg)


