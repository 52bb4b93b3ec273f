"""What a quantized KV cache costs in accuracy: `serve kv-calc --accuracy`.

The model reads a text once per KV storage dtype, through the paged cache in chunks as chunked
prefill does: each chunk writes its K/V into the pages (quantized on write for fp8/int8) and
attends to the whole cached prefix read back from the pages, its own tokens included. Logits are
kept for every position. Against the bf16 cache (the reference) each dtype gets, over the
positions that have a next token in the text:

    KL      KL(p_bf16 || p_dtype) per position: mean and max
    top-1   fraction of positions where argmax p_dtype == argmax p_bf16
    ppl     exp(mean negative log-likelihood of the text's next token) under p_dtype

Weights and activations stay in float32 on the CPU, so the dtypes differ only in how K and V are
stored. All dtypes advance chunk by chunk in lockstep, so only one chunk's logits per dtype are
ever held (the full-vocabulary logits of a whole text would not fit comfortably).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.nn import functional as F

from engine.attention import AttnMetadata, Ops
from engine.models.llama import LlamaForCausalLM
from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec

REFERENCE_KV_DTYPE = "bfloat16"
KV_DTYPES = ("bfloat16", "fp8", "int8", "float32")  # float32: an extra row, the cache without rounding
DEFAULT_CHUNK_SIZE = 256
DEFAULT_TEXT = Path(__file__).parent / "data" / "lighthouse_keepers_almanac.txt"
DEVICE = "cpu"  # float32 weights on the CPU: the report's numbers don't depend on a GPU's kernels


class AccuracyInputError(ValueError):
    """A text or model the report can't use; the message says what to change."""


@dataclass(frozen=True)
class KVDtypeAccuracy:
    kv_dtype: str
    bytes_per_token: int  # kvcache/spec.py's figure for this model, scales included
    mean_kl: float
    max_kl: float
    top1_agreement: float  # in [0, 1]
    perplexity: float


@dataclass(frozen=True)
class AccuracyReport:
    model_name: str
    text_name: str
    text_tokens: int  # tokens of the whole text
    num_tokens: int  # tokens fed to the model (the text truncated to the context length)
    max_context_len: int
    chunk_size: int
    rows: tuple[KVDtypeAccuracy, ...]
    reference: str = REFERENCE_KV_DTYPE
    weights_dtype: str = "float32"
    device: str = DEVICE

    @property
    def num_predictions(self) -> int:
        return self.num_tokens - 1

    @property
    def truncated(self) -> bool:
        return self.num_tokens < self.text_tokens

    def row(self, kv_dtype: str) -> KVDtypeAccuracy:
        for r in self.rows:
            if r.kv_dtype == kv_dtype:
                return r
        raise KeyError(kv_dtype)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [asdict(r) for r in self.rows]
        out["num_predictions"] = self.num_predictions
        out["truncated"] = self.truncated
        return out


@dataclass
class _Tally:
    """Running sums for one KV dtype over the chunks."""
    kl_sum: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    nll_sum: float = 0.0
    count: int = 0

    def add(self, kl: torch.Tensor, agree: torch.Tensor, nll: torch.Tensor) -> None:
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int(agree.sum())
        self.nll_sum += float(nll.sum())
        self.count += kl.numel()


@dataclass
class _Pass:
    """One KV dtype's pool and tally."""
    spec: KVCacheSpec
    pool: KVPool
    tally: _Tally = field(default_factory=_Tally)


