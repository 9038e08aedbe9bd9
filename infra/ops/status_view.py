"""Rich rendering of a `RunStatus` for people (scripts use `--json`)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from .status import RunStatus

#: the console width off a terminal: wider than any table, so none is folded or cut (`| less -S`, files)
OFF_TERMINAL_WIDTH = 1000


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 90:
        return f"{s:.0f}s ago"
    if s < 5400:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def _overview(st: RunStatus) -> Table:
    t = Table(title=f"run {st.run}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("store", st.store)
    m = st.manifest or {}
    if m:
        t.add_row("contract", f"n_samples={m['n_samples']} plane={m['plane']} kv_mode={m['kv_mode'] or '-'} "
                  f"task={m['task']} staleness={m['staleness']}")
        t.add_row("model", str(m["model_id"]))
    ptr = "-" if st.pointer_version is None else (
        f"v{st.pointer_version} ({human_age(st.pointer_age_s)}), cold joins start at anchor v{st.pointer_anchor}")
    t.add_row("pointer", ptr)
    t.add_row("anchors", ", ".join(f"v{v}" for v in st.anchors) or "-")
    rate = "-" if st.groups_per_minute is None else f"{st.groups_per_minute:.1f}"
    t.add_row("workers", f"{st.active_workers} active in the last {st.window_min:g} min, groups/min {rate}")
    return t


def _audit_cell(w) -> Text:
    """The trainer's log-prob audit of a worker: its mismatch in nats and the version it was last measured at,
    red and marked when flagged."""
    if w.logprob_mismatch is None:
        return Text("-")
    at = f" @v{w.audited_version}" if w.audited_version is not None else ""
    return Text(f"{'FLAGGED ' if w.flagged else ''}{w.logprob_mismatch:.3f}{at}",
                style="bold red" if w.flagged else "")


def _workers(st: RunStatus) -> Table:
    t = Table(title="workers (recent version prefixes)", title_justify="left")
    for col in ("worker", "newest", "lag", "groups", f"last {st.window_min:g}m", "last seen", "used", "dropped",
                "audit", "versions"):
        t.add_column(col, justify="left" if col in ("worker", "versions") else "right")
    for w in st.workers:
        lag = Text(str(w.lag), style="red" if st.manifest and w.lag > st.manifest["staleness"] else "")
        t.add_row(w.worker_id, f"v{w.newest_version}", lag, str(w.groups),
                  "-" if w.groups_recent is None else str(w.groups_recent), human_age(w.last_seen_s),
                  "-" if w.used is None else str(w.used),
                  Text("-" if w.dropped is None else str(w.dropped), style="red" if w.dropped else ""),
                  _audit_cell(w), " ".join(str(v) for v in w.versions[-8:]))
    return t


def _histogram(st: RunStatus) -> Table:
    t = Table(title="staleness (versions behind the pointer)", title_justify="left")
    t.add_column("staleness", justify="right")
    t.add_column("in the bucket", justify="right")  # trained on or not: the bucket does not say which
    t.add_column("")
    t.add_column("trained on (recent)", justify="right")
    top = max(st.staleness.values(), default=1)
    bound = st.manifest["staleness"] if st.manifest else None
    for s in sorted(set(st.staleness) | set(st.staleness_consumed)):
        n = st.staleness.get(s, 0)
        style = "red" if bound is not None and (s > bound or s < 0) else "green"
        bar = Text("#" * max(1, round(30 * n / top)) if n else "", style=style)
        t.add_row(str(s), str(n), bar, str(st.staleness_consumed.get(s, 0)))
    return t


def _drops(st: RunStatus) -> Table:
    t = Table(title="drops by reason", title_justify="left")
    t.add_column("reason")
    t.add_column("since the learner started", justify="right")  # a resumed learner counts from 0
    t.add_column("recent versions", justify="right")
    for reason in sorted(set(st.drops) | set(st.drops_recent), key=lambda r: -st.drops.get(r, 0)):
        t.add_row(reason, str(st.drops.get(reason, 0)), str(st.drops_recent.get(reason, 0)))
    return t


def _publishes(st: RunStatus) -> Table:
    t = Table(title="recent publishes", title_justify="left")
    for col in ("version", "patch", "latency", "groups"):
        t.add_column(col, justify="right")
    for p in st.publishes:
        t.add_row(f"v{p.version}", human_bytes(p.patch_bytes),
                  "-" if p.latency_s is None else f"{p.latency_s:.2f}s", "-" if p.groups is None else str(p.groups))
    return t


def _bytes(st: RunStatus) -> Table:
    t = Table(title="bucket bytes by prefix", title_justify="left")
    for col in ("prefix", "objects", "bytes"):
        t.add_column(col, justify="left" if col == "prefix" else "right")
    usage = st.bytes_by_prefix
    assert usage is not None
    for name, u in sorted(usage.prefixes.items(), key=lambda kv: -kv[1].bytes):
        t.add_row(name, str(u.objects), human_bytes(u.bytes))
    t.add_row("total", str(sum(u.objects for u in usage.prefixes.values())), human_bytes(usage.total_bytes),
              style="bold")
    return t


def _cost(st: RunStatus) -> Table:
    c = st.cost
    assert c is not None
    note = ("as if on R2, " if st.store.startswith("file://") else "") + "before the free tier"
    t = Table(title="R2 cost (estimate)", caption=note, title_justify="left", caption_justify="left")
    for col in ("", "so far", "per hour"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("storage", f"{c.gb_month_so_far:.3g} GB-month", f"{human_bytes(c.storage_gb * 1e9)} held")
    t.add_row("class A ops", f"{c.class_a_ops:,}", f"{c.class_a_per_hour:,.0f}")
    t.add_row("class B ops", f"{c.class_b_ops:,}", f"{c.class_b_per_hour:,.0f}")
    t.add_row("USD", f"${c.usd_total:.4f}", f"${c.usd_per_hour:.4f}", style="bold")
    return t


def _remote(st: RunStatus) -> Table:
    t = Table(title="trainer box", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in (st.remote or {}).items():
        text = "\n".join(v[-10:]) if isinstance(v, list) else str(v)
        t.add_row(str(k), text)
    return t


def render_status(st: RunStatus) -> RenderableType:
    parts: list[RenderableType] = [_overview(st)]
    if st.workers:
        parts.append(_workers(st))
    if st.staleness or st.staleness_consumed:
        parts.append(_histogram(st))
    if st.drops or st.drops_recent:
        parts.append(_drops(st))
    if st.publishes:
        parts.append(_publishes(st))
    if st.bytes_by_prefix is not None:
        parts.append(_bytes(st))
    if st.cost is not None:
        parts.append(_cost(st))
    if st.remote is not None:
        parts.append(_remote(st))
    parts += [Text(f"note: {n}", style="yellow") for n in st.notes]
    return Group(*parts)


#: seconds between refreshes of `--watch`, and between its full (bytes-by-prefix) listings
WATCH_INTERVAL_S = 5.0
BYTES_REFRESH_S = 60.0


def attach_remote(st: RunStatus, host: str, *, ssh_key: str | None = None, remote_dir: str | None = None) -> None:
    """Add the trainer box's own view (infra.remote.remote_status over SSH) to `st`, or say why it is missing."""
    from worker_contract.env import redact

    try:
        from infra.remote import remote_status
    except ImportError:
        st.notes.append("--host given, but infra.remote.remote_status is not available in this checkout")
        return
    kwargs = {"ssh_key": ssh_key, **({"remote_dir": remote_dir} if remote_dir else {})}
    try:
        st.remote = {k: redact(str(v)) if isinstance(v, str) else v
                     for k, v in dict(remote_status(host, st.run, **kwargs)).items()}
    except Exception as e:  # a status view reports a box it cannot reach; it does not crash on it
        st.notes.append(f"trainer box {host}: {type(e).__name__}: {redact(str(e))}")


