"""Drop-in without loss, measured on a real llama-server (a script, not a test).

For each wiring a user would copy from the README or the frameworks' docs, every request
body that leaves for the server is recorded (httpx request hooks on the model's own
clients), and two things are counted:

- dangling references: location references ("Please refer to [Doc_k] in the previous
  conversation.") whose block text ("[Doc_k] ...") is not earlier in the same request's
  messages: the model is told to look for a document it never sees;
- misattributed calls: calls whose request id sent is not the id of the request prepared
  for that very call (duplicates, another user's id, a fresh id while the prepared request
  is never reported back). The prepared id is read where the components hand it out: the
  documents' ``metadata["contextpilot"]["request_id"]`` (LangChain, through a callback on
  the retriever run) and ``ContextPilotEvent`` (LlamaIndex, through the instrumentation
  dispatcher, in the calling thread). Each user's question carries a unique marker
  (``ZQ017``), found again in the last user message of the body sent.

Wirings: the README's LCEL chain (two turns, one thread id); the same through
``ContextualCompressionRetriever``; a LangGraph node that puts the context in the system
message; LlamaIndex's stock ``ContextChatEngine`` with the postprocessor (three turns);
``--users`` concurrent users on one pilot (LangChain chain, LlamaIndex query engine, a
two-replica ``Router``); ``chain.batch`` of one question ``--batch`` times.

Only APIs that exist before and after the redesign of issue 19 are used, so the script runs
on either tree (switch with ``PYTHONPATH``). It binds 127.0.0.1 only and stops its servers.

Usage: python benchmarks/bench_drop_in.py [--users 50] [--batch 8] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda, RunnablePassthrough
from pydantic import ConfigDict
from rank_bm25 import BM25Okapi

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.testing.llama_server import tiny_llama_server
from contextpilot_integrations.whatif.datasets import load_multihop_rag

try:
    from contextpilot_integrations.testing.invariants import dangling_references
except ImportError:  # the tree before issue 19: the same check, with the default templates

    def dangling_references(texts: Sequence[str]) -> list[str]:
        """Labels of location references whose block is not rendered before them."""
        pattern = re.compile(re.escape("Please refer to [") + r"(.+?)" + re.escape("] in the previous conversation."))
        joined = "\n".join(texts)
        return [m.group(1) for m in pattern.finditer(joined) if f"[{m.group(1)}] " not in joined[: m.start()]]


QUESTION = "Who is the individual associated with the cryptocurrency industry facing a criminal trial?"
MARKER = re.compile(r"ZQ\d{3}")
"""A user's marker: a token no chunk contains, so BM25 ranks the same documents for all."""
K = 4
MAX_CHARS = 120
SYSTEM = "Answer the question using the context documents.\n\n{context}"

_current_marker: ContextVar[str | None] = ContextVar("bench_marker", default=None)
"""The marker of the question this thread is asking (LlamaIndex events carry no query)."""


def ask(n: int) -> str:
    return f"ZQ{n:03d} {QUESTION}"


def marker_of(text: str) -> str | None:
    found = MARKER.findall(text)
    return found[-1] if found else None


# ---- data ------------------------------------------------------------------------------------
CHUNKS = [chunk for _, chunk in zip(range(400), load_multihop_rag().chunks.values(), strict=False)]
_BM25 = BM25Okapi([chunk.text.lower().split() for chunk in CHUNKS])


