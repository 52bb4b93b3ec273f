"""A reasoning model's thinking out of its answer, incrementally (`--reasoning-parser`): text in (any
split), (reasoning, content) pieces out, the same whatever the split, so streamed deltas assemble to
the non-streamed message's `reasoning` and `content`.

qwen3 and deepseek_r1 write the thinking between `<think>` and `</think>`, mistral between
`[THINK]` and `[/THINK]`:
- qwen3 (Qwen3, QwQ's newer templates): thinking only where the output opens it with `<think>`, or
  where the prompt left a `<think>` open (templates that write it for the model); with
  `chat_template_kwargs: {"enable_thinking": false}` the template closes it in the prompt and the
  whole output is the answer.
- deepseek_r1 (DeepSeek-R1 and its distills): the output starts in thinking (the template opens it
  in the prompt, a `<think>` the model writes itself is dropped) and an output that never writes
  `</think>` is all thinking.
- mistral (Magistral): as qwen3, with `[THINK]` and `[/THINK]`, special tokens of its tokenizer that
  the request keeps in its text for the parser (serve/prompts.py).
"""
from __future__ import annotations

from typing import Any

OPEN = "<think>"
CLOSE = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "mistral")
TAGS = {"qwen3": (OPEN, CLOSE), "deepseek_r1": (OPEN, CLOSE), "mistral": ("[THINK]", "[/THINK]")}
# parsers whose output thinks only where it (or the prompt) opens the thinking
OPENED_ONLY = ("qwen3", "mistral")


def _held(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag (held back until the next piece)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt: str, kind: str = "qwen3") -> bool:
    """The rendered prompt ends inside a thinking (`<think>`) it opened for the model."""
    opening, closing = TAGS[kind]
    return prompt.rfind(opening) > prompt.rfind(closing)


def prompt_closes_thinking(prompt: str, kind: str = "qwen3") -> bool:
    """The rendered prompt ends with a thinking it closed for the model (Qwen3's enable_thinking: false)."""
    return prompt.rstrip().endswith(TAGS[kind][1])


def think_token_ids(tokenizer: Any, kind: str = "qwen3") -> tuple[int, int] | None:
    """The ids of the thinking's tags (`<think>`, `</think>`) where each is one token of the vocabulary, else None."""
    ids = []
    for tag in TAGS[kind]:
        try:
            encoded = list(tokenizer.encode(tag, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the tags has no such tokens
            return None
        if len(encoded) != 1:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]


class ReasoningParser:
    def __init__(self, kind: str, opened: bool) -> None:
        """opened: the prompt left a <think> open (prompt_opens_thinking)."""
        if kind not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}; got {kind!r}")
        # start: "reasoning", "content", or "opening" (an output that may begin with <think>)
        self.open, self.close_tag = TAGS[kind]
        self.state = "reasoning" if opened or kind not in OPENED_ONLY else "opening"
        self.thought = self.state == "reasoning"  # the output has been in its thinking
        # deepseek_r1: a <think> the model writes itself at the start is not text
        self._drop_open = kind == "deepseek_r1" and not opened
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of output -> (reasoning, content) it completes."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            buf = self._buf
            if self.state == "opening":
                stripped = buf.lstrip()
                if stripped.startswith(self.open):
                    self._buf, self.state, self.thought = stripped[len(self.open):], "reasoning", True
                elif self.open.startswith(stripped):
                    break  # whitespace, or part of <think>: wait for more
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self._drop_open and buf.lstrip().startswith(self.open):
                    self._buf = buf.lstrip()[len(self.open):]
                    self._drop_open = False
                    continue
                if self._drop_open and self.open.startswith(buf.lstrip()):
                    break
                self._drop_open = False
                at = buf.find(self.close_tag)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self._buf, self.state = buf[at + len(self.close_tag):], "content"
                else:
                    keep = _held(buf, self.close_tag)
                    reasoning.append(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    break
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def close(self) -> tuple[str, str]:
        """The end of the output: what was held back, as what it turned out to be."""
        buf, self._buf = self._buf, ""
        if self.state == "reasoning":
            return buf, ""
        return "", buf


class ReasoningTokens:
    """A choice's output through its reasoning parser, step by step: `split` is the last step's
    (reasoning, content), which the stream sends, and `count` how many output tokens are the thinking
    (usage's reasoning_tokens). A step's tokens count while the thinking is open before or after its
    text, so the tokens of `<think>` and `</think>` count too (and what led up to a `<think>` that
    opens it). A step of several tokens (multi-step decoding) that closes the thinking counts whole."""

    def __init__(self, kind: str, opened: bool) -> None:
        self._parser = ReasoningParser(kind, opened)
        self._opening = 0  # tokens seen while the output may still open a thinking
        self.count = 0
        self.split = ("", "")

    def step(self, text: str, num_tokens: int, finished: bool = False) -> None:
        parser = self._parser
        counts = parser.state != "content"
        reasoning, content = parser.feed(text)
        if finished:
            more_reasoning, more_content = parser.close()
            reasoning, content = reasoning + more_reasoning, content + more_content
        self.split = (reasoning, content)
        if not counts:
            return
        if parser.state == "opening":
            self._opening += num_tokens
        elif parser.thought:  # in it, or left it during this step's text
            self.count += self._opening + num_tokens
            self._opening = 0


def split_reasoning(kind: str, opened: bool, text: str) -> tuple[str, str]:
    """A whole output -> (reasoning, content)."""
    parser = ReasoningParser(kind, opened)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.close()
    return r1 + r2, c1 + c2
