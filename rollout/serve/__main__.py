"""Run the rollout service: `python -m rollout.serve --model DIR [options]`; `--help` lists them."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from rollout.serve import API_KEY_ENV

_MB = 1 << 20
# Longer than clients keep idle connections (RemoteRolloutEngine: 10 s; httpx's default: 5 s), so the
# server never closes a connection a client is about to reuse (uvicorn's default is 5 s).
KEEP_ALIVE_S = 60


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.serve",
        description="Serve a RolloutEngine over HTTP: rollouts with trajectories, weight and LoRA hot swaps, "
        "pause/resume. Routes and bodies are listed in the README.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine = parser.add_argument_group("engine (the fields of EngineConfig)")
    engine.add_argument("--model", required=True, help="local diffusers pipeline folder to serve")
    engine.add_argument(
        "--executor", default="uni", help="'uni' (in-process), 'mp', 'ray', or a dotted path to an Executor subclass"
    )
    engine.add_argument("--num-workers", type=int, default=1, help="model replicas (data parallel); 'uni' runs one")
    engine.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N'")
    engine.add_argument(
        "--dtype", default="float32", help="weights dtype: float32, bfloat16 or float16 (trajectories stay float32)"
    )
    engine.add_argument("--max-batch-size", type=int, default=16, help="most samples one worker denoises at once")
    engine.add_argument(
        "--threads-per-worker", type=int, default=None, help="torch CPU threads per worker process; default: shared"
    )
    engine.add_argument(
        "--worker-extension-cls",
        default=None,
        help="dotted path of a class whose methods become worker functions, callable by name at /collective_rpc",
    )
    engine.add_argument("--rpc-timeout-s", type=float, default=300.0, help="default timeout of a worker function")
    engine.add_argument("--step-timeout-s", type=float, default=600.0, help="timeout of one engine step")
    engine.add_argument("--startup-timeout-s", type=float, default=600.0, help="time for every worker to load")
    engine.add_argument(
        "--ray-placement-strategy", default="PACK", help="PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (executor ray)"
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind; any but loopback needs an API key")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    server.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}; "
        "prefer the variable: a flag shows in the process list)",
    )
    server.add_argument("--max-body-mb", type=float, default=1.0, help="largest JSON request body (413 past it)")
    server.add_argument(
        "--max-upload-mb", type=float, default=8192.0, help="largest safetensors body: weights, adapters (413 past it)"
    )
    server.add_argument(
        "--max-samples-per-request",
        type=int,
        default=1024,
        help="most outputs (prompts x num_samples x leaves per sample) per generate",
    )
    server.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=20.0,
        help="on SIGTERM or Ctrl-C, how long running requests may take to finish; then every unfinished request "
        "ends with an error naming the shutdown, and the workers stop",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="logging")
    args = parser.parse_args(argv)
    if args.api_key is None and not is_loopback(args.host):
        parser.error(
            f"--host {args.host} is reachable from other machines, and without an API key anyone there could "
            f"push weights; set {API_KEY_ENV} (or --api-key), or bind 127.0.0.1"
        )
    return args


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported after the checks, so a refused command line answers at once.
    import uvicorn

    from rollout import EngineConfig, RolloutEngine
    from rollout.async_engine import AsyncRolloutEngine
    from rollout.serve.app import ServerSettings, build_app
    from rollout.serve.server import RolloutServer

    try:
        config = EngineConfig(
            model=args.model,
            executor=args.executor,
            num_workers=args.num_workers,
            worker_extension_cls=args.worker_extension_cls,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            threads_per_worker=args.threads_per_worker,
            rpc_timeout_s=args.rpc_timeout_s,
            step_timeout_s=args.step_timeout_s,
            startup_timeout_s=args.startup_timeout_s,
            ray_placement_strategy=args.ray_placement_strategy,
        )
    except ValueError as error:
        sys.exit(f"error: {error}")
    settings = ServerSettings(
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * _MB),
        max_upload_bytes=int(args.max_upload_mb * _MB),
        max_samples_per_request=args.max_samples_per_request,
    )
    engine = AsyncRolloutEngine(RolloutEngine(config))
    try:
        server = RolloutServer(
            uvicorn.Config(
                build_app(engine, settings),
                args.host,
                args.port,
                log_level=args.log_level,
                timeout_keep_alive=KEEP_ALIVE_S,
            ),
            engine,
            grace_s=args.shutdown_grace_s,
        )
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down; nothing is left to report
        return 130
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
