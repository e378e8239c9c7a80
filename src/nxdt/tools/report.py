"""`nxdt report`: plots and a one-page summary of training runs; with several runs, their curves
overlaid and the largest gap between them, per metric.

    nxdt report nxdt_experiments/tiny_llama/2026-11-24_16-09-50
    nxdt report runs/ref runs/tp2 --assert-equal 1e-5          # exit 1 if the losses differ more

A run directory is an exp_manager log dir: TensorBoard event files directly in it (read with
TensorBoard's EventAccumulator), else `metrics.csv` (the CSV logger), plus `config.yaml` for the
layout and the model size. Writes `report.md` and one PNG per metric (matplotlib, the `report`
extra) to `--output` (default `<RUN_DIR>/report` for one run, `./nxdt_report` for several: a
comparison belongs to no single run). Metrics a run did not log are left out and named.

`--assert-equal TOL` is for scripts (layout parity, a refactor that must not change numbers): exit 1,
one line per metric, when two runs differ by more than TOL (absolute) at a step they share, on the
losses (reduced_train_loss, val_loss, test_loss) or the metrics named by `--metrics`.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from nxdt.config.errors import ConfigError
from nxdt.config.load import load_saved_config
from nxdt.spec import build_spec
from nxdt.tools.plan import plan

# Plotted by default, in this order, with a title each; any other logged tag can be named by --metrics.
TITLES = {
    "reduced_train_loss": "train loss",
    "val_loss": "validation loss",
    "lr": "learning rate",
    "gradient_norm": "gradient norm",
    "throughput": "tokens/s",
    "mfu": "MFU (% of peak)",
    "tflops": "model TFLOP/s per device",
    "memory/peak_gib": "peak memory (GiB)",
}
# drawn on another metric's plot too: the validation loss beside the training loss
OVERLAID = {"reduced_train_loss": "val_loss"}
# plotted from 0: a small change of an amount is not a cliff
FROM_ZERO = ("memory/peak_gib", "throughput", "mfu", "tflops")
DEFAULT_PLOTS = ("reduced_train_loss", "val_loss", "lr", "gradient_norm", "throughput", "mfu", "memory/peak_gib")
# What --assert-equal compares unless --metrics names others: the values a change of layout or a
# refactor must keep (timings never repeat, so they are only reported).
DEFAULT_COMPARED = ("reduced_train_loss", "val_loss", "test_loss")
BOOKKEEPING = ("epoch",)  # Lightning's; never worth a plot
EXACT = ".8g"  # values side by side: enough digits (float32 has ~7) to see a gap of one rounding
PNG_WIDTH, PNG_HEIGHT, PNG_DPI = 7.0, 4.0, 100

Series = dict[int, float]  # step -> value


@dataclass
class Run:
    path: Path
    label: str
    series: dict[str, Series]
    source: str                    # where the numbers came from, for the summary
    wall_time_s: float | None      # summed over sessions; None without timestamps (metrics.csv)
    sessions: int
    cfg: Any = None                # the saved NxdtConfig, or None
    config_note: str = ""          # why there is no config
    facts: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- reading a run
def _event_sessions(run_dir: Path) -> list[tuple[dict[str, list[tuple[int, float]]], float, float]]:
    """Per event file that holds scalars: ({tag: [(step, value)]}, first, last wall time), in
    the order they were written. Each (re)start of a run writes a new file."""
    sessions = []
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})  # 0 = keep every point, not a sample
        acc.Reload()
        scalars, times = {}, []
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            scalars[tag] = [(int(e.step), float(e.value)) for e in events]
            times += [e.wall_time for e in events]
        if times:
            sessions.append((scalars, min(times), max(times)))
    sessions.sort(key=lambda s: s[1])
    return sessions


def merge_sessions(sessions: list[dict[str, list[tuple[int, float]]]]) -> dict[str, Series]:
    """One series per tag from a run's sessions, oldest first.

    A resumed session restarts at its checkpoint's step: what earlier sessions logged from that
    step on was redone or abandoned (a crash after the checkpoint), so it is dropped; where steps
    repeat, the last value written for a step wins (also within one session). A session without
    training steps (an evaluate-only rerun) only adds its values."""
    merged: dict[str, Series] = {}
    for scalars in sessions:
        train = scalars.get("reduced_train_loss")
        if train:
            restart = min(step for step, _ in train)
            merged = {tag: {s: v for s, v in series.items() if s < restart} for tag, series in merged.items()}
        for tag, points in scalars.items():
            series = merged.setdefault(tag, {})
            for step, value in points:
                series[step] = value
    return {tag: dict(sorted(series.items())) for tag, series in merged.items() if series}


def _csv_sessions(path: Path) -> list[dict[str, list[tuple[int, float]]]]:
    """metrics.csv (the CSV logger: a `step` column, one column per metric, blank where a row did
    not log it; a resumed run appends) cut into sessions like the event files: a row whose training
    loss is at a step the current session already passed is a restart."""
    sessions: list[dict[str, list[tuple[int, float]]]] = [{}]
    last_train_step = -1
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            try:
                step = int(float(row.get("step") or ""))
            except ValueError:
                continue
            values = {}
            for tag, text in row.items():
                if tag not in (None, "step") and text not in (None, ""):
                    try:
                        values[tag] = float(text)
                    except ValueError:
                        pass
            if "reduced_train_loss" in values:
                if step <= last_train_step:
                    sessions.append({})
                last_train_step = step
            for tag, value in values.items():
                sessions[-1].setdefault(tag, []).append((step, value))
    return sessions


def _no_data_error(run_dir: Path) -> ConfigError:
    nested = sorted({p.parent.name for p in run_dir.glob("*/events.out.tfevents.*")})  # the parent of runs?
    shown = ", ".join(nested[-5:]) + (f" and {len(nested) - 5} more" if len(nested) > 5 else "")
    hint = f" (event files are in its sub-folders {shown}: pass one of them)" if nested else ""
    return ConfigError(f"{run_dir}: no TensorBoard event files with scalars nor metrics.csv{hint}")


def read_run(run_dir: Path, label: str) -> Run:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    sessions = _event_sessions(run_dir)
    if sessions:
        series = merge_sessions([s for s, _, _ in sessions])
        wall = sum(last - first for _, first, last in sessions)
        files = len(sessions)
        run = Run(run_dir, label, series, f"TensorBoard events ({files} file{'s' * (files > 1)})", wall, files)
    elif (run_dir / "metrics.csv").is_file():
        sessions = _csv_sessions(run_dir / "metrics.csv")
        run = Run(run_dir, label, merge_sessions(sessions), "metrics.csv", None, len(sessions))
    else:
        raise _no_data_error(run_dir)
    if not any(run.series.values()):
        raise _no_data_error(run_dir)
    _attach_config(run)
    return run


def _attach_config(run: Run) -> None:
    path = run.path / "config.yaml"
    if not path.is_file():
        run.config_note = "no config.yaml"
        return
    try:
        run.cfg = load_saved_config(path)
    except ConfigError as err:
        run.config_note = f"config.yaml unreadable: {err}"


def run_labels(paths: list[Path]) -> list[str]:
    """The folder names, with as many parent folders as it takes to tell the runs apart."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p.name}#{i}" for i, p in enumerate(paths)]  # the same folder twice


