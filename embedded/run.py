"""The embedded default: the whole loop on this machine, no GPU, no R2 credentials.

    run_embedded(cfg)      what `make gsm8k RUN=<id>` runs when there is no HOST, GPU or credentials

The base model, run.json in the file bucket .stoa/bucket/ with the run's key, the learner
(`python -m entrypoints.learner`) and reference workers as child processes in sessions of their own,
held-out evaluation of each published version in this process, a live panel, then a summary and plots.
A rerun of the same RUN resumes from the learner's checkpoint; a new RUN starts fresh.
More in docs/embedded.md (module notes).
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infra.boxops import lock_run_dir
from trainer.config import REPO_ROOT

from .config import EmbeddedRecipe
from .localprocs import Child, Processes, per_worker_cap, start_learner, start_workers, worker_backends

STOA_DIR = REPO_ROOT / ".stoa"


@dataclass(frozen=True)
class EmbeddedPaths:
    root: Path
    run: str

    @property
    def bucket(self) -> Path:
        return self.root / "bucket"

    @property
    def store_url(self) -> str:
        return f"file://{self.bucket}"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / self.run

    @property
    def key_file(self) -> Path:
        return self.run_dir / "trainer.key"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"


def embedded_cfg(cfg: EmbeddedRecipe, paths: EmbeddedPaths) -> EmbeddedRecipe:
    """The recipe as the embedded run uses it: the file store, `max_steps` steps. The backend is the embedded
    overrides' (hf); `train.backend=megatron` on the command line runs megatron-core (on a GPU, or on the CPU
    where DRL_MEGATRON_CPU_SETUP names the hook its CUDA calls need: trainer/backends/megatron.py)."""
    train = cfg.train.model_copy(update={"num_steps": cfg.embedded.max_steps})
    model = cfg.model.model_copy(update={"hf_id": None})  # built here or given with MODEL=: never fetched
    return cfg.model_copy(update={"store": cfg.store or paths.store_url, "train": train, "model": model})


def local_services(task):
    """The module that runs a task's services on this machine, or None for a task that calls none: a search task
    (`services` names the retriever) gets embedded/psqa.py (a generated corpus, the retriever on 127.0.0.1, its
    own base and held-out evaluation). Keyed on the task's hook, never on its name."""
    if "retriever" in task.services:
        from . import psqa

        return psqa
    return None


def plan_lines(cfg: EmbeddedRecipe, paths: EmbeddedPaths) -> list[str]:
    """What `run_embedded` will do, for the dry run."""
    from infra.native_launch import learner_argv
    from worker_contract.tasks import get_task

    from .basemodel import config_digest

    py, kit = "python", local_services(get_task(cfg.task))
    if cfg.model.path:
        base = f"use the model at {cfg.model.path} (MODEL=); task {cfg.task}"
    elif kit is not None:
        base = ""  # the services module's plan says how its base is built
    else:
        d = paths.cache / f"base-{config_digest(cfg.embedded.base, get_task(cfg.task))}"
        b = cfg.embedded.base
        base = (f"{'reuse the cached' if (d / 'base.json').exists() else 'build and cache the'} base model {d}: "
                f"Qwen2 {b.num_layers}x{b.hidden_size}, {b.sft_steps} supervised steps on generated problems")
    store = cfg.store or paths.store_url  # DRL_STORE when set: the store the run really uses
    where = f"the file bucket {paths.bucket}" if store == paths.store_url else f"the store {store} (DRL_STORE)"
    q = shlex.quote  # a printed command is one a user can paste, paths with spaces included
    w = [f"  {i + 1}. {q(str(py))} -m worker_contract.worker --store {q(store)} --run {cfg.run} --model <base> "
         f"--worker-id local-{i + 1} --threads 1 --max-groups-per-version {per_worker_cap(cfg)} "
         f"--backend {backend}   "
         f"(DRL_N_SAMPLES={cfg.contract.n_samples} "
         f"DRL_PULSE_PLANE={cfg.contract.plane} DRL_TRAINER_KEY_FINGERPRINT=<fingerprint of trainer.key>; "
         f"log {paths.run_dir}/worker-{i + 1}.log)"
         for i, backend in enumerate(worker_backends(cfg))]
    learner = shlex.join(map(str, learner_argv(py, paths.run_dir / "recipe.json", "<base>", paths.run_dir)))
    backends = worker_backends(cfg)
    kinds = " and ".join(f"{backends.count(b)} {b}" for b in dict.fromkeys(backends))
    middle = [
        f"2. run.json in {where} (created, or resumed with an identical contract); "
        f"signing key {paths.key_file} (0600)",
        f"3. learner: {learner} (Ray on 127.0.0.1 only; publishes the first "
        f"anchor, then {cfg.train.num_steps} steps of {cfg.algo.groups_per_step} groups x {cfg.contract.n_samples}; "
        f"log {paths.run_dir}/learner.log)",
        f"4. {kinds} workers:", *w,
    ]
    tail = [
        f"6. stop after {cfg.train.num_steps} steps or {cfg.embedded.time_budget_s:.0f} s; Ctrl-C stops every "
        "process cleanly; a rerun of the same RUN resumes",
        f"7. metrics {paths.metrics}; plots in {paths.run_dir}/plots/",
    ]
    if kit is not None:
        return kit.plan_lines(cfg, paths, middle, tail)
    return [
        "mode: embedded (no HOST; no CUDA GPU with R2 credentials or DRL_STORE): the whole loop on this machine",
        f"1. {base}", *middle,
        f"5. held-out evaluation every {cfg.embedded.eval_every} steps on {cfg.embedded.eval_problems} test "
        f"problems of task {cfg.task}, in this process", *tail,
    ]


