"""Run `sluice plan` over the examples as a story, chaining the state from pass to pass.

1. a heterogeneous pool settles (A100 > 4090 > CPU);
2. one pod starts failing and another is OOMKilled: both leave routing at once;
3. Prometheus goes away: weights freeze, the pool says why;
4. time passes with healthy signals: the pods come back along the recovery ramp;
5. a canary rolls out step by step.
Istio objects of each pass are written to out/examples/, the explanations are printed.
"""

from __future__ import annotations

import contextlib
import io
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from sluice.cli import main as sluice

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "out" / "examples"
T0 = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)


def step(title: str, pool: str, observed: Path, seconds: float, state_in: Path | None, state_out: Path) -> None:
    print(f"\n=== {title} (t={seconds:.0f}s)")
    args = ["plan", "-f", str(HERE / "pools" / pool), "--observed", str(observed)]
    args += ["--now", (T0 + timedelta(seconds=seconds)).isoformat(), "--state-out", str(state_out)]
    if state_in is not None:
        args += ["--state", str(state_in)]
    stdout, terminal = io.StringIO(), sys.stdout
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(terminal):
        code = sluice(args)
    if code != 0:
        raise SystemExit(f"sluice plan exited {code}")
    (OUT / f"{state_out.stem}.istio.yaml").write_text(stdout.getvalue())


def healthy_at(seconds: float) -> Path:
    """The heterogeneous observation, re-stamped so it is fresh at `seconds`, restarts as after the OOM."""
    data = yaml.safe_load((HERE / "observed" / "heterogeneous.yaml").read_text())
    data["signals"]["collectedAt"] = (T0 + timedelta(seconds=seconds - 1)).isoformat()
    for pod in data["pods"]:
        if pod["name"] == "llama-4090-0":
            pod["restarts"] = 1
            pod["lastTerminationReason"] = "OOMKilled"
    path = OUT / f"observed-healthy-{seconds:.0f}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def canary_at(seconds: float) -> Path:
    data = yaml.safe_load((HERE / "observed" / "canary.yaml").read_text())
    data["signals"]["collectedAt"] = (T0 + timedelta(seconds=seconds - 1)).isoformat()
    path = OUT / f"observed-canary-{seconds:.0f}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    obs = HERE / "observed"
    state = OUT / "state-00.json"
    step("heterogeneous pool settles", "heterogeneous.yaml", obs / "heterogeneous.yaml", 2, None, state)
    nxt = OUT / "state-01.json"
    step("a pod fails, another is OOMKilled", "heterogeneous.yaml", obs / "failing-pod.yaml", 7, state, nxt)
    state, nxt = nxt, OUT / "state-02.json"
    step("Prometheus is down: fail-static", "heterogeneous.yaml", obs / "stale-metrics.yaml", 12, state, nxt)
    state = nxt
    for i, seconds in enumerate((40, 60, 90, 150), start=3):
        nxt = OUT / f"state-{i:02d}.json"
        step("healthy again: recovery ramp", "heterogeneous.yaml", healthy_at(seconds), seconds, state, nxt)
        state = nxt
    state = None
    for i, seconds in enumerate((300, 340, 370, 430, 460, 520, 550, 610, 640), start=10):
        nxt = OUT / f"state-{i:02d}.json"
        step("canary rollout", "canary.yaml", canary_at(seconds), seconds, state, nxt)
        state = nxt
    print(f"\nIstio objects of every pass: {OUT}/*.istio.yaml")


if __name__ == "__main__":
    main()
