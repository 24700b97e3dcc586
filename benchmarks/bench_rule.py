"""The send rule on traffic it was not tuned on: a script, not a test.

Three generated workloads, unlike the bundled MultiHop-RAG sample (15 blocks of ~600 tokens):

- ``memory``: questions over 10 users' long chat histories, 20 retrieved snippets of
  ~35 tokens a request, recurrence scattered (a topic's snippets come back in another
  subset and order each time);
- ``passage``: 15 passages of ~270 tokens a request, topic clusters, sessions interleaved;
- ``chat``: the memory snippets as long conversations (40 turns), a topic drifting slowly.

Each is run through the project's own simulator (``whatif.replay``, every prompt token
counted) offline, online and chat at 1%, 5%, 25% and 100% of the working set, with and
without ContextPilot. ``--sample`` adds the bundled sample; ``--forms`` prints what each
annotation form costs (issue 29's ``order_form``). Only APIs older than issue 29 are used by the
sweep, so it runs on either tree (switch with ``PYTHONPATH``).

Usage: python benchmarks/bench_rule.py [--workloads memory,passage,chat] [--requests 1200]
       [--modes offline,online,chat] [--capacities 0.01,0.05,0.25,1] [--sample] [--json]
       python benchmarks/bench_rule.py --forms
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

from contextpilot_integrations.whatif.replay import PromptShape, replay
from contextpilot_integrations.whatif.trace import TraceRequest, multihop_chats, multihop_trace, working_set_tokens

CAPACITIES = (0.01, 0.05, 0.25, 1.0)
MODES = ("offline", "online", "chat")


def _topic_pick(rng: random.Random, topic: Sequence[str], others: Sequence[str], k: int, spill: float) -> list[str]:
    """``k`` distinct ids, best first: most from the topic (a random subset in a noisy
    relevance order), ``spill`` of them from elsewhere (popular ones more often)."""
    outside = min(len(others), sum(rng.random() < spill for _ in range(k)))
    inside = min(len(topic), k - outside)
    picked = rng.sample(list(topic), inside)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(others))]
    while len(picked) < inside + outside:
        choice = rng.choices(others, weights)[0]
        if choice not in picked:
            picked.append(choice)
    rng.shuffle(picked)  # the retriever's ranking mixes them
    return picked


def memory_trace(requests: int = 1200, seed: int = 1, users: int = 10, turns: int = 0) -> list[TraceRequest]:
    """Questions over users' chat histories (snippets of 20-50 tokens, 20 a request).

    ``turns``: group each user's questions into conversations of that many turns (chat)."""
    rng = random.Random(seed)
    snippets = {u: [f"m{u}.{k}" for k in range(360)] for u in range(users)}
    tokens = {s: rng.randint(20, 50) for ids in snippets.values() for s in ids}
    topics = {u: [ids[t : t + 30] for t in range(0, len(ids), 30)] for u, ids in snippets.items()}
    out = []
    count: dict[int, int] = {}
    topic_of: dict[int, int] = {}
    for i in range(requests):
        user = rng.randrange(users)
        n = count.get(user, 0)
        count[user] = n + 1
        if n == 0 or rng.random() < (0.15 if turns else 0.6):  # a chat drifts slowly; questions jump
            topic_of[user] = rng.randrange(len(topics[user]))
        topic = topics[user][topic_of[user]]
        blocks = _topic_pick(rng, topic, snippets[user], 20, 0.3)
        conversation = f"u{user}-c{n // turns}" if turns else None
        out.append(
            TraceRequest(
                id=f"q{i}",
                blocks=tuple(blocks),
                tokens=tuple(tokens[b] for b in blocks),
                question=f"what did user {user} say about topic {topic_of[user]}, question {i}?",
                session=f"u{user}",
                conversation=conversation,
            )
        )
    return out


def passage_trace(requests: int = 1200, seed: int = 2) -> list[TraceRequest]:
    """15 passages of 200-340 tokens a request, topic clusters of 40 over 3,000 passages."""
    rng = random.Random(seed)
    passages = [str(10_000 + k) for k in range(3000)]
    tokens = {p: rng.randint(200, 340) for p in passages}
    topics = [passages[t : t + 40] for t in range(0, len(passages), 40)]
    popular = [rng.randrange(len(topics)) for _ in range(30)]  # Zipf-ish: some topics come back often
    out = []
    for i in range(requests):
        topic = topics[rng.choice(popular) if rng.random() < 0.7 else rng.randrange(len(topics))]
        blocks = _topic_pick(rng, topic, passages, 15, 0.2)
        out.append(
            TraceRequest(
                id=f"p{i}",
                blocks=tuple(blocks),
                tokens=tuple(tokens[b] for b in blocks),
                question=f"passage question {i}",
                session=f"s{i % 8}",
                conversation=f"s{i % 8}-c{i // 40}",
            )
        )
    return out


