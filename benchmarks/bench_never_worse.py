"""Never worse than retrieval order: a script, not a test.

Two measurements, each ContextPilot against the prompt a user sends without it (the
retriever's order, no labels, no order annotation):

1. the simulator (``whatif.replay``) on the bundled MultiHop-RAG sample, at every cache
   capacity from 0.2% to 100% of the working set, offline, online and chat: prefill
   tokens (prompt tokens not served from the cache) side by side, and their sign;
2. a real llama-server with ONE slot and no RAM cache (a fresh process per pass), the way
   a new user tries it: LangChain and LlamaIndex, offline (a burst through ``chain.batch``
   / ``asyncio.gather``, planned by a ``MicroBatcher``), online (one question after another)
   and chat (conversations interleaved by turn). Counted from the engine's own usage of
   every response: prompt tokens, cached tokens, computed = prompt - cached.

Only APIs that exist before and after issue 21 are used, so the script runs on either tree
(switch with ``PYTHONPATH``). It binds 127.0.0.1 only and stops its servers.

Usage: python benchmarks/bench_never_worse.py [--requests 24] [--chars 120] [--k 4]
       [--repeats 2] [--skip-engine] [--skip-simulator] [--labels-only] [--json]

``--labels-only``: what the block labels, the LlamaIndex label lines and the order annotation
cost, before issue 21 and now, in characters and llama-server tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from contextpilot_integrations import ContextPilot, MicroBatcher
from contextpilot_integrations.testing.llama_server import tiny_llama_server
from contextpilot_integrations.whatif.replay import PromptShape, replay
from contextpilot_integrations.whatif.trace import TraceRequest, multihop_chats, multihop_trace, working_set_tokens

CAPACITIES = (0.002, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)
SYSTEM = "Answer the question using the context documents."


# ---- 1. the simulator ---------------------------------------------------------------------------
@dataclass
class SimRow:
    mode: str
    capacity: float
    without: int
    with_contextpilot: int
    hit_without: float
    hit_with: float

    @property
    def sign(self) -> str:
        return "<=" if self.with_contextpilot <= self.without else "WORSE"


def simulator_sweep(capacities: Sequence[float], modes: Sequence[str]) -> list[SimRow]:
    """Prefill tokens without and with ContextPilot (the default strategy) per capacity."""
    single, chat = multihop_trace(), multihop_chats()
    shape = PromptShape()
    rows = []
    for mode in modes:
        trace = chat if mode == "chat" else single
        if mode == "chat":  # capacity: a share of what resending every block leaves in a cache that never evicts
            base = replay(trace, "retrieval", "chat", None, shape=shape, history_turns=4, deduplicate=False).held_tokens
        else:
            base = working_set_tokens(trace)
        for fraction in capacities:
            capacity = int(base * fraction)
            options: dict[str, Any] = {"shape": shape}
            if mode == "chat":
                options["history_turns"] = 4
            without = replay(trace, "retrieval", mode, capacity, deduplicate=False, **options)  # type: ignore[arg-type]
            ours = replay(trace, "trie", mode, capacity, **options)  # type: ignore[arg-type]
            rows.append(
                SimRow(mode, fraction, without.prefill_tokens, ours.prefill_tokens, without.hit_ratio, ours.hit_ratio)
            )
            print(f"  simulator {mode} {fraction:.1%}: done", file=sys.stderr)
    return rows


# ---- 0. what the labels and the annotation cost -------------------------------------------------
OLD_ORDER = "Please read the context in the following priority order: {order} and answer the question."
"""The order annotation before issue 21 (the paper's wording), labels ``Doc_<id>``."""
IDS = {
    "MultiHop-RAG chunk id": ["545", "26", "700", "25"],
    "LlamaIndex node id (uuid)": [f"3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a{n:02d}" for n in range(4)],
    "content hash (no id given)": ["557be7eca214f188", "9b1de4f3a6c07e21", "0c4e5a7b8d9f1e2a", "7a1b2c3d4e5f6071"],
}


def old_label(block_id: str) -> str:
    import hashlib
    import re

    if re.fullmatch(r"[A-Za-z0-9_.:-]{1,40}", block_id):
        return f"Doc_{block_id}"
    return f"Doc_{hashlib.sha256(block_id.encode()).hexdigest()[:12]}"


def label_costs(url: str | None) -> list[dict[str, Any]]:
    """Characters (and tokens of llama-server's tokenizer, where a server is given) of the labels
    of four blocks, the LlamaIndex label lines, and the order annotation, before and after."""
    from contextpilot_integrations import Block
    from contextpilot_integrations.core.annotations import render_order

    def tokens(text: str) -> int | None:
        if url is None:
            return None
        reply = httpx.post(url + "/tokenize", json={"content": text, "add_special": False}, timeout=60)
        return len(reply.json()["tokens"])

    rows = []
    for kind, ids in IDS.items():
        blocks = [Block(id=i, text="x") for i in ids]
        before = {
            "block labels": "".join(f"[{old_label(i)}] " for i in ids),
            "LlamaIndex label lines": "".join(f"contextpilot_label: {old_label(i)}\n\n" for i in ids),
            "order annotation": OLD_ORDER.format(order=" > ".join(f"[{old_label(i)}]" for i in reversed(ids))),
        }
        after = {
            "block labels": "".join(f"[{b.label}] " for b in blocks),
            "LlamaIndex label lines": "".join(f"ref: {b.label}\n\n" for b in blocks),
            "order annotation": render_order(list(reversed(blocks))),
        }
        for part in before:
            rows.append(
                {
                    "ids": kind,
                    "part": part,
                    "chars_before": len(before[part]),
                    "chars_after": len(after[part]),
                    "tokens_before": tokens(before[part]),
                    "tokens_after": tokens(after[part]),
                }
            )
    return rows


def print_label_costs(rows: Sequence[dict[str, Any]]) -> None:
    print("\nlabels and annotation of four blocks (tokens: llama-server's tokenizer, the tiny test model)")
    head = f"{'ids':<28}{'part':<24}{'chars before':>13}{'after':>7}{'tokens before':>15}{'after':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['ids']:<28}{r['part']:<24}{r['chars_before']:>13}{r['chars_after']:>7}"
            f"{r['tokens_before'] if r['tokens_before'] is not None else '-':>15}"
            f"{r['tokens_after'] if r['tokens_after'] is not None else '-':>7}"
        )


