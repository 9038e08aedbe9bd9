"""The machine-readable launch plan: what a launch will do, printed by every dry run.

`DRL_DRY_RUN=1 make gsm8k RUN=<id> [HOST=...]` prints a human-readable summary followed by the plan as
JSON between two marker lines, so a pipe can pick it out of any surrounding output:

    DRL_DRY_RUN=1 make gsm8k RUN=my-run | nox -s preflight

`render_plan` writes that text and `parse_plan` reads it back (the preflight relies on it). The plan never
holds a secret: `env` carries the contract variables with secret values replaced by asterisks, and
`render_plan` refuses to print a plan in which a registered secret still appears.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PLAN_VERSION = 1
BEGIN_MARKER = "----- BEGIN STOA LAUNCH PLAN -----"
END_MARKER = "----- END STOA LAUNCH PLAN -----"


class PlanError(ValueError):
    """Text that holds no plan, or a plan that does not validate."""


class LaunchStep(BaseModel):
    """One step of a launch, in the order it runs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str
    """Short id, e.g. `check_box`, `convert_model`, `launch_trainer`."""
    where: Literal["local", "remote", "box"]
    """`local`: this machine; `remote`: over SSH from here; `box`: on the GPU box itself."""
    summary: str
    """What the step does, and how it stays idempotent."""
    gpu_only: bool = False
    """True when the step needs the GPU box (a CUDA GPU, the slime image)."""


class LaunchPlan(BaseModel):
    """Everything a launch will do, resolved; printed by the dry run and read by the preflight."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    plan_version: Literal[1] = PLAN_VERSION
    """Version of this format."""
    run: str
    """DRL_RUN: the run id (bucket prefix)."""
    recipe: dict[str, Any]
    """The resolved RecipeConfig (`model_dump(mode="json")`): recipe file < environment < command line."""
    env: dict[str, str]
    """The env contract values the launch uses (DRL_*, R2_*), secrets replaced by asterisks."""
    command: list[str]
    """The trainer launch, argv form: `ray job submit ... -- python3 <slime>/train.py <flags>`."""
    slime_args: list[str]
    """The slime flags alone (the part of `command` after train.py), for flag-by-flag checks."""
    host: str | None = None
    """`user@box` when launched over SSH; None when launched on the GPU box itself."""
    remote_dir: str
    """Where the tree lives on the GPU box."""
    log_file: str
    """Where the detached trainer writes its log on the box."""
    steps: list[LaunchStep] = Field(default_factory=list)
    """The steps, in order."""
    notes: list[str] = Field(default_factory=list)
    """Facts the operator should know (e.g. which trainer-only mode and why)."""

    def command_line(self) -> str:
        """`command` as one shell-quoted line."""
        return shlex.join(self.command)


def _summary(plan: LaunchPlan) -> list[str]:
    r = plan.recipe
    algo, contract = r.get("algo", {}), r.get("contract", {})
    where = f"over SSH on {plan.host}" if plan.host else "on this GPU box"
    lines = [
        f"stoa launch plan: run {plan.run!r}, recipe {r.get('name')!r}, {where} (dry run: nothing changed)",
        f"  model          {r.get('model', {}).get('path') or r.get('model', {}).get('hf_id')}",
        f"  contract       DRL_N_SAMPLES={contract.get('n_samples')} DRL_PULSE_PLANE={contract.get('plane')}"
        + (f" DRL_KV_MODE={contract.get('kv_mode')}" if contract.get("kv_mode") else ""),
        f"  batch          {algo.get('groups_per_step')} groups x {contract.get('n_samples')} samples per step",
        f"  staleness      bound {algo.get('staleness')} versions, reuse cap {algo.get('reuse_cap')}",
        f"  objective      DPPO gate {algo.get('gate')}, Dr.GRPO reducer, dual-clip PPO "
        f"(eps {algo.get('eps_clip')}/{algo.get('eps_clip_high')}, c {algo.get('eps_clip_c')}), "
        f"k3 ref-KL {algo.get('kl_coef')}",
        f"  temperature    {algo.get('temperature')} (sampler and learner)",
        f"  remote dir     {plan.remote_dir}",
        f"  log            {plan.log_file}",
        "  environment    " + " ".join(f"{k}={v}" for k, v in sorted(plan.env.items())),
        "  steps:",
    ]
    for i, s in enumerate(plan.steps, 1):
        tag = f"{s.where}{', GPU' if s.gpu_only else ''}"
        lines.append(f"    {i}. {s.name} [{tag}]: {s.summary}")
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append("  trainer command:")
    lines.append("    " + plan.command_line())
    return lines


def render_plan(plan: LaunchPlan) -> str:
    """The summary for people, then the plan as JSON between the BEGIN/END marker lines."""
    body = json.dumps(plan.model_dump(mode="json"), indent=2, sort_keys=True)
    text = "\n".join([*_summary(plan), BEGIN_MARKER, body, END_MARKER]) + "\n"
    from worker_contract.env import redact

    if redact(text) != text:  # a registered secret reached the plan: a bug, never print it
        raise AssertionError("a secret value reached the launch plan; refusing to print it")
    return text


def parse_plan(text: str) -> LaunchPlan:
    """The plan inside `text` (any output around the markers is ignored); PlanError if none or invalid."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == BEGIN_MARKER)
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == END_MARKER)
    except StopIteration:
        raise PlanError(
            f"no launch plan found: expected a line {BEGIN_MARKER!r} followed by JSON and {END_MARKER!r}; "
            "produce one with DRL_DRY_RUN=1 make gsm8k RUN=<id>"
        ) from None
    try:
        data = json.loads("\n".join(lines[start + 1 : end]))
    except ValueError as e:
        raise PlanError(f"the launch plan between the markers is not JSON: {e}") from None
    if isinstance(data, dict) and data.get("plan_version") != PLAN_VERSION:
        raise PlanError(f"plan_version={data.get('plan_version')!r}; this tool reads version {PLAN_VERSION}")
    try:
        return LaunchPlan.model_validate(data)
    except ValidationError as e:  # one line: each field and what is wrong with it
        what = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'the plan'}: {err['msg']}" for err in e.errors())
        raise PlanError(f"the launch plan does not validate ({what}); produce it again with DRL_DRY_RUN=1 "
                        "make gsm8k RUN=<id> HOST=user@box") from None
