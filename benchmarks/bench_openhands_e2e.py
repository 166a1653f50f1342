"""OpenHands task completion time, fcfs vs mars, end to end on CPU (issue #17; MARS §6).

Scenario: ``--tasks`` SWE-bench tasks whose instances have a bundled mini-swe-agent trace
(``../shared/data/traces/mini-swe-agent/deepseek_chat_dev``, sorted by name), in SWE-bench's own
row format (``instance_id``, ``repo``, ``base_commit``, ``problem_statement`` = the trace's PR
description), with a local repository mirror of tiny fixture git repositories written here (one
per repository, named ``<owner>__<name>``; the real repositories are not on this machine). Then
``mars-openhands openhands bench`` (:mod:`eval.ohbench`): per policy, an emulated-GPU vLLM server
(``--gpu`` × Qwen3-Coder-30B-A3B, ``--kv-blocks``), the playback engine serving each task's recorded
turns (at most ``--max-turns``, recorded prompt and decode lengths forwarded to the engine) and the
real gateway in front; every task a real OpenHands conversation whose tool calls really run in a
clone of its fixture repository; arrivals at ``--rps`` (fixed gaps), seed 0.

KV: the trimmed tasks' contexts are short (~5-10k tokens at 12 turns against 30-60k for the whole
traces), so the default ``--kv-blocks 2048`` (32k tokens, ~28% of an H100 SXM's 118k-token KV for
this model) keeps roughly the pressure of the full traces on the full GPU (the compare's
``--kv-scale auto`` idea), where ~3 sessions' final contexts fit.

``--rps 4 --kv-blocks 1100`` is the contended point of the README (all eight tasks in two
seconds, KV for about two of their final contexts). Takes ~5 min on the 2-core dev box (two server starts, 2 × tasks OpenHands processes): not in
CI. Writes the report (``summary.md``, Parquet, plots) into ``--out``, prints one line and appends
a row to ``benchmarks/results/bench_openhands_e2e.parquet``.

    .venv-openhands/bin/python benchmarks/bench_openhands_e2e.py --out runs/ohbench
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACES = ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent" / "deepseek_chat_dev"
RESULTS = ROOT / "benchmarks" / "results" / "bench_openhands_e2e.parquet"


def repo_of(instance_id: str) -> str:
    """``owner/name`` of a SWE-bench instance id (``owner__name-123``). Pure.

    >>> repo_of("pvlib__pvlib-python-1072")
    'pvlib/pvlib-python'
    """
    owner, _, rest = instance_id.partition("__")
    return f"{owner}/{rest.rsplit('-', 1)[0]}"


def problem_of(trace: Path) -> str:
    """The PR description of a mini-swe-agent trajectory (its first user message)."""
    data = json.loads(gzip.open(trace, "rt").read())
    text = next(m["content"] for m in data["messages"] if m["role"] == "user")
    text = text if isinstance(text, str) else "".join(p.get("text", "") for p in text)
    found = re.search(r"<pr_description>(.*?)</pr_description>", text, re.S)
    return (found.group(1) if found else text).replace("Consider the following PR description:",
                                                       "").strip()


def fixture_repo(path: Path, repo: str) -> str:
    """A tiny git repository standing in for ``repo`` (a package, a test, a README); its sha."""
    package = repo.split("/")[1].replace("-", "_")
    files = {"README.md": f"# {repo} (fixture)\n", f"{package}/__init__.py": "__version__ = '0.0'\n",
             f"{package}/core.py": "def add(a, b):\n    return a + b\n",
             "tests/test_core.py": f"from {package}.core import add\n\n\ndef test_add():\n"
                                   "    assert add(1, 2) == 3\n"}
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=fixture", "-c", "user.email=f@f"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "fixture"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def write_swebench_fixture(out: Path, num_tasks: int, traces_dir: Path) -> tuple[Path, Path]:
    """SWE-bench rows (``rows.jsonl``) and the mirror (``mirror/``) for the first traces."""
    traces = sorted(traces_dir.glob("*.traj.json.gz"))[:num_tasks]
    if len(traces) < num_tasks:
        raise SystemExit(f"only {len(traces)} traces in {traces_dir}; need {num_tasks} (--traces)")
    mirror = out / "fixture" / "mirror"
    rows, shas = [], {}
    for trace in traces:
        instance_id = trace.name.split(".traj.json")[0]
        repo = repo_of(instance_id)
        if repo not in shas:
            shas[repo] = fixture_repo(mirror / repo.replace("/", "__"), repo)
        rows.append({"instance_id": instance_id, "repo": repo, "base_commit": shas[repo],
                     "problem_statement": problem_of(trace), "version": "fixture"})
    path = out / "fixture" / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, mirror


def _git_sha() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ohbench")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--policies", default="fcfs,mars")
    parser.add_argument("--rps", default="0.5")
    parser.add_argument("--max-turns", default="12")
    parser.add_argument("--kv-blocks", default="2048")
    parser.add_argument("--gpu", default="h100_sxm")
    parser.add_argument("--traces", type=Path, default=TRACES,
                        help="the recorded runs (default ../shared/data/traces/mini-swe-agent/"
                             "deepseek_chat_dev next to the checkout)")
    args, rest = parser.parse_known_args(argv)
    import shutil

    shutil.rmtree(args.out / "fixture", ignore_errors=True)
    rows, mirror = write_swebench_fixture(args.out, args.tasks, args.traces)
    from mars_openhands.openhands.quiet import quiet_environment

    quiet_environment()  # before the bench imports the SDK: no banner, no price-map download
    from eval.ohbench_cli import main as bench

    t0 = time.perf_counter()
    code = bench(["--source", "swebench", "--tasks", str(rows), "--repos-dir", str(mirror),
                  "--out", str(args.out), "--policies", args.policies, "--rps", args.rps,
                  "--max-turns", args.max_turns, "--kv-blocks", args.kv_blocks,
                  "--gpu", args.gpu, "--max-model-len", "16384", "--max-prompt-tokens", "15000",
                  "--task-timeout", "900", "--traces", str(args.traces), *rest])
    wall_s = time.perf_counter() - t0
    import pandas as pd

    summary = pd.read_parquet(args.out / "summary.parquet")
    ratios = pd.read_parquet(args.out / "ratios.parquet")
    by = summary.set_index("policy")
    parts = [f"{p}: mean {r.task_mean_s:.1f} s P95 {r.task_p95_s:.1f} s ({r.num_finished}/"
             f"{r.num_tasks})" for p, r in by.iterrows()]
    mars = ratios[ratios["policy"] == "mars"]
    ratio = float(mars["mean"].iloc[0]) if not mars.empty else float("nan")
    print(f"bench_openhands_e2e: {'; '.join(parts)}; mars vs best baseline mean {ratio:.3f}x "
          f"(paper 1.20-1.87x); {wall_s:.0f} s wall")
    row = {"git_sha": _git_sha(), "machine": platform.node(), "python": platform.python_version(),
           "tasks": args.tasks, "rps": float(args.rps), "max_turns": int(args.max_turns),
           "kv_blocks": int(args.kv_blocks), "gpu": args.gpu, "extra_args": " ".join(rest),
           "wall_s": wall_s,
           "mars_vs_best_baseline_mean": ratio,
           **{f"{p}_{c}": float(r[c]) for p, r in by.iterrows()
              for c in ("task_mean_s", "task_p50_s", "task_p95_s", "task_p99_s",
                        "tool_wait_share", "llm_wait_share")}}
    old = pd.read_parquet(RESULTS) if RESULTS.exists() else pd.DataFrame()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    pd.concat([old, pd.DataFrame([row])], ignore_index=True).to_parquet(RESULTS, index=False)
    return code


if __name__ == "__main__":
    sys.exit(main())
