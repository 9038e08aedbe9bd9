"""Every recipe under runs/ is registered, resolves, and names a known task; the fleet recipe holds the
contract the fleet preflight and REPRODUCE.md promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedded.config import resolve_embedded
from trainer.config import RECIPES, RUNS_DIR, RecipeConfig, load_recipe_file, resolve
from worker_contract.tasks import TASKS

RECIPE_FILES = sorted(p for p in Path(RUNS_DIR).rglob("*.yaml") if "example" not in p.name)


def test_every_recipe_file_is_registered():
    registered = {(RUNS_DIR / f).resolve() for f in RECIPES.values()}
    assert RECIPE_FILES, "no recipes under runs/"
    for path in RECIPE_FILES:
        assert path.resolve() in registered, f"{path} is not in trainer.config.RECIPES"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_resolves(name):
    cfg = resolve(name, env={})
    assert cfg.name == name
    assert cfg.task in TASKS, f"recipe {name} names unknown task {cfg.task!r}"
    assert cfg.run is None, "a recipe never pins DRL_RUN"
    assert load_recipe_file(RUNS_DIR / RECIPES[name]).get("run") is None


def test_fleet_recipe_contract():
    cfg = resolve("psqa", env={})
    assert (cfg.contract.n_samples, cfg.contract.plane, cfg.contract.kv_mode) == (8, "int8g64", "paged_prefix")
    assert (cfg.algo.eps_clip, cfg.algo.eps_clip_high, cfg.algo.eps_clip_c) == (10000, 19, 20)
    assert (cfg.algo.staleness, cfg.algo.reuse_cap, cfg.train.save_interval) == (3, 2, 4)
    assert cfg.model.hf_id == "LiquidAI/LFM2.5-8B-A1B" and cfg.train.backend == "megatron"
    # the environment layer still wins over the recipe (precedence), and bad values are refused
    assert resolve("psqa", env={"DRL_N_SAMPLES": "16"}).contract.n_samples == 16
    with pytest.raises(ValueError, match="DRL_PULSE_PLANE='fp8'"):  # the variable the user set, by name
        resolve("psqa", env={"DRL_PULSE_PLANE": "fp8"})


@pytest.mark.parametrize("top_p", [0.9, 0.5])
def test_top_p_below_1_is_refused_naming_the_field_the_value_and_why(top_p):
    """Workers record log-probs under the nucleus they drew from; the learner recomputes the full
    temperature-scaled softmax, so a run at top_p < 1 would train against a behaviour policy it never scores."""
    with pytest.raises(ValueError, match=rf"algo\.top_p={top_p}: .*learner.*top_p: 1\.0") as e:
        resolve("gsm8k", env={}, overrides={"algo.top_p": top_p})
    assert "Value error" not in str(e.value)
    tree = resolve("psqa", env={}).model_dump()
    tree["algo"]["top_p"] = top_p
    with pytest.raises(ValueError, match="top_p"):  # a resolved recipe validated again (preflight, box launch)
        RecipeConfig.model_validate(tree)
    with pytest.raises(ValueError, match="algo.top_p"):
        resolve_embedded("gsm8k", env={}, overrides={"algo.top_p": top_p})
    assert resolve("gsm8k", env={}, overrides={"algo.top_p": 1.0}).algo.top_p == 1.0
    for out_of_range in (0.0, 1.5):
        with pytest.raises(ValueError, match="algo.top_p"):
            resolve("gsm8k", env={}, overrides={"algo.top_p": out_of_range})
