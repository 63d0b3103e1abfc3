"""`python -m sluice plan` as a user runs it: YAML stream on stdout, explanation on stderr, chained state, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


def sluice(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def plan(pool: str, observed: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return sluice("plan", "-f", str(EX / "pools" / pool), "--observed", str(EX / "observed" / observed), *extra)


def test_plan_prints_istio_objects_and_an_explanation(tmp_path):
    result = plan("heterogeneous.yaml", "heterogeneous.yaml", "--now", "2026-12-01T10:00:02Z")
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    assert [o["kind"] for o in objects] == ["ServiceEntry", "DestinationRule", "VirtualService"]
    weights = {e["address"]: e["weight"] for e in objects[0]["spec"]["endpoints"]}
    assert weights["10.8.0.11"] > weights["10.8.1.21"] > weights["10.8.2.31"]
    assert "POD" in result.stderr
    assert "IDLE" in result.stderr
    assert "scoring: headroom (targetUtilization 0.8" in result.stderr
    assert "llama-cpu-0" in result.stderr
    assert "MetricsAvailable=True" in result.stderr


def test_state_chains_through_a_failure_and_an_outage(tmp_path):
    first, second, third = tmp_path / "1.json", tmp_path / "2.json", tmp_path / "3.json"
    ok = plan("heterogeneous.yaml", "heterogeneous.yaml", "--now", "2026-12-01T10:00:02Z", "--state-out", str(first))
    assert ok.returncode == 0, ok.stderr
    failing = plan(
        "heterogeneous.yaml",
        "failing-pod.yaml",
        "--now",
        "2026-12-01T10:00:07Z",
        "--state",
        str(first),
        "--state-out",
        str(second),
    )
    assert failing.returncode == 0, failing.stderr
    rows = {r["pod"]: r for r in json.loads(second.read_text())["endpoints"]}
    # the failing A100 still serves 65 % of its requests and the others cannot take its 11 req/s: held, not zeroed
    assert rows["llama-a100-1"]["state"] == "Routable"
    assert rows["llama-a100-1"]["capacityHeld"] is True
    assert rows["llama-a100-1"]["incident"] == "ErrorRate"
    # an OOM-killed pod cannot serve: it leaves at once
    assert rows["llama-4090-0"]["state"] == "Zeroed"
    assert rows["llama-4090-0"]["incident"] == "OOMKilled"
    addresses = {e["address"] for e in next(yaml.safe_load_all(failing.stdout))["spec"]["endpoints"]}
    assert addresses == {"10.8.0.11", "10.8.0.12", "10.8.2.31"}
    assert "PodZeroed          llama-4090-0" in failing.stderr
    assert "PodHeld            llama-a100-1: would be zeroed (error rate 35.0% >= 10.0%), held at" in failing.stderr

    stale = plan(
        "heterogeneous.yaml",
        "stale-metrics.yaml",
        "--now",
        "2026-12-01T10:00:12Z",
        "--state",
        str(second),
        "--state-out",
        str(third),
    )
    assert stale.returncode == 0, stale.stderr
    before = {r["pod"]: r["weight"] for r in json.loads(second.read_text())["endpoints"]}
    after = {r["pod"]: r["weight"] for r in json.loads(third.read_text())["endpoints"]}
    assert after == before
    assert "MetricsAvailable=False (QueryFailed)" in stale.stderr
    assert "weights frozen" in stale.stderr


def test_canary_example_splits_traffic_by_the_first_step():
    result = plan("canary.yaml", "canary.yaml", "--now", "2026-12-01T10:05:01Z")
    assert result.returncode == 0, result.stderr
    vs = next(o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "VirtualService")
    assert {r["destination"]["subset"]: r["weight"] for r in vs["spec"]["http"][0]["route"]} == {
        "rev-v1": 95,
        "rev-v2": 5,
    }
    assert "canary: Progressing" in result.stderr


def test_show_queries_prints_the_promql():
    result = plan("heterogeneous.yaml", "heterogeneous.yaml", "--show-queries")
    assert result.returncode == 0
    assert "vllm:num_requests_waiting" in result.stderr
    assert "not provided by vllm: loraFailureRate" in result.stderr


def test_invalid_pool_exits_2_naming_the_field_and_the_rule():
    for path in sorted((EX / "invalid").glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        expected = path.read_text().splitlines()[0].removeprefix("# expect: ").strip()
        result = sluice("plan", "-f", str(path), "--observed", str(EX / "observed" / "heterogeneous.yaml"))
        assert result.returncode == 2, path.name
        assert result.stdout == ""
        assert f'InferencePool "{document["metadata"]["name"]}" is invalid' in result.stderr
        assert expected in result.stderr, (path.name, result.stderr)


def test_unreadable_inputs_exit_2_with_a_message(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    result = sluice("plan", "-f", str(broken), "--observed", str(EX / "observed" / "heterogeneous.yaml"))
    assert result.returncode == 2
    assert "not valid YAML" in result.stderr
    missing = sluice("plan", "-f", str(tmp_path / "nope.yaml"), "--observed", "x")
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr
    bad_now = plan("heterogeneous.yaml", "heterogeneous.yaml", "--now", "yesterday")
    assert bad_now.returncode == 2
    assert "ISO 8601" in bad_now.stderr


def test_observed_signal_written_as_text_is_refused_not_read_as_zero(tmp_path):
    observed = tmp_path / "o.yaml"
    observed.write_text(
        "pods: [{name: a, ip: 10.0.0.1, labels: {app: llama}}]\n"
        "signals: {collectedAt: '2026-12-01T10:00:00Z', pods: {a: {ttftSeconds: fast}}}\n"
    )
    result = sluice("plan", "-f", str(EX / "pools" / "heterogeneous.yaml"), "--observed", str(observed))
    assert result.returncode == 2
    assert "signals.pods.a.ttftSeconds" in result.stderr


def test_crd_command_prints_the_committed_crd():
    result = sluice("crd")
    assert result.returncode == 0
    committed = yaml.safe_load((ROOT / "crds" / "inference.sluice.dev_inferencepools.yaml").read_text())
    assert yaml.safe_load(result.stdout) == committed


def test_a_nan_signal_in_observed_exits_2_naming_the_field(tmp_path):
    document = yaml.safe_load((EX / "observed" / "heterogeneous.yaml").read_text())
    document["signals"]["pods"]["llama-a100-0"]["ttftSeconds"] = float("nan")
    observed = tmp_path / "nan.yaml"
    observed.write_text(yaml.safe_dump(document))
    result = sluice("plan", "-f", str(EX / "pools" / "heterogeneous.yaml"), "--observed", str(observed))
    assert result.returncode == 2
    assert "signals.pods.llama-a100-0.ttftSeconds" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_state_written_by_another_version_is_read_leniently_and_the_drop_is_said(tmp_path):
    first = tmp_path / "1.json"
    ok = plan("heterogeneous.yaml", "heterogeneous.yaml", "--now", "2026-12-01T10:00:02Z", "--state-out", str(first))
    assert ok.returncode == 0, ok.stderr
    state = json.loads(first.read_text())
    state["endpoints"][0]["state"] = "Draining"  # a state this version does not know
    state["canary"] = {"phase": "Shadowing"}
    first.write_text(json.dumps(state))
    result = plan("heterogeneous.yaml", "heterogeneous.yaml", "--now", "2026-12-01T10:00:07Z", "--state", str(first))
    assert result.returncode == 0, result.stderr
    assert "dropped an unreadable entry" in result.stderr
    assert "canary: dropped" in result.stderr
    assert yaml.safe_load_all(result.stdout)


def test_plan_shows_a_shadow_canary_and_renders_its_mirror():
    result = plan("shadow-canary.yaml", "canary.yaml", "--now", "2026-12-01T10:00:00Z")
    assert result.returncode == 0, result.stderr
    service = next(o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "VirtualService")
    http = service["spec"]["http"][0]
    assert [r["destination"]["subset"] for r in http["route"]] == ["rev-v1"]
    assert http["mirrors"][0]["destination"]["subset"] == "rev-v2"
    assert http["mirrors"][0]["percentage"] == {"value": 50.0}
    assert "canary: Shadow stable=v1 candidate=v2 step=shadow weight=0% mirror=50%" in result.stderr
    assert "ShadowMirroring" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["operator", "--shards", "0"], "--shards must be at least 1"),
        (["operator", "--shards", "3", "--peering", "sluice"], "--shards and --peering exclude each other"),
    ],
)
def test_the_operator_refuses_bad_shard_settings_before_starting(argv, message, capsys) -> None:
    from sluice.cli import main  # noqa: PLC0415

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "seconds"), [([], 30.0), (["--status-refresh", "120"], 120.0), (["--status-refresh", "0"], 0.0)]
)
def test_the_status_refresh_reaches_the_operator_config(flag: list[str], seconds: float) -> None:
    from sluice.cli import build_parser, operator_config  # noqa: PLC0415

    assert operator_config(build_parser().parse_args(["operator", *flag])).status_refresh == seconds


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon"])
def test_a_status_refresh_that_is_not_seconds_is_refused(value: str, capsys) -> None:
    from sluice.cli import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as exited:
        main(["operator", "--status-refresh", value])
    assert exited.value.code == 2
    assert "--status-refresh" in capsys.readouterr().err


def _log_lines(level: str, json_logs: bool = False) -> list[str]:
    """What a fresh operator process prints for one info and one warning line of sluice's at `level`."""
    script = (
        "import logging\n"
        "from sluice.cli import configure_logging\n"
        f"configure_logging({level!r}, {json_logs!r})\n"
        "logging.getLogger('sluice').info('an info line')\n"
        "logging.getLogger('sluice').warning('a warning line')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    return [line for line in (done.stdout + done.stderr).splitlines() if " line" in line]


@pytest.mark.parametrize(("level", "shown"), [("info", ["an info", "a warning"]), ("warning", ["a warning"])])
def test_the_operator_logs_each_line_once_at_the_level_asked(level: str, shown: list[str]) -> None:
    """`--log-level warning` leaves info out (kopf's own set-up put the root logger back at INFO), and each line
    is printed once (a second handler printed every line again in another format)."""
    lines = _log_lines(level)
    assert [text for text in ("an info", "a warning") if any(text in line for line in lines)] == shown
    assert len(lines) == len(shown), lines


def test_json_logs_are_json_lines_only() -> None:
    lines = _log_lines("info", json_logs=True)
    assert len(lines) == 2, lines
    assert [json.loads(line)["message"] for line in lines] == ["an info line", "a warning line"]


def test_the_readme_plan_example_is_what_the_command_prints():
    """README's `sluice plan` example, run as written: its explanation is the command's, line for line."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("$ .venv/bin/python -m sluice plan -f examples/pools/heterogeneous.yaml")
    block = readme[start : readme.index("```", start)].splitlines()
    command = block[0].removeprefix("$ .venv/bin/python -m sluice ").removesuffix(" >/dev/null").split()
    result = sluice(*command)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == block[1:]