WORKLOADS: dict[str, Callable[[int], list[TraceRequest]]] = {
    "memory": lambda n: memory_trace(n, turns=20),
    "passage": passage_trace,
    "chat": lambda n: memory_trace(n, seed=3, users=6, turns=40),
}


def sweep(
    name: str, trace: Sequence[TraceRequest], modes: Sequence[str], capacities: Sequence[float]
) -> list[dict[str, Any]]:
    """Prefill tokens without and with ContextPilot per mode and capacity."""
    shape = PromptShape()
    rows = []
    for mode in modes:
        options: dict[str, Any] = {"shape": shape}
        if mode == "chat":
            options["history_turns"] = 4
            base = replay(trace, "retrieval", "chat", None, deduplicate=False, **options).held_tokens
        else:
            base = working_set_tokens(trace)
        for fraction in capacities:
            capacity = max(1, int(base * fraction))
            without = replay(trace, "retrieval", mode, capacity, deduplicate=False, **options)  # type: ignore[arg-type]
            ours = replay(trace, "trie", mode, capacity, **options)  # type: ignore[arg-type]
            rows.append(
                {
                    "workload": name,
                    "mode": mode,
                    "capacity": fraction,
                    "without": without.prefill_tokens,
                    "with": ours.prefill_tokens,
                    "change": ours.prefill_tokens / without.prefill_tokens - 1,
                    "hit_without": without.hit_ratio,
                    "hit_with": ours.hit_ratio,
                }
            )
            print(f"  {name} {mode} {fraction:.0%}: done", file=sys.stderr)
    return rows


def form_costs(name: str, trace: Sequence[TraceRequest], requests: int = 300) -> list[dict[str, Any]]:
    """What each annotation form adds to a reordered request (labels and annotation, four
    characters a token as the simulator counts), against its block tokens: every request
    sent in the trie strategy's order of a pilot in that form."""
    from contextpilot_integrations import Block, ContextPilot
    from contextpilot_integrations.core.gain import annotation_tokens, label_tokens

    rows = []
    for form in ("labels", "positions", "moved"):
        pilot = ContextPilot(order_form=form)  # type: ignore[arg-type]
        added = blocks = reordered = 0
        for request in trace[:requests]:
            ranking = [
                Block(id=b, text=b, tokens=t) for b, t in zip(request.blocks, request.token_counts(), strict=True)
            ]
            order = pilot._strategy.order(request.id, [b.id for b in ranking])
            by_id = {b.id: b for b in ranking}
            sent = [by_id[key] for key in order]
            blocks += sum(b.token_count for b in ranking)
            if sent == ranking:
                continue
            reordered += 1
            added += annotation_tokens(ranking, pilot.templates, sent, form)  # type: ignore[arg-type]
            if form == "labels":
                added += label_tokens(ranking, pilot.templates)
        rows.append(
            {
                "workload": name,
                "form": form,
                "reordered": reordered,
                "added_per_request": added / max(reordered, 1),
                "share_of_blocks": added / blocks,
            }
        )
    return rows


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    print("| workload | mode | capacity | prefill w/o | prefill with | change | hit w/o -> with |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        flag = "" if r["with"] <= r["without"] else " **WORSE**"
        print(
            f"| {r['workload']} | {r['mode']} | {r['capacity']:.0%} | {r['without']:,} | {r['with']:,} | "
            f"{r['change']:+.1%}{flag} | {r['hit_without']:.1%} -> {r['hit_with']:.1%} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="memory,passage,chat")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    parser.add_argument("--sample", action="store_true", help="the bundled MultiHop-RAG sample too")
    parser.add_argument("--forms", action="store_true", help="what each annotation form costs, then exit")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.forms:
        print("| workload | form | requests reordered | tokens added a reordered request | of all block tokens |")
        print("|---|---|---|---|---|")
        traces = {"multihop": multihop_trace(), **{n: WORKLOADS[n](args.requests) for n in ("memory", "passage")}}
        for name, trace in traces.items():
            for r in form_costs(name, trace):
                print(
                    f"| {name} | {r['form']} | {r['reordered']} | {r['added_per_request']:.1f} | "
                    f"{r['share_of_blocks']:.2%} |"
                )
        return 0
    modes = [m for m in args.modes.split(",") if m]
    capacities = [float(c) for c in args.capacities.split(",") if c]
    rows: list[dict[str, Any]] = []
    for name in [w for w in args.workloads.split(",") if w]:
        rows += sweep(name, WORKLOADS[name](args.requests), modes, capacities)
    if args.sample:
        single, chats = multihop_trace(), multihop_chats()
        for mode in modes:
            rows += sweep("multihop", chats if mode == "chat" else single, [mode], capacities)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(rows)
    worse = [r for r in rows if r["with"] > r["without"]]
    print(f"{len(rows) - len(worse)} of {len(rows)} cells never worse", file=sys.stderr)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
