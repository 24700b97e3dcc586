"""The simulator's prediction of an engine's cached tokens (issue 29, item 4), on token ids:
whole pages only, at least one prompt token left to compute, the answer cached after the
prompt, least-recently-used eviction in a pool of the engine's size. The live engines check
the prediction against SGLang and vLLM themselves (tests/live/test_live_compare.py). The
engine's ids come from its ``/tokenize`` (:class:`EngineTokenizer`): here a live llama-server's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from contextpilot_integrations.engines import EngineTokenCounter
from contextpilot_integrations.errors import EngineUnavailable
from contextpilot_integrations.whatif.engine_predict import CacheShape, EngineTokenizer, predict_cached
from tests.engine_support import free_port, start_llama_server


def ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_only_whole_pages_are_reused() -> None:
    prompt = ids(0, 40)
    assert predict_cached([(prompt, []), (prompt, [])], CacheShape(16, 10_000)) == [0, 32]  # 2 whole pages of 40 tokens
    assert predict_cached([(prompt, []), (prompt, [])], CacheShape(1, 10_000)) == [0, 39]  # token pages: all but one


def test_a_hit_leaves_one_prompt_token_to_compute() -> None:
    prompt = ids(0, 32)  # two whole pages: the second holds the last token, which must be computed
    assert predict_cached([(prompt, []), (prompt, [])], CacheShape(16, 10_000)) == [0, 16]


def test_a_divergence_inside_a_page_loses_that_page() -> None:
    first, second = ids(0, 64), [*ids(0, 20), *ids(500, 44)]
    assert predict_cached([(first, []), (second, [])], CacheShape(16, 10_000)) == [0, 16]


def test_the_answer_is_cached_for_the_next_turn_but_its_last_token() -> None:
    prompt, answer = ids(0, 30), ids(100, 19)
    follow_up = [*prompt, *answer, *ids(200, 40)]
    # prompt + answer less its last token: 48 tokens, three whole pages
    assert predict_cached([(prompt, answer), (follow_up, [])], CacheShape(16, 10_000)) == [0, 48]
    without_answer = [*prompt, *ids(300, 19), *ids(200, 40)]
    assert predict_cached([(prompt, answer), (without_answer, [])], CacheShape(16, 10_000)) == [0, 16]


def test_the_pool_evicts_the_least_recently_used() -> None:
    a, b, c = ids(0, 33), ids(1000, 33), ids(2000, 33)  # two whole pages of 16 each
    shape = CacheShape(16, 64)  # room for two prompts
    assert predict_cached([(a, []), (b, []), (a, []), (c, []), (a, []), (b, [])], shape) == [0, 0, 32, 0, 32, 0]


def test_the_tokenizer_reads_llama_servers_ids_and_forgets_the_least_recently_used(tmp_path: Path) -> None:
    """llama-server reads ``{"content"}``, not SGLang's and vLLM's ``{"prompt"}``: the ids are its
    own, as the token counter counts them; what it remembers is bounded, the least recently used
    forgotten first (a text asked for again comes back as the very ids remembered)."""
    texts = ["The quarterly report names three suppliers.", "Acme shipped late.", "The third one is new."]
    server = start_llama_server(tmp_path)
    try:
        own = [
            tuple(httpx.post(server.url + "/tokenize", json={"content": t}, timeout=60).json()["tokens"]) for t in texts
        ]
        with EngineTokenizer(server.url + "/v1", "default") as tokenizer, EngineTokenCounter(server.url) as counter:
            tokenizer.MAX_REMEMBERED = 2
            first, second = tokenizer.text(texts[0]), tokenizer.text(texts[1])
            assert [first, second] == own[:2] and all(own) and counter(texts[1]) == len(second)
            assert tokenizer.text(texts[0]) is first  # remembered, and now the most recently used
            assert tokenizer.text(texts[2]) == own[2]  # the third: the second, least recently used, goes
            assert tokenizer.text(texts[0]) is first
            again = tokenizer.text(texts[1])
            assert again == second and again is not second  # asked of the engine again
    finally:
        server.stop()


def test_the_tokenizer_without_an_engine_raises_the_librarys_error() -> None:
    tokenizer = EngineTokenizer(f"http://127.0.0.1:{free_port()}", "default")
    with tokenizer, pytest.raises(EngineUnavailable, match="not reachable"):
        tokenizer.messages([{"role": "user", "content": "hello"}])