def _chunk_metadata(start: int, end: int, block_table: torch.Tensor) -> AttnMetadata:
    """One sequence whose blocks are 0, 1, 2, ... so a token's slot is its position."""
    n = end - start
    return AttnMetadata(slot_mapping=torch.arange(start, end, dtype=torch.int64),
                        block_tables=block_table,
                        seq_lens=torch.tensor([end], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                        num_decode=0, max_query_len=n)


def check_inputs(num_tokens: int, chunk_size: int) -> None:
    if num_tokens < 2:
        raise AccuracyInputError(f"the text must have at least 2 tokens to predict one; it has {num_tokens}")
    if chunk_size < 1:
        raise AccuracyInputError(f"chunk size must be >= 1; got {chunk_size}")


@torch.inference_mode()
def measure(model: LlamaForCausalLM, ops: Ops, spec: KVCacheSpec, token_ids: Sequence[int],
            kv_dtypes: Sequence[str] = KV_DTYPES, chunk_size: int = DEFAULT_CHUNK_SIZE,
            show_progress: bool = False) -> tuple[KVDtypeAccuracy, ...]:
    """Feed token_ids through one paged cache per KV dtype; compare each with the bf16 cache.
    spec gives the cache's shape (its dtype is replaced per row). The model must hold rope
    tables for len(token_ids) positions."""
    from tqdm import tqdm

    n = len(token_ids)
    check_inputs(n, chunk_size)
    dtypes = list(dict.fromkeys([REFERENCE_KV_DTYPE, *kv_dtypes]))
    nblocks = spec.blocks_for_tokens(n)
    passes = {}
    for d in dtypes:
        s = replace(spec, dtype=d)
        passes[d] = _Pass(s, KVPool(s, nblocks, DEVICE))
    block_table = torch.arange(nblocks, dtype=torch.int32).unsqueeze(0)
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    starts = range(0, n, chunk_size)
    for start in tqdm(starts, desc="KV accuracy", unit="chunk", disable=not show_progress):
        end = min(n, start + chunk_size)
        meta = _chunk_metadata(start, end, block_table)
        rows = torch.arange(end - start)
        logits = {d: model(ops, ids[start:end], torch.arange(start, end), p.pool.layers, meta, rows)
                  for d, p in passes.items()}
        m = min(end, n - 1) - start  # positions with a next token; the text's last one has none
        if m == 0:
            continue
        targets = ids[start + 1:start + 1 + m].unsqueeze(1)
        # float64: the float32-vs-bf16 KL is ~1e-6, below float32's rounding of a 50k-term sum
        ref = F.log_softmax(logits[REFERENCE_KV_DTYPE][:m].double(), dim=-1)
        ref_p, ref_top = ref.exp(), ref.argmax(-1)
        for d, p in passes.items():
            logp = ref if d == REFERENCE_KV_DTYPE else F.log_softmax(logits[d][:m].double(), dim=-1)
            kl = (ref_p * (ref - logp)).sum(-1).clamp_min(0.0)  # exact 0 can round to -1e-17
            p.tally.add(kl, logp.argmax(-1) == ref_top, -logp.gather(1, targets).squeeze(1))
    return tuple(KVDtypeAccuracy(d, p.spec.bytes_per_token, p.tally.kl_sum / p.tally.count, p.tally.kl_max,
                                 p.tally.agree / p.tally.count, math.exp(p.tally.nll_sum / p.tally.count))
                 for d, p in passes.items())


def read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AccuracyInputError(f"text file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise AccuracyInputError(f"{str(path)!r} is a folder: --text takes a UTF-8 text file") from None
    except UnicodeDecodeError:
        raise AccuracyInputError(f"{str(path)!r} is not UTF-8 text") from None
    except OSError as e:
        raise AccuracyInputError(f"can't read {str(path)!r}: {e.strerror or e}") from None
    if not text.strip():
        raise AccuracyInputError(f"text file {str(path)!r} is empty: give a text of a few thousand tokens")
    return text


def run_accuracy(model: str | None = None, text_path: str | Path | None = None,
                 kv_dtypes: Sequence[str] = KV_DTYPES, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 show_progress: bool = False) -> AccuracyReport:
    """Load model (a local folder; None = the default model) in float32 on the CPU, tokenize the
    text (None = the shipped one) and measure every KV dtype against the bf16 cache."""
    from engine.config import EngineConfig, ModelConfig
    from engine.runner import ModelRunner
    from serve.build import TokenIdTokenizer, load_tokenizer, resolve_model_path

    path = DEFAULT_TEXT if text_path is None else Path(text_path)
    text = read_text(path)
    # a one-block pool: the runner's own cache goes unused, measure() makes one per dtype
    cfg = EngineConfig(model=model, dtype="float32", device=DEVICE, kv_cache_dtype="float32",
                       num_kv_blocks=1, enforce_eager=True, backend="torch", enable_prefix_caching=False)
    model_path = resolve_model_path(cfg, show_progress)
    model_cfg = ModelConfig.from_path(model_path)
    tokenizer = load_tokenizer(model_path)
    if isinstance(tokenizer, TokenIdTokenizer):
        raise AccuracyInputError(f"{model_path} has no tokenizer files; the accuracy report needs one to read the text")
    ids = list(tokenizer.encode(text))
    max_len = model_cfg.max_context_len
    fed = ids[:max_len]
    check_inputs(len(fed), chunk_size)  # before loading the weights
    runner = ModelRunner(model_cfg, model_path, cfg, len(fed), show_progress)
    rows = measure(runner.model, runner.ops, runner.kv_spec, fed, kv_dtypes, chunk_size, show_progress)
    name = model_path.name if model is not None else "SmolLM2-135M-Instruct"
    text_name = f"{path.name} (shipped)" if text_path is None else str(text_path)
    return AccuracyReport(name, text_name, len(ids), len(fed), max_len, chunk_size, rows)


def format_table(report: AccuracyReport) -> str:
    r = report
    cut = (f", truncated from {r.text_tokens:,} to the model's {r.max_context_len:,}-token context"
           if r.truncated else "")
    lines = [
        f"KV-cache accuracy: {r.model_name} on {r.text_name}",
        f"  {r.num_tokens:,} tokens{cut}, fed in chunks of {r.chunk_size} through the paged cache; "
        f"{r.num_predictions:,} next-token predictions",
        f"  weights and activations {r.weights_dtype} on the {r.device}: the rows differ only in how K and V are stored",
        f"  KL = KL(p_{r.reference} || p_row) per position; top-1 = argmax equal to the {r.reference} cache's",
        "",
        f"  {'KV dtype':<10}{'bytes/token':>12}{'mean KL':>12}{'max KL':>12}{'top-1 agree':>13}{'perplexity':>12}",
    ]
    for row in r.rows:
        note = "  (reference)" if row.kv_dtype == r.reference else ""
        lines.append(f"  {row.kv_dtype:<10}{row.bytes_per_token:>12,}{row.mean_kl:>12.2e}{row.max_kl:>12.2e}"
                     f"{row.top1_agreement:>12.2%} {row.perplexity:>12.3f}{note}")
    return "\n".join(lines)


def format_json(report: AccuracyReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
