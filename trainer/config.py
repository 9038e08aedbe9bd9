"""One config system: pydantic models, YAML recipes under `runs/`, resolved in one place.

Precedence, lowest to highest (written down once, here):
    field defaults  <  runs/<recipe>.yaml  <  environment (DRL_* contract values)  <  command-line overrides
`resolve()` is the only function that applies it; the dry run prints what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from worker_contract.planes import PlaneName

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNS_DIR = REPO_ROOT / "runs"



def _scan_recipes(runs_dir: Path) -> dict[str, str]:
    """recipe name -> its file under runs/: every `runs/*.yaml` and `runs/*/recipe.yaml`, under the `name:` it
    gives (read as one top-level line, not parsed: every process start builds this). Two files of one name
    are refused. A file whose name cannot be read (not UTF-8, no `name:` line: a broken edit) is listed under
    its file's stem (the file name less `.yaml`, or the folder's name for a `recipe.yaml`) where no named recipe
    takes it, so that asking for it loads the file and the refusal names the file and what is wrong with it."""
    import re

    found: dict[str, str] = {}
    unnamed: list[tuple[str, str]] = []
    for path in sorted([*runs_dir.glob("*.yaml"), *runs_dir.glob("*/recipe.yaml")]):
        rel = path.relative_to(runs_dir).as_posix()
        text = path.read_bytes().decode("utf-8", errors="replace")
        m = re.search(r"^name:\s*['\"]?([A-Za-z0-9_.-]+)", text, re.MULTILINE)
        if m is None:
            unnamed.append((path.parent.name if path.name == "recipe.yaml" else path.stem, rel))
            continue
        if m[1] in found:
            raise ValueError(f"runs/{found[m[1]]} and runs/{rel} both give name: {m[1]}; rename one")
        found[m[1]] = rel
    for stem, rel in unnamed:
        found.setdefault(stem, rel)
    return found


#: recipe name -> file under runs/, derived from the files there (one registry; unknown names are refused with
#: this list): a new recipe is a file, nothing else
RECIPES: dict[str, str] = _scan_recipes(RUNS_DIR)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ContractConfig(_Model):
    """The cross-host contract every worker must match (docs/r2-setup.md section 5)."""

    n_samples: int = Field(8, ge=1, le=1024)
    """DRL_N_SAMPLES: group size. A group of any other size is dropped with a counted reason."""
    plane: PlaneName = "bf16"
    """DRL_PULSE_PLANE: the weight plane published and declared by workers; both sides fail closed on mismatch."""
    kv_mode: str | None = None
    """DRL_KV_MODE: workers' KV-cache mode; the fleet profile requires `paged_prefix`."""


class ModelConfig(_Model):
    """Which policy the run trains."""

    hf_id: str | None = None
    """Hugging Face repo id downloaded on the GPU box (e.g. Qwen/Qwen2.5-1.5B-Instruct)."""
    path: str | None = None
    """A local HF directory (config.json + safetensors + tokenizer); wins over hf_id. `MODEL=` sets it."""
    rotary_base: float | None = None
    """Rotary base to launch with; None = take the HF config's rope_theta. A value that differs is refused."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype of the learner."""


class GateConfig(_Model):
    """The asymmetric DPPO gate (docs/objective.md)."""

    divergence: Literal["tv", "kl"] = "tv"
    """Binary-TV or Binary-KL between the behaviour and current token probability."""
    delta_low: float = 0.2
    """Threshold on the negative-advantage side (p fell below p_behavior)."""
    delta_high: float = 0.2
    """Threshold on the positive-advantage side (p rose above p_behavior)."""


