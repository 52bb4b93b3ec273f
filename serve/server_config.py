"""ServerConfig: the HTTP server's settings and its limits on what one request may ask for."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serve.reasoning import REASONING_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None: the engine's model name
    model_aliases: tuple[str, ...] = ()  # more names requests may give the served model (responses name the first)
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <key>"
    max_waiting_requests: int = 1024  # sequences waiting for the engine before new ones get 429
    max_request_rate: float | None = None  # sequences admitted per second; None = unlimited
    shutdown_timeout_s: float = 10.0  # on SIGTERM, in-flight requests get this long, then are aborted
    max_body_bytes: int = 8 * 2**20
    max_n: int = 16  # choices per prompt
    max_sequences_per_request: int = 64  # prompts x n
    max_tokens_limit: int | None = None  # cap on max_tokens; None: the context length
    # Stop strings are matched on every generated token: bound the work one request can ask for.
    max_stop_strings: int = 8
    max_stop_string_chars: int = 128
    # the format of the model's tool calls: auto, hermes, llama3_json, mistral, qwen3_coder (serve/tools.py)
    tool_parser: str = "auto"
    reasoning_parser: str | None = None  # a reasoning model's thinking, split from its answer (serve/reasoning.py)
    grammar_timeout_s: float = 10.0  # a grammar or schema not compiled within this is refused (400)
    # request defaults from the model's generation_config.json (serve/generation_config.py): auto, vllm
    # (pagedserve's own), or a folder holding one
    generation_config: str = "auto"
    chat_template: str | None = None  # a Jinja chat template in place of the tokenizer's (serve/chat_template.py)
    allowed_origins: tuple[str, ...] = ()  # CORS: pages of these origins ("*": any) may call the API from a browser
    ssl_keyfile: str | None = None  # HTTPS: the server's private key and certificate (PEM files)
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_body_bytes", "max_n", "max_sequences_per_request",
                     "max_stop_strings", "max_stop_string_chars"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1; got {self.max_tokens_limit}")
        if self.max_request_rate is not None and not self.max_request_rate > 0:
            raise ValueError(f"max_request_rate must be > 0; got {self.max_request_rate}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0; got {self.shutdown_timeout_s}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got "
                             f"{self.reasoning_parser!r}")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).expanduser().is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a folder holding a generation_config.json; "
                             f"got {self.generation_config!r}")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both (or neither)")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"{name} {path!r} is not a file")
