"""The resolved slime launch for a run, generated from its recipe (runs/*.yaml): one function per part.

Everything here is data-driven from `RecipeConfig`; the GSM8K quickstart and the PaperSearchQA fleet differ
only in their recipe values (the fleet's --save-interval 4, --eps-clip 10000 --eps-clip-high 19
--eps-clip-c 20 are its recipe's numbers, not code). What slime does with each flag: docs/slime.md.
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer.config import RecipeConfig

TrainerOnly = Literal["rollout-num-gpus-0", "debug-train-only"]

#: dotted paths slime loads inside its Ray actors (our tree is on PYTHONPATH through the runtime env)
PLUGIN = "trainer.slime_plugin"
ROLLOUT_FN = f"{PLUGIN}.rollout.generate_rollout"
REWARD_POST_FN = f"{PLUGIN}.objective.drgrpo_rewards"
GATE_FN = f"{PLUGIN}.objective.dppo_gate"
REDUCER_FN = f"{PLUGIN}.objective.drgrpo_reducer"
PUBLISH_HOOK_FN = f"{PLUGIN}.publish.after_train"
# the worker audit on slime's recomputed log-probs (slime calls it as (args, rollout_id, rollout_data))
AUDIT_FN = f"{PLUGIN}.audit.audit_rollout_data"
#: the flag our patch 0001 adds to slime (infra/patches/0001-after-train-hook.patch)
AFTER_TRAIN_FLAG = "--custom-after-train-hook-path"
DASHBOARD = "http://127.0.0.1:8265"


#: a line of slime's actor.py that exists exactly since PR #2057 (the no-engine short-circuit)
_NO_ENGINE_MARK = "No updatable SGLang engines are running"


def detect_trainer_only(slime_dir: str) -> TrainerOnly | None:
    """The trainer-only mode the slime tree at `slime_dir` supports; None if there is no tree to read."""
    actor = Path(slime_dir) / "slime" / "backends" / "megatron_utils" / "actor.py"
    try:
        text = actor.read_text()
    except OSError:
        return None
    return "rollout-num-gpus-0" if _NO_ENGINE_MARK in text else "debug-train-only"


class BoxPaths(BaseModel):
    """Where a run's files live on the GPU box; every path derives from `remote_dir` and the run id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    remote_dir: str
    run: str
    model_dir_override: str | None = None

    @property
    def _root(self) -> PurePosixPath:
        return PurePosixPath(self.remote_dir)

    @property
    def env_file(self) -> str:
        return str(self._root / ".r2env")

    @property
    def state_dir(self) -> str:
        return str(self._root / ".stoa" / "runs" / self.run)

    @property
    def models_dir(self) -> str:
        return str(self._root / ".stoa" / "models")

    def hf_dir(self, hf_id: str | None) -> str:
        if self.model_dir_override:
            return self.model_dir_override
        if not hf_id:
            raise ValueError("model.hf_id is not set and no MODEL= directory was given; set one of them")
        return str(PurePosixPath(self.models_dir) / re.sub(r"[^A-Za-z0-9._-]", "--", hf_id))

    def torch_dist_dir(self, hf_id: str | None) -> str:
        return str(PurePosixPath(self.models_dir) / (PurePosixPath(self.hf_dir(hf_id)).name + "_torch_dist"))

    @property
    def ckpt_dir(self) -> str:
        return str(PurePosixPath(self.state_dir) / "ckpt")

    @property
    def compile_cache_dir(self) -> str:
        return str(PurePosixPath(self.state_dir) / "compile-cache")

    @property
    def recipe_file(self) -> str:
        return str(PurePosixPath(self.state_dir) / "recipe.json")

    @property
    def key_file(self) -> str:
        return str(PurePosixPath(self.state_dir) / "trainer.key")

    @property
    def pid_file(self) -> str:
        return str(PurePosixPath(self.state_dir) / "trainer.pid")

    @property
    def log_file(self) -> str:
        return str(self._root / "logs" / f"{self.run}.log")