class OptimConfig(_Model):
    """AdamW, every setting in one place, read by both engines (the native optimizer's param groups, the slime
    launch's flags; tests/test_optim_parity.py fails on any difference between them) and by the memory plan.
    Fixed, not settings: a constant learning rate with no warm-up (an RL run has no known length to decay
    over) and float32 master weights (the model computes in `model.dtype`)."""

    lr: float = 1e-6
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    beta1: float = Field(0.9, gt=0, lt=1)
    """Adam's first-moment decay."""
    beta2: float = Field(0.999, gt=0, lt=1)
    """Adam's second-moment decay. 0.999 for our recipes: the value the native quickstart was verified with
    (docs/performance.md); the slime launch passed a hard-coded 0.98 before, so slime runs now use 0.999."""
    eps: float = Field(1e-8, gt=0)
    """Adam's epsilon."""
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of Adam's two moments. `bfloat16` (native engine, megatron backend): stored in bf16, computed in
    float32 from float32 master weights, as DeepSeek-V3 trained; half their memory (bench/results/lfm2_moments_cpu.json
    compares the loss curves)."""
    offload: float = Field(0.0, ge=0, le=1)
    """megatron backend (native engine; slime: Megatron's --optimizer-offload-fraction): the share of parameters,
    largest first, whose float32 master weights and Adam moments live in pinned host memory; each step streams
    them through the GPU for the update (PCIe time, no CPU arithmetic). 0 keeps every state on the GPU. The GPU
    then holds per parameter only the bf16 weights, the bf16 reference and the float32 gradient
    (docs/performance.md)."""


class AlgoConfig(_Model):
    """The learner's objective and data gates (docs/objective.md)."""

    objective: str = "recipe"
    """The policy-gradient term, a name in trainer/objectives.py's registry. `recipe`: the DPPO gate and
    dual-clip PPO on the ratio to the behaviour policy; `ppo`: plain PPO clipping on that ratio, no gate, no dual
    clip; `no_is`: no importance correction (the gradient -A grad log pi, as if every group were on-policy). The
    last two exist to measure the recipe against (bench/staleness.py); advantages, reducer and KL term are the
    same for all."""
    groups_per_step: int = Field(8, ge=1)
    """Prompt groups per learner step."""
    staleness: int = Field(3, ge=0)
    """Rollouts sampled more than this many versions ago are dropped."""
    reuse_cap: int = Field(2, ge=1)
    """A prompt group is used at most this many times."""
    gate: GateConfig = GateConfig()
    eps_clip: float = 0.2
    """Lower PPO clip (ratio floor 1 - eps_clip)."""
    eps_clip_high: float = 0.28
    """Upper PPO clip (ratio ceiling 1 + eps_clip_high)."""
    eps_clip_c: float = 3.0
    """Dual-clip constant c > 1: the loss of a negative-advantage token is capped at c*|A|."""
    kl_coef: float = 0.001
    """Coefficient of the k3 KL to the reference model."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides logits by it too, so ratios compare like with like."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus cutoff (1.0 = off). Only 1.0 is accepted for now (`_top_p_is_scored`)."""
    max_new_tokens: int = Field(1024, ge=1)
    """Response budget; also the Dr.GRPO reducer's constant length."""
    routing_replay: bool = False
    """MoE models: every learner forward on a record (policy, audit and frozen reference) sends each token to
    the experts the worker's forward routed it to (the record's routes), with the gating weights still
    computed by the learner's router over those experts, so the router keeps learning. A record without
    routes is then dropped (routes_missing). Dense models: no effect (docs/objective.md, routing replay)."""

    @field_validator("objective")
    @classmethod
    def _objective_is_registered(cls, v: str) -> str:
        from .objectives import get_objective

        return get_objective(v).name

    @field_validator("top_p")
    @classmethod
    def _top_p_is_scored(cls, v: float) -> float:
        """Workers record each token's log-prob under the distribution they drew it from, which at top_p < 1
        is the renormalised nucleus; the learner (and its audit) recomputes the full temperature-scaled
        softmax. Until it scores the truncated distribution, a run at top_p < 1 would train against a
        behaviour policy it never recomputes, so such a recipe is refused (docs/contract.md)."""
        if v < 1.0:
            raise ValueError("top_p < 1 is refused: workers record log-probs under the renormalised nucleus they "
                             "sample from, while the learner recomputes the full temperature-scaled softmax, so "
                             "every ratio to the behaviour policy would be off by the nucleus mass; set "
                             "algo.top_p: 1.0, as the shipped recipes do")
        return v


class CheckpointConfig(_Model):
    """Learner checkpoints on disk (model, optimizer, RNG, step, consumption ledger), both engines."""

    interval: int = Field(4, ge=1)
    """Checkpoint every this many steps."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk: the newest and the ones before it (2 = newest + one previous)."""


class ComputeConfig(_Model):
    """How a step runs on the learner's devices: chunking, parallelism, precision of the forward, recompute and
    graphs. A memory and speed plan: the update is the same whatever these hold."""

    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The dtype of the forward and backward (hf backend: the weights stay float32; megatron backend: the
    model's weights, with float32 master weights). `auto`: model.dtype on CUDA, float32 on CPU. The embedded run's small model takes float32 on a GPU too: in bf16 it is measurably
    another model than the float32 one its CPU workers sample (docs/embedded.md)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward chunk (at most)."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """Padded tokens per forward/backward chunk on one GPU (rows x longest sequence), as slime's
    `--max-tokens-per-gpu` with `--use-dynamic-batch-size`; when set, micro_batch_size is not used. Larger
    chunks mean fewer, larger kernel launches (faster) and more activation memory; the update is the same."""
    cuda_graphs: bool = False
    """megatron backend, tensor_parallel 1: replay the training pass's decoder as CUDA graphs, one per
    micro-batch shape (lengths padded to a multiple of 128). Pays where micro-batches are small (the
    forward is then launch-bound); costs a few seconds of capture per new shape."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (megatron backend)."""
    vocab_chunk: int = Field(8192, ge=1)
    """Vocabulary rows per chunk when computing log-probs (bounds the logits held at once)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (hf backend; megatron backend: each decoder layer's, from its input):
    less memory, about a third more compute."""


class TrainConfig(_Model):
    """The learner's loop: which engine and backend, how long, its seed, how it polls and how often it anchors."""

    engine: Literal["native", "slime"] = "native"
    """Which learner a GPU box runs: `native`, our Ray learner (trainer/native/learner.py) with `backend`, on any
    CUDA box with torch, megatron-core and Ray; or `slime`, slime's train.py with our plugin (the slime
    image). The embedded run on a machine without a GPU is always native. `ENGINE=` on the make line."""
    backend: Literal["hf", "megatron"] = "hf"
    """Learner backend: transformers (CPU, single GPU) or megatron-core (GPU scale)."""
    anchor_interval: int = Field(10, ge=1)
    """A full anchor every this many versions (bounds a cold joiner's catch-up)."""
    num_steps: int = Field(1000, ge=1)
    """Learner steps before the run ends."""
    seed: int = 1234
    """Global seed."""
    poll_interval_s: float = 2.0
    """How often the rollout source lists the bucket when it is waiting for groups."""



class LaunchConfig(_Model):
    """The slime launch on a GPU box (the real trainer)."""

    slime_dir: str = "/root/slime"
    """Where slime is checked out in the image."""
    megatron_dir: str = "/root/Megatron-LM"
    """Where Megatron-LM is checked out in the image."""
    remote_dir: str = "/root/dRL"
    """Where our tree is shipped on the box."""
    extra_args: list[str] = []
    """Extra slime flags appended verbatim (prefer a recipe field)."""


class PreflightConfig(_Model):
    """What the preflight (infra/preflight.py) holds a launch of this recipe to: its profile's name and the
    recipe keys whose values the launch may not change. The required values are this recipe's own (its file
    over the defaults), never copies of them."""

    profile: str = "quickstart"
    """The profile name DRL_PREFLIGHT_PROFILE (or --profile) selects this recipe's checks by; a launch of this
    recipe is checked under it by default."""
    pinned: list[str] = ["contract.n_samples", "contract.plane"]
    """Recipe keys (dotted) whose launch value must equal this recipe's: the environment or command line may not
    move them. Keys the preflight compares: contract.n_samples, contract.plane, contract.kv_mode,
    checkpoint.interval, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c, algo.staleness, algo.reuse_cap,
    algo.kl_coef, algo.groups_per_step."""
    remote_store: bool = False
    """Workers run on other machines, so the store must be r2:// or s3:// even without a HOST."""
    min_free_disk_gb: float = 100.0
    """Free disk the box needs when the model's size is not known (for a known model the preflight computes it:
    infra.slime_launch.disk_need_gb)."""

    @field_validator("pinned")
    @classmethod
    def _pinned_keys_are_compared(cls, v: list[str]) -> list[str]:
        bad = [k for k in v if k not in PINNABLE]
        if bad:
            raise ValueError(f"preflight.pinned names {', '.join(bad)}, which the preflight does not compare; "
                             f"use some of: {', '.join(PINNABLE)}")
        return v


#: the recipe keys a preflight profile can pin (each has its check in infra/preflight_checks.py)
PINNABLE = ("contract.n_samples", "contract.plane", "contract.kv_mode", "checkpoint.interval", "algo.eps_clip",
            "algo.eps_clip_high", "algo.eps_clip_c", "algo.staleness", "algo.reuse_cap", "algo.kl_coef",
            "algo.groups_per_step")


class RecipeConfig(_Model):
    """A complete run recipe: what `make <recipe> RUN=...` runs."""

    name: str
    """Recipe name (gsm8k, psqa)."""
    task: str
    """Task registry name shared by worker and trainer."""
    run: str | None = None
    """DRL_RUN: the run id (bucket prefix). Set from the environment or command line, never in a recipe."""
    store: str | None = None
    """DRL_STORE: store URL; None = R2 when credentials exist, else the embedded file store."""
    contract: ContractConfig = ContractConfig()
    model: ModelConfig = ModelConfig()
    algo: AlgoConfig = AlgoConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    compute: ComputeConfig = ComputeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()
    preflight: PreflightConfig = PreflightConfig()
    embedded: dict[str, Any] = {}
    """The local runs' section, as the recipe gives it: embedded/config.py validates it (EmbeddedRecipe); the
    learner and the GPU launch read none of it."""

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """A recipe written with the keys before a section moved means what it meant (`RENAMED`)."""
        return migrate(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _memory_plan_needs_megatron(self) -> RecipeConfig:
        on_hf = (self.train.engine, self.train.backend) == ("native", "hf")
        if self.optim.moment_dtype != "float32" and on_hf:
            raise ValueError("optim.moment_dtype=bfloat16 runs on the megatron backend (native engine) or on "
                             "slime, not on train.backend: hf: set train.backend: megatron, or moment_dtype: float32")
        if self.optim.offload > 0 and on_hf:
            raise ValueError("optim.offload runs on the megatron backend (native engine) or on slime, not "
                             "on train.backend: hf: set train.backend: megatron, or optim.offload: 0")
        return self

    @model_validator(mode="after")
    def _replay_runs_eagerly(self) -> RecipeConfig:
        if self.algo.routing_replay and self.compute.cuda_graphs:
            raise ValueError("algo.routing_replay cannot run under compute.cuda_graphs (a captured decoder replays the "
                             "routes it was captured with): set compute.cuda_graphs: false, or algo.routing_replay: false")
        return self

    @model_validator(mode="after")
    def _objective_runs_on_the_engine(self) -> RecipeConfig:
        from .objectives import check_engine

        check_engine(self.algo.objective, self.train.engine)
        return self


def recipe_path(name: str) -> Path:
    """A registered recipe's file, or `name` itself when it is a path to a recipe YAML (`--recipe my.yaml`),
    validated like the registered ones."""
    if name in RECIPES:
        return RUNS_DIR / RECIPES[name]
    path = Path(name).expanduser()
    if "/" in name or path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"recipe file {name!r} {'is not a file' if path.exists() else 'does not exist'}: "
                             f"give a recipe YAML file or one of the recipes {', '.join(sorted(RECIPES))}")
        return path.resolve()
    raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}, or the path of a "
                     "recipe YAML file")


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