# -- the run -------------------------------------------------------------------------------------------
def prepare_model(cfg: EmbeddedRecipe, paths: EmbeddedPaths, console) -> tuple[EmbeddedRecipe, Path]:
    """The model directory (MODEL= or the cached small base, built now if needed) and the final recipe."""
    from worker_contract.tasks import get_task

    if cfg.model.path:
        if alt := get_task(cfg.task).stand_in():
            console.print(f"[yellow]the data of task {cfg.task} cannot be loaded here (for GSM8K: no `datasets` "
                          f"package, no DRL_GSM8K_DIR): task {alt} stands in for it[/]")
            cfg = cfg.model_copy(update={"task": alt})
        return cfg, Path(cfg.model.path)
    from .basemodel import ensure_base

    task = get_task(cfg.task)
    # the recipe's base ships with the repository (embedded/base_gsm8k); any other is built once, with a bar
    report = ensure_base(cfg.embedded.base, task, paths.cache, max_new_tokens=cfg.algo.max_new_tokens,
                         eval_problems=cfg.embedded.eval_problems, log=console.print, show_progress=True)
    origin = ("shipped with the repository" if report.shipped else
              f"built here in {report.sft_seconds:.0f} s, once; cached under .stoa/cache/")
    console.print(f"base model {report.path}: {report.params / 1e6:.2f} M parameters, held-out accuracy "
                  f"{100 * report.heldout_accuracy:.2f}% after {report.sft_steps} supervised steps ({origin}; the "
                  f"run's own base figure scores v1, these weights in the {cfg.contract.plane} plane, as workers "
                  "sample them)")
    lo, hi = cfg.embedded.base.sft_target_accuracy
    if not lo <= report.heldout_accuracy <= hi:
        console.print(f"[yellow]the base is outside the intended {100 * lo:.0f}-{100 * hi:.0f}% band: RL has "
                      f"{'too little signal' if report.heldout_accuracy < lo else 'little room'}; adjust "
                      "embedded.base.sft_steps in runs/gsm8k.yaml[/]")
    model = cfg.model.model_copy(update={"path": report.path, "hf_id": None})
    return cfg.model_copy(update={"model": model}), Path(report.path)


def publish_contract(cfg: EmbeddedRecipe, paths: EmbeddedPaths, model_dir: Path):
    """run.json (created, or resumed with an identical contract) and the run's signing key; returns the
    store, the manifest and the fingerprint of the key this launcher holds (the workers' join card value)."""
    from trainer.run_init import create_run
    from worker_contract.store import open_store

    store = open_store(cfg.store)
    start = create_run(cfg, store, model_dir, paths.key_file, publish_base=False)  # the learner publishes v1
    if start.reclaimed:
        from rich.console import Console

        Console(stderr=True).print(start.reclaimed, style="yellow", markup=False, highlight=False)
    return store, start.manifest, start.fingerprint


def _steps_done(paths: EmbeddedPaths, say=lambda _line: None) -> int:
    """Steps in the run's newest intact checkpoint (0 for a new run); `say` gets one line per damaged newer
    one the learner will fall back past."""
    from trainer import checkpoint

    skipped: list[str] = []
    path = checkpoint.latest(paths.run_dir / "checkpoints", skipped)
    for line in skipped:
        say(line)
    return checkpoint.read_state(path).step if path is not None else 0


