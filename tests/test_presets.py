"""Engine presets as strings: one vector query per signal, escaping, overrides, declared gaps.

What each preset reads is tested by running it on the real Prometheus (`test_presets_promql.py`).
"""

from __future__ import annotations

import re

import pytest

from sluice.api.v1alpha1 import AdmissionSpec
from sluice.core.observed import ALL_SIGNALS
from sluice.core.presets import POD_REGEX_LIMIT, PRESETS, build_queries, escape_regex, escape_string
from tests.helpers import spec

PODS = ["llama-0", "llama-1"]

ENGINES = ["sglang", "tgi", "triton", "trtllm", "vllm"]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_query_is_a_pool_wide_vector_grouped_by_pod(engine):
    plan = build_queries(spec(engine=engine), "llm", PODS)
    for signal, query in plan.queries.items():
        assert "by (pod" in query, (engine, signal)
        assert 'namespace="llm"' in query
        assert "$" not in query, f"unsubstituted placeholder in {signal}: {query}"
        assert query.count("(") == query.count(")")


def test_tgi_declares_it_has_no_ttft_and_no_kv_cache():
    plan = build_queries(spec(engine="tgi"), "llm", PODS)
    assert {"ttft", "ttftP95", "kvCacheUsage", "loraFailureRate"} <= set(plan.unsupported)
    assert "ttft" not in plan.queries


def test_lora_failures_come_only_from_an_engine_that_counts_its_adapter_loads():
    """SGLang counts the answers of its /load_lora_adapter route; vLLM's HTTP metrics leave that route out
    (its instrumentator excludes every handler matching /load) and the others have no such metric."""
    for engine in PRESETS:
        pool = spec(engine=engine, metrics={"queries": {"ttft": "x"}}) if engine == "custom" else spec(engine=engine)
        unsupported = build_queries(pool, "llm", PODS).unsupported
        assert ("loraFailureRate" in unsupported) == (engine != "sglang"), engine
    assert (
        'endpoint="/load_lora_adapter"' in build_queries(spec(engine="sglang"), "llm", PODS).queries["loraFailureRate"]
    )


def test_override_replaces_the_preset_and_supplies_a_missing_signal():
    s = spec(
        engine="tgi",
        metrics={
            "queries": {
                "ttft": "avg by ($podLabel) (my_ttft{$selector})",
                "loraFailureRate": "sum by ($podLabel) (rate(lora_fail_total{$selector}[$window]))",
            }
        },
    )
    plan = build_queries(s, "llm", PODS)
    assert plan.queries["ttft"].startswith('avg by (pod) (my_ttft{namespace="llm",pod=~')
    assert "[1m]" in plan.queries["loraFailureRate"]
    assert "ttft" not in plan.unsupported
    assert "loraFailureRate" not in plan.unsupported


def test_custom_pod_and_namespace_labels_and_extra_matchers():
    s = spec(
        metrics={
            "podLabel": "kubernetes_pod_name",
            "namespaceLabel": "kubernetes_namespace",
            "extraLabels": {"job": "vllm"},
        }
    )
    query = build_queries(s, "llm", PODS).queries["queueLength"]
    assert query.startswith("sum by (kubernetes_pod_name) (")
    assert 'kubernetes_namespace="llm"' in query
    assert 'job="vllm"' in query


def _literals(query: str) -> list[str]:
    """Decode every double-quoted PromQL string literal in the query (backslash escapes)."""
    out, i = [], 0
    while (start := query.find('"', i)) != -1:
        j, chars = start + 1, []
        while query[j] != '"':
            if query[j] == "\\":
                j += 1
                chars.append({"n": "\n"}.get(query[j], query[j]))
            else:
                chars.append(query[j])
            j += 1
        out.append("".join(chars))
        i = j + 1
    return out


def test_hostile_names_cannot_escape_the_string_or_the_regex():
    hostile_pod = 'x"} or vector(1) or {a="'
    hostile_ns = 'llm"} or up{x="'
    query = build_queries(spec(), hostile_ns, [hostile_pod, "a.b"]).queries["queueLength"]
    # Outside the literals, the query is exactly the preset's shape: nothing leaked out of a string.
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    assert skeleton == 'sum by (pod) (vllm:num_requests_waiting{namespace="",pod=~""})'
    namespace, pods_regex = _literals(query)
    assert namespace == hostile_ns
    assert re.fullmatch(pods_regex, hostile_pod)
    assert re.fullmatch(pods_regex, "a.b")
    assert not re.fullmatch(pods_regex, "axb")  # '.' is literal


def test_escape_helpers():
    assert escape_string('a"b\\c') == 'a\\"b\\\\c'
    assert escape_regex("a.b|c") == "a\\.b\\|c"


def test_large_pools_select_by_namespace_and_filter_client_side():
    many = [f"pod-{i}" for i in range(POD_REGEX_LIMIT + 1)]
    plan = build_queries(spec(), "llm", many)
    assert plan.filters_pods_client_side
    assert "pod=~" not in plan.queries["queueLength"]
    small = build_queries(spec(), "llm", many[:3])
    assert not small.filters_pods_client_side


def test_every_signal_is_either_queried_or_declared_unsupported():
    for engine in PRESETS:
        s = spec(engine=engine, metrics={"queries": {"ttft": "x"}}) if engine == "custom" else spec(engine=engine)
        plan = build_queries(s, "llm", PODS)
        assert set(plan.queries) | set(plan.unsupported) == set(ALL_SIGNALS) - {"refusedRate"}
        assert not set(plan.queries) & set(plan.unsupported)
        enforced = build_queries(s.model_copy(update={"admission": AdmissionSpec(mode="Enforce")}), "llm", PODS)
        assert set(enforced.queries) == set(plan.queries) | {"refusedRate"}  # the sidecar's, whatever the engine