#: recipe keys that moved to their owner's section: old dotted key -> new. A recipe, an override or a printed
#: launch plan that uses the old key means what it meant (the optimizer was split across algo, algo.optim and
#: train before it became one `optim` section; checkpoints and the compute plan were fields of train)
RENAMED: dict[str, str] = {
    "algo.lr": "optim.lr", "algo.weight_decay": "optim.weight_decay", "algo.grad_clip": "optim.grad_clip",
    "algo.optim.beta1": "optim.beta1", "algo.optim.beta2": "optim.beta2", "algo.optim.eps": "optim.eps",
    "algo.optim.moment_dtype": "optim.moment_dtype", "train.optimizer_offload": "optim.offload",
    "train.save_interval": "checkpoint.interval", "train.keep_checkpoints": "checkpoint.keep",
    "train.compute_dtype": "compute.dtype", "train.micro_batch_size": "compute.micro_batch_size",
    "train.max_tokens_per_gpu": "compute.max_tokens_per_gpu",
    "train.tensor_parallel": "compute.tensor_parallel",
    "train.cuda_graphs": "compute.cuda_graphs",
    "train.gradient_checkpointing": "compute.gradient_checkpointing",
    "train.vocab_chunk": "compute.vocab_chunk",
}
#: old keys that accepted one value only and are gone: that value is dropped, any other is refused
DROPPED: dict[str, Any] = {"algo.optim.lr_schedule": "constant", "algo.optim.lr_warmup_steps": 0,
                           "algo.optim.master_dtype": "float32"}