class BM25ChunkRetriever(BaseRetriever):
    """BM25 over the first 400 bundled MultiHop-RAG chunks (as the adapter's tests use)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    k: int = K
    max_chars: int | None = MAX_CHARS

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
        scores = _BM25.get_scores(query.lower().split())
        best = sorted(range(len(CHUNKS)), key=lambda i: -scores[i])[: self.k]
        return [
            Document(id=CHUNKS[i].id, page_content=CHUNKS[i].text[: self.max_chars], metadata={"title": "t"})
            for i in best
        ]


# ---- what was prepared, what was sent ----------------------------------------------------------
@dataclass
class Tally:
    """Prepared requests (marker, id, documents) and bodies sent, for one wiring."""

    prepared: list[tuple[str | None, str, int]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_body(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/chat/completions"):
            with self.lock:
                self.bodies.append(json.loads(request.content))

    def record_prepared(self, marker: str | None, request_id: str, documents: int) -> None:
        with self.lock:
            self.prepared.append((marker, request_id, documents))

    def hooks(self) -> tuple[httpx.Client, httpx.AsyncClient]:
        async def record(request: httpx.Request) -> None:
            self.record_body(request)

        return (
            httpx.Client(event_hooks={"request": [self.record_body]}, timeout=120),
            httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120),
        )


def _texts(body: dict[str, Any]) -> list[str]:
    out = []
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append(content if isinstance(content, str) else "")
    return out


def _body_marker(body: dict[str, Any]) -> str | None:
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    return marker_of(_texts({"messages": users[-1:]})[0]) if users else None


@dataclass
class Row:
    wiring: str
    calls: int
    documents: int
    references: int
    dangling: int
    misattributed: int
    distinct_ids_sent: int
    seconds: float
    error: str | None = None

    def cells(self) -> list[str]:
        if self.error:
            return [self.wiring, "error", self.error[:60]]
        return [
            self.wiring,
            f"{self.dangling} / {self.documents} (refs {self.references})",
            f"{self.misattributed} of {self.calls} (distinct ids {self.distinct_ids_sent})",
        ]


def score(name: str, tally: Tally, seconds: float) -> Row:
    """Dangling references and misattributed calls: per marker, the calls whose sent id no
    prepared request of that marker accounts for (a multiset match, so that identical
    questions of ``batch`` count only duplicates and strangers)."""
    sent: dict[str | None, Counter[str]] = {}
    for body in tally.bodies:
        sent.setdefault(_body_marker(body), Counter())[str(body.get("rid"))] += 1
    prepared: dict[str | None, Counter[str]] = {}
    for marker, request_id, _ in tally.prepared:
        prepared.setdefault(marker, Counter())[request_id] += 1
    wrong = 0
    for marker in set(sent) | set(prepared):
        ours, theirs = sent.get(marker, Counter()), prepared.get(marker, Counter())
        wrong += max(sum(ours.values()), sum(theirs.values())) - sum((ours & theirs).values())
    texts = [_texts(body) for body in tally.bodies]
    return Row(
        wiring=name,
        calls=len(tally.bodies),
        documents=sum(documents for _, _, documents in tally.prepared),
        references=sum("\n".join(t).count("Please refer to ") for t in texts),
        dangling=sum(len(dangling_references(t)) for t in texts),
        misattributed=wrong,
        distinct_ids_sent=len({str(body.get("rid")) for body in tally.bodies}),
        seconds=seconds,
    )


class PreparedTap(BaseCallbackHandler):
    """The request id each ContextPilot retriever run handed out, with its query's marker."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.queries: dict[UUID, str] = {}

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, **kwargs: Any) -> None:
        self.queries[run_id] = query

    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, **kwargs: Any) -> None:
        ids = {(d.metadata.get("contextpilot") or {}).get("request_id") for d in documents} - {None}
        for request_id in ids:  # a ContextPilot retriever's documents carry exactly one
            self.tally.record_prepared(marker_of(self.queries.get(run_id, "")), str(request_id), len(documents))


# ---- LangChain wirings -------------------------------------------------------------------------
def chat_sglang(url: str | None, tally: Tally, **options: Any) -> Any:
    from langchain_contextpilot import ChatSGLang

    client, aclient = tally.hooks()
    base = {"model": "tiny", "max_tokens": 1, "http_client": client, "http_async_client": aclient}
    if url is not None:
        base["base_url"] = url + "/v1"
    return ChatSGLang(**base, **options)


def readme_chain(retriever: Any, llm: Any) -> Any:
    from langchain_contextpilot import format_documents

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    return {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | prompt | llm


def lc_two_turns(url: str, tally: Tally, compressed: bool) -> None:
    from langchain_contextpilot import ContextPilotCompressor, ContextPilotRetriever

    pilot = ContextPilot()
    if compressed:
        from langchain_classic.retrievers import ContextualCompressionRetriever

        retriever: Any = ContextualCompressionRetriever(
            base_compressor=ContextPilotCompressor(pilot=pilot), base_retriever=BM25ChunkRetriever()
        )
    else:
        retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(), pilot=pilot)
    chain = readme_chain(retriever, chat_sglang(url, tally))
    tap = PreparedTap(tally)
    for turn in (1, 2):
        chain.invoke(ask(turn), config={"callbacks": [tap], "configurable": {"thread_id": "t1"}})


