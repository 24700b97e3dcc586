from __future__ import annotations

import random

import pytest

from contextpilot_integrations.whatif.simulate import RadixCacheSimulator
from tests.sglang_support import SGLangRadix


def test_hits_lru_and_notices_by_hand() -> None:
    sim = RadixCacheSimulator(capacity_tokens=10)
    assert sim.request("a", [("x", 3), ("y", 3)]).hit_tokens == 0
    b = sim.request("b", [("x", 3), ("z", 2)])
    assert (b.hit_tokens, b.hit_blocks, b.block_tokens) == (3, 1, 5)
    assert sim.used_tokens == 8
    # "a"'s leaf (y) is the least recently used: it goes, "a" keeps its first block
    c = sim.request("c", [("w", 4)])
    assert c.evicted == (("a", 1),) and sim.used_tokens == 9
    assert sim.match(["x", "z"]) == 2 and sim.match(["x", "y"]) == 1


def test_own_path_is_never_evicted_and_oversized_requests_are_not_cached() -> None:
    sim = RadixCacheSimulator(capacity_tokens=6)
    sim.request("a", [("x", 3), ("y", 3)])
    result = sim.request("b", [("x", 3), ("q", 3)])
    assert result.hit_tokens == 3 and result.evicted == (("a", 1),)
    assert sim.request("big", [("huge", 50)]).hit_tokens == 0 and sim.match(["huge"]) == 0
    with pytest.raises(ValueError):
        RadixCacheSimulator(-1)


def test_unbounded_cache_never_evicts() -> None:
    sim = RadixCacheSimulator()
    for i in range(200):
        assert sim.request(str(i), [("shared", 10), (i, 5)]).evicted == ()
    assert sim.request("again", [("shared", 10), (7, 5)]).hit_tokens == 15


def _workload(seed: int, n_blocks: int = 24, n_requests: int = 150) -> tuple[dict[int, int], list[list[int]]]:
    rng = random.Random(seed)
    sizes = {b: rng.randint(1, 4) for b in range(n_blocks)}
    weights = [1.0 / (b + 1) for b in range(n_blocks)]
    requests: list[list[int]] = []
    for _ in range(n_requests):
        if requests and rng.random() < 0.3:
            base = rng.choice(requests[-10:])
            order = base[: rng.randint(1, len(base))] + rng.sample(range(n_blocks), 2)
            order = list(dict.fromkeys(order))
        else:
            order = list(dict.fromkeys(rng.choices(range(n_blocks), weights, k=rng.randint(1, 6))))
        requests.append(order)
    return sizes, requests


def _tokens(order: list[int], sizes: dict[int, int]) -> list[int]:
    return [1_000 * block + j for block in order for j in range(sizes[block])]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [24, 40, 10_000])
def test_same_hits_as_sglang_radix_cache(seed: int, capacity: int) -> None:
    engine = SGLangRadix(capacity)
    sizes, requests = _workload(seed)
    sim = RadixCacheSimulator(capacity)
    for n, order in enumerate(requests):
        hit = engine.serve(_tokens(order, sizes))
        simulated = sim.request(str(n), [(block, sizes[block]) for block in order])
        assert simulated.hit_tokens == hit, f"request {n}: simulator {simulated.hit_tokens} != SGLang {hit}"
        assert sim.used_tokens == capacity - engine.allocator.available_size() or capacity == 10_000
    for order in {tuple(o) for o in requests}:
        blocks = sim.match(list(order))
        assert sum(sizes[b] for b in order[:blocks]) == engine.match(_tokens(list(order), sizes))


@pytest.mark.parametrize("seed", [3, 4])
def test_chat_answers_are_cached_like_sglang_caches_output(seed: int) -> None:
    """Turn t of a chat resends turn t-1's prompt and answer: both engines reuse them."""
    rng = random.Random(seed)
    engine = SGLangRadix(400)
    sim = RadixCacheSimulator(400)
    histories: dict[int, list[tuple[object, int]]] = {c: [(("system",), 3)] for c in range(4)}
    for step in range(40):
        conversation = step % 4
        prompt = histories[conversation] + [((conversation, step, "q"), rng.randint(1, 5))]
        prompt += [(b, 2) for b in rng.sample(range(12), 3)]
        answer = [((conversation, step, "a"), rng.randint(1, 4))]
        tokens = [t for key, size in prompt for t in _unit_tokens(key, size)]
        generated = [t for key, size in answer for t in _unit_tokens(key, size)]
        hit = engine.serve(tokens, generated)
        simulated = sim.request(f"{step}", prompt, answer)
        assert simulated.hit_tokens == hit, f"step {step}: simulator {simulated.hit_tokens} != SGLang {hit}"
        histories[conversation] = prompt + answer


_TOKENS: dict[object, int] = {}


def _unit_tokens(key: object, size: int) -> list[int]:
    base = _TOKENS.setdefault(key, 1_000 * (len(_TOKENS) + 1))
    return [base + j for j in range(size)]
