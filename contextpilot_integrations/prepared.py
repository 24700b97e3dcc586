"""What :meth:`ContextPilot.prepare` returns: one request, ready to render and send."""

from __future__ import annotations

from dataclasses import dataclass, field

from .annotations import DEFAULT_TEMPLATES, Templates, render_block, render_order, render_reference
from .blocks import Block

__all__ = ["PreparedRequest", "Reference"]


@dataclass(frozen=True, slots=True)
class Reference:
    """A block replaced by a location annotation, because an earlier turn carries it."""

    block: Block
    turn: int
    """The conversation turn (0-based) that sent the block in full."""
    text: str
    """The location annotation, e.g. "Please refer to [Doc_3] in the previous conversation."."""


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request in send order, with its annotations and a request id for the engine.

    Render it with :meth:`render` (prompt text) or :meth:`to_messages` (chat messages):
    blocks first, so the prefix is shared; then references, the order annotation and the
    question, which are specific to this request.
    """

    request_id: str
    query: str
    blocks: tuple[Block, ...]
    """Blocks sent in full, in send order."""
    references: tuple[Reference, ...] = ()
    """Blocks replaced by location references, in retrieval order."""
    ranking: tuple[Block, ...] = ()
    """Every retrieved block (sent or referenced) in the retriever's order."""
    conversation_id: str | None = None
    turn: int | None = None
    cached_blocks: int = 0
    """Leading blocks the index predicts the engine still holds."""
    cached_tokens: int = 0
    """Tokens of those blocks."""
    merged_duplicates: tuple[str, ...] = ()
    """Ids given more than once (same text) and sent once."""
    batch_index: int | None = None
    """Position in the batch given to :meth:`ContextPilot.plan`."""
    annotate_order: bool = True
    templates: Templates = field(default=DEFAULT_TEMPLATES, repr=False)

    @property
    def order_annotation(self) -> str:
        """The retriever's ranking restated by label; empty when disabled, or when the model
        reads the blocks in the retriever's order anyway (a prompt without ContextPilot
        carries no annotation, so neither does one ContextPilot did not reorder)."""
        if not self.annotate_order or not self.ranking:
            return ""
        read = [block.id for block in self.blocks] + [reference.block.id for reference in self.references]
        if read == [block.id for block in self.ranking]:
            return ""
        return render_order(self.ranking, self.templates)

    @property
    def reordered(self) -> bool:
        """Whether the send order differs from the retriever's."""
        sent = [b.id for b in self.blocks]
        fresh = set(sent)
        return sent != [b.id for b in self.ranking if b.id in fresh]

    @property
    def block_tokens(self) -> int:
        """Tokens of the blocks sent in full."""
        return sum(block.token_count for block in self.blocks)

    def render_context(self) -> str:
        """The blocks (the shareable prefix), then the location references."""
        parts = [render_block(block, self.templates) for block in self.blocks]
        parts.extend(reference.text for reference in self.references)
        return self.templates.separator.join(parts)

    def render(self, include_question: bool = True) -> str:
        """The full user prompt: context, order annotation, question."""
        parts = [self.render_context(), self.order_annotation]
        if include_question:
            parts.append(self.templates.question.format(query=self.query))
        return self.templates.separator.join(part for part in parts if part)

    def to_messages(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        """OpenAI-style chat messages: an optional system message, then the prompt."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": self.render()})
        return messages


def make_reference(block: Block, turn: int, templates: Templates) -> Reference:
    return Reference(block=block, turn=turn, text=render_reference(block, templates))
