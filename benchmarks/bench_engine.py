"""Backend benchmark on real prefix-caching servers (a script, not a test).

1. The demo's engine comparison (``demo --engine-cmd``) on each engine of ``--engines``:
   llama.cpp's ``llama-server`` (built by ``scripts/build_llama_server.sh``, tiny
   random-weight GGUF, one slot, no RAM cache: a fresh server for every pass), live SGLang
   and live vLLM (``scripts/setup_live_engine.sh``, tiny random-weight HF Llama, one server
   flushed before every pass, a KV pool of ``--kv-tokens``), all on CPU. The bundled
   MultiHop-RAG queries offline, online and as interleaved chats, without ContextPilot
   (the texts in retrieval order, no labels, no annotation) against ContextPilot, A B B A
   (``--passes 2``: A B, for long runs; token counts do not drift between passes, times may).
   Prints, per engine and mode, the engine's own prompt, cached and computed (prompt -
   cached) tokens side by side, and time to first token only as a ratio within the run;
   beside each arm's computed tokens, the simulator's for the very same requests (the
   engine's tokenizer, page size and KV pool; SGLang and vLLM) and the gap between them.
2. Eviction sync latency: SGLang's real RadixCache under capacity pressure publishes its
   KV events through our plugin publisher over HTTP to the callback server; prints the
   p50/p99 time from publish to index updated. Target: p99 <= 50 ms.

Sizes (defaults): 40 requests (chat: turns) per pass, chunks cut to 200 characters (the
tiny models read about one token a character: ~3.3k-token single-shot prompts), chats
keep 1 earlier turn and answer 16 tokens; 3 modes x 4 passes x 40 = 480 requests an
engine, a few minutes each on 2 CPU cores.

Usage: python benchmarks/bench_engine.py [--engines llama-server,sglang,vllm] [--model tiny|real] [--requests 40]
       [--block-chars 200] [--passes 4|2] [--kv-tokens 16384] [--cache-ram MiB] [--skip-sync]
       [--url URL]  (an already running server instead, flushed before every pass)"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import EvictionListener

ENGINES = ("llama-server", "sglang", "vllm")


def engine_command(engine: str, args: argparse.Namespace) -> str:
    """The ``--engine-cmd`` for one engine, with the tiny model or the real one (``--model``)."""
    if engine == "llama-server":
        from contextpilot_integrations.testing.llama_server import LlamaServer, llama_server_binary, write_tiny_gguf
        from contextpilot_integrations.testing.real_model import real_model_gguf

        binary = llama_server_binary()
        if binary is None:
            raise SystemExit("llama-server is not built: run scripts/build_llama_server.sh")
        if args.model == "real":
            model = real_model_gguf()
            if model is None:
                raise SystemExit("the real model is not assembled: run scripts/fetch_real_model.sh")
        else:
            model = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="cp-bench-")) / "tiny.gguf")
        # one thread (-t, last one wins): on the shared 2-core machine two threads spin-wait for
        # each other at every op; the prefix cache is the same either way
        context = ("-c", "16384") if args.model == "real" else ()
        return LlamaServer.command(binary, model, ("--cache-ram", str(args.cache_ram), "-t", "1", *context))
    from contextpilot_integrations.testing.live_engines import live_engine_command, require_live_engine
    from contextpilot_integrations.testing.real_model import real_model_hf

    def missing(reason: str) -> None:
        raise SystemExit(reason)

    hf = real_model_hf() if args.model == "real" else None
    if args.model == "real" and hf is None:
        raise SystemExit("the real model is not converted for vLLM and SGLang: run scripts/convert_real_model.sh")
    where = require_live_engine(engine, missing)
    return live_engine_command(engine, where, kv_tokens=args.kv_tokens, context=8192, model=hf)


def compare(engine: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The demo's engine comparison on one engine (or ``--url``), as its JSON report."""
    from contextpilot_integrations.whatif.cli import main as cli

    target = ["--engine", args.url] if args.url else ["--engine-cmd", engine_command(engine or "", args)]
    demo = ["demo", "--modes", "offline", "--capacity", "0.25", "--strategies", "retrieval,trie", "--no-plot"]
    sizes = ["--engine-requests", str(args.requests), "--engine-block-chars", str(args.block_chars)]
    sizes += ["--engine-modes", args.modes, "--engine-passes", str(args.passes)]
    sizes += ["--history-turns", "1", "--answer-tokens", "16", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli([*demo, *sizes, *target])
    if code:
        raise SystemExit(f"the comparison on {engine or args.url} failed (exit {code})")
    report: dict[str, Any] = json.loads(out.getvalue())["engine"]
    return report


def bench_engines(args: argparse.Namespace) -> None:
    order, summed = (
        ("A B B A", "both passes of an arm") if args.passes == 4 else ("A B (two passes)", "one pass an arm")
    )
    print(
        f"\n== engine comparison: {args.requests} requests a pass, chunks of {args.block_chars} characters, "
        f"{order}, every pass on an empty cache; tokens summed over {summed} =="
    )
    head = (
        f"{'engine':<13}{'mode':<9}{'prompt w/o':>12}{'prompt with':>13}{'cached w/o':>12}{'cached with':>13}"
        f"{'computed w/o':>14}{'computed with':>15}{'ratio':>7}{'TTFT w/o:with':>15}"
        f"{'simulator w/o':>15}{'gap':>7}{'simulator with':>16}{'gap':>7}"
    )
    print(head)
    print("-" * len(head), flush=True)
    for engine in [None] if args.url else args.engines.split(","):
        print(f"comparing on {engine or args.url} ...", file=sys.stderr, flush=True)
        report = compare(engine, args)
        for mode, data in report["modes"].items():  # each engine's rows as soon as it is done
            base, ours = data["retrieval_order"], data["contextpilot"]
            ttft = f"{data['mean_ttft_ratio']:.2f}" if data["mean_ttft_ratio"] else "-"
            ratio = f"{data['computed_ratio']:.2f}" if data["computed_ratio"] is not None else "-"
            simulated = ""
            for arm, width in ((base, 15), (ours, 16)):
                value, gap = arm.get("simulator_computed_tokens"), arm.get("simulator_gap")
                simulated += f"{f'{value:,}' if value is not None else '-':>{width}}"
                simulated += f"{f'{gap:+.1%}' if gap is not None else '-':>7}"
            print(
                f"{report['engine']:<13}{mode:<9}{base['prompt_tokens']:>12,}{ours['prompt_tokens']:>13,}"
                f"{base['cached_tokens']:>12,}{ours['cached_tokens']:>13,}{base['computed_tokens']:>14,}"
                f"{ours['computed_tokens']:>15,}{ratio:>7}{ttft:>15}{simulated}"
            )
            print(f"{'':<22}cached {base['cached_ratio']:.1%} without, {ours['cached_ratio']:.1%} with ContextPilot")
            if data.get("engine_prompt_ms_ratio"):  # llama-server's own timings
                seconds = [arm["engine_prompt_ms"] / 1e3 for arm in (base, ours)]
                print(
                    f"{'':<22}prefill by the engine's own timings: {seconds[0]:.1f} s without, {seconds[1]:.1f} s "
                    f"with ContextPilot a pass (x{data['engine_prompt_ms_ratio']:.2f})"
                )
        print(f"{'':<13}({report['clean_cache']}; order {report['order']})", flush=True)
    print("ratio: computed prompt tokens with / without ContextPilot (below 1: ContextPilot computes fewer)")
    print("simulator: its computed tokens for the same requests; gap: simulator / engine - 1")


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
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    parser.add_argument("--requests", type=int, default=40, help="requests (chat: turns) per pass")
    parser.add_argument("--block-chars", type=int, default=200, help="cut chunks so prompts fit the tiny models")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV pool of live SGLang and vLLM, in tokens")
    parser.add_argument("--cache-ram", type=int, default=0, help="llama-server --cache-ram (MiB of prompt cache)")
    parser.add_argument("--url", help="use this running server (it must flush its cache) instead of --engines")
    parser.add_argument(
        "--model",
        choices=("tiny", "real"),
        default="tiny",
        help="tiny: random weights, about a token a character; real: Gemma 3 270M (vLLM and SGLang: after "
        "scripts/convert_real_model.sh)",
    )
    parser.add_argument("--modes", default="offline,online,chat", help="modes compared on the server")
    parser.add_argument("--passes", type=int, choices=(4, 2), default=4, help="4: A B B A; 2: A B (long runs)")
    parser.add_argument("--sync-requests", type=int, default=2_000)
    parser.add_argument("--skip-sync", action="store_true", help="skip the eviction-sync latency")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the engine comparison")
    args = parser.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines: {', '.join(sorted(unknown))}")
    if not args.skip_sync:
        bench_eviction_sync(args)
    if not args.skip_ttft:
        bench_engines(args)


if __name__ == "__main__":
    main()
