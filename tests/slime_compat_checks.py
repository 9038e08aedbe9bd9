"""Our slime engine against real slime: run only by `nox -s slime_compat -- SLIME_DIR MEGATRON_DIR`
(not by `make test`: CI has no slime, and this needs sglang in a venv of its own; see noxfile.py).
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import pickle
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

SLIME = Path(os.environ.get("STOA_SLIME_TREE", "/nonexistent"))
pytestmark = pytest.mark.skipif(not (SLIME / "slime").is_dir(), reason="run through nox -s slime_compat")

# the plugin's fixtures: a file bucket with run.json, v1 and real worker records
import test_slime_plugin  # noqa: E402
from test_slime_plugin import G, N, put_group  # noqa: E402

box, plugin = test_slime_plugin.box, test_slime_plugin.plugin

from infra import slime_launch  # noqa: E402
from infra.patches import probes  # noqa: E402

PARSE = """
import argparse, pickle, sys
known = set()
_add = argparse._ActionsContainer.add_argument
def _record(self, *names, **kw):  # every option string sglang's, Megatron's and slime's parsers define
    known.update(n for n in names if n.startswith("-"))
    return _add(self, *names, **kw)
argparse._ActionsContainer.add_argument = _record
sys.argv = ["train.py", *{argv!r}]
from slime.utils.arguments import parse_args
args = parse_args()
with open({out!r}, "wb") as f:
    pickle.dump({{k: v for k, v in vars(args).items() if _ok(v)}}, f)
with open({out!r} + ".flags", "wb") as f:
    pickle.dump(sorted(known), f)
"""
#: slime's own model provider on the parsed args, the model on the meta device (its real size needs no
#: memory); the CPU stand-ins: CPU initialization, the fusions of Transformer Engine and apex off, MoE's
#: allgather dispatcher for alltoall (which needs CUDA streams; the same routing), and for
#: a launch on slime's Transformer Engine spec the local spec instead, whose torch norms need
#: persist_layer_norm off (TE's norms do not read it)
BUILD = """
import pickle, sys, torch
from argparse import Namespace
from tests import megatron_cpu
megatron_cpu.init_distributed()
with open({out!r}, "rb") as f:
    args = Namespace(**pickle.load(f))
args.use_cpu_initialization = True
args.apply_rope_fusion = False  # Transformer Engine's (the slime image has it)
args.gradient_accumulation_fusion = False  # apex's (the slime image has it)
if args.moe_token_dispatcher_type == "alltoall":
    args.moe_token_dispatcher_type = "allgather"  # alltoall needs CUDA streams; the same routing
    args.variable_seq_lengths = False  # which allgather refuses (it only shapes the dispatch)
if args.spec is None:
    args.transformer_impl = "local"
    args.no_persist_layer_norm = True
from megatron.training.arguments import core_transformer_config_from_args
from slime.backends.megatron_utils.model_provider import get_model_provider_func
with torch.device("meta"):
    model = get_model_provider_func(args)(pre_process=True, post_process=True)
shapes = {{n: tuple(p.shape) for n, p in model.named_parameters()}}
with open({out!r} + ".model", "wb") as f:
    pickle.dump({{"shapes": shapes, "local_stand_in": args.transformer_impl == "local"}}, f)
