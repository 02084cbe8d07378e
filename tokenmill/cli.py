"""Command line: ``tokenmill generate | chat | serve | bench``.

Every :class:`~tokenmill.config.EngineConfig` field is also an option (``--max-running-requests``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import types
import typing
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.request import SamplingParams
from tokenmill.server.limits import ConnectionLimits


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if flag in parser._option_string_actions:  # a sampling option of the same name (--seed) serves both
            continue
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, type=kind, default=None, metavar=kind.__name__.upper())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the options given on the command line (others keep their defaults)."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in given.items() if v is not None})


def _add_connection_limit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection limits")
    hints = typing.get_type_hints(ConnectionLimits)
    for f in dataclasses.fields(ConnectionLimits):
        help_text = f"{f.metadata['help']} (default: {f.default})"
        kind = hints[f.name]
        group.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=None, metavar=kind.__name__.upper(), help=help_text
        )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """ConnectionLimits from the options given on the command line (others keep their defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ConnectionLimits)}
    return ConnectionLimits(**{k: v for k, v in given.items() if v is not None})


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )


async def _stream(engine: Any, prompt: str | list[int], params: SamplingParams) -> str:
    from tokenmill.engine.async_engine import AsyncEngine

    text = []
    async for delta in AsyncEngine(engine).generate(prompt, params):
        for out in delta.outputs:
            print(out.text, end="", flush=True)
            text.append(out.text)
            if out.error:
                raise RuntimeError(out.error)
    print(flush=True)
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import Engine

    engine = Engine(engine_config(args))
    try:
        print(args.prompt, end="", flush=True)
        asyncio.run(_stream(engine, args.prompt, _sampling_params(args)))
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import Engine

    engine = Engine(engine_config(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    turns = list(args.message) if args.message else None
    try:
        while True:
            if turns is not None:
                if not turns:
                    return 0
                user = turns.pop(0)
            else:
                try:
                    user = input("> ")
                except EOFError:
                    return 0
            messages.append({"role": "user", "content": user})
            prompt = engine.tokenizer.apply_chat_template(messages)
            reply = asyncio.run(_stream(engine, prompt, _sampling_params(args)))
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.lifecycle import run_server

    grace = {} if args.shutdown_grace_seconds is None else {"shutdown_grace_seconds": args.shutdown_grace_seconds}
    run_server(
        engine_config(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        allowed_weight_roots=args.allowed_weight_roots,
        limits=connection_limits(args),
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        **grace,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return args.bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    gen.add_argument("prompt")
    _add_sampling_options(gen)
    _add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive, or --message for one turn)")
    chat.add_argument("--message", action="append", default=None, help="a user turn (repeatable); else stdin")
    chat.add_argument("--system", default=None)
    _add_sampling_options(chat)
    _add_engine_options(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: folder name)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or x-api-key)")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    serve.add_argument(
        "--allowed-weight-roots",
        nargs="+",
        default=[],
        metavar="DIR",
        help="folders POST /update_weights_from_disk may load checkpoints from (default: none)",
    )
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=None,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted (default: 10)",
    )
    serve.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="tokenize special-token text typed in chat messages as control tokens (default: as plain text)",
    )
    _add_connection_limit_options(serve)
    _add_engine_options(serve)
    serve.set_defaults(func=cmd_serve)

    from tokenmill.bench import serve as bench_serve
    from tokenmill.bench import throughput as bench_throughput

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, module in (("throughput", bench_throughput), ("serve", bench_serve)):
        doc = module.__doc__ or ""
        sub_bench = bench.add_parser(
            name, help=doc.splitlines()[0], description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(sub_bench)
        sub_bench.set_defaults(func=cmd_bench, bench_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")  # warnings from everyone, on stderr
    logging.getLogger("tokenmill").setLevel(logging.INFO)  # and tokenmill's start-up facts
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
