"""`serve generate`: offline generation from the command line."""
from __future__ import annotations

import argparse

from scheduler.request import SamplingParams
from serve.chat_template import resolve_chat_template
from serve.cli_args import add_engine_arguments, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="for --chat, a Jinja chat template in place of the tokenizer's: a file, or the template itself")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--lora", default=None, metavar="NAME|FOLDER",
                   help="generate with a LoRA adapter: a --lora-modules name, or a PEFT folder")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos,
                            seed=args.seed if args.temperature > 0 else None)
    if args.lora is not None and args.lora not in {name for name, _ in args.lora_modules}:
        args.lora_modules = [*args.lora_modules, (args.lora, args.lora)]  # a folder: its own name
    cfg = engine_config_from_args(args)
    template = None if args.chat_template is None else resolve_chat_template(args.chat_template)
    if template is not None and not args.chat:
        raise ValueError("--chat-template applies to --chat prompts; add --chat")
    from serve.build import is_follower_rank, run_follower
    from serve.llm import LLM  # torch is imported only once the arguments are known to be good

    if is_follower_rank(cfg):  # under torchrun: rank 0 generates, this rank follows its steps
        run_follower(cfg)
        return 0
    llm = LLM.from_config(cfg, show_progress=True)
    if args.chat:
        prompts = []
        for text in args.prompts:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
            prompts.append(llm.chat_prompt(msgs, template))
    else:
        prompts = args.prompts
    outputs = llm.generate(prompts, params, lora_request=args.lora)
    for prompt, out in zip(args.prompts, outputs):
        if len(outputs) > 1:
            print(f"### {prompt}")
        print(out.text)
    return 0