"""
PARSE_PRE = "def _ok(v):\n    import pickle\n    try:\n        pickle.dumps(v)\n        return True\n    except Exception:\n        return False\n"


def test_patch_set_is_in_place_and_the_hook_is_called():
    verdicts = {name: fn(SLIME) for name, fn in probes.PROBES.items()}
    assert all(ok for ok, _ in verdicts.values()), verdicts
    from slime.backends.megatron_utils import actor, loss

    src = inspect.getsource(actor.MegatronTrainRayActor.train)
    assert "self.after_train_hook(self.args, rollout_id, self.model)" in src
    assert "eps_clip_c=args.eps_clip_c" in inspect.getsource(loss.policy_loss_function)


def _launch_args(recipe: str, root: Path) -> list[str]:
    from trainer.config import resolve

    cfg = resolve(recipe, env={"DRL_RUN": f"compat-{recipe}"}, overrides={"train.engine": "slime"})
    paths = slime_launch.BoxPaths(remote_dir=str(root), run=f"compat-{recipe}")
    hf = dict(slime_launch.KNOWN_HF_CONFIGS[cfg.model.hf_id])
    hf_dir = Path(paths.hf_dir(cfg.model.hf_id))
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(hf))
    Path(paths.torch_dist_dir(cfg.model.hf_id)).mkdir(parents=True, exist_ok=True)  # --ref-load must exist
    mode = slime_launch.detect_trainer_only(str(SLIME))
    return slime_launch.slime_args(cfg, paths, hf, trainer_only=mode)


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """recipe -> slime's parsed args (the picklable part), each parse in its own process, as train.py runs."""
    out = {}
    for recipe in ("gsm8k", "psqa"):
        root = tmp_path_factory.mktemp(recipe)
        argv = _launch_args(recipe, root)
        dump = root / "args.pkl"
        res = subprocess.run([sys.executable, "-c", PARSE_PRE + PARSE.format(argv=argv, out=str(dump))],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "WORLD_SIZE": "1",
                                                                                  "RANK": "0"})
        out[recipe] = (argv, res, pickle.loads(dump.read_bytes()) if dump.exists() else None)
        flags = Path(str(dump) + ".flags")
        known[recipe] = pickle.loads(flags.read_bytes()) if flags.exists() else []
    return out


known: dict[str, list[str]] = {}  # recipe -> every option string the parse defined (filled by `parsed`)


@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
def test_launch_parses_and_validates_in_slime(parsed, recipe):
    argv, res, args = parsed[recipe]
    assert res.returncode == 0 and args is not None, res.stderr[-3000:]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}
    assert args["rollout_function_path"] == slime_launch.ROLLOUT_FN
    assert args["custom_reward_post_process_path"] == slime_launch.REWARD_POST_FN
    assert args["custom_tis_function_path"] == slime_launch.GATE_FN
    assert args["custom_pg_loss_reducer_function_path"] == slime_launch.REDUCER_FN
    assert args["custom_after_train_hook_path"] == slime_launch.PUBLISH_HOOK_FN  # patch 0001's flag parsed
    assert args["eps_clip_c"] == float(flag["--eps-clip-c"]) and args["eps_clip_high"] == float(flag["--eps-clip-high"])
    assert args["use_rollout_logprobs"] and args["use_kl_loss"] and args["get_mismatch_metrics"]
    assert args["kl_loss_type"] == "low_var_kl" and args["advantage_estimator"] == "grpo"
    assert args["global_batch_size"] == args["rollout_batch_size"] * args["n_samples_per_prompt"]
    if "--spec" in argv:
        assert list(args["spec"]) == argv[argv.index("--spec") + 1: argv.index("--spec") + 3]


@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
def test_every_flag_we_pass_is_one_slime_or_megatron_defines(parsed, recipe):
    """Megatron's parse ignores unknown flags and slime drops them silently (neither takes abbreviations,
    so a near miss is dropped too): each flag of the launch must be spelled exactly as a parser defines it."""
    argv = parsed[recipe][0]
    assert len(known[recipe]) > 500, "the parse recorded no parser definitions"
    unknown = [a for a in argv if a.startswith("--") and a not in known[recipe]]
    assert not unknown, f"flags no parser of slime, Megatron or sglang defines (dropped silently): {unknown}"


#: launch flag -> where slime calls the function it names, and the callee there (for call_rollout_fn, the
#: function is its first argument); read off slime's tree (the patched copy: the after-train hook is ours)
HOOK_CALLS = {
    "--rollout-function-path": ("slime/ray/rollout.py", "call_rollout_fn", "self.generate_rollout"),
    "--custom-reward-post-process-path": ("slime/ray/rollout.py", "self.custom_reward_post_process_func", None),
    "--custom-tis-function-path": ("slime/backends/megatron_utils/loss.py", "tis_func", None),
    "--custom-pg-loss-reducer-function-path": ("slime/backends/megatron_utils/loss.py",
                                               "custom_pg_loss_reducer_func", None),
    "--rollout-data-postprocess-path": ("slime/backends/megatron_utils/actor.py", "self.rollout_data_postprocess", None),
    slime_launch.AFTER_TRAIN_FLAG: ("slime/backends/megatron_utils/actor.py", "self.after_train_hook", None),
}


