"""Command line: ``tokenmill generate | chat | serve | bench``.

Every :class:`~tokenmill.config.EngineConfig` field is also an option (``--max-running-requests``), its
help the field's docstring. ``generate`` and ``chat`` take the sampling settings the user does not give
from the model's ``generation_config.json`` (vLLM's ``--generation-config auto``), else from
:data:`SAMPLING_DEFAULTS`.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
import json
import logging
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from tokenmill.config import EngineConfig
from tokenmill.request import SamplingParams
from tokenmill.server.limits import ConnectionLimits


class FieldDoc(NamedTuple):
    section: str
    """The ``# comment`` heading the field's block in the class ("" for the fields above the first)."""
    text: str
    """The field's attribute docstring (the string literal under it), on one line."""


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """The section and docstring of each documented field of the dataclass ``cls``, read from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (class_def,) = ast.parse(source).body
    body = class_def.body
    docs, section = {}, ""
    for before, node, after in zip([class_def, *body], body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        gap = lines[(before.end_lineno if before is not class_def else class_def.lineno) : node.lineno - 1]
        comments = [line.strip().lstrip("#").strip() for line in gap if line.strip().startswith("#")]
        if comments:
            section = comments[0].split(" (")[0]
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = FieldDoc(section, " ".join(after.value.value.split()))
    return docs


def _help(text: str, default: Any) -> str:
    """argparse help: ``text`` (``%`` escaped) and the default."""
    return f"{text.replace('%', '%%')} (default: {default})"


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if flag in parser._option_string_actions:  # a sampling option of the same name (--seed) serves both
            continue
        doc = docs.get(f.name, FieldDoc("", ""))
        title = f"engine options: {doc.section or 'model'}"
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        help_text = _help(doc.text, f.default) if doc.text else None
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=None, metavar=kind.__name__.upper(), help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the options given on the command line (others keep their defaults)."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in given.items() if v is not None})


def _add_connection_limit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection limits")
    hints = typing.get_type_hints(ConnectionLimits)
    for f in dataclasses.fields(ConnectionLimits):
        help_text = _help(f.metadata["help"], f.default)
        kind = hints[f.name]
        group.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=None, metavar=kind.__name__.upper(), help=help_text
        )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """ConnectionLimits from the options given on the command line (others keep their defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ConnectionLimits)}
    return ConnectionLimits(**{k: v for k, v in given.items() if v is not None})


SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_tokens": 128,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
"""``generate``/``chat`` sampling where neither the user nor the model's generation_config.json sets it (greedy)."""
GENERATION_CONFIG_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
"""generation_config.json key -> SamplingParams name: the sampling defaults a model may set (as vLLM reads them)."""
SAMPLING_HELP = {
    "max_tokens": "most tokens to generate",
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "sample from the smallest set of tokens whose probabilities add up to this",
    "top_k": "sample from this many most likely tokens; 0 for all",
    "min_p": "drop tokens less likely than this fraction of the most likely one",
    "repetition_penalty": "penalize tokens already in the prompt or output by this factor (1 is off)",
}


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling options",
        "An option not given takes the model's generation_config.json value, else the default shown.",
    )
    for name, default in SAMPLING_DEFAULTS.items():
        kind = type(default)
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            metavar=kind.__name__.upper(),
            help=_help(SAMPLING_HELP[name], default),
        )
    group.add_argument("--seed", type=int, default=None, help=_help("seed of the sampling and of the engine", None))
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def model_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling settings the model's ``generation_config.json`` sets, by SamplingParams name ({} without one)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {name: config[key] for key, name in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}


def _sampling_params(args: argparse.Namespace, model_dir: Path) -> SamplingParams:
    """The user's sampling options, the model's defaults for the others (named in one line on stderr), else ours."""
    given = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None}
    from_model = {k: v for k, v in model_sampling_defaults(model_dir).items() if k not in given}
    if from_model:
        used = ", ".join(f"{name}={value}" for name, value in from_model.items())
        print(f"sampling defaults from the model's generation_config.json: {used}", file=sys.stderr)
    return SamplingParams(**(SAMPLING_DEFAULTS | from_model | given), seed=args.seed, stop=args.stop)


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

    config = engine_config(args)
    params = _sampling_params(args, config.model_path())
    engine = Engine(config)
    try:
        print(args.prompt, end="", flush=True)
        asyncio.run(_stream(engine, args.prompt, params))
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import Engine

    config = engine_config(args)
    params = _sampling_params(args, config.model_path())
    engine = Engine(config)
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
            reply = asyncio.run(_stream(engine, prompt, params))
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()


CORS_OPTIONS = {  # run_server's CORS parameter -> what it lists, and its default
    "allowed_origins": ("origins browsers may call the server from, '*' for any", "none, CORS off"),
    "allowed_methods": ("HTTP methods allowed from those origins", "*"),
    "allowed_headers": ("request headers allowed from those origins", "*"),
}


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.distributed.group import launched_place
    from tokenmill.server.lifecycle import run_server

    place = launched_place()
    if place is not None and place.rank > 0:  # torchrun started every rank: rank 0 serves, the others are workers
        from tokenmill.distributed.worker_process import launched_worker_main

        launched_worker_main(engine_config(args))  # exits the process once rank 0 stops it
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
        **{name: getattr(args, name) for name in CORS_OPTIONS if getattr(args, name)},
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
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    _add_sampling_options(chat)
    _add_engine_options(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server",
        description="Under torchrun (tensor parallelism over machines) rank 0 serves and the other ranks run workers.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: folder name)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or x-api-key)")
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="a request body larger than this gets 413 (default: %(default)s)",
    )
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
    for name, (what, default) in CORS_OPTIONS.items():
        serve.add_argument(
            "--" + name.replace("_", "-"),
            action="extend",
            type=lambda value: [part.strip() for part in value.split(",") if part.strip()],
            metavar="LIST",
            help=f"CORS: {what}; repeatable or comma-separated (default: {default})",
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
