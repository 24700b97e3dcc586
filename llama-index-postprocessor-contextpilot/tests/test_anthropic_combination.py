"""LlamaIndex's Anthropic LLM in the combination this package declares (the ``anthropic``
extra; the README's hosted recipe installs it): what is installed satisfies it, and a stock
query engine through ContextPilotLLM around ``llama_index.llms.anthropic.Anthropic`` gets a
real answer over real HTTP from a local server speaking Anthropic's Messages API (the
bundled fake; the hosted API cannot be reached from here). With anthropic 1.x or 2.x the
same engine answers "Empty Response" after no request at all (LlamaIndex swallows the
TypeError)."""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.anthropic import Anthropic
from packaging.requirements import Requirement

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import invariant_breaches, message_texts
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from llama_index.postprocessor.contextpilot import ContextPilotLLM, ContextPilotPostprocessor

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE = Path(__file__).resolve().parents[1]
CHUNKS = list(load_multihop_rag().chunks.values())[:6]


class Six(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = [TextNode(id_=chunk.id, text=chunk.text[:400].strip()) for chunk in CHUNKS]
        return [NodeWithScore(node=node, score=1.0) for node in nodes]


def declared() -> dict[str, Requirement]:
    extras = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    return {requirement.name: requirement for requirement in map(Requirement, extras.get("anthropic", []))}


def test_the_declared_combination_is_installed_and_answers_through_the_wrapper() -> None:
    pins = declared()
    assert set(pins) == {"llama-index-llms-anthropic", "anthropic"}
    assert all(pins[name].specifier.contains(version(name)) for name in pins)  # what CI installed
    assert not pins["anthropic"].specifier.contains("2.0.0") and not pins["anthropic"].specifier.contains("1.0.0")
    readme = (PACKAGE / "README.md").read_text()
    assert re.search(r'pip install "[^"]*llama-index-postprocessor-contextpilot\[anthropic\]"', readme)

    pilot = ContextPilot()
    with fake_anthropic() as fake:
        llm = ContextPilotLLM(llm=Anthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0))
        engine = RetrieverQueryEngine.from_args(
            Six(), llm=llm, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
        )
        answer = str(engine.query("Who is on trial?"))
        bodies = list(fake.requests)
    assert answer != "Empty Response" and answer.strip()
    assert len(bodies) == 1 and bodies[0]["model"] == "claude-sonnet-4-6"
    sent = "\n".join(message_texts(bodies[0]))
    assert all(chunk.text[:400].strip() in sent for chunk in CHUNKS)  # every node reached the server
    assert pilot.stats().provider_usage["anthropic"].requests == 1 and invariant_breaches(bodies) == []
