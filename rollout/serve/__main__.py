"""Run the rollout service: `python -m rollout.serve --model DIR [options]`; `--help` lists them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from rollout.config import EngineConfig
from rollout.http.hosts import allowed_hosts, is_loopback
from rollout.request_limits import RequestLimits
from rollout.serve import API_KEY_ENV
from rollout.serve.key_file import KeyFile, write_generated_key
from rollout.serve.setting_flags import add_setting_flags, settings_from_args

logger = logging.getLogger("rollout.serve")

_MB = 1 << 20
# Longer than clients keep idle connections (RemoteRolloutEngine: 10 s; httpx's default: 5 s), so the
# server never closes a connection a client is about to reuse (uvicorn's default is 5 s).
KEEP_ALIVE_S = 60
# The fields of EngineConfig that are no flag of their own, and why; every other field is a flag
# made from its setting (name, type, default, help), which a test holds to.
NOT_ENGINE_FLAGS = {
    "request_limits": "a group of flags of its own, one per RequestLimits field (--max-inference-steps, ...)"
}


def build_parser() -> argparse.ArgumentParser:
    """The server's flags: the engine's come from `EngineConfig`'s and `RequestLimits`' settings."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout.serve",
        description="Serve a RolloutEngine over HTTP: rollouts with trajectories, weight and LoRA hot swaps, "
        "pause/resume. Routes and bodies are listed in docs/service.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine = parser.add_argument_group("engine (the fields of EngineConfig)")
    add_setting_flags(engine, EngineConfig, engine_flag_names())
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    server.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients reach the server by (its DNS name, a proxy's); requests whose Host header "
        "names neither it nor the bound address are refused. Repeatable",
    )
    auth = server.add_mutually_exclusive_group()
    auth.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}, else a "
        "key generated at start and written to --api-key-file; prefer the variable: a flag shows in the process "
        "list)",
    )
    auth.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without a key, to every program on this machine (loopback binds only)",
    )
    server.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="where a generated key is written, readable by this user only, and removed at exit "
        "(default: $XDG_RUNTIME_DIR/diffusion-rollout/serve-PORT.key, else ~/.cache/diffusion-rollout/...)",
    )
    server.add_argument(
        "--rpc-allow",
        action="append",
        default=[],
        metavar="METHOD",
        help="a worker function that may change state (the engine's own, such as sleep or load_lora, or one of "
        "--worker-extension-cls not marked @read_only) which /collective_rpc may call by name anyway; by default "
        "it calls only the functions marked read-only (the engine's routes keep its record of weights, adapters "
        "and sleep). Repeatable",
    )
    server.add_argument("--max-body-mb", type=float, default=1.0, help="largest JSON request body (413 past it)")
    server.add_argument(
        "--max-upload-mb", type=float, default=8192.0, help="largest safetensors body: weights, adapters (413 past it)"
    )
    server.add_argument(
        "--input-image-budget-mb",
        type=float,
        default=1024.0,
        help="decoded input images (an edit family's) that all requests together may hold, from their decode until "
        "their answer ends: a request whose images do not fit waits for its turn, one over the whole budget is a 413",
    )
    server.add_argument(
        "--max-samples-per-request",
        type=int,
        default=1024,
        help="most outputs (prompts x num_samples x leaves per sample) per generate",
    )
    server.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="a connection must finish sending a request's headers this long after it connects (or after the "
        "first bytes of its next request), or it is closed",
    )
    server.add_argument(
        "--body-timeout-s",
        type=float,
        default=30.0,
        help="a request body may pause this long between two chunks; past it the request is a 408",
    )
    server.add_argument(
        "--upload-timeout-s",
        type=float,
        default=600.0,
        help="a body of tensors (a weight push, streamed or whole; an adapter) must arrive whole this long after "
        "its request started; past it the request is a 408 and its connection is closed",
    )
    server.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections (and their requests) at once; past it a new one gets a 503",
    )
    server.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=20.0,
        help="on SIGTERM or Ctrl-C, how long running requests may take to finish; then every unfinished request "
        "ends with an error naming the shutdown, and the workers stop",
    )
    limits = parser.add_argument_group(
        "request limits", "what one request may ask for at most (RequestLimits); past one, a 400 names it"
    )
    add_setting_flags(limits, RequestLimits, [f.name for f in dataclasses.fields(RequestLimits)])
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="logging")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None and not args.no_auth:
        args.api_key = os.environ.get(API_KEY_ENV)  # read here, so --help never shows it
    if args.api_key is not None and not args.api_key.strip():
        parser.error(f"the API key (--api-key or ${API_KEY_ENV}) is empty; give a real one, or unset it to get one")
    for name in ("header_timeout_s", "body_timeout_s", "upload_timeout_s", "shutdown_grace_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.input_image_budget_mb <= 0:
        parser.error(f"--input-image-budget-mb must be > 0, got {args.input_image_budget_mb}")
    if args.max_connections < 1:
        parser.error(f"--max-connections must be >= 1, got {args.max_connections}")
    if args.no_auth and not is_loopback(args.host):
        parser.error(
            f"--no-auth with --host {args.host}: the server would be reachable from other machines, where anyone "
            "could push weights; bind 127.0.0.1 or drop --no-auth"
        )
    return args


def key_file_path(args: argparse.Namespace) -> Path:
    if args.api_key_file is not None:
        return args.api_key_file
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else Path.home() / ".cache"
    return folder / "diffusion-rollout" / f"serve-{args.port}.key"


def engine_flag_names() -> list[str]:
    """The fields of `EngineConfig` that are flags: all but those in `NOT_ENGINE_FLAGS`."""
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in NOT_ENGINE_FLAGS]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        listening = listen(args.host, args.port)  # before anything loads: a port in use fails at once
    except OSError as error:
        sys.exit(
            f"error: cannot listen on {args.host}:{args.port}: {error.strerror or error}; another program (another "
            "rollout server?) serves that port: stop it, or pick another --port"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported after the checks, so a refused command line answers at once.
    from rollout.engine.config_check import check_engine_config
    from rollout.serve.app import ServerSettings

    limits = settings_from_args(args, [f.name for f in dataclasses.fields(RequestLimits)])
    try:
        config = EngineConfig(**settings_from_args(args, engine_flag_names()), request_limits=RequestLimits(**limits))
        check_engine_config(config)  # the model folder and classes too, before any key or worker
        _check_rpc_allow(args.rpc_allow, config)
    except ValueError as error:
        sys.exit(f"error: {error}")
    generated_key_file = None
    if args.api_key is None and not args.no_auth:
        try:
            generated_key_file = write_generated_key(key_file_path(args))
        except ValueError as error:
            sys.exit(f"error: {error}")
        args.api_key = generated_key_file.key
        _remove_on_sigterm(generated_key_file)
        logger.warning(
            "no API key was given: generated one into %s (readable by you only); clients read it with "
            "export %s=$(cat %s)",
            generated_key_file.path,
            API_KEY_ENV,
            generated_key_file.path,
        )
    settings = ServerSettings(
        api_key=args.api_key,
        allowed_hosts=allowed_hosts(args.host, tuple(args.allowed_host)),
        rpc_allow=frozenset(args.rpc_allow),
        max_body_bytes=int(args.max_body_mb * _MB),
        max_upload_bytes=int(args.max_upload_mb * _MB),
        max_samples_per_request=args.max_samples_per_request,
        input_image_budget_bytes=int(args.input_image_budget_mb * _MB),
        body_timeout_s=args.body_timeout_s,
        upload_timeout_s=args.upload_timeout_s,
    )
    try:
        return _serve(args, config, settings, listening)
    finally:
        if generated_key_file is not None:
            generated_key_file.remove()


def _check_rpc_allow(names: list[str], config: EngineConfig) -> None:
    """ValueError unless every --rpc-allow name is a worker function (a typo would open nothing)."""
    from rollout.worker.marks import worker_functions
    from rollout.worker.worker import build_worker_class

    unknown = sorted(set(names) - worker_functions(build_worker_class(config.worker_extension_cls)))
    if unknown:
        raise ValueError(
            f"--rpc-allow {' '.join(unknown)}: not a worker function of this engine (its own, or of "
            "--worker-extension-cls)"
        )


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening as uvicorn would make it. A client that connects
    while the model loads waits in the backlog until the server answers."""
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: a port a stopped server left in TIME_WAIT is free to take again.
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(2048)  # uvicorn's default backlog
    except OSError:
        listening.close()
        raise
    return listening


def _remove_on_sigterm(key_file: KeyFile) -> None:
    """uvicorn re-raises SIGTERM once it has shut down, which ends the process past every `finally`:
    remove the file then, and let the signal end the process as before (its status names SIGTERM)."""
    previous = signal.getsignal(signal.SIGTERM)

    def remove_then_exit(sig: int, frame) -> None:
        key_file.remove()
        signal.signal(sig, previous)
        signal.raise_signal(sig)

    signal.signal(signal.SIGTERM, remove_then_exit)


def _serve(args: argparse.Namespace, config, settings, listening: socket.socket) -> int:
    import uvicorn

    from rollout import RolloutEngine
    from rollout.engine.async_engine import AsyncRolloutEngine
    from rollout.http.protocol import server_protocol
    from rollout.serve.app import build_app
    from rollout.serve.routes import path
    from rollout.serve.server import RolloutServer

    engine = AsyncRolloutEngine(RolloutEngine(config))
    try:
        server = RolloutServer(
            uvicorn.Config(
                build_app(engine, settings),
                args.host,
                args.port,
                log_level=args.log_level,
                timeout_keep_alive=KEEP_ALIVE_S,
                http=server_protocol(args.header_timeout_s, frame_body_paths=[path("update_weights")]),
                limit_concurrency=args.max_connections,
            ),
            engine,
            grace_s=args.shutdown_grace_s,
        )
        server.run(sockets=[listening])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down; nothing is left to report
        return 130
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
