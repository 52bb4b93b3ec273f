"""The `serve` command: run | generate | bench | kv-calc."""
from __future__ import annotations

import argparse
import importlib
import sys

from serve.cli_args import OneLineErrorParser

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "run": ("serve.run_cmd", "start the OpenAI-compatible HTTP server"),
    "generate": ("serve.generate_cmd", "generate text offline from prompts"),
    "bench": ("bench.cli", "load-test a server and compare with the roofline bound"),
    "kv-calc": ("serve.kv_calc_cmd", "size the KV cache for a model and GPU"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="serve", description="pagedserve: a small LLM inference server")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


class UserError(Exception):
    """Raised for problems the user can fix; printed as one line."""


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands' modules import
        return 130
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, UserError, RuntimeError) as e:
        print(f"serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
