"""Tiny random-weight Hugging Face checkpoints built inside the tests (no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Once upon a time there was a small engine that served many requests at once.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Hello, world! How are you today? I am fine, thank you.",
    "naïve café résumé — unicode text: 北京, Москва, 東京 🚀✨",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB = 384


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


ARCHS = {
    # Llama: GQA, tied embeddings, Llama-3.1 rope scaling
    "llama": dict(cls="LlamaConfig", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen2: qkv bias, untied
    "qwen2": dict(cls="Qwen2Config", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    # Qwen3: q/k norm, explicit head_dim != hidden / heads
    "qwen3": dict(cls="Qwen3Config", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False),
    # Mistral: no GQA here, sharded checkpoint
    "mistral": dict(cls="MistralConfig", num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
                    tie_word_embeddings=False),
    # Qwen3-MoE: 8 experts, top 3 renormalized, layer 1 dense (mlp_only_layers), q/k norm
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    # Qwen2-MoE: 8 experts, top 2 not renormalized, a gated shared expert of width 48, layer 1 dense
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1], qkv_bias=True),
    # Mixtral: 4 experts of width 48, top 2
    "mixtral": dict(cls="MixtralConfig", num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                    tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
}


def build_model(arch: str, out: Path, seed: int = 0, shard: bool | None = None, **sizes) -> Path:
    """Save a 2-layer random model of `arch` with a trained BPE tokenizer into out; return out.
    sizes: config fields over the defaults (hidden_size=256, ...)."""
    import transformers

    spec = dict(ARCHS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    cfg = cls(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0), **spec, **sizes})
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomize so loading is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="300KB" if (shard if shard is not None else arch == "mistral") else "1GB")
    build_tokenizer(out)
    return out


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' own greedy generate, one prompt at a time (no padding), ignoring EOS."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model_greedy(model, prompts, max_new_tokens)


def model_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy with a transformers model already built (its weights replaced, say)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs
