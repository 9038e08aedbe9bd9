"""Every recipe under runs/ is registered, resolves, and names a known task; the fleet recipe holds the
contract the fleet preflight and REPRODUCE.md promise."""

from __future__ import annotations

import re
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
    assert set(RECIPES) == {"gsm8k", "psqa"}  # the names users type


def test_the_recipe_list_is_the_files_under_runs(tmp_path):
    """A new recipe is a file: the list is read from the folder, and one name given twice is refused."""
    from trainer.config import _scan_recipes

    (tmp_path / "toy.yaml").write_text("# a toy\nname: toy\ntask: arithmetic\n")
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "recipe.yaml").write_text("name: 'fleetish'\ntask: psqa\n")
    (tmp_path / "fleet" / "notes.yaml").write_text("name: ignored\n")  # only recipe.yaml inside a folder
    assert _scan_recipes(tmp_path) == {"toy": "toy.yaml", "fleetish": "fleet/recipe.yaml"}
    # a file whose name cannot be read is listed under its stem, so loading it names what is wrong with it
    (tmp_path / "broken.yaml").write_text("algo: [1,\n")
    (tmp_path / "binary.yaml").write_bytes(b"name: \xff\xfe\n")
    (tmp_path / "toy2.yaml").write_text("task: arithmetic\n")
    assert _scan_recipes(tmp_path) == {"toy": "toy.yaml", "fleetish": "fleet/recipe.yaml", "broken": "broken.yaml",
                                       "binary": "binary.yaml", "toy2": "toy2.yaml"}
    (tmp_path / "fleetish.yaml").write_text("task: psqa\n")  # a named recipe keeps its name
    assert _scan_recipes(tmp_path)["fleetish"] == "fleet/recipe.yaml"
    (tmp_path / "again.yaml").write_text("name: toy\n")
    with pytest.raises(ValueError, match="both give name: toy"):
        _scan_recipes(tmp_path)


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
    assert (cfg.algo.staleness, cfg.algo.reuse_cap, cfg.checkpoint.interval) == (3, 2, 4)
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


OLD_OPTIM = """
name: old
task: arithmetic
algo:
  lr: 2.0e-5
  weight_decay: 0.01
  grad_clip: 0.5
  optim: {beta1: 0.8, beta2: 0.99, eps: 1.0e-7, lr_schedule: constant, lr_warmup_steps: 0, master_dtype: float32,
          moment_dtype: bfloat16}
train: {backend: megatron, optimizer_offload: 0.25}
"""


def test_a_recipe_with_the_old_optimizer_keys_means_what_it_meant(tmp_path):
    """The optimizer was split across algo, algo.optim and train; its settings are one `optim` section now, and
    a recipe file, an override or a printed plan using the old keys keeps its meaning."""
    old = tmp_path / "old.yaml"
    old.write_text(OLD_OPTIM)
    cfg = resolve(str(old), env={})
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.grad_clip, o.beta1, o.beta2, o.eps, o.moment_dtype, o.offload) == (
        2e-5, 0.01, 0.5, 0.8, 0.99, 1e-7, "bfloat16", 0.25)
    assert resolve(str(old), env={}, overrides={"algo.lr": 3e-5}).optim.lr == 3e-5  # an old-name override wins
    assert resolve(str(old), env={}, overrides={"optim.lr": 4e-5}).optim.lr == 4e-5
    assert RecipeConfig.model_validate(load_recipe_file(old)).optim == o  # a tree validated as it is
    with pytest.raises(ValueError, match="lr_schedule='cosine' is not supported"):
        resolve(str(old), env={}, overrides={"algo.optim.lr_schedule": "cosine"})
    both = tmp_path / "both.yaml"
    both.write_text(OLD_OPTIM + "optim: {lr: 1.0e-6}\n")
    with pytest.raises(ValueError, match="both algo.lr .* and optim.lr: keep optim.lr"):
        resolve(str(both), env={})


@pytest.mark.parametrize(("over", "says"), [
    ({"algo.lrr": 1e-5}, "'lrr' is no key of algo; known: objective"),
    ({"optim.lr": "fast"}, "override optim.lr='fast': Input should be a valid number"),
    ({"algo.groups_per_step": 0}, "override algo.groups_per_step=0: Input should be greater than or equal to 1"),
    ({"embedded.workers": 3}, "'embedded' is no key of the recipe"),
])
def test_embedded_overrides_are_typed_by_the_recipe_schema(over, says):
    """Each key of embedded.overrides names a recipe value and each value has that value's type, checked when the
    section validates (an untyped dotted-key dict took any of these until the run started)."""
    from embedded.config import EmbeddedConfig

    with pytest.raises(ValueError, match=re.escape(says)):
        EmbeddedConfig(overrides=over)
    with pytest.raises(ValueError, match=re.escape(says)):
        EmbeddedConfig(model_overrides=over)
    assert EmbeddedConfig(overrides={"algo.lr": 2e-5, "train.max_tokens_per_gpu": None}).overrides["algo.lr"] == 2e-5
