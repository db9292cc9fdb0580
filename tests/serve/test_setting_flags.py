"""The server's engine flags are made from the settings of `EngineConfig` and `RequestLimits`: each
field is a flag with its name, type, default and help, or is listed as deliberately none, with why."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rollout import EngineConfig
from rollout.request_limits import RequestLimits
from rollout.serve.__main__ import NOT_ENGINE_FLAGS, build_parser, parse_args
from rollout.serve.setting_flags import add_setting_flags
from rollout.settings import setting, setting_default, setting_help


def flags() -> dict[str, argparse.Action]:
    return {option: action for action in build_parser()._actions for option in action.option_strings}


@pytest.mark.parametrize("cls", [EngineConfig, RequestLimits], ids=lambda cls: cls.__name__)
def test_every_field_is_a_flag_made_from_its_setting_or_is_listed_with_a_reason(cls):
    by_flag = flags()
    for f in dataclasses.fields(cls):
        if cls is EngineConfig and f.name in NOT_ENGINE_FLAGS:
            assert len(NOT_ENGINE_FLAGS[f.name]) > 20, f"say why {f.name} is no flag"
            continue
        action = by_flag.get("--" + f.name.replace("_", "-"))
        assert action is not None, f"{cls.__name__}.{f.name} is neither a flag nor in NOT_ENGINE_FLAGS"
        assert action.dest == f.name and action.help == setting_help(cls, f.name)
        if setting_default(f) is dataclasses.MISSING:
            assert action.required
        else:
            assert action.default == setting_default(f) and not action.required
    assert set(NOT_ENGINE_FLAGS) <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_flags_parse_to_the_fields_types_and_build_the_config():
    args = parse_args(
        ["--model", "m", "--max-batch-size", "3", "--rpc-timeout-s", "1.5", "--threads-per-worker", "2"]
        + ["--max-inference-steps", "7", "--no-auth"]
    )
    assert (args.max_batch_size, args.rpc_timeout_s, args.threads_per_worker) == (3, 1.5, 2)
    assert isinstance(args.rpc_timeout_s, float) and args.max_inference_steps == 7
    assert args.executor == "uni" and args.worker_extension_cls is None  # str | type | None: a str flag
    assert parse_args(["--model", "m", "--no-auth"]).threads_per_worker is None


def test_a_missing_model_and_a_wrong_type_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--no-auth"])
    assert "the following arguments are required: --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--no-auth", "--num-workers", "two"])
    assert "argument --num-workers: invalid int value: 'two'" in capsys.readouterr().err


def test_a_field_with_no_one_flag_type_is_refused_by_name():
    @dataclasses.dataclass
    class Odd:
        shape: tuple[int, int] = setting((1, 1), "a pair")

    with pytest.raises(TypeError, match=r"Odd.shape .* has no one flag type of int, float or str"):
        add_setting_flags(argparse.ArgumentParser(), Odd, ["shape"])
