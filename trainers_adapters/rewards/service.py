"""Serve named rewards over HTTP: `python -m trainers_adapters.rewards.service --reward KEY [options]`.

KEY is what a recipe's `reward:` key holds, as YAML text or a .yaml/.json file of it:

    python -m trainers_adapters.rewards.service --workers 2 --port 8100 \\
        --reward '{clip_score: {model: /models/clip-vit-large-patch14, device: cuda:0}, aesthetic: {...}}'

The rewards run in a pool of `--workers N` reward workers (`--runner process`: processes; `ray`:
Ray actors; `--devices`: one device per worker; `--timeout-s`: the longest one group may take) or
on a thread of the server (`--workers 0`);
routes in `service_app`, the client is `RemoteReward`. The key comes from
$REWARD_SERVICE_API_KEY or --api-key, as the rollout service's does; --no-auth only on loopback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import yaml

from rollout.http.hosts import allowed_hosts, is_loopback
from trainers_adapters.rewards.placement import open_reward_runner, placement_problems
from trainers_adapters.rewards.spec import reward_problems

API_KEY_ENV = "REWARD_SERVICE_API_KEY"
_MB = 1 << 20
_FLAG_OF_KEY = {
    "reward_workers": "--workers",
    "reward_runner": "--runner",
    "reward_devices": "--devices",
    "reward_timeout_s": "--timeout-s",
}

logger = logging.getLogger("trainers_adapters.rewards.service")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainers_adapters.rewards.service",
        description="Serve rewards over HTTP: POST /score with a group's images (safetensors or PNG) returns "
        "JSON scores. See docs/training.md (reward workers and the reward service).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--reward",
        required=True,
        help="the rewards, as a recipe's `reward:` key: YAML text (colour, or {clip_score: {model: DIR}, ...}) or "
        "a .yaml/.json file holding it",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="reward worker processes (each loads the models); 0: a thread here"
    )
    parser.add_argument(
        "--runner",
        default="process",
        choices=["process", "ray"],
        help="what a reward worker is: a process or a Ray actor",
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        default=None,
        metavar="DEVICE",
        help="one device per worker (cpu, cuda:1; with --runner ray: cpu or cuda), where it builds the models",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="the longest a worker may take over one group before it is killed",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8100, help="TCP port to listen on")
    parser.add_argument(
        "--allowed-host", action="append", default=[], metavar="NAME", help="another name clients reach it by"
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer it)"
    )
    auth.add_argument("--no-auth", action="store_true", help="serve without a key (loopback binds only)")
    parser.add_argument("--max-body-mb", type=float, default=256.0, help="largest request body (413 past it)")
    parser.add_argument("--max-images", type=int, default=1024, help="most images scored per request")
    parser.add_argument("--body-timeout-s", type=float, default=30.0, help="longest pause inside a request body")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.reward = _reward_value(args.reward, parser)
    problems = reward_problems(args.reward)
    if problems:
        parser.error("--reward: " + "; ".join(problems))
    placement = placement_problems(args.workers, args.runner, args.devices, args.timeout_s, args.reward)
    if placement:  # the recipe keys' checks, told with this command's option names
        text = "; ".join(placement)
        for key, flag in _FLAG_OF_KEY.items():
            text = text.replace(key, flag)
        parser.error(text)
    if args.max_images < 1 or args.max_body_mb <= 0 or args.body_timeout_s <= 0:
        parser.error("--max-images, --max-body-mb and --body-timeout-s must be > 0")
    if args.api_key is None and not args.no_auth:
        args.api_key = os.environ.get(API_KEY_ENV)
        if not args.api_key:
            parser.error(f"give the service a key: export {API_KEY_ENV}=... (or --api-key); or --no-auth on loopback")
    if args.no_auth and not is_loopback(args.host):
        parser.error(f"--no-auth with --host {args.host}: anyone on the network could use it; bind 127.0.0.1")
    return args


def _reward_value(text: str, parser: argparse.ArgumentParser):
    if text.endswith((".yaml", ".yml", ".json")):
        if not Path(text).is_file():
            parser.error(f"--reward {text!r}: no such file")
        text = Path(text).read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        parser.error(f"--reward is not YAML: {error}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from rollout.http.protocol import server_protocol
    from trainers_adapters.rewards.service_app import RewardServiceSettings, build_reward_app
    from trainers_adapters.rewards.spec import reward_specs

    settings = RewardServiceSettings(
        api_key=args.api_key,
        allowed_hosts=allowed_hosts(args.host, tuple(args.allowed_host)),
        max_body_bytes=int(args.max_body_mb * _MB),
        max_images=args.max_images,
        body_timeout_s=args.body_timeout_s,
    )
    names = [spec.name for spec in reward_specs(args.reward)]
    runner = open_reward_runner(
        args.reward, args.workers, runner=args.runner, devices=args.devices, timeout_s=args.timeout_s
    )
    with runner:
        app = build_reward_app(runner, names, settings)
        logger.info("serving rewards %s on http://%s:%d (%d workers)", names, args.host, args.port, args.workers)
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=server_protocol(10.0))
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