def lc_graph(url: str, tally: Tally) -> None:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    from langchain_contextpilot import ContextPilotRetriever, format_documents

    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(), pilot=ContextPilot())
    llm = chat_sglang(url, tally)

    def respond(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        documents = retriever.invoke(str(state["messages"][-1].content), config)
        system = SystemMessage(SYSTEM.format(context=format_documents(documents)))
        return {"messages": [llm.invoke([system, *state["messages"]], config)]}

    builder = StateGraph(MessagesState)
    builder.add_node("respond", respond)
    builder.add_edge(START, "respond")
    graph = builder.compile(checkpointer=InMemorySaver())
    tap = PreparedTap(tally)
    for turn in (1, 2):
        graph.invoke({"messages": [HumanMessage(ask(turn))]}, {"callbacks": [tap], "configurable": {"thread_id": "g1"}})


def lc_concurrent(url: str | None, tally: Tally, users: int, router: Router | None = None) -> None:
    from langchain_contextpilot import ContextPilotRetriever

    pilot: Any = router if router is not None else ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(), pilot=pilot)
    llm = chat_sglang(url, tally, router=router) if router is not None else chat_sglang(url, tally)
    chain = readme_chain(retriever, llm)
    tap = PreparedTap(tally)

    def user(n: int) -> None:
        chain.invoke(ask(n), config={"callbacks": [tap], "configurable": {"thread_id": f"user-{n}"}})

    _all_at_once(user, users)


def lc_routed(replicas: Sequence[str], tally: Tally, users: int) -> None:
    router = Router([Target("r0", replicas[0], engine="sglang"), Target("r1", replicas[1], engine="sglang")])
    lc_concurrent(replicas[0], tally, users, router=router)


def lc_batch(url: str, tally: Tally, size: int) -> None:
    from langchain_contextpilot import ContextPilotRetriever

    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(), pilot=ContextPilot())
    chain = readme_chain(retriever, chat_sglang(url, tally))
    chain.batch([ask(900)] * size, config={"callbacks": [PreparedTap(tally)]})


def _all_at_once(work: Callable[[int], None], users: int) -> None:
    start = threading.Barrier(users)

    def run(n: int) -> None:
        start.wait(timeout=60)
        work(n)

    with ThreadPoolExecutor(max_workers=users) as pool:
        for future in [pool.submit(run, n) for n in range(1, users + 1)]:
            future.result()


# ---- LlamaIndex wirings ------------------------------------------------------------------------
_event_tallies: list[Tally] = []
"""The tally ContextPilotEvents go to now (one wiring runs at a time)."""


