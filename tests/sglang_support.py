"""Drive SGLang's real radix cache on CPU (sglang 0.5.23, torch CPU).

SGLang imports a few GPU-only modules at module level that the cache code never runs
(``triton``, ``torchvision``, ``tvm_ffi``); they are replaced by inert stand-ins before
the import. Nothing of SGLang's cache is faked: allocator, tree and eviction are real.
Set ``CONTEXTPILOT_REQUIRE_SGLANG=1`` (CI does) to fail instead of skip when it is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import random
import sys
import types
from array import array
from typing import Any

import pytest

from contextpilot_integrations import Block

STUBBED = tuple(
    name for name in ("triton", "torchvision", "tvm_ffi") if importlib.util.find_spec(name) is None
)  # tvm_ffi is real where vLLM's event classes were installed (xgrammar needs the real one)


class _Inert:
    """Absorbs any use: attribute access, calls, decorators, subscripts."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Inert(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # bare decorator
        return _Inert(f"{self._name}()")

    def __getitem__(self, item: Any) -> Any:
        return _Inert(f"{self._name}[]")

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        # torch itself does isinstance(x, triton.<CamelCase>): give it real classes
        if self.__name__.split(".")[0] == "triton" and item.lstrip("_")[:1].isupper():
            cls = type(item, (), {"__module__": self.__name__})
            setattr(self, item, cls)
            return cls
        return _Inert(f"{self.__name__}.{item}")


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_sglang() -> types.SimpleNamespace:
    """The SGLang cache classes, or a skip (a failure when SGLang is required)."""
    if not any(isinstance(f, _InertFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _InertFinder())
    try:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as exc:
        if os.environ.get("CONTEXTPILOT_REQUIRE_SGLANG"):
            raise
        pytest.skip(f"sglang is not installed ({exc}); ./run.sh test installs it")
    return types.SimpleNamespace(
        torch=torch,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
        CacheInitParams=CacheInitParams,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
    )


class SGLangRadix:
    """SGLang's ``RadixCache`` with a real allocator of ``capacity`` tokens, served the
    way the scheduler does: match, lock the prefix, evict what the new tokens need,
    allocate, insert, unlock."""

    def __init__(self, capacity: int, page_size: int = 1) -> None:
        sgl = self.sgl = import_sglang()
        self.allocator = sgl.TokenToKVPoolAllocator(
            size=capacity, dtype=sgl.torch.float16, device="cpu", kvcache=None, need_sort=False
        )
        self.cache = sgl.RadixCache(
            sgl.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page_size,
                eviction_policy="lru",
                enable_kv_cache_events=True,
            )
        )

    def _key(self, tokens: list[int]) -> Any:
        return self.sgl.RadixKey(array("q", tokens))

    def match(self, tokens: list[int]) -> int:
        return self.cache.match_prefix(self.sgl.MatchPrefixParams(key=self._key(tokens))).device_prefix_len

    def serve(self, tokens: list[int], generated: list[int] | None = None) -> int:
        """One request; returns the cached prefix length SGLang reused. ``generated``
        tokens (an answer) are cached with the prompt when the request finishes."""
        sgl, cache = self.sgl, self.cache
        match = cache.match_prefix(sgl.MatchPrefixParams(key=self._key(tokens)))
        hit = match.device_prefix_len
        lock = cache.lock(match.last_device_node)
        sequence = tokens + (generated or [])
        need = len(sequence) - hit
        if need > self.allocator.available_size():
            cache.evict(sgl.EvictParams(num_tokens=need - self.allocator.available_size()))
        fresh = self.allocator.alloc(need)
        assert fresh is not None, "the request does not fit the cache"
        value = sgl.torch.cat([cache.path_device_indices(match.last_device_node), fresh]) if hit else fresh
        result = cache.insert(sgl.InsertParams(key=self._key(sequence), value=value))
        assert result.prefix_len == hit
        cache.unlock(lock)
        return hit


def build_cache(kind: str, capacity: int) -> tuple[Any, Any]:
    """A real SGLang cache with KV events on: ``radix`` (legacy ``RadixCache``) or
    ``unified-python`` / ``unified-rust`` (the server default, ``UnifiedRadixCache``,
    with its Python or Rust tree core). Returns (cache, allocator)."""
    sgl = import_sglang()
    torch = sgl.torch
    if kind == "radix":
        engine = SGLangRadix(capacity)
        return engine.cache, engine.allocator
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(
        size=capacity,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=capacity, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        tree_components=(ComponentType.FULL,),
        enable_kv_cache_events=True,
        tree_core_backend=kind.split("-", 1)[1],
    )
    return UnifiedRadixCache(params=params), allocator


def serve_tokens(cache: Any, allocator: Any, tokens: list[int]) -> int:
    """Serve one request on any SGLang cache: match, lock, evict, allocate, insert, unlock."""
    sgl = import_sglang()
    key = sgl.RadixKey(array("q", tokens))
    match = cache.match_prefix(sgl.MatchPrefixParams(key=key))
    lock = cache.lock(match.last_device_node)
    if len(tokens) > allocator.available_size():
        cache.evict(sgl.EvictParams(num_tokens=len(tokens) - allocator.available_size()))
    fresh = allocator.alloc(len(tokens))
    assert fresh is not None, "the request does not fit the cache"
    result = cache.insert(sgl.InsertParams(key=sgl.RadixKey(array("q", tokens)), value=fresh))
    if isinstance(cache, sgl.RadixCache):
        allocator.free(fresh[: result.prefix_len])  # already cached: give the copies back
    # (UnifiedRadixCache frees the duplicate slots itself, through its cache actions)
    cache.unlock(lock)
    return int(match.device_prefix_len)


def match_tokens(cache: Any, tokens: list[int]) -> int:
    sgl = import_sglang()
    return int(cache.match_prefix(sgl.MatchPrefixParams(key=sgl.RadixKey(array("q", tokens)))).device_prefix_len)


def block_workload(rng: random.Random) -> tuple[dict[int, int], dict[int, list[int]], dict[int, Block], list[float]]:
    """30 blocks of 1-3 tokens each (sizes drawn from ``rng``): sizes, token ids, blocks and
    Zipf-like popularity weights, for driving SGLang's cache and the index side by side."""
    sizes = {b: rng.randint(1, 3) for b in range(30)}
    tokens_of = {b: [1_000 * (b + 1) + j for j in range(sizes[b])] for b in sizes}
    blocks = {b: Block(id=str(b), text=f"block {b}", tokens=sizes[b]) for b in sizes}
    return sizes, tokens_of, blocks, [1 / (b + 1) for b in sizes]


def layout(order: list[str], tokens_of: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """The token ids of blocks sent in ``order``, and where each block ends."""
    tokens: list[int] = []
    ends = []
    for block_id in order:
        tokens += tokens_of[int(block_id)]
        ends.append(len(tokens))
    return tokens, ends