# ---- 2. llama-server, one slot ------------------------------------------------------------------
@dataclass
class Usage:
    """The engine's own counts over every chat completion of one pass."""

    calls: int = 0
    prompt: int = 0
    cached: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    def add(self, body: dict[str, Any]) -> None:
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        with self.lock:
            self.calls += 1
            self.prompt += int(usage.get("prompt_tokens") or 0)
            self.cached += int(cached)

    def merge(self, other: Usage) -> None:
        self.calls += other.calls
        self.prompt += other.prompt
        self.cached += other.cached

    def clients(self) -> tuple[httpx.Client, httpx.AsyncClient]:
        def record(response: httpx.Response) -> None:
            if response.request.url.path.endswith("/chat/completions") and response.status_code == 200:
                response.read()
                self.add(response.json())

        async def arecord(response: httpx.Response) -> None:
            if response.request.url.path.endswith("/chat/completions") and response.status_code == 200:
                await response.aread()
                self.add(response.json())

        return (
            httpx.Client(event_hooks={"response": [record]}, timeout=600),
            httpx.AsyncClient(event_hooks={"response": [arecord]}, timeout=600),
        )


@dataclass
class Workload:
    """Questions with the documents the retriever returns for each (the trace's top-k)."""

    single: list[TraceRequest]
    chat: list[list[TraceRequest]]
    k: int
    chars: int

    def documents(self, question: str) -> list[tuple[str, str]]:
        request = self._by_question[question]
        texts = request.texts or ()
        return [(block, text[: self.chars]) for block, text in list(zip(request.blocks, texts, strict=True))[: self.k]]

    def __post_init__(self) -> None:
        self._by_question = {r.question or r.id: r for r in [*self.single, *(t for c in self.chat for t in c)]}


