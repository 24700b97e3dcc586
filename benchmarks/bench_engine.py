"""Backend benchmark on a real prefix-caching server (a script, not a test).

1. TTFT: the bundled MultiHop-RAG queries sent to llama.cpp's ``llama-server`` (built by
   ``scripts/build_llama_server.sh``, tiny random-weight GGUF written locally, CPU) twice:
   retrieval order, one query after another, vs. ContextPilot's order and schedule.
   Prints mean and p90 time-to-first-token and the server-reported cached tokens side by
   side. Target (issue 4): >= 2x lower mean TTFT.
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
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from contextpilot_integrations.whatif.engine_compare import compare_on_engine


def bench_ttft(args: argparse.Namespace) -> None:
    data = load_multihop_rag()
    requests = []
    for query in data.queries[: args.requests]:
        blocks = [b.model_copy(update={"text": b.text[: args.block_chars]}) for b in data.blocks_for(query)]
        requests.append((blocks, query.text))
    server = None
    url = args.url
    if url is None:
        from tests.engine_support import start_llama_server

        workdir = Path(tempfile.mkdtemp(prefix="cp-bench-"))
        server = start_llama_server(workdir, extra_args=("--cache-ram", str(args.cache_ram)))
        url = server.url
    try:
        baseline, ours = compare_on_engine(url, requests, progress=True)
    finally:
        if server is not None:
            server.stop()
    print(
        f"\n== TTFT on {'llama-server (tiny GGUF, CPU)' if server else url}: {len(requests)} queries, "
        f"15 chunks of <= {args.block_chars} chars =="
    )
    print(f"{'':<18}{'mean TTFT':>12}{'p90 TTFT':>12}{'cached / prompt tokens':>30}")
    for run in (baseline, ours):
        tokens = f"{run.cached_tokens:,} / {run.prompt_tokens:,} ({run.cached_ratio:.0%})"
        print(f"{run.name:<18}{run.mean_ttft_s * 1e3:>10.0f}ms{run.p90_ttft_s * 1e3:>10.0f}ms{tokens:>30}")
    print(
        f"mean TTFT ratio (retrieval / ContextPilot): {baseline.mean_ttft_s / ours.mean_ttft_s:.2f}x; "
        f"p90: {baseline.p90_ttft_s / ours.p90_ttft_s:.2f}x"
    )


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
    parser.add_argument("--url", help="use this running server instead of starting llama-server")
    parser.add_argument("--sync-requests", type=int, default=2_000)
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    bench_eviction_sync(args)
    if not args.skip_ttft:
        bench_ttft(args)


if __name__ == "__main__":
    main()