def _pop_dotted(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _dropped(dotted: str, value: Any) -> bool:
    """True for a gone key holding its one accepted value; a ValueError naming the key for any other value."""
    if dotted not in DROPPED:
        return False
    if value != DROPPED[dotted]:
        raise ValueError(f"{dotted}={value!r} is not supported: only {DROPPED[dotted]!r} ever was, and the key is "
                         "gone; remove it from the recipe")
    return True


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe tree with every old key (`RENAMED`, `DROPPED`) moved to its section; a tree giving one value
    under both the old and the new key is refused."""
    import copy

    tree = copy.deepcopy(dict(data))
    for old, new in RENAMED.items():
        found, value = _pop_dotted(tree, old)
        if not found:
            continue
        if _pop_dotted(copy.deepcopy(tree), new)[0]:
            raise ValueError(f"the recipe gives both {old} (its old name) and {new}: keep {new}")
        _set_dotted(tree, new, value)
    for old in DROPPED:
        found, value = _pop_dotted(tree, old)
        if found:
            _dropped(old, value)
    algo = tree.get("algo")
    if isinstance(algo, dict) and algo.get("optim") == {}:
        del algo["optim"]
    return tree


def check_override(dotted: str, value: Any) -> Any:
    """`value` checked as the recipe key `dotted` (an old name means its new key): a key that names no leaf of
    the recipe, or a value of the wrong type or out of range, is a ValueError naming the key, the value and the
    known keys. What an override section (`embedded.overrides`) holds is typed by this."""
    from pydantic import TypeAdapter

    if _dropped(dotted, value):
        return value
    parts = RENAMED.get(dotted, dotted).split(".")
    node: type[BaseModel] = RecipeConfig
    for i, part in enumerate(parts):
        if part not in node.model_fields or part == "embedded":
            where = ".".join(parts[:i]) or "the recipe"
            known = ", ".join(k for k in node.model_fields if k != "embedded")
            raise ValueError(f"override {dotted}={value!r}: {part!r} is no key of {where}; known: {known}")
        field = node.model_fields[part]
        if i < len(parts) - 1:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                raise ValueError(f"override {dotted}={value!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
            node = field.annotation
    try:
        kind = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"override {dotted}={value!r}: {msg}") from None


def _check_overrides(values: dict[str, Any]) -> dict[str, Any]:
    return {k: check_override(k, v) for k, v in values.items()}


#: recipe values keyed by their dotted recipe key, each key and value checked against the recipe's schema
#: (`check_override`): the type of a section of overrides, such as `embedded.overrides`
RecipeOverrides = Annotated[dict[str, Any], AfterValidator(_check_overrides)]


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    if _dropped(dotted, value):
        return
    dotted = RENAMED.get(dotted, dotted)
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {p!r} is not a section")
    node[leaf] = value


#: environment variable -> dotted config field (the env layer of the precedence)
ENV_FIELDS: dict[str, str] = {
    "DRL_RUN": "run",
    "DRL_STORE": "store",
    "DRL_N_SAMPLES": "contract.n_samples",
    "DRL_PULSE_PLANE": "contract.plane",
    "DRL_KV_MODE": "contract.kv_mode",
}
#: environment variable -> its field of worker_contract.env.EnvContract (the parsed, checked value)
_CONTRACT_ATTR = {"DRL_RUN": "run", "DRL_STORE": "store", "DRL_N_SAMPLES": "n_samples", "DRL_PULSE_PLANE": "plane",
                  "DRL_KV_MODE": "kv_mode"}


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    """A recipe YAML as a mapping; a file that does not parse is a ValueError naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text: a recipe is a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    return data


def _validation_sentence(what: str, e: Any, from_env: Mapping[str, str]) -> str:
    """pydantic's errors as one line after `what`: each names the recipe key (or the variable that set it) and
    its value."""
    parts = []
    for err in e.errors():
        if not err["loc"]:  # a check across sections: its message names the keys
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        dotted = ".".join(str(x) for x in err["loc"])
        var = from_env.get(dotted)
        name = var or dotted
        base, _, flag = name.partition(" (")  # "ENGINE (--engine)": the variable, then the flag
        shown = (f"{base}={err['input']!r}" + (f" ({flag}" if flag else "")) if err["type"] != "missing" else name
        parts.append(f"{shown}: {err['msg'].removeprefix('Value error, ')}")
    return f"{what}: " + "; ".join(parts)


def validate_resolved(tree: Mapping[str, Any], source: str) -> RecipeConfig:
    """A recipe resolved elsewhere and read back (the launch plan a dry run printed), checked again with the
    same rules as `resolve` and refused in one line naming `source`, the key and its value."""
    try:
        return RecipeConfig.model_validate(tree)
    except ValidationError as e:
        raise ValueError(_validation_sentence(f"{source} does not validate", e, {})) from None


def resolve(
    recipe: str,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    override_names: Mapping[str, str] | None = None,
    after_yaml: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
    schema: type[RecipeConfig] = RecipeConfig,
) -> RecipeConfig:
    """Resolve a recipe: defaults < runs/<recipe>.yaml < environment < `overrides` (dotted keys).

    `override_names` says what the user typed for an override (`train.engine` -> `ENGINE`), so an error
    names that instead of the recipe key. `after_yaml(tree)` gives dotted values applied right after the
    YAML, so the environment and command line still win over them; `schema` is the model that validates
    the result (a subclass that types a section the learner does not read: embedded/config.py).
    """
    import os

    env = os.environ if env is None else env
    tree = migrate(load_recipe_file(recipe_path(recipe)))
    for dotted, value in dict(after_yaml(tree) if after_yaml else {}).items():
        _set_dotted(tree, dotted, value)
    from worker_contract.env import parse_env

    contract = parse_env(env)  # the one validation of DRL_*: strict integers, planes, store URLs, run ids
    from_env: dict[str, str] = {}
    for var, dotted in ENV_FIELDS.items():
        if env.get(var, "").strip():
            _set_dotted(tree, dotted, getattr(contract, _CONTRACT_ATTR[var]))
            from_env[dotted] = var
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
            if dotted in (override_names or {}):
                from_env[dotted] = override_names[dotted]
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise ValueError(_validation_sentence(f"recipe {recipe!r} ({recipe_path(recipe)}) does not resolve", e,
                                              from_env)) from None
