"""The GRPO and DPO recipe configs: the shipped ones hold what they promise, and bad input gets one
error listing every problem before any model loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import recipes.config
from recipes.loading import load_config
from trainers_adapters.rewards.spec import reward_specs

CONFIG_DIR = Path(recipes.config.__file__).parent / "configs"

pytestmark = pytest.mark.timeout(30)


def problems_of(error: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(error.value).splitlines()[1:]]


def test_gpu_config_carries_the_published_flow_grpo_settings():
    config = load_config(CONFIG_DIR / "grpo_sd35_medium_lora.yaml")
    assert (config.lora.rank, config.lora.alpha) == (32, 64)
    assert {m.rsplit(".", 1)[-1] for m in config.lora.target_modules} >= {"to_q", "to_k", "to_v", "add_q_proj"}
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 40)
    assert config.sampling.noise_level == 0.7 and config.sampling.sampler == "flow_sde"
    assert (config.sampling.num_samples, config.prompts_per_step) == (24, 48)
    assert config.grpo.clip_range == 1e-4 and config.grpo.kl_beta == 0.04
    assert config.engine.device == "cuda" and config.engine.dtype == "bfloat16"


def test_flux_config_carries_the_published_flow_grpo_settings():
    config = load_config(CONFIG_DIR / "grpo_flux1_dev_lora.yaml")
    assert (config.lora.rank, config.lora.alpha) == (64, 128)
    assert {"ff.net.0.proj", "ff_context.net.2", "attn.to_add_out"} <= set(config.lora.target_modules)
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (6, 28)
    assert (config.sampling.noise_level, config.sampling.guidance_scale) == (0.9, 3.5)
    assert config.sampling.true_cfg_scale is None and config.sampling.max_sequence_length == 128
    assert (config.sampling.num_samples, config.prompts_per_step) == (24, 48)
    assert config.grpo.kl_beta == 0.0 and config.grpo.global_std


def test_qwen_image_config_carries_the_published_flow_grpo_settings():
    config = load_config(CONFIG_DIR / "grpo_qwen_image_lora.yaml")
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 50)
    assert (config.sampling.true_cfg_scale, config.sampling.negative_prompt) == (4.0, " ")
    assert config.sampling.guidance_scale is None
    assert (config.sampling.noise_level, config.sampling.sde_window) == (1.2, (0, 2))
    assert (config.sampling.num_samples, config.prompts_per_step) == (16, 32)


def test_qwen_image_edit_config_carries_the_published_flow_grpo_settings():
    """Flow-GRPO's `counting_qwenimage_edit`: noise 1.0 on every step (no SDE window), true CFG 4."""
    config = load_config(CONFIG_DIR / "grpo_qwen_image_edit_lora.yaml")
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 50)
    assert (config.sampling.true_cfg_scale, config.sampling.negative_prompt) == (4.0, " ")
    assert (config.sampling.noise_level, config.sampling.sde_window) == (1.0, None)
    assert (config.sampling.height, config.sampling.width) == (512, 512)
    assert (config.sampling.num_samples, config.prompts_per_step) == (16, 32)
    assert config.grpo.kl_beta == 0.0 and config.grpo.global_std and config.grpo.optimizer_steps == 2
    assert config.input_images.source == "shapes" and config.reward == "colour_edit"


def test_flux2_klein_config_carries_the_flow_grpo_settings_it_cites():
    config = load_config(CONFIG_DIR / "grpo_flux2_klein_lora.yaml")
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (64, 128, None)
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 50)
    assert (config.sampling.guidance_scale, config.sampling.noise_level) == (4.0, 0.9)
    assert config.sampling.true_cfg_scale is None and config.sampling.negative_prompt is None  # CFG against ""
    assert (config.sampling.num_samples, config.prompts_per_step) == (24, 48)
    assert config.grpo.kl_beta == 0.0 and config.grpo.global_std


