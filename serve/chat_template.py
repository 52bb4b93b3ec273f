"""`serve run --chat-template`: a Jinja chat template that replaces the tokenizer's, given as a file
or as the template itself (vLLM's two forms). Base models ship none, and a fine-tune's may differ
from the one it was trained with."""
from __future__ import annotations

from pathlib import Path

# a value with any of these is a template, never a file name
TEMPLATE_MARKS = ("{", "}", "\n")


def resolve_chat_template(value: str) -> str:
    """The template text of --chat-template's value, checked to parse."""
    if any(mark in value for mark in TEMPLATE_MARKS):
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template: no file {value!r} (give a Jinja template file, or the template "
                             "itself)")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    try:
        check_chat_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return text


def check_chat_template(text: str) -> None:
    """A ValueError, with the line, where the template is empty or does not parse (as transformers
    compiles it: a sandboxed Jinja environment)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not text.strip():
        raise ValueError("the chat template is empty")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None
