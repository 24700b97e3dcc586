"""Backend benchmark on a real prefix-caching server (a script, not a test).

1. TTFT: the demo's engine comparison (``demo --engine-cmd``): the bundled MultiHop-RAG
   queries sent to llama.cpp's ``llama-server`` (built by ``scripts/build_llama_server.sh``,
   tiny random-weight GGUF written locally, CPU), offline, online and as interleaved chats,
   retrieval order against ContextPilot, A B B A, every pass on a fresh server. Prints mean,
   p50 and p90 time to first token and the server-reported cached tokens side by side.
2. Eviction sync latency: SGLang's real RadixCache under capacity pressure publishes its
   KV events through our plugin publisher over HTTP to the callback server; prints the
   p50/p99 time from publish to index updated. Target: p99 <= 50 ms.

Usage: python benchmarks/bench_engine.py [--requests 200] [--block-chars 250] [--cache-ram MiB]
       [--url URL]  (an already running server instead of starting llama-server)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import EvictionListener


def bench_ttft(args: argparse.Namespace) -> None:
    """The demo's engine comparison: every pass on a fresh llama-server (or a flushed --url)."""
    from contextpilot_integrations.whatif.cli import main as cli
    from contextpilot_integrations.whatif.llama_server import LlamaServer, llama_server_binary, write_tiny_gguf

    engine = ["--engine", args.url] if args.url else []
    if not args.url:
        binary = llama_server_binary()
        if binary is None:
            raise SystemExit("llama-server is not built: run scripts/build_llama_server.sh")
        model = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="cp-bench-")) / "tiny.gguf")
        engine = ["--engine-cmd", LlamaServer.command(binary, model, ("--cache-ram", str(args.cache_ram)))]
    demo = ["demo", "--capacity", "0.25", "--no-plot", "--quiet", "--engine-requests", str(args.requests)]
    sizes = ["--engine-block-chars", str(args.block_chars), "--engine-modes", args.modes, "--answer-tokens", "16"]
    cli([*demo, *sizes, *engine])


def bench_eviction_sync(args: argparse.Namespace) -> None:
    from tests.sglang_support import build_cache, import_sglang, serve_tokens

    import_sglang()
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    rng = random.Random(5)
    sizes = {b: rng.randint(2, 8) for b in range(400)}
    blocks = {b: Block(id=str(b), text=f"block {b}", tokens=sizes[b]) for b in sizes}
    weights = [1 / (b + 1) for b in sizes]
    cache, allocator = build_cache("unified-rust", capacity=400)
    cache.take_events()
    pilot = ContextPilot()
    with EvictionListener(pilot, page_size=1) as listener:
        config = json.dumps({"publisher": "contextpilot_http", "endpoint": listener.kv_events_url})
        publisher = EventPublisherFactory.create(config, 0)
        removed = 0
        for _ in range(args.sync_requests):
            chosen = list(dict.fromkeys(rng.choices(list(sizes), weights, k=8)))
            prepared = pilot.prepare([blocks[b] for b in chosen], "q")
            tokens, ends = [], []
            for block in prepared.blocks:
                tokens += [10_000 * (int(block.id) + 1) + j for j in range(sizes[int(block.id)])]
                ends.append(len(tokens))
            serve_tokens(cache, allocator, tokens)
            listener.sink.track(prepared.request_id, tokens, ends)
            events = cache.take_events()
            removed += sum(type(e).__name__ == "BlockRemoved" for e in events)
            if events:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
            time.sleep(0.002)  # a scheduler step
        publisher.flush()
        time.sleep(0.1)
        stats = listener.sink.stats()
        publisher.shutdown()
    print(
        f"\n== eviction sync: SGLang UnifiedRadixCache (rust core) -> plugin -> HTTP -> index, "
        f"{args.sync_requests} requests =="
    )
    print(
        f"batches {stats.batches}, events {stats.events} ({removed} BlockRemoved), gaps {stats.sequence_gaps}, "
        f"requests shortened {stats.requests_shortened}"
    )
    print(f"publish -> index updated: p50 {stats.latency_p50_ms:.2f} ms, p99 {stats.latency_p99_ms:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--block-chars", type=int, default=250, help="cut chunks so 15 fit the tiny model's context")
    parser.add_argument("--cache-ram", type=int, default=0, help="llama-server --cache-ram (MiB of prompt cache)")
    parser.add_argument("--url", help="use this running server (it must support /flush_cache) instead of llama-server")
    parser.add_argument("--modes", default="offline,online,chat", help="modes compared on the server")
    parser.add_argument("--sync-requests", type=int, default=2_000)
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    bench_eviction_sync(args)
    if not args.skip_ttft:
        bench_ttft(args)


if __name__ == "__main__":
    main()