# --------------------------------------------------------------------------- numbers
def steps_trained(run: Run) -> int | None:
    """Optimizer steps done in this log: the last `global_step` value, else the last logged training
    step (a logged step's number is the optimizer steps done, as `global_step`); less the steps done
    before this log began (`steps_before`: 300 steps from step 300 are 300, not 600)."""
    train = run.series.get("reduced_train_loss")
    start = steps_before(run)
    if run.series.get("global_step"):
        return int(list(run.series["global_step"].values())[-1]) - start
    return max(train) - start if train else None


def log_interval(run: Run) -> int:
    """trainer.log_every_n_steps of the run: its config's, else the smallest gap between the logged
    training steps, else 1."""
    if run.cfg is not None:
        return max(int(run.cfg.trainer.log_every_n_steps), 1)
    steps = sorted(run.series.get("reduced_train_loss") or {})
    return min((b - a for a, b in zip(steps, steps[1:])), default=1)


def steps_before(run: Run) -> int:
    """Optimizer steps done before this log began (0 for a run from scratch): a step's scalars are
    logged when its number (the optimizer steps done) is a multiple of log_every_n_steps, so the
    first logged step F of a log that began after S steps (S a multiple of the interval, as saves
    and resumes are in practice) is S + interval: with 10, a fresh run's first row is step 10
    (S = 0, not 10), a run resumed at 300 starts at 310 (S = 300)."""
    train = run.series.get("reduced_train_loss")
    return max(min(train) - log_interval(run), 0) if train else 0


def _steps_fact(run: Run) -> str:
    n = steps_trained(run)
    if n is None:
        return ""
    train = run.series.get("reduced_train_loss") or {0: 0.0}
    first, last, start = min(train), max(train), steps_before(run)
    return f"{n:,}" + (f" (steps {first:,}–{last:,}: started from a checkpoint at step {start:,})" if start else "")