def test_zimage_config_carries_the_published_flow_factory_settings():
    config = load_config(CONFIG_DIR / "grpo_zimage_lora.yaml")
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (64, 128, None)
    assert (config.sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 40)
    assert (config.sampling.guidance_scale, config.sampling.true_cfg_scale) == (4.0, None)
    assert (config.sampling.noise_level, config.sampling.sde_window) == (0.7, (1, 2))
    assert (config.sampling.height, config.sampling.width) == (512, 512)
    assert (config.sampling.num_samples, config.prompts_per_step) == (16, 48)
    assert config.grpo.clip_range == 1e-4 and config.grpo.kl_beta == 0.0 and not config.grpo.global_std
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (3e-4, 1e-4)


def test_ltx2_configs_carry_flow_factory_s_settings():
    """Flow-Factory's LTX-2 GRPO examples (examples/grpo/lora/ltx2/t2av.yaml and i2av.yaml)."""
    for name, steps, sampler, noise, window, window_range, lr in [
        ("grpo_ltx2_lora.yaml", 24, "cps", 0.8, (0, 3), (0, 10), 3e-4),
        ("grpo_ltx2_i2v_lora.yaml", 30, "flow_sde", 0.7, (1, 2), (1, 4), 1e-4),
    ]:
        config = load_config(CONFIG_DIR / name)
        s = config.sampling
        assert (s.height, s.width, s.num_frames, s.num_inference_steps) == (512, 768, 121, steps), name
        assert (s.sampler, s.noise_level, s.sde_window, s.num_samples, s.guidance_scale) == (
            sampler,
            noise,
            window,
            16,
            1.0,
        ), name
        assert config.sde_window_range == window_range and config.optimizer.learning_rate == lr, name
        assert (config.lora.rank, config.lora.alpha, config.grpo.optimizer_steps) == (64, 128, 2), name
        assert (config.grpo.clip_range, config.grpo.global_std, config.grpo.kl_beta) == (1e-4, True, 0.0), name


def test_nft_config_carries_the_published_diffusion_nft_settings():
    config = load_config(CONFIG_DIR / "nft_sd35_medium_lora.yaml")
    assert config.recipe == "nft"
    assert (config.lora.rank, config.lora.alpha) == (32, 64)
    assert set(config.lora.target_modules) == {
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    }  # fmt: skip
    sampling = config.sampling
    assert (sampling.sampler, sampling.guidance_scale) == ("ode", 1.0)  # deterministic and CFG-free
    assert (sampling.num_inference_steps, config.eval.num_inference_steps) == (10, 40)
    assert (sampling.height, sampling.width) == (512, 512)
    assert (sampling.num_samples, config.prompts_per_step) == (24, 48)
    nft = config.nft
    assert (nft.beta, nft.adv_clip_max, nft.kl_beta, nft.timestep_fraction) == (1.0, 5.0, 1e-4, 0.99)
    assert nft.global_std and nft.optimizer_steps == 1 and nft.max_grad_norm == 1.0
    schedule = nft.decay_schedule()  # the authors' decay_type 1: min(0.001 * step, 0.5)
    assert (schedule(1), schedule(100), schedule(2000)) == (0.001, 0.1, 0.5)
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (3e-4, 1e-4)
    assert config.engine.device == "cuda"


