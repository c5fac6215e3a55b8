"""`specserve` command line: serve, generate, models, download, bench, soak, train-draft."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path

from .flags import GENERATE_FLAGS, LOG_FLAGS, MODEL_AND_ENGINE, SERVE_FLAGS
from .settings import (
    CliError,
    OneLineArgumentParser,
    add_flags,
    build_settings_class,
    engine_config_from,
    fail,
    parse_settings,
)

GENERATE_LOG_FLAGS = [f for f in LOG_FLAGS if f.name != "no_access_log"]  # no HTTP requests to log
GenerateSettings = build_settings_class(
    "GenerateSettings", MODEL_AND_ENGINE + GENERATE_FLAGS + GENERATE_LOG_FLAGS
)
ServeSettings = build_settings_class("ServeSettings", MODEL_AND_ENGINE + SERVE_FLAGS + LOG_FLAGS)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="specserve", description="Lossless speculative decoding behind an OpenAI-compatible API."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineArgumentParser)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_flags(serve, MODEL_AND_ENGINE + SERVE_FLAGS + LOG_FLAGS)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_flags(gen, MODEL_AND_ENGINE + GENERATE_FLAGS + GENERATE_LOG_FLAGS)
    sub.add_parser("models", help="list known models and whether each is cached")
    dl = sub.add_parser("download", help="fetch a known model into the cache")
    dl.add_argument("model_id", help="hub id, e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct")
    for name in ("bench", "soak"):
        p = sub.add_parser(name, help=f"{name} (see specserve {name} --help)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    train = sub.add_parser(
        "train-draft",
        help="train a Medusa draft head on the CPU (see specserve train-draft --help)",
        add_help=False,
    )
    train.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        if argv[:1] in (["bench"], ["soak"]):
            # Straight through: argparse's REMAINDER would reject a leading --option (`soak --duration`).
            from specserve.api import tools

            tools.main(argv[0], argv[1:])
            return
        if argv[:1] == ["train-draft"]:
            from specserve.api import train_draft

            train_draft.main(argv[1:])
            return
        args = parser.parse_args(argv)
        if args.version:
            from specserve import __version__

            print(__version__)
            return
        if args.command == "serve":
            run_serve(_with_logging(parse_settings(ServeSettings, args)))
        elif args.command == "generate":
            run_generate(_with_logging(parse_settings(GenerateSettings, args)))
        elif args.command == "models":
            run_models()
        elif args.command == "download":
            run_download(args.model_id)
        elif args.command in ("bench", "soak"):
            from specserve.api import tools

            tools.main(args.command, args.rest)
        else:
            parser.print_help()
            raise SystemExit(2)
    except CliError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _with_logging(settings):
    """Set up logging from --log-level / --log-format (or SPECSERVE_LOG_*) before anything logs."""
    from .logs import configure_logging

    try:
        configure_logging(settings.log_level, settings.log_format)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return settings


def _startup_errors() -> tuple[type[BaseException], ...]:
    from specserve.engine.memory import InsufficientMemoryError
    from specserve.engine.models.arch import UnsupportedArchitectureError
    from specserve.engine.models.errors import ModelLoadError
    from specserve.engine.models.weights import WeightLoadError
    from specserve.engine.proposer import ProposerError
    from specserve.engine.sampling_params import InvalidParameterError

    return (
        ModelLoadError,
        ProposerError,
        UnsupportedArchitectureError,
        WeightLoadError,
        InsufficientMemoryError,
        InvalidParameterError,
        ValueError,
        FileNotFoundError,
    )


def run_serve(settings) -> None:
    """Load the engine (a load failure is one error line, not a traceback), then serve until a signal."""
    import asyncio

    config = engine_config_from(settings)
    # Imported here, not at the top: the server's aiohttp stack is not needed by the other commands,
    # and the engine's torch not before the flags are known to be good.
    from specserve.engine.async_engine import AsyncEngine

    from .server import serve

    try:
        engine = AsyncEngine.build(config)  # on the thread its steps run on (engine/async_engine.py)
    except _startup_errors() as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    asyncio.run(serve(engine, settings))


def run_generate(settings) -> None:
    s = settings
    if s.prompt is None and s.prompt_file is None:
        raise CliError("give --prompt or --prompt-file")
    prompt = s.prompt if s.prompt is not None else _read(s.prompt_file)
    config = engine_config_from(s)
    # The engine (torch, transformers) only once the flags are known to be good.
    from specserve.engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            stop=[s.stop] if s.stop else [],
            ignore_eos=s.ignore_eos,
            seed=s.seed,
        )
        llm = LLM(config=config)
        out = llm.generate(prompt, params, use_chat_template=not s.no_chat_template)[0]
    except _startup_errors() as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    if s.output == "text":
        print(out.text)
        return
    decode_s = out.elapsed_s - (out.first_token_s or 0.0)
    spec = out.spec
    report = {
        "text": out.text,
        "token_ids": out.token_ids,
        "prompt_tokens": len(out.prompt_token_ids),
        "generated_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "elapsed_s": round(out.elapsed_s, 4),
        "time_to_first_token_s": round(out.first_token_s or 0.0, 4),
        "decode_tokens_per_s": round((len(out.token_ids) - 1) / decode_s, 3) if decode_s > 0 else None,
        "spec": {
            "method": llm.engine.proposer_name,
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "acceptance_rate": round(spec.acceptance_rate, 4),
            "mean_acceptance_length": round(spec.mean_acceptance_length, 4),
            "per_position_acceptance": [round(x, 4) for x in spec.per_position_acceptance()],
            "mean_k": round(spec.mean_k, 4),
        },
    }
    print(json.dumps(report))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read --prompt-file {path}: {exc.strerror}") from None


def run_models() -> None:
    from specserve.engine.models.loader import list_known_models

    for hub_id, carrier, cached in list_known_models(None):
        print(f"{hub_id:40s} {carrier:32s} {'cached' if cached else 'not cached'}")


def run_download(model_id: str) -> None:
    from specserve.engine.models.errors import ModelLoadError
    from specserve.engine.models.loader import download_model

    try:
        resolved = download_model(model_id, None)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    print(resolved.directory)


def run() -> None:
    """The `specserve` command (console script and `python -m specserve.api.cli`): `main`, then a
    quick exit. The interpreter's final garbage collection walks every object torch and transformers
    created (~0.6-1.4 s of a server's or generate's exit here); frozen, they are left to the process's
    exit. Threads are still joined, atexit handlers (log flushing) and destructors run as usual. Not
    part of `main`, which tests and scripts call in a process that goes on."""
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    run()