def _layout_fact(cfg) -> str:
    try:
        lay = build_spec(cfg).layout
    except ConfigError as err:
        return f"not computed ({err})"
    ep = f", ep {lay.ep}" if lay.ep > 1 else ""
    return f"world {lay.world_size}: dp {lay.dp}, tp {lay.tp}, pp {lay.pp}, cp {lay.cp}{ep}"


def _parameters_fact(cfg) -> str:
    """The exact count `nxdt plan` prints (the model built on the meta device: no memory, no weights)."""
    try:
        n = plan(build_spec(cfg))["parameters"]
    except Exception as err:  # a nicety: a moved tokenizer or HF model config must not stop the report
        return f"not computed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return f"{n:,}" if n < 1e6 else f"{n:,} ({n / 1e6:.1f} M)" if n < 1e9 else f"{n:,} ({n / 1e9:.2f} B)"


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    if not minutes:
        return f"{seconds:.1f} s"
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m:02d} min" if hours else f"{m} min {s:02d} s"


def _fmt(value: float, spec: str = ".6g") -> str:
    return format(value, spec)


def _lowest(series: Series) -> str:
    """The smallest value and its (first) step; NaNs never win."""
    step = min(series, key=lambda s: (math.isnan(series[s]), series[s], s))
    return f"{_fmt(series[step])} (step {step})"


def run_facts(run: Run) -> dict[str, str]:
    """Row name -> the run's cell of the summary table ("" = not known, shown as —)."""
    s, cfg = run.series, run.cfg
    facts = {"run dir": f"`{run.path}`", "read from": run.source}
    if cfg is not None:
        facts["config"] = f"{cfg.name} (model_source {cfg.model_source}, precision {cfg.precision.type})"
        facts["layout"] = _layout_fact(cfg)
        facts["parameters"] = _parameters_fact(cfg)
    else:
        facts["config"] = run.config_note
    facts["steps trained"] = _steps_fact(run)
    if run.wall_time_s is not None:
        sessions = f", {run.sessions} sessions" if run.sessions > 1 else ""
        facts["wall time"] = f"{_duration(run.wall_time_s)} (first to last logged step{sessions})"
    train = s.get("reduced_train_loss")
    if train:
        first, last = min(train), max(train)
        facts["train loss first / last / min"] = (f"{_fmt(train[first])} (step {first}) / "
                                                  f"{_fmt(train[last])} (step {last}) / {_lowest(train)}")
    if s.get("val_loss"):
        facts["best val loss"] = _lowest(s["val_loss"])
    if s.get("test_loss"):
        step = max(s["test_loss"])
        facts["test loss"] = f"{_fmt(s['test_loss'][step])} (step {step})"
    for tag, row, spec in (("throughput", "median tokens/s", ",.0f"), ("step_time", "median step time (s)", ".3g"),
                           ("tflops", "median TFLOP/s per device", ".3g"), ("mfu", "median MFU (%)", ".1f")):
        if s.get(tag):
            facts[row] = _fmt(statistics.median(s[tag].values()), spec)
    if s.get("memory/peak_gib"):
        facts["peak memory (GiB)"] = _fmt(max(s["memory/peak_gib"].values()), ".2f")
    return facts


def _values_gap(values: list[float]) -> float:
    """Spread of the runs' values at one step; NaN against a number is an infinite gap, NaN against NaN none."""
    nans = sum(math.isnan(v) for v in values)
    if nans:
        return 0.0 if nans == len(values) else math.inf
    return max(values) - min(values)


@dataclass
class Gap:
    metric: str
    shared_steps: int
    gap: float = 0.0
    step: int | None = None
    values: list[float] = field(default_factory=list)
    missing_in: list[str] = field(default_factory=list)  # labels of runs that did not log it


def max_gap(runs: list[Run], metric: str) -> Gap:
    """The largest spread between the runs' values of `metric` over the steps all of them logged."""
    missing = [r.label for r in runs if not r.series.get(metric)]
    if missing:
        return Gap(metric, 0, missing_in=missing)
    shared = set.intersection(*(set(r.series[metric]) for r in runs))
    best = Gap(metric, len(shared))
    for step in sorted(shared):
        values = [r.series[metric][step] for r in runs]
        gap = _values_gap(values)
        if best.step is None or gap > best.gap:
            best.gap, best.step, best.values = gap, step, values
    return best


# --------------------------------------------------------------------------- output
def _png_name(metric: str) -> str:
    return metric.replace("/", "_") + ".png"