def test_nft_refuses_an_sde_sampler_naming_the_fix():
    with pytest.raises(ValueError) as error:
        load_config(CONFIG_DIR / "nft_tiny.yaml", ["sampling.sampler=flow_sde", "nft.beta=0"])
    problems = problems_of(error)
    assert any("DiffusionNFT samples the old policy deterministically: use ode" in p for p in problems), problems
    assert any("beta must be in (0, 1]" in p for p in problems), problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name, family",
    [
        ("grpo_sd35_medium_lora.yaml", "sd3"),
        ("nft_sd35_medium_lora.yaml", "sd3"),
        ("grpo_flux1_dev_lora.yaml", "flux"),
        ("grpo_qwen_image_lora.yaml", "qwen_image"),
        ("grpo_flux_tiny.yaml", "flux"),
        pytest.param("grpo_flux_kontext_tiny.yaml", "flux_kontext", marks=pytest.mark.slow),  # a tiny build more
        ("grpo_qwen_image_tiny.yaml", "qwen_image"),
        ("grpo_flux2_klein_lora.yaml", "flux2_klein"),
        ("grpo_flux2_klein_tiny.yaml", "flux2_klein"),
        ("grpo_flux2_klein_edit_tiny.yaml", "flux2_klein"),
        pytest.param("grpo_qwen_image21_lora.yaml", "qwen_image21", marks=pytest.mark.slow),  # a tiny build more
        pytest.param("grpo_qwen_image21_tiny.yaml", "qwen_image21", marks=pytest.mark.slow),
        pytest.param("grpo_flux2_dev_lora.yaml", "flux2_dev", marks=pytest.mark.slow),
        pytest.param("grpo_flux2_dev_tiny.yaml", "flux2_dev", marks=pytest.mark.slow),
        ("grpo_zimage_lora.yaml", "zimage"),
        ("grpo_zimage_tiny.yaml", "zimage"),
        ("grpo_wan_tiny.yaml", "wan"),
        ("grpo_wan22_a14b_lora.yaml", "wan22"),
        ("grpo_wan_i2v_tiny.yaml", "wan_i2v"),
        ("grpo_wan21_i2v_lora.yaml", "wan_i2v"),
        ("grpo_ltx2_i2v_tiny.yaml", "ltx2_i2v"),
        ("grpo_ltx2_lora.yaml", "ltx2"),
        ("grpo_ltx2_i2v_lora.yaml", "ltx2_i2v"),
        ("grpo_hunyuan_video15_tiny.yaml", "hunyuan_video15"),
        ("grpo_hunyuan_video15_lora.yaml", "hunyuan_video15"),
        *(
            pytest.param(name, "qwen_image_edit", marks=pytest.mark.slow)
            for name in ("grpo_qwen_image_edit_lora.yaml", "grpo_qwen_image_edit_tiny.yaml")
        ),
    ],
)
def test_sampling_settings_fit_their_model_family(tiny_models, name, family):
    """The full-size configs need weights that are not here; their sampling section is checked
    against the model spec of the same family's tiny pipeline (same guidance fields and rules)."""
    from rollout.pipelines.loading import load_adapter

    config = load_config(CONFIG_DIR / name)
    # The tiny transformer's positional table is far smaller than the published model's (64 vs
    # 6144 pixels for SD3.5): the size limit is the real model's, checked by the family's own tests.
    spec = dataclasses.replace(load_adapter(tiny_models(family)).spec, max_grid=None)
    _, problems = spec.resolve(config.sampling)
    assert problems == []
    assert config.model.tiny_family == family


# The settings whose meaning depends on the code that defined them (docs/training.md), per paper:
# a config that quotes the paper must name each one (a default could be another paper's form), with
# the paper's value, or None: named, and its YAML comment says why it differs from the paper's.
PAPER_FORMS = {
    "Flow-GRPO": {("sampling", "log_prob_form"): "flow_grpo", ("grpo", "kl_form"): "flow_grpo"},
    "DanceGRPO": {("sampling", "log_prob_form"): "gaussian"},
    # BranchGRPO's script (finetune_flux_branchgrpo_8gpus.sh) splits at tree_split_noise_scale 4.0,
    # on its own SDE; a config on another sampler says what it chose.
    "BranchGRPO": {("sampling", "branch_noise_scale"): None},
    # DiffusionNFT's code samples with a 2nd-order DPM-Solver; a config says which ODE step it uses.
    "DiffusionNFT": {("sampling", "sampler"): None},
}


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_configs_that_quote_a_paper_name_the_forms_of_its_code(path):
    text = path.read_text()
    raw = yaml.safe_load(text)
    quoted = [paper for paper in PAPER_FORMS if paper in text]
    for paper in quoted:
        for (section, key), value in PAPER_FORMS[paper].items():
            if section not in raw:  # e.g. a rollout recipe has no grpo section
                continue
            assert key in raw[section], f"{path.name} quotes {paper} but leaves {section}.{key} to the default"
            if value is not None:
                assert raw[section][key] == value, f"{path.name}: {section}.{key} is not {paper}'s {value!r}"
            else:
                line = next(line for line in text.splitlines() if line.strip().startswith(f"{key}:"))
                assert paper in line, f"{path.name}: the comment on {section}.{key} does not say what {paper} uses"
    # every GRPO (and NFT) config follows a paper's code
    assert quoted or path.name in ("dpo_tiny.yaml", "dpo_full_tiny.yaml")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*_lora.yaml")), ids=lambda p: p.name)
