"""The demo: sluice running for real on the local stack, telling its story with a live table.

    python -m sluice.devstack.demo [--keep] [--workdir out/demo]

1. a heterogeneous pool (2x A100, RTX 4090, CPU) is applied with kubectl; the A100s weigh most, the CPU no more
   than the 4090 (`capacity_order`);
2. one A100 starts failing 70 % of its requests (most of them: no share is held on it whatever the others' load):
   it is zeroed within a few passes, then recovers along the ramp;
3. the 4090 is OOMKilled: the kubelet reports it, sluice zeroes it at once and brings it back after its restart;
4. a good candidate revision v2 is promoted step by step (10 -> 50 -> 100 %);
5. a bad candidate v3 (30 % errors) is rolled back to 0 and stays there;
6. shadow: a slow candidate v4 (4x latency) first gets only a mirrored copy of half the requests, is caught by the
   shadow's gates and rolled back before any user request reached it (the load generator counts them).
Every step is a claim the demo checks; it prints a summary and exits 0 only if all of them held. Bounded load
(Poisson, ~10 requests/s) runs throughout; everything binds to loopback and stops at the end (`--keep` leaves the
stack running until Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import ROOT, Stack
from sluice.devstack.traffic import Traffic
from sluice.istio.kinds import VIRTUAL_SERVICE

POOL_FILE = ROOT / "examples" / "local" / "pool.yaml"
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.10.1"),
    PodSpec("llama-a100-1", "a100", "v1", "127.0.10.2"),
    PodSpec("llama-4090-0", "rtx4090", "v1", "127.0.10.3"),
    PodSpec("llama-cpu-0", "cpu", "v1", "127.0.10.4"),
]


@dataclass
class Claim:
    text: str
    held: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Story:
    stack: Stack
    traffic: Traffic
    claims: list[Claim] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    quiet: bool = False
    operator_usage: dict[str, float] = field(default_factory=dict)
    operator_seconds: float = 0.0

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"\n[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    async def expect(self, text: str, check: Callable[[dict[str, Any]], str | None], seconds: float) -> bool:
        """Wait until `check(pool)` returns a detail string (the claim holds) or the time is up."""
        begin = time.monotonic()
        pool: dict[str, Any] = {}
        while time.monotonic() - begin < seconds:
            pool = await asyncio.to_thread(self.stack.pool, "llama")
            with contextlib.suppress(KeyError, TypeError, IndexError):
                found = check(pool)
                if found is not None:
                    claim = Claim(text, True, found, time.monotonic() - begin)
                    self.claims.append(claim)
                    self.say(f"OK   {text} ({found}; {claim.seconds:.1f}s)")
                    return True
            await asyncio.sleep(0.5)
        detail = last_seen(pool)
        self.claims.append(Claim(text, False, detail, seconds))
        self.say(f"FAIL {text} (not seen within {seconds:.0f}s; last seen: {detail})")
        return False


def last_seen(pool: dict[str, Any]) -> str:
    """What a failed claim last saw: each pod's state, weight and reason, and the conditions that were not True."""
    status = pool.get("status") or {}
    pods = [
        f"{row['pod']} {row.get('state')} w={row.get('weight')} ({str(row.get('reason', ''))[:80]})"
        for row in status.get("endpoints", [])
    ]
    conditions = status.get("conditions", [])
    off = [f"{c['type']}={c['status']} ({c.get('reason')})" for c in conditions if c["status"] != "True"]
    return "; ".join(pods + off) or "no status"


def capacity_order(pool: dict[str, Any]) -> str | None:
    """The first claim, on fresh signals: every A100 weighs more than the RTX 4090 and the CPU, the CPU no more than
    the 4090, every pod routed. Not 4090 > CPU strictly: a slower pod joins the plan only once the faster ones'
    latency level reaches its idle TTFT (docs/design.md, *Shares, water-filled*), so while the A100s carry the
    load the 4090 and the CPU both hold the minimum weight. The plan orders shares; a weight also carries Envoy's
    in-flight factor, so once both slower pods are planned the CPU can out-weigh the 4090 for a pass: the claim
    asks for one pass in its 60 s, not for every pass."""
    w = {name: row["weight"] for name, row in rows(pool).items()}
    if condition(pool, "MetricsAvailable")["status"] != "True" or len(w) != 4:
        return None
    slower = max(w["llama-4090-0"], w["llama-cpu-0"])
    if min(w["llama-a100-0"], w["llama-a100-1"]) > slower and w["llama-4090-0"] >= w["llama-cpu-0"] > 0:
        return f"weights {w}"
    return None