def _listen_for_events() -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    class PreparedEvents(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "BenchPreparedEvents"

        def handle(self, event: Any, **kwargs: Any) -> None:
            if event.class_name() == "ContextPilotEvent" and _event_tallies:
                _event_tallies[-1].record_prepared(_current_marker.get(), event.request_id, len(event.retrieved))

    get_dispatcher().add_event_handler(PreparedEvents())


_INDEX: Any = None


def li_index() -> Any:
    global _INDEX
    if _INDEX is None:
        from llama_index.core import Settings, VectorStoreIndex
        from llama_index.core.embeddings import MockEmbedding
        from llama_index.core.llms import MockLLM
        from llama_index.core.schema import TextNode

        Settings.embed_model = MockEmbedding(embed_dim=8)
        Settings.llm = MockLLM()
        nodes = [TextNode(id_=c.id, text=c.text[:MAX_CHARS], metadata={}) for c in CHUNKS[:40]]
        _INDEX = VectorStoreIndex(nodes)
        _listen_for_events()
    return _INDEX


def sglang_llm(url: str, tally: Tally) -> Any:
    from llama_index.postprocessor.contextpilot import SGLangLLM

    client, aclient = tally.hooks()
    return SGLangLLM(
        model="tiny",
        api_base=url + "/v1",
        max_tokens=1,
        context_window=8192,
        http_client=client,
        async_http_client=aclient,
    )


def postprocessor(pilot: ContextPilot, **wanted: Any) -> Any:
    from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor

    fields = ContextPilotPostprocessor.model_fields
    return ContextPilotPostprocessor(pilot=pilot, **{k: v for k, v in wanted.items() if k in fields})


def li_chat_engine(url: str, tally: Tally, turns: int = 3) -> None:
    from llama_index.core.chat_engine import ContextChatEngine

    engine = ContextChatEngine.from_defaults(
        retriever=li_index().as_retriever(similarity_top_k=K),
        llm=sglang_llm(url, tally),
        node_postprocessors=[postprocessor(ContextPilot(), conversation_id="c")],
    )
    for turn in range(1, turns + 1):
        token = _current_marker.set(f"ZQ{turn:03d}")
        try:
            engine.chat(ask(turn))
        finally:
            _current_marker.reset(token)


def li_concurrent(url: str, tally: Tally, users: int) -> None:
    engine = li_index().as_query_engine(
        llm=sglang_llm(url, tally), similarity_top_k=K, node_postprocessors=[postprocessor(ContextPilot())]
    )

    def user(n: int) -> None:
        _current_marker.set(f"ZQ{n:03d}")  # a pool thread: its own context
        engine.query(ask(n))

    _all_at_once(user, users)


# ---- the run -------------------------------------------------------------------------------------
@contextmanager
def servers(workdir: Path) -> Iterator[tuple[str, list[str]]]:
    """One llama-server for most wirings, two one-thread replicas for the router; all stopped."""

    def skip(reason: str) -> None:
        raise SystemExit(reason)

    with ExitStack() as stack:
        main = tiny_llama_server(workdir, skip, "main.log")
        stack.callback(main.stop)
        replicas = []
        for n in range(2):
            replica = tiny_llama_server(workdir, skip, f"replica{n}.log", threads=1)
            stack.callback(replica.stop)
            replicas.append(replica.url)
        yield main.url, replicas


def measure(name: str, run: Callable[[Tally], None], rows: list[Row]) -> None:
    gc.collect()  # the previous wirings' pilots are gone (the old tree searched every live pilot)
    tally = Tally()
    _event_tallies.append(tally)
    started = time.perf_counter()
    try:
        run(tally)
        rows.append(score(name, tally, time.perf_counter() - started))
    except Exception as exc:  # a wiring that breaks is a result too
        rows.append(Row(name, len(tally.bodies), 0, 0, 0, 0, 0, time.perf_counter() - started, repr(exc)))
    finally:
        _event_tallies.remove(tally)
    print(f"  {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=50, help="concurrent users on one pilot")
    parser.add_argument("--batch", type=int, default=8, help="chain.batch size (one question repeated)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as workdir, servers(Path(workdir)) as (url, replicas):
        u = args.users
        measure("1. README LCEL chain, 2 turns, one thread_id", lambda t: lc_two_turns(url, t, False), rows)
        measure("2. ContextualCompressionRetriever, 2 turns", lambda t: lc_two_turns(url, t, True), rows)
        measure("3. LangGraph node, context in system msg, 2 turns", lambda t: lc_graph(url, t), rows)
        measure("4. LlamaIndex ContextChatEngine, 3 turns", lambda t: li_chat_engine(url, t), rows)
        measure(f"5a. {u} threads, one pilot: LangChain chain", lambda t: lc_concurrent(url, t, u), rows)
        measure(f"5b. {u} threads, one pilot: LlamaIndex query engine", lambda t: li_concurrent(url, t, u), rows)
        measure(f"5c. {u} threads, Router over 2 replicas (LangChain)", lambda t: lc_routed(replicas, t, u), rows)
        measure(f"6. chain.batch([same question] * {args.batch})", lambda t: lc_batch(url, t, args.batch), rows)

    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    header = ["wiring", "dangling references / documents", "misattributed calls (of N)"]
    table = [header, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table if i < len(line)) for i in range(3)]
    for n, line in enumerate(table):
        print(" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)))
        if n == 0:
            print("-+-".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