def test_real_size_configs_checkpoint_the_trainer_s_activations(path):
    """Without it, the backward through a 12B-20B transformer keeps every block's activations."""
    assert load_config(path).trainer.gradient_checkpointing


def test_flow_grpo_s_kl_weight_keeps_its_meaning():
    config = load_config(CONFIG_DIR / "grpo_sd35_medium_lora.yaml")
    assert (config.grpo.kl_beta, config.grpo.kl_form) == (0.04, "flow_grpo")
    assert config.sampling.log_prob_form == "flow_grpo"


def test_main_job_is_grpo_on_the_tiny_model():
    config = load_config(CONFIG_DIR / "grpo_tiny.yaml")
    assert config.recipe == "grpo" and config.model.path == "tiny" and config.engine.device == "cpu"
    assert config.sampling.num_samples >= 2


def test_every_bad_input_is_reported_in_two_errors(tmp_path):
    """The issue's list: unknown keys, wrong types, a reward that does not import, a group of 1 with
    GRPO, an executor that does not exist. The keys and values are one error, answered without
    importing torch; once they are right, what must be imported to be checked (the reward, the
    executor) is the next, one error again."""
    text = (CONFIG_DIR / "grpo_tiny.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    typos = [
        "grpo.clip_rnage=0.2",  # unknown key
        "steps=many",  # wrong type
        "sampling.num_samples=1",  # group of 1
    ]
    imports = [
        "reward=my_rewards.missing.score",  # does not import
        "engine.executor=threads",  # no such executor
    ]
    with pytest.raises(ValueError) as error:
        load_config(path, typos + imports)
    problems = problems_of(error)
    assert str(error.value).startswith(f"invalid config {path} (3 problems):")
    assert "unknown key 'grpo.clip_rnage'; did you mean 'grpo.clip_range'?" in problems
    assert "steps: expected int, got 'many' (str)" in problems
    assert any("sampling.num_samples (the group size) is 1" in p for p in problems)
    with pytest.raises(ValueError) as error:
        load_config(path, imports)
    problems = problems_of(error)
    assert str(error.value).startswith(f"invalid config {path} (2 problems):")
    assert any("reward 'my_rewards.missing.score'" in p and "my_rewards" in p for p in problems)
    assert any(p.startswith("engine: unknown executor 'threads'") for p in problems)


def test_recipe_specific_checks(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["sampling.sampler=ode", "sampling.lora=mine"])
    problems = problems_of(error)
    assert any("sampling.sampler 'ode' has no log-probs for GRPO" in p for p in problems)
    assert any("sampling.lora must be null" in p for p in problems)
    # DPO needs no log-probs: an ODE rollout (groups differ by their initial noise) is fine.
    assert load_config(CONFIG_DIR / "dpo_tiny.yaml", ["sampling.sampler=ode"]).sampling.sampler == "ode"
    with pytest.raises(ValueError, match="dpo: beta must be > 0, got 0.0"):
        load_config(CONFIG_DIR / "dpo_tiny.yaml", ["dpo.beta=0"])
    with pytest.raises(ValueError, match="prompts_file 'nowhere.txt' does not exist"):
        load_config(CONFIG_DIR / "dpo_tiny.yaml", ["prompts_file=nowhere.txt"])


def test_prompts_file_adds_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red kite\n\n  a red bus  \n")
    config = load_config(CONFIG_DIR / "grpo_tiny.yaml", ["prompts=[a red cup]", f"prompts_file={prompts}"])
    assert config.all_prompts() == ["a red cup", "a red kite", "a red bus"]


