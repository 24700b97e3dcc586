"""An index that knows its engine, on live SGLang and vLLM (issue 41, part 3): what each engine
says of its page, KV pool and tokenizer is what it was started with, and a pilot given the
engine (no KV events: usage feedback, the HTTP path) weighs with them from its second request.

Each engine starts once per module (about 20 s on 2 cores; SGLang with ``--page-size 16``,
vLLM with ``--block-size 32``: its CPU backend takes multiples of 32 only). Without the
engines the tests skip, unless ``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI): then they fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.gain import estimate_tokens, page_margin
from contextpilot_integrations.engines.client import OpenAICompatClient
from contextpilot_integrations.engines.engine_info import aread_engine_info, read_engine_info
from contextpilot_integrations.engines.tokens import EngineTokenCounter
from contextpilot_integrations.testing.live_engines import (
    MODEL_NAME,
    SYSTEM_PROMPT,
    LiveEngine,
    require_live_engine,
    start_sglang,
    start_vllm,
)

pytestmark = pytest.mark.timeout(900)

SGLANG_PAGE, SGLANG_POOL = 16, 2048
VLLM_BLOCK, VLLM_BLOCKS = 32, 60
EXPECTED = {  # kind -> (page, pool) as started
    "sglang": (SGLANG_PAGE, SGLANG_POOL),  # --page-size 16 --max-total-tokens 2048
    "vllm": (VLLM_BLOCK, (VLLM_BLOCKS - 1) * VLLM_BLOCK),  # one of its blocks is the null block
}
DOCS = [Block(id=f"d{n}", text=f"Document {n}: " + "amber harbour stone river " * 8) for n in range(4)]


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LiveEngine]]:
    kind: str = request.param
    where = require_live_engine(kind, pytest.skip)
    log = Path(tmp_path_factory.mktemp(f"info-{kind}")) / f"{kind}.log"
    if kind == "sglang":
        running = start_sglang(where, log, page_size=SGLANG_PAGE, max_total_tokens=SGLANG_POOL)
    else:
        running = start_vllm(where, log, block_size=VLLM_BLOCK, blocks=VLLM_BLOCKS)
    try:
        yield kind, running
    finally:
        running.stop()


def engine_count(url: str, text: str) -> int:
    """The engine's own count of ``text``, asked directly."""
    body = {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False}
    answer = httpx.post(url + "/tokenize", json=body, timeout=30)
    answer.raise_for_status()
    return len(answer.json()["tokens"])


def test_the_engine_says_what_it_was_started_with(engine: tuple[str, LiveEngine]) -> None:
    kind, running = engine
    page, pool = EXPECTED[kind]
    assert running.page_size == page
    for info in (
        read_engine_info(running.url, kind, model=MODEL_NAME),
        read_engine_info(running.url + "/v1", None, model=MODEL_NAME),  # not named: found all the same
        asyncio.run(aread_engine_info(running.url, kind, model=MODEL_NAME)),
    ):
        assert (info.kind, info.page_tokens, info.cache_tokens) == (kind, page, pool), info.source
        assert isinstance(info.tokenizer, EngineTokenCounter), info.source
        text = "The amber harbour, by the stone river."
        assert info.tokenizer(text) == engine_count(running.url, text)
    if kind == "sglang":
        assert info.source["page_tokens"] == "GET /server_info: page_size"
        assert info.source["cache_tokens"] == "GET /server_info: max_total_num_tokens"
    else:
        assert info.source["page_tokens"] == "GET /metrics: vllm:cache_config_info block_size"
        assert "num_gpu_blocks" in info.source["cache_tokens"]


def test_a_pilot_given_the_engine_weighs_with_its_page_and_tokens(engine: tuple[str, LiveEngine]) -> None:
    kind, running = engine
    page, pool = EXPECTED[kind]
    pilot = ContextPilot()
    first = pilot.prepare(DOCS, "Which document mentions a harbour?")
    assert first.blocks[0].token_count == estimate_tokens(first.blocks[0].text)  # before: the estimates
    with OpenAICompatClient(running.url, pilot, model=MODEL_NAME, engine=kind) as client:  # no listener
        client.chat(first, system_prompt=SYSTEM_PROMPT, max_tokens=2, temperature=0)
        assert (pilot.page_tokens, pilot.cache_tokens) == (page, pool)
        assert isinstance(pilot.token_counter, EngineTokenCounter)
        assert page_margin(pilot.page_tokens) == page - 1  # what the send decision gives up per request
        fresh = [Block(id="new", text="A new document: the amber harbour lies by the stone river.")]
        second = pilot.prepare(fresh + DOCS, "Which document is new?")
        served = client.chat(second, system_prompt=SYSTEM_PROMPT, max_tokens=2, temperature=0)
    counted = {block.id: block.token_count for block in second.blocks}
    assert counted["new"] == engine_count(running.url, fresh[0].text) != estimate_tokens(fresh[0].text)
    assert served.cached_tokens is not None and served.prompt_tokens is not None
    assert pilot.stats().engine_requests == 2


def test_what_the_user_set_stays_on_a_live_engine(engine: tuple[str, LiveEngine]) -> None:
    kind, running = engine
    pilot = ContextPilot(page_tokens=1, cache_tokens=100_000)
    with OpenAICompatClient(running.url, pilot, model=MODEL_NAME, engine=kind) as client:
        info = client.learn_engine()
    assert info is not None and info.page_tokens == EXPECTED[kind][0]
    assert (pilot.page_tokens, pilot.cache_tokens) == (1, 100_000)  # the user's word
    assert isinstance(pilot.token_counter, EngineTokenCounter)  # what was unset is filled