def rows(pool: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["pod"]: row for row in pool.get("status", {}).get("endpoints", [])}


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in pool["status"]["conditions"] if c["type"] == kind)


def table(pool: dict[str, Any], traffic: Traffic) -> str:
    share = traffic.share(time.monotonic() - 5)
    lines = [
        f"{'POD':<16}{'REV':<5}{'CLASS':<9}{'TTFT':>7}{'KV':>6}{'WAIT':>6}{'ERR':>7}{'WEIGHT':>8}{'TRAFFIC':>9}  "
        f"{'STATE':<11}REASON"
    ]
    for name, row in sorted(rows(pool).items()):
        s = row.get("signals", {})
        ttft = f"{s['ttftSeconds'] * 1000:.0f}ms" if s.get("ttftSeconds") is not None else "-"
        kv = f"{s['kvCacheUsage']:.0%}" if s.get("kvCacheUsage") is not None else "-"
        wait = f"{s['queueLength']:.0f}" if s.get("queueLength") is not None else "-"
        err = f"{s['errorRate']:.1%}" if s.get("errorRate") is not None else "-"
        lines.append(
            f"{name:<16}{row.get('revision') or '-':<5}{row.get('hardwareClass') or '-':<9}{ttft:>7}{kv:>6}{wait:>6}"
            f"{err:>7}{row['weight']:>8}{share.get(name, 0.0):>9.0%}  {row['state']:<11}{row.get('reason', '')[:60]}"
        )
    status = pool.get("status", {})
    canary = status.get("canary") or {}
    split = ", ".join(f"{k} {v}%" for k, v in sorted((status.get("revisionWeights") or {}).items()))
    conditions = " ".join(f"{c['type']}={c['status']}" for c in status.get("conditions", []))
    lines.append(
        f"routable {status.get('routable', '-')}  split [{split}]  canary {canary.get('phase', '-')} "
        f"{canary.get('weight', 0)}%  {conditions}"
    )
    return "\n".join(lines)