def test_tree_recipes_describe_their_trees():
    tree = load_config(CONFIG_DIR / "branch_grpo_tiny.yaml").sampling
    assert (tree.num_samples, tree.branch_steps, tree.leaves_per_sample) == (2, (2, 4), 4)
    fast = load_config(CONFIG_DIR / "grpo_fast_tiny.yaml").sampling
    assert (fast.num_samples, fast.branch_steps, fast.leaves_per_sample) == (1, (5,), 8)
    assert fast.sde_mask() == [False] * 5 + [True, True, False]  # ODE prefix, 2-step window, ODE
    # Lists from YAML or --set become the tuples SamplingParams holds; a bad tree is named.
    config = load_config(CONFIG_DIR / "grpo_tiny.yaml", ["sampling.branch_steps=[1, 3]", "sampling.record=[x0]"])
    assert config.sampling.branch_steps == (1, 3) and config.sampling.record == ("x0",)
    with pytest.raises(ValueError, match="sampling.branch_steps: expected a list of int"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["sampling.branch_steps=[one]"])
    with pytest.raises(ValueError, match=r"branch_steps \[1\] are ODE steps"):
        load_config(CONFIG_DIR / "grpo_fast_tiny.yaml", ["sampling.branch_steps=[1]"])


def test_sde_window_range_slides_the_window_and_its_branches():
    """Flow-GRPO-Fast's moving window: every start that keeps the window inside the range is drawn,
    and branch steps keep their offset from the window's start."""
    import random

    from recipes.training import slide_window

    fast = load_config(CONFIG_DIR / "grpo_fast_tiny.yaml", ["sde_window_range=[1, 8]"])
    assert fast.sde_window_range == (1, 8)
    starts = set()
    for seed in range(200):
        slid = slide_window(fast.sampling, fast.sde_window_range, random.Random(seed))
        start, stop = slid.sde_window
        assert stop - start == 2 and slid.branch_steps == (start,)
        starts.add(start)
    assert starts == set(range(1, 7))
    same_seed = [slide_window(fast.sampling, (2, 6), random.Random(5)) for _ in range(2)]
    assert same_seed[0] == same_seed[1]


