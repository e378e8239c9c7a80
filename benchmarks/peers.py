#!/usr/bin/env python
"""nxdt against the tool a user would pick instead, per job (issue 40): one table.

    .venv/bin/python benchmarks/peers.py                       # every job (make bench-peers sets up the venvs)
    .venv/bin/python benchmarks/peers.py --jobs titan,sft      # some jobs
    .venv/bin/python benchmarks/peers.py --quick               # smoke shapes, 1 repeat, each job < 60 s
    .venv/bin/python benchmarks/peers.py --json peers.json     # the merged table as JSON too
    .venv/bin/python benchmarks/peers.py --markdown peers.md   # and as the Markdown table docs/performance.md holds
    .venv/bin/python benchmarks/peers.py --render peers.json   # a saved run's Markdown table, nothing run

It prints the machine line first (the CPU, its capability flags, the fp32 and bf16 matmul peaks
measured now by benchmarks/throughput.py's probe), then runs each job's script in a subprocess of
its own, as `python benchmarks/<script> [job args] --peers-json OUT [--quick]` (the protocol: the script
writes {"job", "peer", "rows": [{"what", "nxdt", "peer", "ratio", "goal", "pass", "note"}], "skipped"}
and exits 0, also when its peer cannot run here), and prints one table:
job | peer | what | nxdt | peer | ratio | goal | PASS / MISS, and each skipped job with its reason.

A job whose script is missing, exits non-zero or writes no table is printed as FAILED with the last
line of its stderr; the others still run, and the exit status is 1 at the end. A MISS is a measured
result, not a failure: exit 0. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# job -> (script under benchmarks/, its own arguments, the peer it is measured against)
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "titan": ("peer_titan.py", ()),          # pre-training vs torchtitan 0.3.0
    "sft": ("peer_trl.py", ("--job", "sft")),  # SFT with packing vs TRL's SFTTrainer
    "dpo": ("peer_trl.py", ("--job", "dpo")),  # DPO vs TRL's DPOTrainer
    "lora": ("lora.py", ()),                 # LoRA SFT vs peft + transformers.Trainer
    "sampling": ("generate.py", ()),         # sampling vs transformers.generate
    "memory": ("peer_memory.py", ()),        # one step's peak bytes at vocab 128,256 vs the Trainer
    "grpo": ("grpo.py", ()),                 # GRPO vs TRL's GRPOTrainer
}


def machine_line(probe_seconds: float) -> str:
    """benchmarks/throughput.py's machine line: CPU, capability, threads, fp32 / bf16 peaks measured now."""
    sys.path.insert(0, str(HERE))
    from throughput import measure_cpu_peaks

    from nxdt.hardware import machine_line as line

    return line(peaks=measure_cpu_peaks(probe_seconds)) + f" (measured now, {probe_seconds:g} s each)"


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def run_job(job: str, args, work: Path) -> dict:
    """Run one job's script; its table, or {"failed": one line}."""
    script, extra = JOBS[job]
    path = Path(script) if Path(script).is_absolute() else HERE / script
    if not path.exists():
        return {"job": job, "failed": f"{path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path}"
                                      " not found"}
    out, err_path = work / f"{job}.json", work / f"{job}.stderr"
    cmd = [sys.executable, str(path), *extra, "--peers-json", str(out), *(["--quick"] if args.quick else [])]
    print(f"== {job}: {' '.join([Path(cmd[1]).name, *cmd[2:]])}", flush=True)
    start = time.perf_counter()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(HERE.parent))
        for line in proc.stdout:  # the job's own report, as it goes
            print(f"   {line.rstrip()}", flush=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"job": job, "failed": f"timed out after {args.timeout:g} s"}
    wall = time.perf_counter() - start
    if rc != 0 or not out.exists():
        why = last_line(err_path.read_text()) if err_path.stat().st_size else f"exit {rc}, no --peers-json table"
        return {"job": job, "failed": f"exit {rc}: {why}" if rc else why}
    try:
        res = json.loads(out.read_text())
        assert isinstance(res.get("rows"), list) and "skipped" in res, "needs 'rows' (a list) and 'skipped'"
        for row in res["rows"]:
            missing = [k for k in ("what", "nxdt", "peer", "ratio", "goal", "pass") if k not in row]
            assert not missing, f"a row lacks {missing}"
    except (ValueError, AssertionError) as e:
        return {"job": job, "failed": f"bad --peers-json table: {e}"}
    res.setdefault("job", job)
    res["wall_s"] = round(wall, 1)
    return res


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if float(x).is_integer() and abs(x) >= 10_000:  # byte counts, token totals
        return f"{x:,.0f}"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"


