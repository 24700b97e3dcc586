"""Metrics a platform team scrapes (issue 41): the Prometheus collector reads the pilot's own
stats at scrape time (a pilot, a router's targets and breakers), a real Prometheus scrapes the
eviction listener's ``/metrics`` and answers PromQL with the pilot's numbers, and a model call
that completes through an adapter leaves an OpenTelemetry span with the GenAI usage attributes.
Nothing of either library is imported until asked for."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from contextpilot_integrations import Block, ContextPilot, PreparedRequest
from contextpilot_integrations.engines import EvictionListener, Router, Target
from contextpilot_integrations.integration.metrics import register_metrics
from contextpilot_integrations.pilot import telemetry
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.pilot.stats import PREPARE_SECONDS_BOUNDS

prometheus_client = pytest.importorskip("prometheus_client", reason="the [metrics] extra (in [dev])")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BLOCKS = [Block(id=f"doc-{i}", text=f"Document {i}: " + f"fact {i} " * 60, tokens=100 * (i + 1)) for i in range(5)]
QUERIES = ["Which fact comes first?", "Which fact is second?", "What do the documents share?", "Name one fact."]
TAIL = 37
"""Prompt tokens around the blocks (system prompt, question) that the engine reports on top."""


def serve(pilot: ContextPilot, queries: list[str]) -> list[tuple[PreparedRequest, int, int]]:
    """Prepare each query over the same blocks and report the engine's usage: its prompt (the
    blocks sent plus :data:`TAIL`) and, for every other request, less cached than predicted."""
    served = []
    for index, query in enumerate(queries):
        prepared = pilot.prepare(BLOCKS, query)
        prompt = sum(block.token_count for block in prepared.blocks) + TAIL
        cached = prepared.cached_tokens if index % 2 else prepared.cached_tokens // 2
        pilot.record_usage(prepared, prompt, cached)
        served.append((prepared, prompt, cached))
    return served


# ---- the collector ----------------------------------------------------------------------------------------------
def test_the_collector_reads_the_pilots_own_stats_at_each_scrape() -> None:
    pilot = ContextPilot()
    served = serve(pilot, QUERIES)
    extra = asyncio.run(pilot.aprepare(BLOCKS, "And asynchronously?"))  # timed too
    registry = CollectorRegistry()
    register_metrics(pilot, registry)
    value = registry.get_sample_value
    stats = pilot.stats()

    predicted = sum(prepared.cached_tokens for prepared, _, _ in served) + extra.cached_tokens
    assert predicted > extra.cached_tokens > 0, "the later requests reuse the first's prefix"
    assert value("contextpilot_predicted_cached_tokens_total") == stats.predicted_cached_tokens == predicted
    reported_cached = sum(cached for _, _, cached in served)
    reported_prompt = sum(prompt for _, prompt, _ in served)
    assert value("contextpilot_engine_cached_tokens_total") == stats.engine_cached_tokens == reported_cached
    assert value("contextpilot_engine_prompt_tokens_total") == stats.engine_prompt_tokens == reported_prompt
    assert value("contextpilot_engine_reported_requests_total") == len(served)
    sent = sum(block.token_count for block in BLOCKS) * (len(served) + 1)
    assert value("contextpilot_sent_tokens_total") == stats.tokens_sent == sent
    assert value("contextpilot_prepared_requests_total") == len(served) + 1
    assert value("contextpilot_engine_hit_ratio") == pytest.approx(reported_cached / reported_prompt)
    assert value("contextpilot_predicted_kept_ratio") == pytest.approx(stats.predicted_kept)
    assert value("contextpilot_live_requests") == stats.live_requests == len(served) + 1
    assert value("contextpilot_strategy_info", {"strategy": "trie"}) == 1

    # the prepare latency histogram: every prepare and aprepare, in fixed cumulative buckets
    assert value("contextpilot_prepare_seconds_count") == stats.prepare_count == len(served) + 1
    assert value("contextpilot_prepare_seconds_bucket", {"le": "+Inf"}) == len(served) + 1
    buckets = [value("contextpilot_prepare_seconds_bucket", {"le": repr(bound)}) for bound in PREPARE_SECONDS_BOUNDS]
    assert buckets == [float(count) for _, count in stats.prepare_seconds_buckets] == sorted(buckets)
    assert value("contextpilot_prepare_seconds_sum") == stats.prepare_seconds_sum > 0

    # read at scrape time: an eviction, a conversation's references and one restored show at once
    pilot.evict([served[0][0].request_id])
    first = pilot.prepare(BLOCKS, "Tell me about the documents.", "chat-1")
    second = pilot.prepare(BLOCKS, "And what else?", "chat-1")
    assert second.references, "the second turn refers to the blocks the first showed"
    pilot.note_restored(second, [second.references[0].block.id])
    assert value("contextpilot_evicted_requests_total") == 1
    assert value("contextpilot_referenced_blocks_total") == len(first.references) + len(second.references)
    assert value("contextpilot_referenced_tokens_total") == sum(r.block.token_count for r in second.references)
    assert value("contextpilot_restored_references_total") == 1
    assert value("contextpilot_prepare_seconds_count") == len(served) + 3
    assert value("contextpilot_shared_status", {"status": "connected"}) is None  # sharing is off: no series


def test_a_routers_targets_are_labelled_and_its_breakers_shown() -> None:
    router = Router([Target("a", "http://127.0.0.1:9"), Target("b", "http://127.0.0.1:9")], breaker_failures=1)
    routed = [router.prepare(BLOCKS, query) for query in QUERIES]
    for item in routed:
        router.pilot(item.target).record_usage(item.prepared, 2_000, item.prepared.cached_tokens)
    router.started(router.targets[0])
    router.finished(router.targets[0], "timeout")  # one failure opens a's breaker
    registry = CollectorRegistry()
    register_metrics(router, registry)
    value = registry.get_sample_value

    for name in ("a", "b"):
        mine = [item.prepared for item in routed if item.target.name == name]
        stats = router.pilot(name).stats()
        assert value("contextpilot_predicted_cached_tokens_total", {"target": name}) == sum(
            prepared.cached_tokens for prepared in mine
        )
        assert value("contextpilot_engine_cached_tokens_total", {"target": name}) == stats.engine_cached_tokens
        assert value("contextpilot_prepared_requests_total", {"target": name}) == len(mine)
        assert value("contextpilot_prepare_seconds_count", {"target": name}) == len(mine)
    assert value("contextpilot_router_breaker_state", {"target": "a", "state": "open"}) == 1
    assert value("contextpilot_router_breaker_state", {"target": "a", "state": "closed"}) == 0
    assert value("contextpilot_router_breaker_state", {"target": "b", "state": "closed"}) == 1
    assert value("contextpilot_router_target_up", {"target": "a"}) == 0
    assert value("contextpilot_router_target_up", {"target": "b"}) == 1
    assert value("contextpilot_router_timeouts_total", {"target": "a"}) == 1
    assert value("contextpilot_router_breaker_opened_total", {"target": "a"}) == 1
    assert value("contextpilot_router_sent_requests_total", {"target": "a"}) == router.sent()["a"] == 1
    assert value("contextpilot_router_breaker_open_seconds", {"target": "a"}) > 0


def test_the_shared_logs_health_is_shown_for_a_pilot_that_shares() -> None:
    pytest.importorskip("nats", reason="the [shared] extra (in [dev])")
    from contextpilot_integrations.shared import SharedOptions
    from contextpilot_integrations.shared.server import NatsServer

    with NatsServer() as broker:
        shared = SharedOptions(url=broker.url, secret="a secret every worker of this test shares")
        worker_1, worker_2 = ContextPilot(shared=shared), ContextPilot(shared=shared)
        try:
            sent = [worker_1.prepare(BLOCKS, query) for query in QUERIES]
            assert worker_1.shared is not None and worker_2.shared is not None
            assert worker_1.shared.flush(timeout=10) and worker_2.shared.wait_caught_up(timeout=10)
            registry = CollectorRegistry()
            register_metrics(worker_2, registry)
            value = registry.get_sample_value
            stats = worker_2.stats()
            assert stats.shared_applied == len(sent), "one entry per request worker 1 sent"
            assert value("contextpilot_shared_applied_entries_total") == stats.shared_applied
            assert value("contextpilot_shared_status", {"status": "connected"}) == 1
            assert value("contextpilot_shared_status", {"status": "unreachable"}) == 0
            assert value("contextpilot_shared_rejected_messages_total") == stats.shared_rejected == 0
            assert value("contextpilot_shared_behind_messages") == stats.shared_behind == 0
            assert stats.shared_lag_seconds is not None
            assert value("contextpilot_shared_lag_seconds") == stats.shared_lag_seconds >= 0
            assert value("contextpilot_shared_unsent_entries") == stats.shared_unsent == 0
        finally:
            for worker in (worker_1, worker_2):
                if worker.shared is not None:
                    worker.shared.close()


def test_register_refuses_what_it_cannot_read_and_can_be_undone() -> None:
    registry = CollectorRegistry()
    with pytest.raises(TypeError, match="ContextPilot or a Router"):
        register_metrics(object(), registry)  # type: ignore[arg-type]
    collector = register_metrics(ContextPilot(), registry)
    assert registry.get_sample_value("contextpilot_live_requests") == 0
    registry.unregister(collector)
    assert registry.get_sample_value("contextpilot_live_requests") is None


# ---- the listener's GET /metrics ------------------------------------------------------------------------------
def test_the_listener_serves_metrics_behind_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    pilot = ContextPilot()
    serve(pilot, QUERIES)
    with EvictionListener(pilot, token="scrape-secret") as listener, httpx.Client(base_url=listener.url) as client:
        assert client.get("/metrics").status_code == 401
        answer = client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(answer.text)
            for sample in family.samples
            if not sample.labels
        }
        stats = pilot.stats()
        assert samples["contextpilot_engine_cached_tokens_total"] == stats.engine_cached_tokens
        assert samples["contextpilot_predicted_cached_tokens_total"] == stats.predicted_cached_tokens
        assert samples["contextpilot_prepare_seconds_count"] == stats.prepare_count == len(QUERIES)

        monkeypatch.setitem(sys.modules, "contextpilot_integrations.pilot.metrics", None)  # the extra not installed
        missing = client.get("/metrics", headers={"X-ContextPilot-Token": "scrape-secret"})
        assert missing.status_code == 404 and "[metrics]" in missing.json()["error"]
        assert client.get("/stats", headers={"X-ContextPilot-Token": "scrape-secret"}).status_code == 200


def test_nothing_of_either_library_is_imported_until_asked_for() -> None:
    code = (
        "import sys\n"
        "import contextpilot_integrations, contextpilot_integrations.engines\n"
        "import contextpilot_integrations.integration.metrics, contextpilot_integrations.pilot.telemetry\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('prometheus_client', 'opentelemetry'))))"
    )
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_without_opentelemetry_a_model_call_records_nothing_and_never_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(BLOCKS, QUERIES[0])
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    telemetry._tracer.cache_clear()
    try:
        assert telemetry._tracer() is None
        telemetry.record_model_call(prepared, {"model": "m"}, input_tokens=10)
    finally:
        telemetry._tracer.cache_clear()


# ---- a real Prometheus ----------------------------------------------------------------------------------------
@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        reason = "no prometheus binary on PATH (Debian: apt-get install prometheus; CI installs it)"
        if os.environ.get("CONTEXTPILOT_REQUIRE_PROMETHEUS"):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def prometheus_for(prometheus_binary: str, tmp_path: Path) -> Iterator[Any]:
    """``start(listener_url, token)``: a Prometheus scraping that listener's ``/metrics`` every
    second, on 127.0.0.1 (its data in a temporary folder); returns its query URL. Killed after."""
    processes: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "prometheus.log"

    def start(listener_url: str, token: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: contextpilot\n"
            f"    authorization:\n      credentials: {token}\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{urlparse(listener_url).port}']\n"
        )
        web = f"127.0.0.1:{free_port()}"
        command = [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={web}",
            "--log.level=warn",
        ]
        with log.open("wb") as out:
            processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        return f"http://{web}/api/v1/query"

    yield start
    for process in processes:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if log.exists() and any(process.returncode not in (0, -15) for process in processes):
        print(log.read_text(errors="replace"))


def query(url: str, promql: str) -> float | None:
    """An instant query's single value (``None``: no series, or Prometheus not answering yet)."""
    try:
        answer = httpx.get(url, params={"query": promql}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    results = answer.get("data", {}).get("result", []) if answer.get("status") == "success" else []
    return float(results[0]["value"][1]) if len(results) == 1 else None


def eventually(url: str, promql: str, expected: float, timeout: float = 60.0) -> float | None:
    """The query's value once it equals ``expected`` (Prometheus scrapes every second), else its last."""
    deadline = time.monotonic() + timeout
    seen = query(url, promql)
    while seen != expected and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = query(url, promql)
    return seen


def test_a_real_prometheus_scrapes_the_listener_and_answers_with_the_pilots_numbers(prometheus_for: Any) -> None:
    pilot = ContextPilot()
    serve(pilot, QUERIES)
    with EvictionListener(pilot, token="scrape-secret") as listener:
        url = prometheus_for(listener.url, "scrape-secret")
        assert eventually(url, 'up{job="contextpilot"}', 1.0) == 1.0, "Prometheus never scraped the listener"
        stats = pilot.stats()
        assert eventually(url, "contextpilot_engine_cached_tokens_total", stats.engine_cached_tokens) == (
            stats.engine_cached_tokens
        )
        assert query(url, "contextpilot_predicted_cached_tokens_total") == stats.predicted_cached_tokens
        assert query(url, "contextpilot_engine_prompt_tokens_total") == stats.engine_prompt_tokens
        assert query(url, "contextpilot_prepare_seconds_count") == stats.prepare_count == len(QUERIES)
        # the dashboard's queries (docs/metrics.md), on Prometheus' own evaluation
        accuracy = query(url, "contextpilot_engine_cached_tokens_total / contextpilot_predicted_cached_tokens_total")
        assert accuracy == pytest.approx(stats.engine_cached_tokens / stats.predicted_cached_tokens)
        p99 = query(url, "histogram_quantile(0.99, sum by (le) (contextpilot_prepare_seconds_bucket))")
        assert p99 is not None and math.isfinite(p99) and 0 < p99 <= PREPARE_SECONDS_BOUNDS[-1]

        # read at each scrape: one more served request shows at the next one
        serve(pilot, ["One more question?"])
        later = pilot.stats()
        assert later.engine_cached_tokens > stats.engine_cached_tokens
        assert eventually(url, "contextpilot_engine_cached_tokens_total", later.engine_cached_tokens) == (
            later.engine_cached_tokens
        )
        assert eventually(url, "contextpilot_prepare_seconds_count", later.prepare_count) == len(QUERIES) + 1


# ---- OpenTelemetry --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exporter() -> Any:
    """An in-memory exporter on the process's SDK tracer provider (set here unless one is already)."""
    pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk (in [dev])")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    yield memory
    processor.shutdown()  # the provider keeps it, exporting nothing more


def test_a_langchain_model_call_leaves_a_span_with_the_genai_usage(exporter: Any) -> None:
    pytest.importorskip("langchain_contextpilot", reason="the LangChain adapter")
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI
    from opentelemetry.trace import SpanKind

    from contextpilot_integrations.testing.fake_openai import fake_openai
    from langchain_contextpilot import ContextPilotChatModel, ContextPilotRetriever, format_documents

    documents = [Document(page_content=f"Report {i}. " + f"figure {i} rose " * 90, id=f"report-{i}") for i in range(6)]
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
    )
    exporter.clear()
    with fake_openai() as fake:
        pilot = ContextPilot()
        retriever = ContextPilotRetriever(base_retriever=RunnableLambda(lambda _: documents), pilot=pilot)
        model = ContextPilotChatModel(llm=ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x", max_retries=0))
        chain = {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}
        answers = [(chain | prompt | model).invoke(q) for q in ("Which figure rose?", "Which figure rose most?")]
    spans = [span for span in exporter.get_finished_spans() if span.name.startswith("chat")]
    assert len(spans) == len(answers)
    reads = []
    for span, answer in zip(spans, answers, strict=True):
        usage = answer.usage_metadata
        attributes = dict(span.attributes)
        assert span.name == "chat gpt-5" and span.kind == SpanKind.CLIENT
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "openai"
        assert attributes["gen_ai.request.model"] == "gpt-5"
        assert attributes["gen_ai.usage.input_tokens"] == usage["input_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"]
        read = usage.get("input_token_details", {}).get("cache_read")
        assert attributes.get("gen_ai.usage.cache_read.input_tokens") == read
        assert attributes["contextpilot.references"] == 0
        reads.append(read or 0)
    assert reads[-1] > 0, "the second call reads the first's prefix from the provider's cache"
    stats = pilot.stats()
    assert sum(reads) == stats.engine_cached_tokens
    predicted = [span.attributes["contextpilot.predicted_cached_tokens"] for span in spans]
    assert sum(predicted) == stats.predicted_cached_tokens and predicted[-1] > 0
    assert [span.attributes["contextpilot.request_id"] for span in spans] == pilot.live_request_ids()


def test_a_llama_index_answer_names_its_model_and_usage_in_the_span(exporter: Any) -> None:
    _llm_calls = pytest.importorskip(
        "llama_index.postprocessor.contextpilot._llm_calls", reason="the LlamaIndex adapter"
    )
    from openai.types.chat import ChatCompletion

    pilot = ContextPilot()
    pilot.prepare(BLOCKS, QUERIES[0])
    prepared = pilot.prepare(BLOCKS, QUERIES[1])
    prompt = sum(block.token_count for block in prepared.blocks) + TAIL
    raw = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "served-model",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 3,
                "total_tokens": prompt + 3,
                "prompt_tokens_details": {"cached_tokens": prepared.cached_tokens},
            },
        }
    )
    exporter.clear()
    _llm_calls.report(Binding(pilot, prepared), raw, usage_feedback=False, tracker=None)
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat served-model"
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "served-model",
        "gen_ai.response.model": "served-model",
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": prepared.cached_tokens,
        "contextpilot.request_id": prepared.request_id,
        "contextpilot.predicted_cached_tokens": prepared.cached_tokens,
        "contextpilot.predicted_cached_blocks": prepared.cached_blocks,
        "contextpilot.blocks": len(prepared.blocks),
        "contextpilot.references": 0,
    }
    assert pilot.stats().engine_cached_tokens == prepared.cached_tokens > 0