class _PipeConsole(Console):
    def on_broken_pipe(self) -> None:  # rich exits 1 here; the task's guard ends a closed pipe quietly
        self.quiet = True
        raise BrokenPipeError


@dataclass
class _StatusReader:
    """Reads the run's status, again on every refresh: records' upload times are read once (records are
    immutable), and the whole-run bytes listing is redone only every BYTES_REFRESH_S."""

    store: Any
    run: str
    window_min: float
    host: str | None
    ssh_key: str | None
    remote_dir: str | None
    bytes_at: float = 0.0
    record_times: dict[str, float] = field(default_factory=dict)

    def read(self, prev: RunStatus | None) -> RunStatus:
        from trainer.progress import progress

        from .status import collect_status

        fresh = prev is None or time.monotonic() - self.bytes_at >= BYTES_REFRESH_S
        with progress("listing the run", unit="items") as advance:
            st = collect_status(self.store, self.run, window_min=self.window_min, advance=advance,
                                record_times=self.record_times, bytes_cache=None if fresh else prev.bytes_by_prefix)
        if fresh:
            self.bytes_at = time.monotonic()
        if self.host:
            attach_remote(st, self.host, ssh_key=self.ssh_key, remote_dir=self.remote_dir)
        return st


def show_status(store, run: str, *, watch: bool = False, as_json: bool = False, host: str | None = None,
                ssh_key: str | None = None, remote_dir: str | None = None, window_min: float = 5.0,
                iterations: int | None = None) -> RunStatus:
    """Print the status once (rich tables, or JSON), or keep refreshing it with `watch`.

    With `watch` and `as_json` every refresh prints one JSON line (for scripts that follow the run).
    `iterations` bounds the watch loop (tests); None refreshes until Ctrl-C.
    """
    # Off a terminal (a pipe, a file) rich would fold every table into 80 columns and cut its cells short;
    # there each table keeps its natural width instead (none of them expands to the console's).
    on_terminal = sys.stdout.isatty()
    console = _PipeConsole() if on_terminal else _PipeConsole(width=OFF_TERMINAL_WIDTH)
    reader = _StatusReader(store, run, window_min, host, ssh_key, remote_dir)
    st = reader.read(None)
    if as_json:
        print(st.model_dump_json(indent=None if watch else 2), flush=True)
    if not watch:
        if not as_json:
            console.print(render_status(st))
        return st
    return _watch(reader, st, console, on_terminal=on_terminal, as_json=as_json, iterations=iterations)


def _watch(reader: _StatusReader, st: RunStatus, console: Console, *, on_terminal: bool, as_json: bool,
           iterations: int | None) -> RunStatus:
    """Refresh every WATCH_INTERVAL_S until Ctrl-C (or `iterations` views); returns the last status."""
    import contextlib

    from rich.live import Live

    # Off a terminal a Live view prints nothing until it stops, so `--watch | head` waited forever: there every
    # refresh is printed in full as it comes, and the first write after the reader went away ends the watch.
    live = Live(render_status(st), console=console, refresh_per_second=2) if on_terminal and not as_json else None
    if live is None and not as_json:
        console.print(render_status(st))
        sys.stdout.flush()
    with live or contextlib.nullcontext(), contextlib.suppress(KeyboardInterrupt):
        n = 1
        while iterations is None or n < iterations:
            time.sleep(WATCH_INTERVAL_S)
            st = reader.read(st)
            if as_json:
                print(st.model_dump_json(), flush=True)
            elif live is not None:
                live.update(render_status(st))
            else:
                console.print(render_status(st))
                sys.stdout.flush()
            n += 1
    return st