def workload(requests: int, k: int, chars: int, conversations: int, turns: int) -> Workload:
    single = [r for r in multihop_trace(texts=True) if r.question][:requests]
    grouped: dict[str, list[TraceRequest]] = {}
    for request in multihop_trace(conversations=True, texts=True):
        if request.conversation is not None and request.question:
            grouped.setdefault(request.conversation, []).append(request)
    chats = [turns_of[:turns] for turns_of in grouped.values() if len(turns_of) >= turns][:conversations]
    return Workload(single, chats, k, chars)


def interleaved(chats: Sequence[Sequence[TraceRequest]]) -> Iterator[tuple[int, TraceRequest]]:
    """(conversation, turn request), round-robin by turn."""
    depth = 0
    while True:
        row = [(n, turns[depth]) for n, turns in enumerate(chats) if depth < len(turns)]
        if not row:
            return
        yield from row
        depth += 1


# ---- LangChain --------------------------------------------------------------------------------------
def lc_retriever(work: Workload) -> Any:
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class TraceRetriever(BaseRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
            return [Document(id=block, page_content=text) for block, text in work.documents(query)]

    return TraceRetriever()


def lc_llm(url: str, usage: Usage, ours: bool) -> Any:
    client, aclient = usage.clients()
    options = {"model": "tiny", "max_tokens": 4, "temperature": 0, "http_client": client, "http_async_client": aclient}
    if ours:
        from langchain_contextpilot import ChatSGLang

        return ChatSGLang(base_url=url + "/v1", **options)
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=url + "/v1", api_key="none", **options)  # type: ignore[arg-type]