def test_a_hosted_answer_leaves_a_span_with_its_cache_reads_and_writes(exporter: Any) -> None:
    anthropic_types = pytest.importorskip("anthropic.types", reason="Anthropic's SDK (in [dev])")
    from contextpilot_integrations.integration.hosted_feedback import report_provider_served

    pilot = ContextPilot()
    pilot.prepare(BLOCKS, QUERIES[0])
    prepared = pilot.prepare(BLOCKS, QUERIES[1], "chat-7")
    usage = anthropic_types.Usage(
        input_tokens=TAIL,
        output_tokens=9,
        cache_read_input_tokens=prepared.cached_tokens,
        cache_creation_input_tokens=120,
    )
    exporter.clear()
    report_provider_served(pilot, prepared, usage, "anthropic")
    (span,) = exporter.get_finished_spans()
    attributes = dict(span.attributes)
    assert attributes["gen_ai.provider.name"] == "anthropic"
    assert attributes["gen_ai.usage.input_tokens"] == TAIL + prepared.cached_tokens + 120  # reads and writes included
    assert attributes["gen_ai.usage.output_tokens"] == 9
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == prepared.cached_tokens > 0
    assert attributes["gen_ai.usage.cache_creation.input_tokens"] == 120
    assert attributes["gen_ai.conversation.id"] == "chat-7"
    assert attributes["contextpilot.predicted_cached_tokens"] == prepared.cached_tokens
    assert pilot.stats().provider_usage["anthropic"].cache_write_tokens == 120


