"""The LangChain chains of ``docs/frameworks.md`` and the LlamaIndex chain of its README, run
once against live SGLang (CPU, tiny model) instead of the documented
``http://127.0.0.1:30000`` (the only substitution).

What the engine saw comes from its own request log (``--log-requests``, JSON, one line
per finished request with its ``rid`` and ``cached_tokens``): every request the pilot
sent reached SGLang under the pilot's id, and the cached tokens SGLang reported are the
ones the pilot recorded. About 30 s on 2 cores (start-up, a handful of short requests).
Without the engine the tests skip, unless ``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.live_engines import LiveEngine, require_live_engine, start_sglang

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED_SERVER = "http://127.0.0.1:30000"


class Sglang:
    def __init__(self, engine: LiveEngine, requests_log: Path) -> None:
        self.engine, self.requests_log = engine, requests_log

    def finished(self) -> dict[str, dict[str, Any]]:
        """``rid`` -> the ``meta_info`` SGLang logged when it finished the request."""
        out: dict[str, dict[str, Any]] = {}
        for path in self.requests_log.glob("*"):
            for line in path.read_text(errors="replace").splitlines():
                start = line.find("{")
                if start == -1:
                    continue
                try:
                    record = json.loads(line[start:])
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == "request.finished":
                    out[str(record["rid"])] = record["out"]["meta_info"]
        return out


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sglang]:
    where = require_live_engine("sglang", pytest.skip)
    workdir = Path(tmp_path_factory.mktemp("sglang-readme"))
    requests_log = workdir / "requests"
    requests_log.mkdir()
    logging = ["--log-requests", "--log-requests-level", "0", "--log-requests-format", "json"]
    logging += ["--log-requests-target", str(requests_log)]
    engine = start_sglang(where, workdir / "sglang.log", max_total_tokens=8192, context_length=4096, extra_args=logging)
    try:
        yield Sglang(engine, requests_log)
    finally:
        engine.stop()


def readme_blocks(path: Path, needle: str) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S) if needle in b]


def run_block(block: str, url: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "readme_block"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.replace(DOCUMENTED_SERVER, url), "README block", "exec"), namespace)
    return namespace


def pilots_in(namespace: dict[str, Any]) -> list[ContextPilot]:
    """The pilots a block made: in a variable, or held by one of its objects (``rag.pilot``)."""
    found: list[ContextPilot] = []
    for value in namespace.values():
        for candidate in (value, getattr(value, "pilot", None)):
            if isinstance(candidate, ContextPilot) and all(candidate is not p for p in found):
                found.append(candidate)
    return found


def assert_reached_sglang(pilots: list[ContextPilot], sglang: Sglang) -> int:
    """Every request a pilot sent finished in SGLang under the pilot's id, and the pilot
    recorded exactly the prompt and cached tokens SGLang reported. Returns the requests.

    A pilot's ids share its prefix (``cp-<random>-<n>``); it indexes first requests only
    (a later conversation turn starts with its own history), so the prefix finds them all.
    """
    finished = sglang.finished()
    checked = 0
    for pilot in pilots:
        indexed = pilot.live_request_ids()
        assert indexed, "the pilot sent nothing it could index"
        prefix = indexed[0].rsplit("-", 1)[0] + "-"
        served = [rid for rid in finished if rid.startswith(prefix)]
        assert set(indexed) <= set(served), f"SGLang never finished {set(indexed) - set(served)}"
        stats = pilot.stats()
        assert stats.engine_requests == len(served)
        assert stats.engine_cached_tokens == sum(int(finished[rid]["cached_tokens"]) for rid in served)
        assert stats.engine_prompt_tokens == sum(int(finished[rid]["prompt_tokens"]) for rid in served)
        checked += len(served)
    return checked


def test_the_langchain_chains_of_the_readme_run_against_sglang(sglang: Sglang) -> None:
    blocks = readme_blocks(ROOT / "docs" / "frameworks.md", "ChatSGLang(model=")  # moved from the README
    assert len(blocks) >= 2  # the LCEL chain and ConversationalRAG
    pilots = [p for block in blocks for p in pilots_in(run_block(block, sglang.engine.url))]
    assert len(pilots) == len(blocks)
    assert assert_reached_sglang(pilots, sglang) >= 3  # one chain call, two conversation turns
    # the conversation's second turn starts with its first: SGLang served part of it from cache
    assert pilots[-1].stats().engine_cached_tokens > 0


def test_the_llamaindex_query_engine_of_the_readme_runs_against_sglang(sglang: Sglang) -> None:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    from llama_index.postprocessor.contextpilot import SGLangLLM

    (block,) = readme_blocks(ROOT / "llama-index-postprocessor-contextpilot" / "README.md", DOCUMENTED_SERVER)
    namespace = run_block(block, sglang.engine.url)
    pilot, postprocessor, llm = namespace["pilot"], namespace["postprocessor"], namespace["llm"]
    texts = ["FTX founder Sam Bankman-Fried faces a fraud trial.", "Jury selection began on Tuesday.",
             "Prosecutors say customer funds were misused.", "The defence blames the lawyers."]  # fmt: skip
    index = VectorStoreIndex.from_documents(
        [Document(text=text, id_=str(n)) for n, text in enumerate(texts)], embed_model=MockEmbedding(embed_dim=8)
    )
    # the README's pieces where they go: the postprocessor after retrieval, the bound LLM
    engine = index.as_query_engine(llm=llm, node_postprocessors=[postprocessor], similarity_top_k=3)
    engine.query("Who is facing a fraud trial?")
    engine.query("What do prosecutors say?")
    # and the preset on OpenAILike, with its own pilot
    preset_pilot = ContextPilot()
    preset = SGLangLLM(model="default", api_base=sglang.engine.url + "/v1", max_tokens=8)
    index.as_query_engine(
        llm=preset, node_postprocessors=[type(postprocessor)(pilot=preset_pilot)], similarity_top_k=3
    ).query("Who is facing a fraud trial?")
    assert assert_reached_sglang([pilot, preset_pilot], sglang) == 3
    # the second query shares the first one's system prompt and documents: cached by SGLang
    assert pilot.stats().engine_cached_tokens > 0
