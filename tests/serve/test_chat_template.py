"""`serve run --chat-template` (serve/chat_template.py): a file or the template itself, checked at
start-up, in place of the tokenizer's for every chat request; LLM.chat_prompt(chat_template=...)."""
from __future__ import annotations

import pytest

from scheduler.request import SamplingParams

# a template unlike the tiny model's own (tests/models.py CHAT_TEMPLATE)
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
RENDERED = "[system] Be brief.\n[user] Name a capital.\n[assistant] "


def test_a_file_or_the_template_itself(tmp_path):
    from serve.chat_template import resolve_chat_template

    f = tmp_path / "brackets.jinja"
    f.write_text(BRACKETS)
    assert resolve_chat_template(str(f)) == resolve_chat_template(BRACKETS) == BRACKETS
    with pytest.raises(ValueError, match="--chat-template: no file 'nope.jinja'"):
        resolve_chat_template("nope.jinja")
    with pytest.raises(ValueError, match=r"does not parse \(line 2: "):
        resolve_chat_template("{{ messages }}\n{% for m in messages %}")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        resolve_chat_template(str(tmp_path / "empty.jinja"))
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_chat_template(str(tmp_path / "binary.jinja"))


def test_the_planner_renders_with_it(model_dir):
    from transformers import AutoTokenizer

    from serve.errors import APIError
    from serve.prompts import RequestPlanner
    from serve.protocol import ChatCompletionRequest
    from serve.server_config import ServerConfig

    req = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    own = tok.decode(RequestPlanner(tok, 384, 4096, ServerConfig()).chat(req).prompts[0].token_ids)
    assert own != RENDERED
    plan = RequestPlanner(tok, 384, 4096, ServerConfig(chat_template=BRACKETS)).chat(req)
    assert tok.decode(plan.prompts[0].token_ids) == RENDERED
    # a folder whose tokenizer has none: a 400 without the option, served with it
    bare = AutoTokenizer.from_pretrained(str(model_dir))
    bare.chat_template = None
    with pytest.raises(APIError, match="no chat template"):
        RequestPlanner(bare, 384, 4096, ServerConfig()).chat(req)
    plan = RequestPlanner(bare, 384, 4096, ServerConfig(chat_template=BRACKETS)).chat(req)
    assert bare.decode(plan.prompts[0].token_ids) == RENDERED
    # the tool-call format follows the template the server uses
    llama3 = "{{ '<|python_tag|>' if tools else '' }}" + BRACKETS
    assert RequestPlanner(tok, 384, 4096, ServerConfig(chat_template=llama3)).tool_parser == "llama3_json"
    with pytest.raises(ValueError, match="empty"):
        ServerConfig(chat_template=" ")


def test_the_developer_role_is_the_system_role_for_templates_without_it(model_dir):
    """OpenAI's "developer" messages (its newer name for system ones): as system for a template that
    knows no such role, as they are for one that does."""
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner
    from serve.protocol import ChatCompletionRequest
    from serve.server_config import ServerConfig

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "Be brief."},
                                                             {"role": "user", "content": "Hi"}]})
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.decode(RequestPlanner(tok, 384, 4096, ServerConfig()).chat(req).prompts[0].token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    knows = "{% for m in messages %}{{ 'DEV:' if m.role == 'developer' else m.role + ':' }}{{ m.content }}\n{% endfor %}"
    text = tok.decode(RequestPlanner(tok, 384, 4096, ServerConfig(chat_template=knows)).chat(req).prompts[0].token_ids)
    assert text.startswith("DEV:Be brief.")


def test_a_bad_value_is_one_line_on_the_cli(model_dir, tmp_path, capsys):
    from serve.cli import main

    for value, says in (("nope.jinja", "no file 'nope.jinja'"), ("{% if %}", "does not parse (line 1")):
        assert main(["run", "--model", str(model_dir), "--device", "cpu", "--chat-template", value]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("serve run: error: --chat-template: ") and says in err and "\n" not in err


def test_served_and_offline(model_dir):
    """Over HTTP the reply and its prompt tokens are those of the offline engine given the same
    template (LLM.chat_prompt(chat_template=...), LLM.chat)."""
    import openai

    from serve.llm import LLM
    from serve.server_config import ServerConfig
    from tests.serve.helpers import ServerThread, build, engine_config

    offline = LLM.from_config(engine_config(model_dir))
    ids = offline.chat_prompt(MESSAGES, chat_template=BRACKETS)
    assert offline.tokenizer.decode(ids) == RENDERED
    want = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    with pytest.raises(ValueError, match="does not parse"):
        offline.chat_prompt(MESSAGES, chat_template="{% for %}")
    with ServerThread(build(model_dir), ServerConfig(shutdown_timeout_s=1.0, chat_template=BRACKETS)) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=srv.state.model_name, messages=MESSAGES, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(ids)
    # vLLM's LLM.chat: one conversation, or several, rendered and answered the same way
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert offline.chat(MESSAGES, params, chat_template=BRACKETS)[0].text == want
    other = [{"role": "user", "content": "Name a capital."}]
    both = offline.chat([MESSAGES, other], params, chat_template=BRACKETS)
    assert [o.text for o in both] == [want, offline.generate([offline.chat_prompt(other, BRACKETS)], params)[0].text]
    go_on = other + [{"role": "assistant", "content": "Paris is"}]
    ids = offline.chat_prompt(go_on, add_generation_prompt=False, continue_final_message=True)
    assert offline.tokenizer.decode(ids).endswith("Paris is")  # the reply goes on from there


def test_serve_generate_chat(model_dir, capsys):
    from serve.cli import main
    from serve.llm import LLM
    from tests.serve.helpers import engine_config

    offline = LLM.from_config(engine_config(model_dir))
    msgs = [{"role": "user", "content": "Name a capital."}]
    want = offline.generate([offline.chat_prompt(msgs, chat_template=BRACKETS)],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
    engine = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]
    assert main(["generate", *engine, "--max-tokens", "6", "--ignore-eos", "--chat", "--chat-template", BRACKETS,
                 "Name a capital."]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", *engine, "--chat-template", BRACKETS, "Name a capital."]) == 2
    assert "add --chat" in capsys.readouterr().err