def lc_chain(retriever: Any, llm: Any, ours: bool) -> Any:
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    if ours:
        from langchain_contextpilot import format_documents
    else:

        def format_documents(documents: Sequence[Any]) -> str:
            return "\n\n".join(d.page_content for d in documents)

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM + "\n\n{context}"), ("human", "{question}")])
    return {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | prompt | llm


def lc_pass(mode: str, work: Workload, url: str, usage: Usage, ours: bool) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    llm = lc_llm(url, usage, ours)
    retriever = lc_retriever(work)
    if mode == "chat":
        if ours:
            from langchain_contextpilot import ConversationalRAG

            rag = ConversationalRAG(retriever, llm, ContextPilot(), system_prompt=SYSTEM)
            for n, request in interleaved(work.chat):
                rag.invoke(request.question, config={"configurable": {"thread_id": f"c{n}"}})
            return
        history: dict[int, list[Any]] = {}
        for n, request in interleaved(work.chat):  # the same turns, every document sent again
            question = request.question or ""
            context = "\n\n".join(text for _, text in work.documents(question))
            user = f"{context}\n\nQuestion: {question}"
            kept = history.setdefault(n, [])
            answer = llm.invoke([SystemMessage(SYSTEM), *kept[-16:], HumanMessage(user)])
            kept += [HumanMessage(user), AIMessage(answer.content)]
        return
    if ours:
        from langchain_contextpilot import ContextPilotRetriever

        pilot: Any = MicroBatcher(ContextPilot()) if mode == "offline" else ContextPilot()
        retriever = ContextPilotRetriever(base_retriever=retriever, pilot=pilot)
    chain = lc_chain(retriever, llm, ours)
    questions = [r.question for r in work.single]
    if mode == "offline":
        chain.batch(questions, config={"max_concurrency": len(questions)})
    else:
        for question in questions:
            chain.invoke(question)


# ---- LlamaIndex -------------------------------------------------------------------------------------
def li_retriever(work: Workload) -> Any:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    class TraceRetriever(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            documents = work.documents(query_bundle.query_str)
            return [
                NodeWithScore(node=TextNode(id_=block, text=text), score=1.0 / (rank + 1))
                for rank, (block, text) in enumerate(documents)
            ]

    return TraceRetriever()


def li_llm(url: str, usage: Usage, ours: bool) -> Any:
    client, aclient = usage.clients()
    options = {
        "model": "tiny",
        "api_base": url + "/v1",
        "max_tokens": 4,
        "temperature": 0,
        "context_window": 8192,
        "http_client": client,
        "async_http_client": aclient,
    }
    if ours:
        from llama_index.postprocessor.contextpilot import SGLangLLM

        return SGLangLLM(**options)
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(api_key="none", is_chat_model=True, **options)


def li_pass(mode: str, work: Workload, url: str, usage: Usage, ours: bool) -> None:
    from llama_index.core.chat_engine import ContextChatEngine
    from llama_index.core.query_engine import RetrieverQueryEngine

    llm = li_llm(url, usage, ours)
    retriever = li_retriever(work)

    def postprocessors(pilot: Any) -> list[Any]:
        if not ours:
            return []
        from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor

        return [ContextPilotPostprocessor(pilot=pilot)]

    if mode == "chat":
        pilot = ContextPilot()
        engines = [
            ContextChatEngine.from_defaults(retriever=retriever, llm=llm, node_postprocessors=postprocessors(pilot))
            for _ in work.chat
        ]
        for n, request in interleaved(work.chat):
            engines[n].chat(request.question or "")
        return
    pilot = MicroBatcher(ContextPilot()) if mode == "offline" else ContextPilot()
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, node_postprocessors=postprocessors(pilot))
    questions = [r.question or "" for r in work.single]
    if mode == "offline":

        async def burst() -> None:
            await asyncio.gather(*(engine.aquery(q) for q in questions))

        asyncio.run(burst())
    else:
        for question in questions:
            engine.query(question)


# ---- the engine passes ------------------------------------------------------------------------------
@dataclass
class EngineRow:
    """Both arms of one workload, each run ``2 * repeats`` times (A B B A ...) and summed;
    ``spread``: how far the passes without ContextPilot differ (the same prompts: the
    arrival order of a concurrent burst changes what a one-slot cache shares, by a few
    tokens), times the passes summed, so that it compares with the sums."""

    framework: str
    mode: str
    without: Usage
    with_contextpilot: Usage
    spread: int = 0

    def as_json(self) -> dict[str, Any]:
        def counts(u: Usage) -> dict[str, int]:
            return {"calls": u.calls, "prompt": u.prompt, "cached": u.cached, "computed": u.computed}

        return {
            "framework": self.framework,
            "mode": self.mode,
            "without": counts(self.without),
            "with_contextpilot": counts(self.with_contextpilot),
            "spread_without": self.spread,
        }

    @property
    def sign(self) -> str:
        a, b = self.without.computed, self.with_contextpilot.computed
        return "<=" if b <= a else ("noise" if b - a <= self.spread else "WORSE")


@contextmanager
def fresh_server(workdir: Path) -> Iterator[str]:
    """One llama-server, one slot, no RAM cache: an empty cache for every pass."""

    def skip(reason: str) -> None:
        raise SystemExit(reason)

    server = tiny_llama_server(workdir, skip, "never-worse.log")
    try:
        yield server.url
    finally:
        server.stop()


def engine_passes(work: Workload, modes: Sequence[str], frameworks: Sequence[str], repeats: int = 1) -> list[EngineRow]:
    Runner = Callable[[str, Workload, str, Usage, bool], None]
    runners: dict[str, Runner] = {"langchain": lc_pass, "llamaindex": li_pass}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for framework in frameworks:
            for mode in modes:
                counts = {False: Usage(), True: Usage()}
                without: list[int] = []
                for ours in (False, True, True, False) * repeats:  # A B B A: drift hits both arms alike
                    usage = Usage()
                    started = time.perf_counter()
                    with fresh_server(Path(workdir)) as url:
                        runners[framework](mode, work, url, usage, ours)
                    counts[ours].merge(usage)
                    if not ours:
                        without.append(usage.computed)
                    name = "ContextPilot" if ours else "without"
                    print(f"  {framework} {mode} {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
                spread = (max(without) - min(without)) * len(without)
                rows.append(EngineRow(framework, mode, counts[False], counts[True], spread))
                print(f"  {json.dumps(rows[-1].as_json())}", file=sys.stderr)  # kept if a later pass fails
    return rows


# ---- the report -------------------------------------------------------------------------------------
def print_simulator(rows: Sequence[SimRow]) -> None:
    print("\nsimulator, bundled MultiHop-RAG sample: prefill tokens (prompt tokens not cached)")
    head = f"{'mode':<8}{'capacity':>9}{'without':>14}{'ContextPilot':>14}{'ratio':>8}{'hit w/o':>9}{'hit CP':>8}  sign"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.mode:<8}{r.capacity:>9.1%}{r.without:>14,}{r.with_contextpilot:>14,}"
            f"{r.with_contextpilot / max(r.without, 1):>8.3f}{r.hit_without:>9.1%}{r.hit_with:>8.1%}  {r.sign}"
        )


