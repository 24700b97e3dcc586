"""``ChatSGLang`` against live SGLang on CPU, with our plugin (HTTP) and with SGLang's own
ZMQ publisher: the request id reaches the engine, the cached tokens come back into the
pilot with the prompt's token ids and where each block ends, and the pilot predicts the
engine's prefix cache within one page under eviction (issue 24).

One engine per path for the module (about a minute on 2 cores). Without the live engines
(``scripts/setup_live_engine.sh sglang``) the tests skip, unless
``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI): then they fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate

from contextpilot_integrations import ContextPilot, PreparedRequest, render_block
from contextpilot_integrations.engines.client import BlockTokenizer
from contextpilot_integrations.testing.live_engines import (
    MODEL_NAME,
    SYSTEM_PROMPT,
    EventPath,
    Outcome,
    agreement,
    require_live_engine,
    score,
    settle_sink,
    warm_head,
    workload,
)
from langchain_contextpilot import ChatSGLang, contextpilot_reorder, format_documents_runnable

pytestmark = pytest.mark.timeout(600)


class RecordingPilot(ContextPilot):
    """A real pilot that also keeps the requests it prepared, to score each prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[PreparedRequest] = []

    def prepare(self, *args: Any, **kwargs: Any) -> PreparedRequest:
        result = super().prepare(*args, **kwargs)
        self.prepared.append(result)
        return result


@pytest.fixture(scope="module", params=("sglang-plugin", "sglang-zmq"))
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventPath]:
    where = require_live_engine("sglang", pytest.skip)
    running = EventPath(request.param, where, Path(tmp_path_factory.mktemp(request.param)))
    try:
        yield running
    finally:
        running.stop()


def test_chat_sglang_keeps_the_index_true_under_eviction(path: EventPath) -> None:
    path.flush()
    pilot = RecordingPilot()
    client, sink = path.connect(pilot=pilot)  # the listener or subscriber; the core client unused
    client.close()
    warm_head(path.engine.url)
    llm = ChatSGLang(model=MODEL_NAME, base_url=path.engine.url + "/v1", max_tokens=2, temperature=0, event_sink=sink)
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM_PROMPT), ("user", "{context}\n\nQuestion: {question}")]
    )
    context = contextpilot_reorder(pilot) | format_documents_runnable
    chain = {"context": context, "question": itemgetter("question")} | prompt | llm
    scorer = BlockTokenizer(path.engine.url, "sglang", model=MODEL_NAME)
    page = path.page_size
    inputs = [
        {"documents": [Document(page_content=b.text, id=b.id) for b in blocks], "question": f"question {n}"}
        for n, blocks in enumerate(workload(seed=0, requests=30))
    ]

    answered: list[tuple[str, str]] = []  # (the engine's answer id, our request id)

    def scored(message: Any) -> Outcome:
        prepared = pilot.prepared[-1]
        answered.append((str(message.response_metadata.get("id") or message.id), prepared.request_id))
        usage = message.usage_metadata
        cached, prompt_tokens = usage["input_token_details"]["cache_read"], usage["input_tokens"]
        ids, ends = message.response_metadata["prompt_token_ids"], message.response_metadata["block_ends"]
        assert len(ids) == prompt_tokens and len(ends) == len(prepared.blocks)
        assert scorer.block_ends(prepared, ids) == ends  # the ends the sink got are where the blocks are
        first = scorer.tokens(render_block(prepared.blocks[0], prepared.templates, prepared.labels)) or ()
        settle_sink(sink, prepared.request_id, prompt_tokens // page * page)
        return score(prepared, ends, len(first), cached, prompt_tokens, page)

    if path.name == "sglang-plugin":  # invoke: _generate
        outcomes = [scored(chain.invoke(one)) for one in inputs]
    else:  # ainvoke: _agenerate (its /tokenize calls off the loop), one event loop for all

        async def run_all() -> list[Outcome]:
            return [scored(await chain.ainvoke(one)) for one in inputs]

        outcomes = asyncio.run(run_all())
    scorer.close()
    result, late = agreement(outcomes), agreement(outcomes[3:])
    print(f"\nChatSGLang, {path.name}: {result}")
    assert all(answer.endswith(request_id) for answer, request_id in answered), answered[:3]  # SGLang's rid
    assert sink.stats().tracked_requests == 30 and sink.stats().requests_shortened > 0  # the engine evicted
    assert pilot.stats().engine_cached_tokens == sum(o.cached_tokens for o in outcomes) > 0
    assert result.agree >= 29 and late.over == 0, [o for o in outcomes if not o.agrees]