# -- model flags from the HF config ---------------------------------------------------------------------
#: Architecture facts of the recipe models, used only when a dry run cannot read config.json (the model is
#: downloaded on the box). On the box the flags always come from the downloaded config.json.
KNOWN_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960,
        "num_attention_heads": 12, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    # LFM2.5-8B-A1B (lfm2_moe): 24 layers, attention at 2, 6, 10, 14, 18, 21, the rest gated short convs
    "LiquidAI/LFM2.5-8B-A1B": {
        "model_type": "lfm2_moe", "num_hidden_layers": 24, "hidden_size": 2048, "intermediate_size": 7168,
        "moe_intermediate_size": 1792, "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5,
        "rope_theta": 1000000.0, "vocab_size": 65536, "tie_word_embeddings": True, "num_dense_layers": 2,
        "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "conv_L_cache": 3, "conv_bias": False,
        "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    },
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def rotary_base(cfg: RecipeConfig, hf_config: Mapping[str, Any]) -> float:
    """The rotary base to launch with: the HF rope_theta; a recipe value that differs is refused."""
    from trainer.models.identity import checked_rotary_base

    return checked_rotary_base(hf_config, cfg.model.rotary_base)


def model_args(cfg: RecipeConfig, hf_config: Mapping[str, Any]) -> list[str]:
    """The model's Megatron-LM flags, from its architecture (trainer/models/registry.py): an unknown
    model_type, or one with no slime flags, is refused in one sentence."""
    from trainer.models.registry import get_architecture

    return get_architecture(hf_config).slime_model_flags(hf_config, rotary_base(cfg, hf_config))


# -- the box's disk -------------------------------------------------------------------------------------
#: bytes per parameter on the box's disk: the HF download and its torch_dist copy (bf16, 2 + 2), and each
#: slime (Megatron) checkpoint (bf16 weights, the fp32 master copy, two fp32 Adam moments: 2 + 4 + 8)
MODEL_BYTES, CHECKPOINT_BYTES = 4, 14
#: a native-engine checkpoint per parameter: the fp32 masters (the weights are made from them on resume) and
#: Adam's two moments in optim.moment_dtype
NATIVE_MASTER_BYTES, MOMENT_BYTES = 4, {"float32": 4, "bfloat16": 2}
#: logs, the compile caches, the state dir
DISK_SLACK_GB = 5.0


def model_params(c: Mapping[str, Any]) -> int | None:
    """Parameters of a recipe model from its HF config (dense decoders and LFM2-MoE); None for others."""
    from infra.learner_memory import dense_params

    if c.get("model_type") != "lfm2_moe":
        return dense_params(c)
    h, n, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c["num_attention_heads"])
    kv, d = int(c.get("num_key_value_heads") or heads), h // heads
    attention = 2 * h * heads * d + 2 * h * kv * d + 2 * d
    conv = 3 * h * h + h * h + h * int(c.get("conv_L_cache", 3))  # in_proj (B, C, x), out_proj, depthwise taps
    dense_ffn, experts = 3 * h * int(c["intermediate_size"]), int(c["num_experts"])
    moe_ffn = experts * 3 * h * int(c["moe_intermediate_size"]) + experts * (h + 1)
    kinds = c.get("layer_types") or ["conv"] * n
    mixers = sum(attention if k == "full_attention" else conv for k in kinds)
    dense = int(c.get("num_dense_layers", 2))
    ffns = dense * dense_ffn + (n - dense) * moe_ffn
    return vocab * h * (1 if c.get("tie_word_embeddings", True) else 2) + mixers + ffns + (2 * n + 1) * h


def hf_config_for(cfg: RecipeConfig, paths: BoxPaths) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json if it is on this machine, else the built-in facts; and where it came from."""
    candidate = Path(paths.hf_dir(cfg.model.hf_id)) / "config.json"
    if candidate.is_file():
        from trainer.models.hf_io import load_hf_config

        return load_hf_config(candidate.parent), str(candidate)  # not JSON, not an object: one sentence naming it
    if cfg.model.hf_id in KNOWN_HF_CONFIGS:
        return dict(KNOWN_HF_CONFIGS[cfg.model.hf_id]), (
            f"built-in architecture facts of {cfg.model.hf_id} (on the box: the downloaded config.json)")
    return None, f"{candidate} (not on this machine)"


def reused_model_dirs(cfg: RecipeConfig, paths: BoxPaths) -> list[str]:
    """The recipe's model directories on the box a launch reuses (the HF download; on slime, its torch_dist
    conversion too): what the disk checks count as room already taken by this launch."""
    if not cfg.model.hf_id:
        return []
    dirs = [paths.hf_dir(cfg.model.hf_id)]
    return dirs + [paths.torch_dist_dir(cfg.model.hf_id)] if cfg.train.engine == "slime" else dirs


def disk_floor_gb(cfg: RecipeConfig, hf_config: Mapping[str, Any] | None) -> float:
    """Free disk a launch of `cfg` needs on the box: `disk_need_gb` where the model's size is known, else the
    recipe's `preflight.min_free_disk_gb`. The launch's box check and the preflight's box.disk hold the box to it."""
    need = disk_need_gb(cfg, hf_config) if hf_config is not None else None
    return need if need is not None else cfg.preflight.min_free_disk_gb


def disk_need_gb(cfg: RecipeConfig, hf_config: Mapping[str, Any]) -> float | None:
    """Disk the run needs under the remote dir: the model twice, and `checkpoint.keep` + 1 checkpoints
    (K complete ones and the one being written) of the engine's size (`checkpoint_bytes`)."""
    params = model_params(hf_config)
    if params is None:
        return None
    ckpts = cfg.checkpoint.keep + 1
    return round(params * (MODEL_BYTES + ckpts * checkpoint_bytes(cfg)) / 1e9 + DISK_SLACK_GB)