def print_engine(rows: Sequence[EngineRow]) -> None:
    print(
        "\nllama-server, one slot, no RAM cache, a fresh process per pass, A B B A (passes summed):"
        " the engine's own counts; spread = the passes without ContextPilot, max - min computed, x passes"
    )
    head = (
        f"{'framework':<11}{'mode':<9}{'calls':>6}{'prompt w/o':>12}{'cached w/o':>12}{'computed w/o':>14}"
        f"{'prompt CP':>11}{'cached CP':>11}{'computed CP':>13}{'CP/w/o':>8}{'spread':>8}  sign"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        a, b = r.without, r.with_contextpilot
        print(
            f"{r.framework:<11}{r.mode:<9}{a.calls:>6}{a.prompt:>12,}{a.cached:>12,}{a.computed:>14,}"
            f"{b.prompt:>11,}{b.cached:>11,}{b.computed:>13,}{b.computed / max(a.computed, 1):>8.3f}"
            f"{r.spread:>8,}  {r.sign}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=24, help="questions per single-shot pass")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="documents per question")
    parser.add_argument("--chars", type=int, default=120, help="characters kept of each document")
    parser.add_argument("--modes", default="offline,online,chat")
    parser.add_argument("--frameworks", default="langchain,llamaindex")
    parser.add_argument("--capacities", default=",".join(str(c) for c in CAPACITIES))
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--labels-only", action="store_true", help="only what the labels and annotation cost")
    parser.add_argument("--skip-simulator", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="A B B A blocks per workload")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    report: dict[str, Any] = {}
    if args.labels_only:
        with tempfile.TemporaryDirectory() as workdir, fresh_server(Path(workdir)) as url:
            costs = label_costs(url)
        if args.json:
            print(json.dumps({"labels": costs}, indent=2))
        else:
            print_label_costs(costs)
        return 0
    if not args.skip_simulator:
        sim = simulator_sweep([float(c) for c in args.capacities.split(",")], modes)
        report["simulator"] = [{**asdict(r), "sign": r.sign} for r in sim]
    if not args.skip_engine:
        work = workload(args.requests, args.k, args.chars, args.conversations, args.turns)
        engine = engine_passes(work, modes, [f for f in args.frameworks.split(",") if f], args.repeats)
        report["engine"] = [r.as_json() for r in engine]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not args.skip_simulator:
        print_simulator(sim)
    if not args.skip_engine:
        print_engine(engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