class _Interrupts:
    """Ctrl-C / SIGTERM: the first asks for a clean stop, a second kills the children at once."""

    def __init__(self, procs: Processes):
        self.procs, self.count, self.first = procs, 0, None

    def __call__(self, signum, _frame) -> None:
        self.count += 1
        self.first = self.first or signum
        if self.count > 1:
            self.procs.signal_all(signal.SIGKILL)


#: the console width off a terminal: wide enough that no summary row or table cell is cut
OFF_TERMINAL_WIDTH = 1000


def default_console():
    """The run's console: off a terminal (a pipe, a CI log) rich would cut the summary to 80 columns, so a log
    gets whole lines."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=OFF_TERMINAL_WIDTH)


def run_embedded(cfg: EmbeddedRecipe, console=None, *, root: Path = STOA_DIR) -> int:
    """The embedded run, start to summary; the exit status of `make gsm8k` (0 ok, 1 failed, 130 Ctrl-C, 143
    SIGTERM; the learner stopped by a signal sent to it alone: 128 + that signal's number).

    `root` holds the bucket, the base-model cache and the run dirs (the repo's .stoa/ by default)."""

    console = console or default_console()
    paths = EmbeddedPaths(Path(root), cfg.run)
    cfg = embedded_cfg(cfg, paths)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    # the lock infra/boxops.py's stop and teardown look at; it names this process, for `invoke stop` to end
    lock = lock_run_dir(paths.run_dir, create=True, launcher=True)
    if lock is None:
        console.print(f"[red]run {cfg.run!r} is already running on this machine[/] (lock {paths.run_dir}/.lock); "
                      "stop it first, or choose another RUN")
        return 2
    from infra.children import recorded_children

    if left := recorded_children(paths.run_dir):  # a launcher of this run died; its children still finish
        lock.close()
        where = "" if Path(root) == STOA_DIR else f" --remote-dir {shlex.quote(str(Path(root).resolve().parent))}"
        console.print(f"[red]run {cfg.run!r} still has processes a launcher that died left running[/]: "
                      + ", ".join(f"{c['name']} (pid {c['pid']})" for c in left)
                      + f"; wait for them to end, or stop them (`invoke stop --run {cfg.run} --local{where}`), "
                      "then run it again", markup=True, highlight=False)
        return 2
    from worker_contract.tasks import get_task

    from .view import transformers_errors_only

    services = None
    if (kit := local_services(get_task(cfg.task))) is not None:  # e.g. the generated corpus and the retriever
        services = kit.PsqaServices(cfg, paths)
    # until the children start (a base build, the retriever, run.json), SIGTERM (`invoke stop`) ends the set-up as
    # Ctrl-C does, through the `finally` below, instead of killing the launcher where it stands
    term = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        with transformers_errors_only():  # the base's build and this process's held-out evaluations
            return _run_locked(cfg, paths, console, services)
    finally:
        signal.signal(signal.SIGTERM, term)
        if services is not None:
            services.stop()  # last: workers finishing a group and the final evaluation still search
        lock.close()


def _terminate_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run_locked(cfg: EmbeddedRecipe, paths: EmbeddedPaths, console, services=None) -> int:
    """The run under its lock: the refusals, the model and run.json, the children followed to their end, then
    the last evaluation and the summary; returns the exit status."""
    from trainer.models import IdentityMismatch
    from worker_contract.manifest import ContractMismatch, RunExists

    from .view import panel, status_line

    if (refused := _refusal(cfg, paths, console)) is not None:
        return refused
    if services is not None:
        services.start(console)
        cfg, model_dir = services.prepare_model(cfg, console)
    else:
        cfg, model_dir = prepare_model(cfg, paths, console)
    try:
        store, manifest, key_fingerprint = publish_contract(cfg, paths, model_dir)
    except (ContractMismatch, RunExists, IdentityMismatch) as e:
        console.print(f"[red]{e}[/]\nchoose a new RUN id to start fresh")
        return 2
    procs = Processes(record=paths.run_dir)
    interrupts = _Interrupts(procs)
    old = {s: signal.signal(s, interrupts) for s in (signal.SIGINT, signal.SIGTERM)}
    evaluator = _evaluator(cfg, paths, store, model_dir, services)
    state, tail = _run_state(cfg, paths)
    try:
        learner, workers = _start_children(procs, cfg, paths, model_dir, key_fingerprint, services)
        evaluator.start()
        reason, rc = _watch(cfg, state, tail, evaluator, learner, workers, procs, interrupts, console,
                            panel, status_line)
    finally:
        procs.stop()
        for s, h in old.items():
            signal.signal(s, h)
        evaluator.close()
    if rc == 0:  # after Ctrl-C or a failure, report what was measured and leave
        _last_evaluation(evaluator, tail, state, console)
    _summarize(cfg, paths, store, manifest, state, reason, services, console)
    return rc


def _refusal(cfg: EmbeddedRecipe, paths: EmbeddedPaths, console) -> int | None:
    """The exit status when there is nothing to run (0: the run took its steps) or the recipe cannot resume
    this run (2), found before a base is built or a retriever started; None to go on (a resume says so)."""
    from worker_contract.manifest import ContractMismatch

    done = _steps_done(paths, lambda line: console.print(line, style="yellow", markup=False, highlight=False))
    if done >= cfg.train.num_steps:
        from trainer.config import RECIPES, recipe_path

        # the recipe's name, not the file it was launched from (`--recipe my.yaml` may carry another's name)
        where = (f"{recipe_path(cfg.name)} (or the recipe file it was launched with)" if cfg.name in RECIPES
                 else "the recipe file it was launched with")
        console.print(f"run {cfg.run!r} already took {done} steps (embedded.max_steps={cfg.train.num_steps}): "
                      f"nothing to do. Its metrics: {paths.metrics}. To train it further, raise embedded.max_steps "
                      f"in {where} and run it again (it resumes from its checkpoint); a new RUN starts fresh",
                      markup=False, highlight=False, soft_wrap=True)
        return 0
    try:
        from trainer.run_init import check_recipe_against_run
        from worker_contract.store import open_store

        check_recipe_against_run(cfg, open_store(cfg.store), same_task=("arithmetic",) if cfg.task == "gsm8k" else ())
    except ContractMismatch as e:
        console.print(f"[red]{e}[/]\nchoose a new RUN id to start fresh", markup=True, highlight=False)
        return 2
    if done:
        console.print(f"resuming run {cfg.run!r} from its checkpoint at step {done} of {cfg.train.num_steps}")
    return None


def _evaluator(cfg: EmbeddedRecipe, paths: EmbeddedPaths, store, model_dir: Path, services):
    """The held-out evaluation of each published version, in this process: the services' own, or the task's."""
    if services is not None:
        return services.evaluator(cfg, store, model_dir)
    from worker_contract.tasks import get_task

    from .heldout import HeldoutEvaluator

    return HeldoutEvaluator(store, cfg.run, cfg.contract.plane, model_dir, get_task(cfg.task),
                            problems=cfg.embedded.eval_problems, max_new_tokens=cfg.algo.max_new_tokens,
                            temperature=cfg.embedded.eval_temperature, metrics_path=paths.metrics)


def _run_state(cfg: EmbeddedRecipe, paths: EmbeddedPaths):
    """The panel's state, caught up on the rows of this run's earlier sessions, and a tail of metrics.jsonl
    that starts after them."""
    from worker_contract.tasks import get_task

    from .view import MetricsTail, RunState

    state = RunState(run=cfg.run, max_steps=cfg.train.num_steps, budget_s=cfg.embedded.time_budget_s,
                     heldout_label=get_task(cfg.task).heldout_label, recipe=cfg.name)
    for row in MetricsTail(paths.metrics).read():
        state.update(row)
    state.new_session()
    tail = MetricsTail(paths.metrics)
    tail.offset = paths.metrics.stat().st_size if paths.metrics.exists() else 0
    return state, tail


def _start_children(procs: Processes, cfg: EmbeddedRecipe, paths: EmbeddedPaths, model_dir: Path,
                    key_fingerprint: str, services) -> tuple[Child, list[Child]]:
    """The learner and the workers as child processes, with the services' environment and worker flags."""
    if services is None:
        return (start_learner(procs, cfg, paths, model_dir),
                start_workers(procs, cfg, paths, model_dir, key_fingerprint))
    learner = start_learner(procs, cfg, paths, model_dir, services.env())
    workers = start_workers(procs, cfg, paths, model_dir, key_fingerprint, services.worker_flags(), services.env())
    return learner, workers


def _last_evaluation(evaluator, tail, state, console) -> None:
    """The newest version's held-out evaluation and the learner's last rows, after a run that ended well."""
    try:
        evaluator.evaluate_newest()
    except Exception as e:  # advisory: the run itself is complete
        console.print(f"[yellow]final held-out evaluation failed: {type(e).__name__}: {e}[/]")
    for row in tail.read():
        state.update(row)


def _summarize(cfg: EmbeddedRecipe, paths: EmbeddedPaths, store, manifest, state, reason: str, services,
               console) -> None:
    """The plots and the summary, which names the version the signed pointer holds."""
    from infra.ops.plots import plot_run

    from .view import summary

    plots = plot_run(paths.metrics, paths.run_dir / "plots")
    if services is not None and (paths.run_dir / "plots" / "psqa_eval.png").exists():
        plots.append(paths.run_dir / "plots" / "psqa_eval.png")
    state.version = _pointer_version(store, cfg.run, manifest.trainer_public_key, state.version)
    summary(console, state, paths=paths, plots=plots, stop_reason=reason, store_url=cfg.store)


def _pointer_version(store, run: str, public_key: str, fallback):
    """The version the signed pointer names (what the summary calls published: what a joiner gets), or
    `fallback` where it cannot be read."""
    from worker_contract.pointer import PointerError, read_pointer
    from worker_contract.store import StoreError

    try:
        pointer, _ = read_pointer(store, run, public_key)
    except (PointerError, StoreError):
        return fallback
    return pointer.version if pointer is not None else fallback


def _watch(cfg, state, tail, evaluator, learner: Child, workers: list[Child], procs: Processes,
           interrupts: _Interrupts, console, panel, status_line) -> tuple[str, int]:
    """Follow the run until the learner exits; (why it ended, exit status)."""
    import contextlib

    from rich.live import Live

    from .view import learner_alert

    live = Live(panel(state), console=console, refresh_per_second=2) if console.is_terminal else None
    stopping, reason, rc, last_line = False, "finished", 0, 0
    with live or contextlib.nullcontext():
        while learner.alive():
            for row in tail.read():
                if state.update(row) and state.step % cfg.embedded.eval_every == 0:
                    evaluator.request()
            if not evaluator.results and not evaluator.busy:
                evaluator.request()  # the first published version (the base in a fresh run), once it exists
            if not stopping:
                if interrupts.count:
                    stopping, (reason, rc) = True, interrupted(interrupts.first)
                elif time.monotonic() - state.started > cfg.embedded.time_budget_s:
                    stopping, reason = True, f"time budget of {cfg.embedded.time_budget_s:.0f} s reached"
                elif not any(w.alive() for w in workers) or any(w.proc.poll() not in (None, 0) for w in workers):
                    bad = next(w for w in workers if not w.alive())
                    console.print(f"[red]{bad.name} exited with status {bad.proc.returncode}:[/]\n{bad.tail()}")
                    stopping, reason, rc = True, f"{bad.name} failed", 1
                if stopping:
                    state.phase = f"stopping ({reason}): the learner finishes its step and checkpoints"
                    procs.signal(learner, signal.SIGTERM)
            alert = learner_alert(learner.tail(40))
            if alert and alert != state.alert and live is None:  # off a terminal the panel is not drawn
                console.print(f"learner: {alert} (more in learner.log)", markup=False, highlight=False)
            state.alert = alert or state.alert
            if live is not None:
                live.update(panel(state))
            elif state.step >= last_line + 5:
                last_line = state.step
                console.print(status_line(state))
            time.sleep(0.5)
        for row in tail.read():
            state.update(row)
    return _ending(cfg, state, learner, stopping, reason, rc, console)


def interrupted(signum: int) -> tuple[str, int]:
    """How the run ended when the launcher got `signum` (the first of them): its words and exit status."""
    by = ("Ctrl-C" if signum == signal.SIGINT else "SIGTERM (invoke stop, or another process)"
          if signum == signal.SIGTERM else signal.Signals(signum).name)
    return f"stopped by {by}", 128 + signum


#: how the learner ends when a signal stopped it after its step in hand (entrypoints/learner.py)
_SIGNALLED = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}


def _ending(cfg, state, learner: Child, stopping: bool, reason: str, rc: int, console) -> tuple[str, int]:
    """Why the run ended and its exit status, told from who stopped the learner: this launcher (its reason),
    a signal sent to the learner itself (its name and the step it stopped at), its own end or a failure."""
    status = learner.proc.returncode
    if stopping and status in (0, *_SIGNALLED):  # the stop this launcher asked for
        return reason, rc
    if status in _SIGNALLED:
        return (f"the learner was stopped by {_SIGNALLED[status]} at step {state.step} of "
                f"{cfg.train.num_steps}", status)
    if status not in (0, None):
        console.print(f"[red]the learner exited with status {status}:[/]\n{learner.tail(30)}")
        return "learner failed", 1
    if state.step >= cfg.train.num_steps:
        return f"{cfg.train.num_steps} steps done", rc
    return f"the learner ended at step {state.step} of {cfg.train.num_steps}", rc or 1
