"""What hosted APIs' prompt caches would bill, with and without ContextPilot (a script, not a test).

On the bundled MultiHop-RAG trace (2,556 queries, BM25 top-15 chunks of up to 1,024
tokens) and on its chat variant (queries grouped by their first evidence article into
conversations, 4 earlier turns kept), through the cache model of each provider
(``contextpilot_integrations.whatif.provider_sim``: minimum length, markers and the
20-block look-back, OpenAI's 128-token increments, TTL by arrival time), priced with
``DEFAULT_PRICES`` (writes included). Side by side, per provider and mode:

* retrieval order: the retriever's order, no annotation, every chat block resent, with the
  markers a user sends without ContextPilot (Anthropic/Bedrock: ``system``, a marker on the
  system prompt; ``auto``, one on the last block as automatic caching places it);
* published contextpilot: ContextPilot's order, but only the system prompt marked (what
  the published proxy marks on Anthropic; it sets no OpenAI ``prompt_cache_key``, which
  this model does not need, so on OpenAI and Gemini it equals the next row);
* ContextPilot: the order, chat de-duplication and the markers of ``plan_cache``;
* bound (single-shot modes): every token of a block some earlier request sent read from
  the cache, nothing written (no ordering or marking can do better).

Usage: python benchmarks/bench_providers.py [--rate 1] [--providers anthropic,bedrock,openai,gemini]
"""

from __future__ import annotations

import argparse
import time

from contextpilot_integrations.providers import DEFAULT_PRICES, PRICES_AS_OF, ProviderUsage, cost_of
from contextpilot_integrations.providers.names import check_provider
from contextpilot_integrations.whatif import PromptShape, multihop_chats, multihop_trace
from contextpilot_integrations.whatif.provider_sim import provider_runs
from contextpilot_integrations.whatif.replay import reuse_bound_of_prompts

MODELS = {
    "anthropic": ["claude-sonnet-4-5"],
    "bedrock": ["anthropic.claude-sonnet-4-5", "amazon.nova-pro-v1:0"],
    "openai": ["gpt-5", "gpt-5.6-terra"],
    "gemini": ["gemini-2.5-flash"],
}
HISTORY_TURNS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.0, help="requests a second (the traces have no time stamps)")
    parser.add_argument("--providers", default="anthropic,bedrock,openai,gemini")
    args = parser.parse_args()
    single, chat = multihop_trace(), multihop_chats()
    shape = PromptShape()
    bound = reuse_bound_of_prompts(single, shape)
    print(f"MultiHop-RAG sample: {len(single):,} queries; chat: {len(chat):,} turns in conversations, "
          f"{HISTORY_TURNS} earlier turns kept; {args.rate:g} request/s; prices as of {PRICES_AS_OF}")  # fmt: skip
    print(f"{'provider / model':<34} {'mode':<8} {'run':<50} {'Mtok':>7} {'read':>6} {'written':>7} "
          f"{'cost $':>8} {'vs retrieval':>12}")  # fmt: skip
    started = time.perf_counter()
    for name in args.providers.split(","):
        provider = check_provider(name)
        for model in MODELS[provider]:
            every = provider_runs(single, chat, provider, model, ["offline", "online", "chat"], shape=shape,
                                  history_turns=HISTORY_TURNS, rate=args.rate, published=True)  # fmt: skip
            for mode in ("offline", "online", "chat"):
                runs = [run for run in every if run.mode == mode]
                reference = min(run.cost for run in runs if run.label.startswith("retrieval"))
                for run in runs:
                    label = run.label
                    if label == "ContextPilot, system marker":
                        label = "published contextpilot (order, system marker)"
                    elif label == "ContextPilot":
                        label = "ContextPilot (order, planned markers, chat de-dup)"
                    _row(provider, model, mode, label, run.prompt_tokens, run.read_tokens, run.write_tokens,
                         run.cost, reference)  # fmt: skip
                if mode != "chat":
                    prompt = runs[0].prompt_tokens
                    reusable = int(prompt * bound)
                    cost = cost_of(ProviderUsage(prompt, reusable, 0, provider), model, prices=DEFAULT_PRICES)
                    _row(provider, model, mode, "bound (earlier blocks all read, no writes)", prompt, reusable, 0, cost,
                         reference)  # fmt: skip
    print(f"({time.perf_counter() - started:.0f} s)")


def _row(provider: str, model: str, mode: str, label: str, prompt: int, read: int, write: int, cost: float,
         reference: float) -> None:  # fmt: skip
    saved = f"{1 - cost / reference:+.1%}" if reference else ""
    print(f"{provider + ' / ' + model:<34} {mode:<8} {label:<50} {prompt / 1e6:>7.2f} {read / prompt:>6.1%} "
          f"{write / prompt:>7.1%} {cost:>8.2f} {saved:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