def _slime_calls(path: str, callee: str, first: str | None) -> list[tuple[int, set[str]]]:
    """(positional count, keyword names) of each call of `callee` in slime's file; `**name` resolved
    through a dict literal assigned to that name in the same file."""
    import ast

    tree = ast.parse((SLIME / path).read_text())
    dicts = {t.id: {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
             for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
             for t in node.targets if isinstance(t, ast.Name)}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or ast.unparse(node.func) != callee:
            continue
        pos = list(node.args)
        if first is not None:
            if not pos or ast.unparse(pos[0]) != first:
                continue
            pos = pos[1:]
        kws: set[str] = set()
        for kw in node.keywords:
            kws |= {kw.arg} if kw.arg is not None else dicts.get(ast.unparse(kw.value), {"<unknown **>"})
        calls.append((len(pos), kws))
    return calls


@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
def test_every_hook_we_name_is_a_callable_slime_can_call(parsed, recipe):
    """Each function path the launch passes loads through slime's load_function to a callable whose
    signature takes the call slime makes at its call site; the --spec hook as slime's provider calls it."""
    from slime.utils.misc import load_function

    argv = parsed[recipe][0]
    bad = []
    for flag, (path, callee, first) in HOOK_CALLS.items():
        assert flag in argv, f"{recipe}: the launch no longer passes {flag}"
        calls = _slime_calls(path, callee, first)
        if not calls:
            bad.append(f"{flag}: slime calls no {callee} in {path} any more")
            continue
        try:
            fn = load_function(argv[argv.index(flag) + 1])
        except Exception as e:  # noqa: BLE001 (what slime's load would raise at its first call)
            bad.append(f"{flag} {argv[argv.index(flag) + 1]}: {type(e).__name__}: {e}")
            continue
        for npos, kws in calls:
            try:
                inspect.signature(fn).bind(*range(npos), **dict.fromkeys(kws))
            except TypeError as e:
                bad.append(f"{flag}: {fn.__module__}.{fn.__name__}{inspect.signature(fn)} cannot take slime's "
                           f"call in {path} ({npos} positional, keywords {sorted(kws)}): {e}")
    if "--spec" in argv:
        from megatron.core.transformer.spec_utils import import_module

        spec = import_module(argv[argv.index("--spec") + 1: argv.index("--spec") + 3])
        calls = _slime_calls("slime/backends/megatron_utils/model_provider.py", "transformer_layer_spec", None)
        assert calls and callable(spec)
        for npos, kws in calls:
            try:
                inspect.signature(spec).bind(*range(npos), **dict.fromkeys(kws))
            except TypeError as e:
                bad.append(f"--spec: {e}")
    assert not bad, bad


@pytest.fixture(scope="module")
def built(parsed, tmp_path_factory):
    """recipe -> (the build process, parameter shapes) of the model slime's provider builds from the launch."""
    out = {}
    for recipe in ("gsm8k", "psqa"):
        argv, res, args = parsed[recipe]
        root = tmp_path_factory.mktemp(f"build-{recipe}")
        dump = root / "args.pkl"
        dump.write_bytes(pickle.dumps(args))
        proc = subprocess.run([sys.executable, "-c", BUILD.format(out=str(dump))], capture_output=True, text=True,
                              timeout=900, env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"})
        model = Path(str(dump) + ".model")
        out[recipe] = (proc, pickle.loads(model.read_bytes()) if model.exists() else None)
    return out


@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
def test_slimes_provider_builds_the_launched_model(built, recipe):
    """slime's get_model_provider_func on the launch's parsed args builds the model (psqa through our
    --spec, as on the GPU; gsm8k on the local stand-in for slime's Transformer Engine spec), with the
    parameters of the HF model (infra.slime_launch.model_params, the disk estimate's count)."""
    proc, got = built[recipe]
    assert proc.returncode == 0 and got is not None, proc.stderr[-3000:]
    from trainer.config import resolve

    cfg = resolve(recipe, env={"DRL_RUN": f"compat-{recipe}"}, overrides={"train.engine": "slime"})
    hf = slime_launch.KNOWN_HF_CONFIGS[cfg.model.hf_id]
    count = sum(math.prod(s) for s in got["shapes"].values())
    assert count == slime_launch.model_params(hf), (count, slime_launch.model_params(hf))
    assert got["local_stand_in"] is (recipe == "gsm8k")
    print(f"{recipe}: slime's provider built {count / 1e9:.3f} B parameters in {len(got['shapes'])} tensors")


def _manager(args: Namespace):
    """slime's RolloutManager without its Ray actor, SGLang engines or router: the attributes
    _get_rollout_data and _convert_samples_to_train_data read, set the way its __init__ sets them."""
    from slime.ray.rollout import RolloutManager
    from slime.utils.misc import load_function

    cls = getattr(RolloutManager, "__ray_actor_class__", None) or RolloutManager.__ray_metadata__.modified_class
    mgr = object.__new__(cls)
    mgr.args = args
    mgr.data_source = None
    mgr.generate_rollout = load_function(args.rollout_function_path)
    mgr.custom_reward_post_process_func = load_function(args.custom_reward_post_process_path)
    mgr.custom_convert_samples_to_train_data_func = None
    return mgr


def _run_args(parsed, **over) -> Namespace:
    """The gsm8k launch's parsed args, with the group size and batch of the plugin fixture's run."""
    return Namespace(**{**parsed["gsm8k"][2], "n_samples_per_prompt": N, "rollout_batch_size": G,
                        "global_batch_size": N * G, "rollout_temperature": 1.0, **over})


def test_rollout_output_through_slimes_conversion(box, plugin, parsed):
    from slime.utils.types import Sample

    for i in range(G):
        put_group(box, f"compat-{i}", seed=i)
    mgr = _manager(_run_args(parsed))
    samples, metrics = mgr._get_rollout_data(0)
    assert len(samples) == N * G and all(isinstance(s, Sample) for s in samples)
    assert "rollout/learner_version" in metrics
    data = mgr._convert_samples_to_train_data(samples)
    assert {"tokens", "response_lengths", "rewards", "raw_reward", "loss_masks", "rollout_log_probs",
            "truncated", "rollout_mask_sums"} <= set(data)
    raw = torch.tensor(data["raw_reward"], dtype=torch.float64).view(-1, N)
    want = raw - raw.mean(-1, keepdim=True)  # Dr.GRPO: reward minus the group mean, no std division
    assert data["rewards"] == pytest.approx([float(x) for x in want.flatten()])
    for s, mask, lp, n in zip(samples, data["loss_masks"], data["rollout_log_probs"], data["response_lengths"],
                              strict=True):
        assert len(mask) == len(lp) == n == s.response_length and len(s.tokens) > n
    assert sum(data["truncated"]) == G  # the fixture's third sample of each group stopped at the length cap


def _loss_args(box, parsed) -> Namespace:
    """slime's arguments for a policy-loss check: the recipe's clip range, a dual-clip that bites (c = 3), a
    large KL weight, no entropy, OPSM or TIS; megatron's process groups up (once)."""
    from megatron.core import parallel_state

    from tests import megatron_cpu

    if not parallel_state.model_parallel_is_initialized():
        megatron_cpu.init_distributed()
    a = box["cfg"].algo
    return _run_args(parsed, eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=3.0,
                     kl_loss_coef=0.5, entropy_coef=0.0, calculate_per_token_loss=False, use_opsm=False,
                     use_tis=False, rollout_top_p=1.0)


def _response_logp(logits, tokens, lengths, temperature: float) -> tuple[list, list]:
    """Each response token's log-prob as the policy gives it (the logits at the position before it), and the
    rows of `logits` that predict them."""
    logp, rows, start = [], [], 0
    for t, n in zip(tokens, lengths, strict=True):
        lsm = torch.log_softmax(logits[0, start: start + len(t)].float() / temperature, -1)
        logp.append(lsm[len(t) - n - 1: len(t) - 1].gather(1, t[len(t) - n:, None]).squeeze(1))
        rows.append(list(range(start + len(t) - n - 1, start + len(t) - 1)))
        start += len(t)
    return logp, rows


def test_policy_loss_with_our_hooks_is_the_objective(box, plugin, parsed):
    """slime's policy_loss_function (our TIS hook, our reducer, k3 KL) on logits whose log-probs we know,
    against _slime_policy_loss (tests/test_slime_plugin.py): equal only when dual-clip reaches the loss."""
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import policy_loss_function
    from test_slime_plugin import _slime_policy_loss

    from trainer.slime_plugin import objective

    args = _loss_args(box, parsed)
    g = torch.Generator().manual_seed(3)
    vocab, prompt = 11, [1, 2, 3]
    lengths = [4, 3, 5]
    tokens = [torch.tensor(prompt + torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lengths]
    total = [len(t) for t in tokens]
    logits = (torch.randn(1, sum(total), vocab, generator=g) * 2).requires_grad_(True)
    logp, _ = _response_logp(logits, tokens, lengths, args.rollout_temperature)
    mu = [(x.detach() + torch.randn(x.shape, generator=g) * 1.5).clamp(max=-1e-3) for x in logp]
    ref = [(x.detach() + torch.randn(x.shape, generator=g) * 0.3).clamp(max=-1e-3) for x in logp]
    adv = [torch.full((n,), v) for n, v in zip(lengths, [-1.0, 0.8, -0.6], strict=True)]
    masks = [torch.ones(n) for n in lengths]
    sums = torch.tensor([float(n) for n in lengths])  # a tensor, as slime moves it to the actor
    batch = {"advantages": adv, "rollout_log_probs": mu, "ref_log_probs": ref, "unconcat_tokens": tokens,
             "total_lengths": total, "response_lengths": lengths, "loss_masks": masks, "rollout_mask_sums": sums}
    reducer = get_sum_of_sample_mean(total, lengths, masks, sums, False)
    theirs, metrics = policy_loss_function(args, batch, logits, reducer)
    want = _slime_policy_loss(args, [0, 1, 2], logp, mu, ref, adv, masks, sums)
    off = _slime_policy_loss(Namespace(**{**vars(args), "eps_clip_c": 1e9}), [0, 1, 2], logp, mu, ref, adv, masks,
                             sums)
    assert float(want) != pytest.approx(float(off), rel=1e-6)  # the batch is one where dual-clip bites
    assert float(theirs) == pytest.approx(float(want), rel=1e-5), f"slime {float(theirs)}; without dual-clip {float(off)}"
    assert objective.dppo_gate.__module__ == "trainer.slime_plugin.objective" and "pg_loss" in metrics


def test_slimes_policy_loss_gives_tool_tokens_no_gradient(box, plugin, parsed):
    """slime's own policy_loss_function on psqa-shaped samples (a tool turn of mask-0 tokens inside the
    response, as our rollout hook hands them over): the logits that predict a tool token get exactly zero
    gradient, the sampled tokens' do not, and the loss is still _slime_policy_loss's (tests/
    test_tool_mask_gradient.py checks that transcription and the native step on the same shape)."""
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import policy_loss_function
    from test_slime_plugin import _slime_policy_loss

    args = _loss_args(box, parsed)
    g = torch.Generator().manual_seed(5)
    vocab, prompt = 11, [1, 2, 3]
    masks = [torch.tensor(m, dtype=torch.float32) for m in ([1, 1, 0, 0, 0, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1])]
    lengths = [len(m) for m in masks]
    tokens = [torch.tensor(prompt + torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lengths]
    total = [len(t) for t in tokens]
    logits = (torch.randn(1, sum(total), vocab, generator=g) * 2).requires_grad_(True)
    logp, rows = _response_logp(logits, tokens, lengths, args.rollout_temperature)
    mu = [torch.where(m > 0, (x.detach() + torch.randn(x.shape, generator=g)).clamp(max=-1e-3), 0.0)
          for x, m in zip(logp, masks, strict=True)]  # tool tokens carry log-prob 0.0, as the workers record
    ref = [(x.detach() + torch.randn(x.shape, generator=g) * 0.3).clamp(max=-1e-3) for x in logp]
    adv = [torch.full((n,), v) for n, v in zip(lengths, [-1.0, 0.8, -0.6], strict=True)]
    sums = torch.stack([m.sum() for m in masks])
    batch = {"advantages": adv, "rollout_log_probs": mu, "ref_log_probs": ref, "unconcat_tokens": tokens,
             "total_lengths": total, "response_lengths": lengths, "loss_masks": masks, "rollout_mask_sums": sums}
    theirs, _ = policy_loss_function(args, batch, logits, get_sum_of_sample_mean(total, lengths, masks, sums, False))
    want = _slime_policy_loss(args, [0, 1, 2], logp, mu, ref, adv, masks, sums)
    assert float(theirs) == pytest.approx(float(want), rel=1e-5)
    theirs.backward()
    tool = [row for m, r in zip(masks, rows, strict=True) for keep, row in zip(m.tolist(), r, strict=True) if not keep]
    sampled = [row for m, r in zip(masks, rows, strict=True) for keep, row in zip(m.tolist(), r, strict=True) if keep]
    assert torch.all(logits.grad[0, tool] == 0), logits.grad[0, tool]
    assert torch.count_nonzero(logits.grad[0, sampled]) > 0  # (the DPPO gate may still mask a sampled token)


LAYERS_CONV = 3  # conv layers of test_lfm2_megatron's tiny LFM2 (conv, attention, conv, attention, conv)


def _gather_rank(rank: int, port: int, hf_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from tests import megatron_cpu

    megatron_cpu.init_distributed(rank, 2, port, tp=2)
    from safetensors.torch import load_file
    from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers

    from trainer.models import get_architecture, load_hf_config
    from trainer.models.lfm2_slime import SPEC
    from trainer.models.model import build_model, load_full_state
    from trainer.slime_plugin import publish

    cfg = load_hf_config(hf_dir)
    model = build_model(cfg, dtype=torch.float32, attention="sdpa", fused=False, init=True, device="cpu")
    load_full_state(model, get_architecture(cfg).hf_to_megatron(load_file(Path(hf_dir) / "model.safetensors"), cfg,
                                                                cfg["vocab_size"]))
    args = Namespace(hf_checkpoint=hf_dir, spec=SPEC, num_experts=cfg["num_experts"])
    ours = publish.hf_state(args, [model])
    slime_errors = {}
    for name, param in named_params_and_buffers(args, [model]):
        try:
            all_gather_param(name, param)
        except AssertionError as e:
            slime_errors[name] = str(e)
    if rank == 0:
        torch.save({"ours": ours, "slime_errors": slime_errors}, out)
    megatron_cpu.shutdown_distributed()


def test_after_train_gather_at_tensor_parallel_2(tmp_path):
    from safetensors.torch import load_file
    from test_lfm2_megatron import _tiny_hf

    from tests import megatron_cpu

    hf_dir = tmp_path / "lfm2"
    hf_dir.mkdir()
    _tiny_hf(hf_dir)
    out = tmp_path / "got.pt"
    megatron_cpu.spawn_on_a_free_port(_gather_rank, (str(hf_dir), str(out)), nprocs=2)
    got = torch.load(out, weights_only=False)
    want = load_file(hf_dir / "model.safetensors")
    assert set(got["ours"]) == set(want)
    assert all(torch.equal(got["ours"][k], want[k]) for k in want)
    # slime's own gather on the same model: it asserts on every conv in_proj (stride 3), and on the norms of
    # our local spec (torch norms carry no tensor_model_parallel attribute); why the hook gathers with ours
    errors = got["slime_errors"]
    in_proj = sorted(k for k in errors if k.endswith("in_proj.weight"))
    assert len(in_proj) == LAYERS_CONV and all("partition_stride" in errors[k] for k in in_proj), errors
    kinds = sorted({k.rsplit(".", 2)[-2] + ": " + v.split(" ")[-1] for k, v in errors.items()})
    print(f"slime all_gather_param at TP 2 refuses {len(errors)} tensors: {kinds}")