def test_bad_sde_window_ranges_are_named():
    for overrides, message in [
        (["sde_window_range=[0, 9]"], r"sde_window_range \[0, 9\] must satisfy 0 <= start < stop <= 8"),
        (["sde_window_range=[3, 4]"], r"sde_window_range \[3, 4\] is narrower than sampling.sde_window's 2 steps"),
        (["sde_window_range=[0, 4]", "sampling.sde_window=null", "sampling.branch_steps=[]"], "which is null"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(CONFIG_DIR / "grpo_fast_tiny.yaml", overrides)


def test_reward_names_one_reward_or_a_weighted_sum_of_several(tiny_clip, tiny_aesthetic_head):
    sum_of_three = (
        f"reward={{clip_score: {{weight: 1.0, model: {tiny_clip}}}, "
        f"aesthetic: {{weight: 0.5, model: {tiny_clip}, head: {tiny_aesthetic_head}}}, colour: 0.1}}"
    )
    config = load_config(CONFIG_DIR / "grpo_tiny.yaml", [sum_of_three, "reward.colour=0.2"])
    assert config.reward == {
        "clip_score": {"weight": 1.0, "model": tiny_clip},
        "aesthetic": {"weight": 0.5, "model": tiny_clip, "head": tiny_aesthetic_head},
        "colour": 0.2,  # --set reaches into the mapping
    }
    assert load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward=jpeg_compressibility"]).reward == "jpeg_compressibility"
    text_weight = load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward={colour: {weight: 1e-2}}"])  # YAML 1.1: text
    assert reward_specs(text_weight.reward)[0].weight == 0.01


def test_every_bad_reward_setting_is_named_before_any_model_loads(tmp_path, tiny_clip):
    bad = (
        f"reward={{clip_score: {{weight: 1.0, modle: {tiny_clip}}}, pickscore: {{model: {tmp_path}}}, "
        "colour: {weight: heavy, device: cuda}, aesthetic: {model: /nowhere}, judge: {reward: nope}, "
        "jpeg_compressibility: [1]}"
    )
    with pytest.raises(ValueError) as error:
        load_config(CONFIG_DIR / "grpo_tiny.yaml", [bad])
    assert problems_of(error) == [
        "config: reward.clip_score: unknown setting 'modle'; did you mean 'model'? ClipScore takes model, "
        "processor, device, batch_size",
        "config: reward.clip_score: ClipScore needs model (it takes model, processor, device, batch_size)",
        f"config: reward.pickscore: model '{tmp_path}' is not a CLIPModel folder (no config.json there)",
        "config: reward.colour: weight must be a finite number, got 'heavy'",
        "config: reward.colour: colour is a function and takes no settings; drop device",
        "config: reward.aesthetic: AestheticScore needs head (it takes model, head, processor, device, batch_size)",
        "config: reward.aesthetic: model '/nowhere' is not a CLIPModel folder (no config.json there)",
        "config: reward.judge: unknown reward 'nope'; built-ins: ['audio_loudness', 'colour', 'colour_agreement', "
        "'colour_edit', 'jpeg_compressibility', 'jpeg_incompressibility'], reward models: ['aesthetic', 'clip_score', "
        "'pickscore'], 'remote' (a reward service), or a dotted path (pkg.module.name) to a reward function or class",
        "config: reward.jpeg_compressibility: expected a weight or a mapping of settings, got [1]",
    ]
    with pytest.raises(ValueError, match=r"AestheticScore needs model, head .*give them as reward: "):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward=aesthetic"])
    with pytest.raises(ValueError, match="reward is an empty mapping; name at least one reward"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward={}"])


def test_reward_workers_must_not_be_negative():
    with pytest.raises(ValueError, match=r"reward_workers must be >= 0 \(0: score on a thread of this process\)"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward_workers=-1"])
    assert load_config(CONFIG_DIR / "dpo_tiny.yaml", ["reward_workers=2"]).reward_workers == 2


def test_where_rewards_run_is_checked_with_every_problem_at_once():
    config = load_config(
        CONFIG_DIR / "grpo_tiny.yaml", ["reward_workers=2", "reward_runner=ray", "reward_devices=[cpu, cuda]"]
    )
    assert (config.reward_runner, config.reward_devices, config.reward_timeout_s) == ("ray", ["cpu", "cuda"], 600.0)
    with pytest.raises(ValueError) as error:
        load_config(
            CONFIG_DIR / "grpo_tiny.yaml",
            ["reward_workers=2", "reward_runner=threads", "reward_devices=[cuda:0]", "reward_timeout_s=0"],
        )
    assert problems_of(error) == [
        "config: reward_runner must be one of ('process', 'ray') (worker processes or Ray actors), got 'threads'",
        "config: reward_timeout_s must be > 0 seconds, got 0.0",
        "config: reward_devices names 1 devices for reward_workers 2; give one device per worker",
    ]
    with pytest.raises(ValueError) as error:
        load_config(
            CONFIG_DIR / "grpo_tiny.yaml",
            ["reward_workers=1", "reward_runner=ray", "reward_devices=[cuda:1]", "reward={clip_score: {device: cpu}}"],
        )
    found = problems_of(error)
    assert (
        "config: reward_devices: 'cuda:1': Ray gives each actor its GPU; write cuda (one GPU per actor) or cpu"
        in found
    )
    assert any(
        "reward.clip_score.device is set, and reward_devices places every worker's models too" in p for p in found
    )
    with pytest.raises(ValueError, match="reward_runner 'ray' needs reward_workers >= 1"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward_runner=ray"])
    with pytest.raises(ValueError, match="reward_devices: 'gpu0' is not a device; write cpu, cuda or cuda:N"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward_workers=1", "reward_devices=[gpu0]"])
    with pytest.raises(ValueError, match="reward_devices places reward workers, but reward_workers is 0"):
        load_config(CONFIG_DIR / "grpo_tiny.yaml", ["reward_devices=[cpu]"])


def test_nft_refuses_cfg_before_the_engine_loads(tiny_model, tmp_path):
    from recipes.nft import run

    config = load_config(
        CONFIG_DIR / "nft_tiny.yaml",
        [f"model.path={tiny_model}", f"output_dir={tmp_path / 'out'}", "sampling.guidance_scale=4.5"],
    )
    with pytest.raises(ValueError, match="DiffusionNFT samples and trains without CFG: set sampling.guidance_scale=1"):
        run(config)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