async def printer(story: Story, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        with contextlib.suppress(Exception):
            pool = await asyncio.to_thread(story.stack.pool, "llama")
            if not story.quiet:
                print(table(pool, story.traffic), flush=True)


async def run_story(stack: Stack, quiet: bool = False) -> Story:
    traffic = Traffic(stack, "llama", rate=10.0)
    story = Story(stack, traffic, quiet=quiet)
    kubelet = asyncio.create_task(stack.kubelet())
    load: asyncio.Task[None] | None = None
    show = asyncio.create_task(printer(story, 5.0))
    try:
        story.say("starting 4 simulated vLLM pods (A100 x2, RTX 4090, CPU) and the operator")
        for pod in PODS:
            await asyncio.to_thread(stack.add_pod, pod)
        stack.start_operator()
        operator_started = time.monotonic()
        manifest = POOL_FILE.read_text().replace("PROMETHEUS_URL", stack.prometheus_url)
        await asyncio.to_thread(stack.kubectl, "apply", "-f", "-", stdin=manifest)
        story.say("kubectl apply -f examples/local/pool.yaml")
        load = asyncio.create_task(traffic.run(stack.remaining()))

        await story.expect(
            "capacity-aware weights: the A100s above the RTX 4090 and the CPU, the CPU not above the 4090",
            capacity_order,
            60,
        )
        await story.expect(
            "the Istio objects exist and are in sync",
            lambda p: "IstioSynced=True" if condition(p, "IstioSynced")["status"] == "True" else None,
            20,
        )

        story.say("fault: llama-a100-1 starts failing 70% of its requests")
        await stack.inject("llama-a100-1", {"errorRate": 0.7})
        await story.expect(
            "the failing pod is zeroed (removed from the ServiceEntry)",
            lambda p: rows(p)["llama-a100-1"]["reason"] if rows(p)["llama-a100-1"]["state"] == "Zeroed" else None,
            30,
        )
        await stack.inject("llama-a100-1", {"errorRate": 0.0})
        story.say("fault cleared on llama-a100-1")
        await story.expect(
            "it comes back along the recovery ramp",
            lambda p: rows(p)["llama-a100-1"]["reason"] if rows(p)["llama-a100-1"]["state"] == "Recovering" else None,
            30,
        )
        await story.expect(
            "and returns to normal scoring",
            lambda p: (
                f"weight {rows(p)['llama-a100-1']['weight']}"
                if rows(p)["llama-a100-1"]["state"] == "Routable" and rows(p)["llama-a100-1"].get("incident")
                else None
            ),
            40,
        )

        story.say("fault: llama-4090-0 runs out of memory (the process exits 137; the kubelet reports OOMKilled)")
        await stack.inject("llama-4090-0", {"oom": True})
        await story.expect(
            "the OOMKilled pod is zeroed at once",
            lambda p: (
                rows(p)["llama-4090-0"]["reason"]
                if rows(p)["llama-4090-0"].get("incident") == "OOMKilled" and rows(p)["llama-4090-0"]["weight"] == 0
                else None
            ),
            20,
        )
        await story.expect(
            "after its restart it recovers",
            lambda p: (
                f"weight {rows(p)['llama-4090-0']['weight']}"
                if rows(p)["llama-4090-0"]["state"] == "Routable" and rows(p)["llama-4090-0"]["weight"] > 0
                else None
            ),
            45,
        )

        # Two A100s for v2: at the 50 % step the candidate takes half the load, and one A100 alone would be judged
        # slower than the stable fleet for being overloaded, not for being a worse revision (the ratio gate).
        story.say("canary: a good revision v2 starts on two A100s, and the pool's candidateRevision is set to v2")
        await asyncio.to_thread(stack.add_pod, PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.10.5"))
        await asyncio.to_thread(stack.add_pod, PodSpec("llama-v2-a100-1", "a100", "v2", "127.0.10.7"))
        await asyncio.to_thread(stack.patch_pool, "llama", {"spec": {"canary": {"candidateRevision": "v2"}}})
        seen: set[int] = set()

        def promoted(pool: dict[str, Any]) -> str | None:
            canary = pool["status"].get("canary") or {}
            if canary.get("phase") == "Progressing":
                seen.add(int(canary.get("weight", 0)))
            if canary.get("phase") == "Promoted" and canary.get("stableRevision") == "v2":
                return f"steps seen {sorted(seen)}, split {pool['status']['revisionWeights']}"
            return None

        await story.expect("v2 is promoted step by step", promoted, 90)

        story.say("canary: a bad revision v3 (30% errors) starts, candidateRevision is set to v3")
        await asyncio.to_thread(stack.add_pod, PodSpec("llama-v3-a100-0", "a100", "v3", "127.0.10.6", error_rate=0.3))
        await asyncio.to_thread(stack.patch_pool, "llama", {"spec": {"canary": {"candidateRevision": "v3"}}})
        await story.expect(
            "v3 is rolled back to 0",
            lambda p: (
                p["status"]["canary"]["message"]
                if p["status"]["canary"]["phase"] == "RolledBack" and p["status"]["revisionWeights"] == {"v2": 100}
                else None
            ),
            60,
        )
        await asyncio.sleep(4)
        await story.expect(
            "and stays there",
            lambda p: "still 0%" if p["status"]["canary"]["phase"] == "RolledBack" else None,
            5,
        )
        await shadow_scene(story)
        story.operator_usage = stack.operator_usage()
        story.operator_seconds = time.monotonic() - operator_started
        events = await asyncio.to_thread(stack.events)
        reasons = sorted({e["reason"] for e in events})
        story.say(f"Events on the pool: {', '.join(reasons)}")
        return story
    finally:
        show.cancel()
        if load is not None:
            traffic.stop.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(load, 10)
        stack.stop_kubelet()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(kubelet, 5)
        with contextlib.suppress(asyncio.CancelledError):
            await show


SHADOW = {
    "mirrorPercent": 50,
    "duration": "30s",
    "analysis": {"interval": "3s", "minRequests": 5, "maxErrorRate": 0.05, "maxTtftRatioToStable": 1.5},
}
SLOW_POD = "llama-v4-a100-0"


def mirrors(stack: Stack) -> list[dict[str, Any]]:
    service = stack.istio(VIRTUAL_SERVICE.plural, "sluice-llama") or {}
    found: list[dict[str, Any]] = service.get("spec", {}).get("http", [{}])[0].get("mirrors", [])
    return found


async def shadow_scene(story: Story) -> None:
    """A slow revision caught in shadow: mirrored requests only, rolled back before its first live request."""
    stack, traffic = story.stack, story.traffic
    story.say("shadow: a slow revision v4 (4x latency) starts; candidateRevision v4 with canary.shadow (50% mirrored)")
    await asyncio.to_thread(stack.add_pod, PodSpec(SLOW_POD, "a100", "v4", "127.0.10.8"))
    await asyncio.to_thread(stack.wait_ready, [SLOW_POD])
    await stack.inject(SLOW_POD, {"slowdown": 4.0})
    patch = {"spec": {"canary": {"candidateRevision": "v4", "shadow": SHADOW}}}
    await asyncio.to_thread(stack.patch_pool, "llama", patch)

    def shadowing(pool: dict[str, Any]) -> str | None:
        canary, split = pool["status"]["canary"], pool["status"]["revisionWeights"]
        rendered = mirrors(stack)
        if canary["phase"] == "Shadow" and split == {"v2": 100} and rendered:
            percent = rendered[0]["percentage"]["value"]
            return f"users: {split}; VirtualService mirrors {percent}% to {rendered[0]['destination']['subset']}"
        return None

    await story.expect("v4 in shadow: users stay on v2, a copy of half the requests goes to v4", shadowing, 30)

    def caught(pool: dict[str, Any]) -> str | None:
        canary = pool["status"]["canary"]
        if canary["phase"] != "RolledBack" or canary.get("stage") != "Shadow" or mirrors(stack):
            return None
        return (
            f"{canary['lastCheckReason']}; v4 got {traffic.mirrored[SLOW_POD]} mirrored copies and served "
            f"{traffic.served[SLOW_POD]} user requests; mirror removed"
        )

    await story.expect("v4 is caught in shadow and rolled back, no mirror left", caught, 60)
    await story.expect(
        "no user request was ever served by v4",
        lambda p: "0 served" if traffic.served[SLOW_POD] == 0 and traffic.mirrored[SLOW_POD] > 0 else None,
        3,
    )


def summary(story: Story) -> str:
    lines = ["", "summary:"]
    for claim in story.claims:
        lines.append(
            f"  {'OK  ' if claim.held else 'FAIL'} {claim.text}"
            + (f"  [{claim.seconds:.1f}s]" if claim.held else f"  (last seen: {claim.detail})")
        )
    samples = story.traffic.finished()  # one copy: the traffic's thread may still be appending
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    ok = sum(1 for s in samples if s.ok)
    if ttfts:
        ttfts.sort()
        lines.append(
            f"  traffic: {len(samples)} requests, {ok} succeeded, TTFT p50 "
            f"{ttfts[len(ttfts) // 2] * 1000:.0f} ms, p99 {ttfts[int(len(ttfts) * 0.99)] * 1000:.0f} ms"
        )
    usage = story.operator_usage
    if usage:
        lines.append(
            f"  operator: {usage['cpu_seconds']:.1f} CPU-seconds over {story.operator_seconds:.0f}s "
            f"({usage['cpu_seconds'] / max(1.0, story.operator_seconds):.1%} of one core), "
            f"RSS {usage['rss_mib']:.0f} MiB (peak {usage['peak_rss_mib']:.0f} MiB)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice.devstack.demo", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--workdir", default=str(ROOT / "out" / "demo"))
    parser.add_argument("--keep", action="store_true", help="leave the stack running after the story (Ctrl-C stops it)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every process the stack started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Stack(workdir, deadline_seconds=600) as stack:
        print(f"API emulator {stack.api_url}  (KUBECONFIG={stack.kubeconfig})\nPrometheus {stack.prometheus_url}")
        story = asyncio.run(run_story(stack))
        print(summary(story))
        if args.keep:
            print(f"\nstack left running: KUBECONFIG={stack.kubeconfig} kubectl get slp -n llm   (Ctrl-C to stop)")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(1)
    failed = [c for c in story.claims if not c.held]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