def plot_lines(run: Run, metric: str, several: bool = False) -> list[dict[str, Any]]:
    """What a run draws on a metric's plot: its series, and on the training loss the validation loss
    too (dashed), so the two curves are read against each other."""
    lines = [{"label": run.label if several else metric, "steps": list(run.series[metric]),
              "values": list(run.series[metric].values()), "style": "-"}]
    other = OVERLAID.get(metric)
    if other and run.series.get(other):
        lines.append({"label": f"{run.label} {other}" if several else other, "steps": list(run.series[other]),
                      "values": list(run.series[other].values()), "style": "--"})
    return lines


def write_plots(runs: list[Run], metrics: list[str], out: Path) -> list[str] | None:
    """One PNG per metric that some run logged (the runs overlaid; with several runs a lower panel
    shows each run minus the first on their shared steps). None when matplotlib is missing."""
    try:  # optional extra: matplotlib (nxdt[report])
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    written = []
    for metric in metrics:
        logged = [r for r in runs if r.series.get(metric)]
        if not logged:
            continue
        base = runs[0].series.get(metric)
        diff = len(runs) > 1 and base is not None and any(set(r.series.get(metric, {})) & set(base) for r in runs[1:])
        # Agg on a Figure of its own: no pyplot, no global backend switch, safe in any process
        fig = Figure(figsize=(PNG_WIDTH, PNG_HEIGHT * (1.5 if diff else 1)), dpi=PNG_DPI)
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1]) if diff else [fig.subplots()]
        colors = {r.label: f"C{i % 10}" for i, r in enumerate(runs)}  # a run keeps its colour in both panels
        for r in logged:
            for line in plot_lines(r, metric, several=len(runs) > 1):
                axes[0].plot(line["steps"], line["values"], label=line["label"], color=colors[r.label],
                             linestyle=line["style"], marker="o" if len(line["steps"]) <= 30 else None, markersize=3)
        axes[0].set_title(f"{TITLES.get(metric, metric)}  ({metric})"
                          + (" and validation loss" if metric in OVERLAID else ""))
        axes[0].set_ylabel(TITLES.get(metric, metric))
        if metric in FROM_ZERO:  # 0.22 -> 0.25 GiB is not a cliff
            axes[0].set_ylim(bottom=0)
        if len(runs) > 1 or any(r.series.get(OVERLAID.get(metric, "")) for r in logged):
            axes[0].legend(fontsize="small")
        if diff:
            for r in runs[1:]:
                shared = sorted(set(r.series.get(metric, {})) & set(base))
                if shared:
                    axes[1].plot(shared, [r.series[metric][s] - base[s] for s in shared], color=colors[r.label],
                                 marker="o" if len(shared) <= 30 else None, markersize=3)
            axes[1].axhline(0.0, color="gray", linewidth=0.8)
            axes[1].set_ylabel(f"minus {runs[0].label}", fontsize="small")
        axes[-1].set_xlabel("step")
        for ax in axes:
            ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / _png_name(metric))
        written.append(metric)
    return written


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell or "—" for cell in row) + " |" for row in rows)]


def render_markdown(runs: list[Run], metrics: list[str], gaps: list[Gap], plots: list[str] | None) -> str:
    title = runs[0].label if len(runs) == 1 else " vs ".join(r.label for r in runs)
    lines = [f"# nxdt report: {title}", ""]
    facts = [r.facts for r in runs]
    rows = list(dict.fromkeys(key for f in facts for key in f))
    lines += _table(["", *(r.label for r in runs)], [[row, *(f.get(row, "") for f in facts)] for row in rows])
    absent = []
    for metric in metrics:
        missing = [r.label for r in runs if not r.series.get(metric)]
        if missing:
            absent.append(f"`{metric}`" + ("" if len(missing) == len(runs) else f" (by {', '.join(missing)})"))
    if absent:
        lines += ["", "Not logged: " + ", ".join(absent) + "."]
    if gaps:
        lines += ["", "## Largest gap between the runs", "",
                  "Over the steps all runs logged; the gap is the largest value minus the smallest at one step.", ""]
        header = ["metric", "shared steps", "max gap", "at step", "values there (column order)"]
        lines += _table(header, [_gap_cells(g) for g in gaps])
    lines += ["", "## Plots", ""]
    if plots is None:
        lines.append("Plots not written: matplotlib is not installed (`pip install 'nxdt[report]'`).")
    elif not plots:
        lines.append("No plots: none of the chosen metrics was logged.")
    for metric in plots or []:
        lines += [f"![{TITLES.get(metric, metric)}]({_png_name(metric)})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _gap_cells(g: Gap) -> list[str]:
    if g.missing_in:
        return [f"`{g.metric}`", "", f"not logged by {', '.join(g.missing_in)}", "", ""]
    if g.step is None:
        return [f"`{g.metric}`", "0", "no shared step", "", ""]
    return [f"`{g.metric}`", str(g.shared_steps), _fmt(g.gap, ".3g"), str(g.step),
            " / ".join(_fmt(v, EXACT) for v in g.values)]


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nxdt report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="exp_manager log dirs of training runs")
    p.add_argument("--output", type=Path, metavar="DIR",
                   help="folder for report.md and the PNGs (default: <RUN_DIR>/report for one run, "
                        "./nxdt_report for several)")
    p.add_argument("--metrics", metavar="TAG[,TAG...]",
                   help=f"comma-separated logged tags to plot and compare (default: {','.join(DEFAULT_PLOTS)}); "
                        "'all' = every logged scalar")
    p.add_argument("--assert-equal", type=float, metavar="TOL",
                   help=f"exit 1 if two runs differ by more than TOL at a shared step (default metrics: "
                        f"{', '.join(DEFAULT_COMPARED)})")
    return p


