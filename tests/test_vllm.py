"""The scrape parser against vLLM's real page (and its older names), and the canary verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from proxy.fleet.vllm import (
    SERIES,
    EngineSample,
    ScrapeError,
    canary_request,
    canary_succeeded,
    model_cards,
    parse_metrics,
)

FIXTURES = Path(__file__).parent / "fixtures"
V1 = (FIXTURES / "vllm_metrics_v1.txt").read_text()

EXPECTED_V1 = EngineSample(
    running=3.0,
    waiting=0.0,
    kv_cache_usage=0.001036598706074781,
    prompt_tokens_total=1987508.0,
    generation_tokens_total=264678.0,
    prefix_cache_queries_total=1987508.0,
    prefix_cache_hits_total=383040.0,
    num_gpu_blocks=383948.0,
    block_size=16.0,
)

# vLLM before the V1 renames (fixtures README): same page, older names.
OLD_NAMES = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
}


def old_names_page() -> str:
    text = V1
    for new, old in OLD_NAMES.items():
        # Only whole names (the external_prefix_cache_* series must stay as they are).
        text = text.replace(f"\n{new}", f"\n{old}").replace(f" {new}", f" {old}")
    return text


def test_parse_metrics_reads_v1_fixture() -> None:
    assert parse_metrics(V1) == EXPECTED_V1


def test_parse_metrics_reads_old_names() -> None:
    text = old_names_page()
    assert "vllm:kv_cache_usage_perc" not in text and "vllm:gpu_cache_usage_perc" in text
    assert parse_metrics(text) == EXPECTED_V1


def test_parse_metrics_prefers_new_name_when_both_exported() -> None:
    # vLLM 0.10.x exports both names; adding them up would double the usage.
    text = V1 + (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
    )
    assert parse_metrics(text).kv_cache_usage == EXPECTED_V1.kv_cache_usage


def test_parse_metrics_agrees_with_prometheus_client_on_fixture() -> None:
    wanted = {names[0]: field for field, names in SERIES.items()}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(V1):
        for s in family.samples:
            if s.name in wanted:
                sums[wanted[s.name]] = sums.get(wanted[s.name], 0.0) + s.value
    parsed = parse_metrics(V1)
    for field, value in sums.items():
        assert getattr(parsed, field) == pytest.approx(value), field


def test_parse_metrics_sums_label_sets_and_averages_usage() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 10\n'
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 20\n'
        'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 7\n'
    )
    s = parse_metrics(text)
    assert (s.running, s.waiting) == (7.0, 4.0)
    assert s.kv_cache_usage == pytest.approx(0.4)
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (30.0, 7.0)


def test_parse_metrics_tolerates_crlf_timestamps_and_odd_labels() -> None:
    text = (
        'vllm:num_requests_running{model_name="a b} c"} 4 1700000000000\r\n'
        "# a comment vllm:num_requests_running 100\r\n"
        "vllm:prompt_tokens_total 5\r\n"
        "vllm:generation_tokens_total\t6\r\n"
    )
    s = parse_metrics(text)
    assert (s.running, s.prompt_tokens_total, s.generation_tokens_total) == (4.0, 5.0, 6.0)


@pytest.mark.parametrize(
    "render", [generate_latest, generate_openmetrics], ids=["0.0.4", "openmetrics"]
)
def test_parse_metrics_reads_both_exposition_formats(render) -> None:
    # Rendered by prometheus_client itself, as vLLM does: counters get _total and _created
    # samples (interleaved per label set in OpenMetrics).
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "r", ["engine"], registry=reg)
    prompt = Counter("vllm:prompt_tokens", "p", ["engine"], registry=reg)
    gen = Counter("vllm:generation_tokens", "g", ["engine"], registry=reg)
    for engine, n in (("0", 3), ("1", 4)):
        running.labels(engine).set(n)
        prompt.labels(engine).inc(100 * n)
        gen.labels(engine).inc(10 * n)
    s = parse_metrics(render(reg).decode())
    assert (s.running, s.prompt_tokens_total, s.generation_tokens_total) == (7.0, 700.0, 70.0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP python_gc_objects_collected_total x\npython_gc_objects_collected_total 1\n",
        "vllm:num_requests_running 1\n",  # no token counters: cannot tell a stall
        '{"object": "list"}',
    ],
)
def test_parse_metrics_rejects_pages_without_engine_series(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse_metrics(text)


@pytest.mark.parametrize(
    ("status", "body", "ok"),
    [
        (200, (FIXTURES / "vllm_chat_nonstream.json").read_bytes(), True),
        (200, b'{"choices": [{"text": "!"}], "usage": {"completion_tokens": 1}}', True),
        (200, b'{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}', False),
        (200, b'{"choices": []}', False),
        (200, b"not json", False),
        (200, b'{"error": {"message": "engine dead"}}', False),
        (503, b'{"choices": [{"text": "!"}]}', False),
        (400, (FIXTURES / "vllm_error_400.json").read_bytes(), False),
    ],
)
def test_canary_succeeded_needs_a_generated_token(status: int, body: bytes, ok: bool) -> None:
    assert canary_succeeded(status, body) is ok


def test_canary_request_asks_for_one_unstreamed_token() -> None:
    req = canary_request("m")
    assert (req["model"], req["max_tokens"], req["stream"]) == ("m", 1, False)


def test_model_cards_reads_fixture_and_rejects_other_shapes() -> None:
    cards = model_cards(json.loads((FIXTURES / "vllm_models.json").read_text()))
    assert list(cards) == ["Qwen/Qwen2.5-0.5B-Instruct"]
    with pytest.raises(ValueError):
        model_cards({"data": "nope"})
