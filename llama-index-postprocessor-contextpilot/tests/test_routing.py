"""A router stands where an API base stands: the postprocessor prepares for the replica whose
cache holds the prefix, the LLM sends there; real llama-server replicas and a dead one."""

from __future__ import annotations

from llama_index.core import VectorStoreIndex

from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.testing.llama_server import LlamaServer, free_port
from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION


def test_query_engine_routes_to_the_replica_holding_the_prefix(
    index: VectorStoreIndex, replicas: list[LlamaServer]
) -> None:
    dead = Target("dead", f"http://127.0.0.1:{free_port()}", engine="llamacpp")
    router = Router([dead, *(Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas))])
    llm = SGLangLLM(model="tiny", router=router, max_tokens=2, context_window=8192, max_retries=0, timeout=10)
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=router)]
    )
    for _ in range(3):
        assert engine.query(QUESTION).source_nodes  # none lost, the dead target included
    served = {t.name: router.pilot(t).stats().engine_requests for t in router.targets}
    assert served["dead"] == 0 and sum(served.values()) == 3 and max(served.values()) == 3
    assert router.pilot(max(served, key=served.get)).stats().engine_cached_tokens > 500  # type: ignore[arg-type]