def _chosen_metrics(arg: str | None, runs: list[Run]) -> list[str]:
    logged = list(dict.fromkeys(tag for r in runs for tag in r.series))
    if arg is None:
        return list(DEFAULT_PLOTS)
    if arg.strip() == "all":
        return [t for t in logged if t not in BOOKKEEPING]
    chosen = [m.strip() for m in arg.split(",") if m.strip()]
    for metric in chosen:
        if metric not in logged:  # a typo, most likely: nothing would be plotted or compared
            close = difflib.get_close_matches(metric, logged, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"--metrics: '{metric}' is logged by none of the runs "
                              f"({hint}logged: {', '.join(logged)})")
    return chosen


def _assert_equal(runs: list[Run], metrics: list[str], tol: float) -> list[str]:
    """One line per metric that breaks the tolerance (or cannot be compared)."""
    failures, compared = [], 0
    for metric in metrics:
        g = max_gap(runs, metric)
        if len(g.missing_in) == len(runs):
            continue  # e.g. test_loss of runs without a test split
        compared += 1
        if g.missing_in:
            failures.append(f"{metric}: not logged by {', '.join(g.missing_in)}")
        elif g.step is None:
            failures.append(f"{metric}: the runs share no logged step")
        elif not g.gap <= tol:
            values = ", ".join(f"{r.label} {_fmt(v, EXACT)}" for r, v in zip(runs, g.values))
            failures.append(f"{metric} differs by {_fmt(g.gap, '.3g')} at step {g.step} (tolerance {tol:g}): {values}")
    if not compared:
        failures.append(f"nothing to compare: none of {', '.join(metrics)} is logged by the runs")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.assert_equal is not None and (len(args.run_dirs) < 2 or not args.assert_equal >= 0):
        raise ConfigError("--assert-equal: needs two or more RUN_DIRs and a tolerance >= 0 "
                          f"(got {len(args.run_dirs)} run(s), {args.assert_equal})")
    labels = run_labels(args.run_dirs)
    runs = [read_run(path, label) for path, label in zip(args.run_dirs, labels)]
    metrics = _chosen_metrics(args.metrics, runs)
    for run in runs:
        run.facts = run_facts(run)

    compared = metrics if args.metrics else list(DEFAULT_COMPARED)
    gap_metrics = list(dict.fromkeys([*compared, *metrics]))
    gaps = [max_gap(runs, m) for m in gap_metrics if any(r.series.get(m) for r in runs)] if len(runs) > 1 else []

    out = args.output or (runs[0].path / "report" if len(runs) == 1 else Path("nxdt_report"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output {out}: cannot create it ({err.strerror}); "
                          "choose another folder with --output") from None
    plots = write_plots(runs, metrics, out)
    (out / "report.md").write_text(render_markdown(runs, metrics, gaps, plots), encoding="utf-8")

    made = "no plots: pip install 'nxdt[report]'" if plots is None else f"{len(plots)} plot{'s' * (len(plots) != 1)}"
    print(f"report: {out / 'report.md'} ({made})")
    if gaps:
        print("max gap between runs (steps all of them logged):")
        for g in gaps:
            _, shared, gap, step, _ = _gap_cells(g)
            where = f" at step {step} ({shared} shared steps)" if g.step is not None else ""
            print(f"  {g.metric:<24} {gap}{where}")
    if args.assert_equal is not None:
        failures = _assert_equal(runs, compared, args.assert_equal)
        for line in failures:
            print(f"not equal: {line}", file=sys.stderr)
        if failures:
            return 1
        checked = [m for m in compared if any(r.series.get(m) for r in runs)]
        print(f"equal within {args.assert_equal:g}: {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
