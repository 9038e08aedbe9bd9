"""Held-out evaluation for slime's `evaluation=True` call: the task's test split, scored by the task.

The trainer box runs no generator of its own (the workers sample), so evaluation generates through an
SGLang-compatible `/generate` endpoint: `DRL_EVAL_ENDPOINT` if set, else slime's router when it has one
(`--rollout-num-gpus 0` launches the router; an external engine registered there serves it). Each
completion is scored with the same `Task.reward` the workers use, and returned in slime's eval shape:
`{task: {"rewards", "truncated", "samples"}}` (docs/slime.md).
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.config import RecipeConfig

from .context import PluginContext
from .types import slime_types

#: concurrent requests to the endpoint
CONCURRENCY = 16
#: test problems per evaluation when the recipe names none (the local run's default too: embedded/config.py)
EVAL_PROBLEMS = 200


def eval_endpoint(args: Any) -> str:
    url = os.environ.get("DRL_EVAL_ENDPOINT", "").strip()
    if url:
        return url.rstrip("/")
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if ip and port:
        return f"http://{ip}:{port}"
    raise ValueError("held-out evaluation needs a generation endpoint: set DRL_EVAL_ENDPOINT=http://host:port "
                     "(an SGLang server with the current policy), or drop --eval-interval")


def _generate(url: str, input_ids: list[int], sampling: dict[str, Any], timeout_s: float = 600.0) -> dict:
    body = json.dumps({"input_ids": input_ids, "sampling_params": sampling}).encode()
    req = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def eval_problems(cfg: RecipeConfig) -> int:
    """How many test problems: the recipe's `embedded.eval_problems`, the held-out count the local run uses too
    (a value the recipe section holds as given; embedded/config.py types it), else EVAL_PROBLEMS."""
    return int(cfg.embedded.get("eval_problems") or EVAL_PROBLEMS)


def eval_output(args: Any, rollout_id: int, ctx: PluginContext):
    """Generate and score the held-out problems; returns slime's RolloutFnEvalOutput."""
    from transformers import AutoTokenizer

    from worker_contract.tasks import get_task
    from worker_contract.tasks.base import render_prompt

    Sample, _, EvalOutput, _ = slime_types()
    hf_dir = getattr(args, "hf_checkpoint", None) or ctx.cfg.model.path
    if not hf_dir:
        raise ValueError("held-out evaluation needs the model's tokenizer: pass --hf-checkpoint")
    url = eval_endpoint(args)
    task = get_task(ctx.cfg.task)
    test = task.dataset("test")
    problems = [test[i] for i in range(min(len(test), eval_problems(ctx.cfg)))]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    m = ctx.manifest
    temp = getattr(args, "eval_temperature", None)
    sampling = {"temperature": m.temperature if temp is None else float(temp), "top_p": m.top_p,
                "max_new_tokens": int(getattr(args, "eval_max_response_len", None) or m.max_new_tokens)}
    prompts = [render_prompt(tok, task.messages(p)) for p in problems]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda ids: _generate(url, ids, sampling), prompts))
    samples, rewards, truncated = [], [], []
    for i, (problem, ids, ans) in enumerate(zip(problems, prompts, answers, strict=True)):
        text = ans.get("text", "")
        out_ids = ans.get("output_ids") or tok.encode(text, add_special_tokens=False)
        finish = ((ans.get("meta_info") or {}).get("finish_reason") or {}).get("type", "stop")
        reward = float(task.reward(text, problem))
        cut = finish == "length"
        samples.append(Sample(index=i, prompt=problem.question, label=problem.answer, tokens=list(ids) + list(out_ids),
                              response=text, response_length=len(out_ids), reward=reward,
                              status=Sample.Status.TRUNCATED if cut else Sample.Status.COMPLETED,
                              metadata={"problem_id": problem.id, "rollout_id": rollout_id}))
        rewards.append(reward)
        truncated.append(cut)
    name = ctx.cfg.task
    metrics = {f"eval/{name}/reward_mean": sum(rewards) / max(len(rewards), 1),
               f"eval/{name}/truncated_frac": sum(truncated) / max(len(truncated), 1),
               f"eval/{name}/problems": float(len(problems))}
    return EvalOutput(data={name: {"rewards": rewards, "truncated": truncated, "samples": samples}}, metrics=metrics)