def checkpoint_bytes(cfg: RecipeConfig) -> int:
    """Bytes per parameter of one checkpoint: slime's Megatron checkpoint, or the native engine's masters
    and moments (12 with float32 moments, 8 with bfloat16)."""
    if cfg.train.engine == "native":
        return NATIVE_MASTER_BYTES + 2 * MOMENT_BYTES[cfg.optim.moment_dtype]
    return CHECKPOINT_BYTES


# -- the slime flags ------------------------------------------------------------------------------------
def cluster_args(cfg: RecipeConfig, trainer_only: TrainerOnly) -> list[str]:
    gpus = cfg.compute.tensor_parallel
    args = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(gpus)]
    return args + (["--rollout-num-gpus", "0"] if trainer_only == "rollout-num-gpus-0" else ["--debug-train-only"])


def checkpoint_args(cfg: RecipeConfig, paths: BoxPaths) -> list[str]:
    hf_id = cfg.model.hf_id
    return [
        "--hf-checkpoint", paths.hf_dir(hf_id), "--ref-load", paths.torch_dist_dir(hf_id),
        "--load", paths.ckpt_dir, "--save", paths.ckpt_dir, "--save-interval", str(cfg.checkpoint.interval),
    ]


def rollout_args(cfg: RecipeConfig) -> list[str]:
    a, n = cfg.algo, cfg.contract.n_samples
    return [
        "--rollout-function-path", ROLLOUT_FN, "--disable-rollout-global-dataset",
        "--num-rollout", str(cfg.train.num_steps),
        "--rollout-batch-size", str(a.groups_per_step), "--n-samples-per-prompt", str(n),
        "--global-batch-size", str(a.groups_per_step * n),
        "--rollout-max-response-len", str(a.max_new_tokens),
        "--rollout-temperature", _num(a.temperature), "--rollout-top-p", _num(a.top_p),
    ]


def objective_args(cfg: RecipeConfig) -> list[str]:
    """slime's flags for the recipe's objective; one slime's hooks cannot build is refused in one sentence."""
    from trainer.objectives import check_engine

    a = cfg.algo
    check_engine(a.objective, "slime")
    return [
        "--advantage-estimator", "grpo", "--disable-grpo-std-normalization",
        "--custom-reward-post-process-path", REWARD_POST_FN,
        "--use-rollout-logprobs",
        "--eps-clip", _num(a.eps_clip), "--eps-clip-high", _num(a.eps_clip_high), "--eps-clip-c", _num(a.eps_clip_c),
        "--use-kl-loss", "--kl-loss-coef", _num(a.kl_coef), "--kl-loss-type", "low_var_kl", "--entropy-coef", "0",
        "--get-mismatch-metrics", "--custom-tis-function-path", GATE_FN,
        "--custom-pg-loss-reducer-function-path", REDUCER_FN,
        "--rollout-data-postprocess-path", AUDIT_FN,
        AFTER_TRAIN_FLAG, PUBLISH_HOOK_FN,
        # slime's own rollout routing replay (both checked slime commits have it): the records' routes, which
        # trainer/slime_plugin/rollout.py hands over as each Sample's rollout_routed_experts
        *(["--use-rollout-routing-replay"] if a.routing_replay else []),
    ]


def moment_bytes(cfg: RecipeConfig, offload: float | None = None) -> int:
    """Bytes of each Adam moment the engine keeps under the recipe's plan (`offload`: optim.offload
    unless given). The native engine keeps optim.moment_dtype. On slime, bf16 moments come from Megatron's
    precision-aware optimizer, but with --optimizer-cpu-offload Megatron-LM builds its HybridDeviceOptimizer from
    the learning rate, betas, eps and weight decay alone (no moment dtype): torch's AdamW on float32 copies of
    the weights, so the moments are float32 on the host and on the GPU alike."""
    offload = cfg.optim.offload if offload is None else offload
    if cfg.train.engine == "slime" and offload > 0:
        return 4
    return MOMENT_BYTES[cfg.optim.moment_dtype]


def host_optimizer_bytes(cfg: RecipeConfig) -> int:
    """Bytes of host memory per offloaded parameter: the native engine's float32 master and two moments in
    optim.moment_dtype; slime's HybridDeviceOptimizer keeps a float32 master, a pinned float32 gradient
    buffer (the GPU's gradient is copied there for the CPU update) and two float32 moments, 16 bytes."""
    if cfg.train.engine == "slime":
        return 4 + 4 + 2 * moment_bytes(cfg)
    return NATIVE_MASTER_BYTES + 2 * moment_bytes(cfg)


