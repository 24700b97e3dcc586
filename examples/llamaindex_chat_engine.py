"""A LlamaIndex query engine and a memory-aware chat engine with ContextPilot.

    python examples/llamaindex_chat_engine.py             # offline: MockLLM echoes the prompt
    CONTEXTPILOT_ENGINE_URL=http://127.0.0.1:30000 python examples/llamaindex_chat_engine.py

Needs: pip install llama-index-postprocessor-contextpilot
(from a clone: pip install ./ ./llama-index-postprocessor-contextpilot)
"""

from __future__ import annotations

import os

from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms.mock import MockLLMWithChatMemoryOfLastCall
from llama_index.core.schema import TextNode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from llama_index.postprocessor.contextpilot import ContextPilotChatEngine, ContextPilotPostprocessor, SGLangLLM

Settings.embed_model = MockEmbedding(embed_dim=8)  # use your embedding model here
chunks = list(load_multihop_rag().chunks.values())[:60]
index = VectorStoreIndex([TextNode(id_=c.id, text=c.text[:300]) for c in chunks])  # short: small demo models

url = os.environ.get("CONTEXTPILOT_ENGINE_URL")
llm = (
    SGLangLLM(model=os.environ.get("CONTEXTPILOT_MODEL", "default"), api_base=url + "/v1", max_tokens=64)
    if url
    else MockLLMWithChatMemoryOfLastCall(is_chat_model=True, max_tokens=8)
)
pilot = ContextPilot()

# 1. a query engine: exactly where LongContextReorder would go
engine = index.as_query_engine(
    llm=llm, similarity_top_k=4, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
)
print("query engine sources:", [n.node.node_id for n in engine.query("Who faces a fraud trial?").source_nodes])

# 2. a memory-aware chat: repeated documents become location references
chat = ContextPilotChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=3), llm=llm, pilot=pilot)
for turn, question in enumerate(["Who faces a fraud trial?", "What was he accused of?", "Who faces a fraud trial?"]):
    response = chat.chat(question)
    sent = getattr(llm, "last_chat_messages", None)
    references = sent[-1].content.count("Please refer to") if sent else "?"
    print(f"turn {turn}: {references} location references; cached tokens: {response.metadata.get('cached_tokens')}")
print(pilot.stats())