def table(results: list[dict]) -> str:
    head = ("job", "peer", "what", "nxdt", "peer", "ratio", "goal", "")
    body = []
    notes = []
    for res in results:
        if "failed" in res:
            notes.append(f"{res['job']}: FAILED: {res['failed']}")
            continue
        if res.get("skipped"):
            notes.append(f"{res['job']}: skipped: {res['skipped']}")
        for row in res["rows"]:
            verdict = "skipped" if row["pass"] is None else ("PASS" if row["pass"] else "MISS")
            body.append((res["job"], res.get("peer", ""), row["what"], fmt(row["nxdt"]), fmt(row["peer"]),
                         fmt(row["ratio"]), row["goal"], verdict + (f"  {row['note']}" if row.get("note") else "")))
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 40)
    lines = [" | ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("-+-".join("-" * w for w in widths[:-1]) + "-+-" + "-" * 8)
    lines += [" | ".join(c.ljust(w) if i != 1 else c[:w].ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in body]
    return "\n".join(lines + notes)


def markdown(saved: dict) -> str:
    """A run's merged table (what --json writes) as the Markdown docs/performance.md holds: the date and
    machine line, one row per goal, then each skipped or failed job with its reason."""
    lines = [f"Measured {saved['date']}{' (--quick)' if saved.get('quick') else ''} by one run of "
             f"`benchmarks/peers.py`; `{saved['machine']}`.", "",
             "| job | peer | what | nxdt | peer | ratio | goal | |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for res in saved["jobs"]:
        if "failed" in res:
            notes.append(f"- {res['job']}: FAILED: {res['failed']}")
            continue
        if res.get("skipped"):
            notes.append(f"- {res['job']}: skipped: {res['skipped']}")
        for i, row in enumerate(res["rows"]):
            verdict = "skipped" if row["pass"] is None else ("PASS" if row["pass"] else "MISS")
            job, peer = (res["job"], res.get("peer", "")) if i == 0 else ("", "")  # once, on the job's first row
            cells = (job, peer, row["what"], fmt(row["nxdt"]), fmt(row["peer"]), fmt(row["ratio"]), row["goal"], verdict)
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma list from {','.join(JOBS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="passed to every job: smoke shapes, 1 repeat")
    p.add_argument("--json", metavar="OUT", help="write the merged table (machine line, every job) here")
    p.add_argument("--markdown", metavar="OUT", help="write the table as Markdown (docs/performance.md's form) here")
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a saved --json run; runs nothing")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds per dtype of the matmul peak probe")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one job may run")
    args = p.parse_args(argv)
    args.jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    bad = [j for j in args.jobs if j not in JOBS]
    if bad or not args.jobs:
        p.error(f"--jobs: from {','.join(JOBS)} (got {','.join(args.jobs) or 'none'})")
    if args.probe_seconds <= 0 or args.timeout <= 0:
        p.error("--probe-seconds and --timeout must be > 0")
    return args


def main(argv=None) -> int:
    import tempfile

    args = parse(argv)
    if args.render:
        try:
            saved = json.loads(Path(args.render).read_text())
            print(markdown(saved), end="")
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"peers.py: --render {args.render}: not a saved run ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        return 0
    machine = machine_line(args.probe_seconds)
    print(machine, flush=True)
    with tempfile.TemporaryDirectory(prefix="nxdt-peers-") as tmp:
        results = [run_job(job, args, Path(tmp)) for job in args.jobs]
    print()
    print(f"nxdt vs its peers, {time.strftime('%Y-%m-%d', time.gmtime())}{' (--quick)' if args.quick else ''}")
    print(machine)
    print(table(results), flush=True)
    saved = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine, "quick": args.quick,
             "jobs": results}
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(saved))
    failed = [r["job"] for r in results if "failed" in r]
    if failed:
        print(f"\njobs failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