def test_the_core_clients_call_leaves_a_span_with_the_engines_cache_reads(exporter: Any, tmp_path: Any) -> None:
    """``OpenAICompatClient`` (no framework) on a real llama-server: one span per served request,
    its cache reads the engine's own report beside what the index predicted."""
    from contextpilot_integrations import Block
    from contextpilot_integrations.engines import OpenAICompatClient
    from tests.engine_support import start_llama_server

    server = start_llama_server(tmp_path)
    try:
        pilot = ContextPilot()
        docs = [Block(id=f"d{n}", text=f"Document {n}: " + "harbour lights " * 40) for n in range(3)]
        exporter.clear()
        with OpenAICompatClient(server.url, pilot, engine="llamacpp", discover=False) as client:
            served = [client.chat(pilot.prepare(docs, q), max_tokens=2) for q in ("Which one?", "Which two?")]
        spans = [span for span in exporter.get_finished_spans() if span.name.startswith("chat")]
        assert len(spans) == 2
        for span, result in zip(spans, served, strict=True):
            attributes = dict(span.attributes)
            assert attributes["contextpilot.request_id"] == result.request_id
            assert attributes["gen_ai.usage.input_tokens"] == result.prompt_tokens
            assert attributes["gen_ai.usage.cache_read.input_tokens"] == (result.cached_tokens or 0)
        assert (served[1].cached_tokens or 0) > 0 and attributes["contextpilot.predicted_cached_tokens"] > 0
    finally:
        server.stop()