def optimizer_args(cfg: RecipeConfig) -> list[str]:
    """AdamW from the recipe's `optim` section (the native learner reads the same fields); fp32 master weights
    and moments are Megatron's defaults. bf16 moments through Megatron's precision-aware optimizer, and
    `optim.offload` through its CPU offload of that share; with the offload Megatron keeps float32
    moments whatever --exp-avg-dtype says (`moment_bytes`), and the host holds 16 bytes per offloaded parameter
    (`host_optimizer_bytes`)."""
    o, offload = cfg.optim, cfg.optim.offload
    args = [
        "--optimizer", "adam", "--lr", _num(o.lr), "--lr-decay-style", "constant",
        "--lr-warmup-iters", "0", "--weight-decay", _num(o.weight_decay),
        "--adam-beta1", _num(o.beta1), "--adam-beta2", _num(o.beta2), "--adam-eps", _num(o.eps),
        "--clip-grad", _num(o.grad_clip), "--seed", str(cfg.train.seed),
    ]
    if o.moment_dtype == "bfloat16":
        args += ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    if offload > 0:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", _num(offload)]
    return args


def perf_args(cfg: RecipeConfig, hf_config: Mapping[str, Any] | None = None) -> list[str]:
    """Parallelism, batching and precision. Sequence parallelism at TP > 1, except for a model with short
    conv layers (LFM2's `layer_types`): the conv runs along the sequence and refuses a split one."""
    tp = cfg.compute.tensor_parallel
    convs = "conv" in ((hf_config or {}).get("layer_types") or [])
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1",
            "--context-parallel-size", "1", "--micro-batch-size", str(cfg.compute.micro_batch_size)]
    if cfg.compute.max_tokens_per_gpu is not None:  # token-budget micro-batches, as our backends do
        args += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(cfg.compute.max_tokens_per_gpu)]
    if tp > 1 and not convs:
        args.append("--sequence-parallel")
    if cfg.model.dtype == "bfloat16":
        args.append("--bf16")
    if cfg.compute.gradient_checkpointing:  # as the native learner: every decoder layer recomputed in backward
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return args + ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                   "--attention-softmax-in-fp32", "--attention-backend", "flash"]


def slime_args(cfg: RecipeConfig, paths: BoxPaths, hf_config: Mapping[str, Any], *,
               trainer_only: TrainerOnly = "rollout-num-gpus-0") -> list[str]:
    """Every flag after `train.py`, in a fixed order (tests compare flag by flag)."""
    return [
        *cluster_args(cfg, trainer_only), *model_args(cfg, hf_config), *checkpoint_args(cfg, paths),
        *rollout_args(cfg), *objective_args(cfg), *optimizer_args(cfg), *perf_args(cfg, hf_config),
        *cfg.launch.extra_args,
    ]


def runtime_env(cfg: RecipeConfig, paths: BoxPaths) -> dict[str, Any]:
    """The Ray runtime env of the job: our tree and Megatron on PYTHONPATH, where the plugin finds its run.

    Credentials are never in here: the plugin reads them from `DRL_ENV_FILE` (mode 0600) on the box. The
    compile caches are the run's own: slime torch.compile's its policy loss with the clip bounds as
    constants, and a cache shared by runs on one box (~/.cache, /tmp) can give a run another's kernels.
    """
    return {"env_vars": {
        "TORCHINDUCTOR_CACHE_DIR": paths.compile_cache_dir + "/inductor",
        "TRITON_CACHE_DIR": paths.compile_cache_dir + "/triton",
        "PYTHONPATH": f"{cfg.launch.megatron_dir}:{paths.remote_dir}",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTHONUNBUFFERED": "1",
        "DRL_RECIPE_FILE": paths.recipe_file,
        "DRL_ENV_FILE": paths.env_file,
        "DRL_STATE_DIR": paths.state_dir,
    }}


def launch_command(cfg: RecipeConfig, paths: BoxPaths, hf_config: Mapping[str, Any], *,
                   trainer_only: TrainerOnly = "rollout-num-gpus-0") -> list[str]:
    """`ray job submit` of slime's synchronous train.py with our flags (argv form)."""
    train_py = str(PurePosixPath(cfg.launch.slime_dir) / "train.py")
    return [
        "ray", "job", "submit", "--address", DASHBOARD,
        "--metadata-json", json.dumps({"stoa_run": paths.run}, separators=(",", ":")),
        "--runtime-env-json", json.dumps(runtime_env(cfg, paths), separators=(",", ":"), sort_keys=True),
        "--", "python3", train_py, *slime_args(cfg, paths, hf_config, trainer_only=trainer_only),
    ]


def quote(argv: list[str]) -> str:
    return shlex.join(argv)
