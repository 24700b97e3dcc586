"""What :meth:`ContextPilot.prepare` returns: one request, ready to render and send."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field

from .annotations import (
    DEFAULT_TEMPLATES,
    Templates,
    opening,
    quote_status,
    reference_spans,
    render_block,
    render_order,
    render_position_order,
    render_reference,
)
from .blocks import Block

__all__ = ["PreparedRequest", "Reference", "resolve_history", "resolve_references", "resolve_request"]


@dataclass(frozen=True, slots=True)
class Reference:
    """A block replaced by a location annotation, because an earlier turn carries it."""

    block: Block
    turn: int
    """The conversation turn (0-based) that sent the block in full."""
    text: str
    """The location annotation, e.g. "Please refer to [Doc_3] in the previous conversation."."""
    labelled: bool = True
    """Whether that turn sent the block with its label (the reference names it); else the
    reference quotes the block's opening words."""
    words: str = ""
    """For a quote: the opening words it quotes (empty: the block's first
    :data:`~.annotations.QUOTE_WORDS`, :func:`~.annotations.opening`)."""

    @property
    def quoted(self) -> str:
        """The words a quote reference names its block by."""
        return self.words or opening(self.block.text)

    def target(self, templates: Templates = DEFAULT_TEMPLATES) -> str:
        """The text that must come before the reference in the messages for it to be sound."""
        return render_block(self.block, templates, self.labelled)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request in send order, with its annotations and a request id for the engine.

    Render it with :meth:`render` (prompt text) or :meth:`to_messages` (chat messages):
    blocks first, so the prefix is shared; then references, the order annotation and the
    question, which are specific to this request. Blocks sent as their text alone in the
    retriever's order (a later turn of a conversation) keep each reference in its block's
    place instead: the model reads the retriever's order, with no annotation.
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
    annotate_order: bool = False
    templates: Templates = field(default=DEFAULT_TEMPLATES, repr=False)
    labels: bool = True
    """Whether the blocks carry their labels. False: each block is its text alone, as
    without ContextPilot (reordered, the annotation ranks them by position)."""
    order_form: str = "positions"
    """How the annotation restates the ranking of unlabelled blocks: ``"positions"`` (all
    of them) or ``"moved"`` (those out of place); labelled blocks are ranked by label."""
    top_last: bool = False
    """The retriever's top block goes last, right before the question (a conversation's later
    turn, after its history: where a model reads it best, :mod:`.reading`)."""
    partition: str | None = None
    """The engine's cache partition it is sent in (:mod:`.partitions`: a tenant's
    ``cache_salt``, a LoRA adapter); ``None``: the engine's default one."""

    @property
    def order_annotation(self) -> str:
        """The retriever's ranking restated (by label, or by position for blocks sent as
        their text alone); empty when disabled, or when the model reads the blocks in the
        retriever's order anyway (a prompt without ContextPilot carries no annotation, so
        neither does one ContextPilot did not reorder)."""
        if not self.annotate_order or not self.ranking:
            return ""
        read = [part.block.id if isinstance(part, Reference) else part.id for part in self.sequence]
        if read == [block.id for block in self.ranking]:
            return ""
        if self.labels:
            return render_order(self.ranking, self.templates)
        sent = {block.id for block in self.blocks}  # references (labelled requests only) have no position
        ranking = [block for block in self.ranking if block.id in sent]
        return render_position_order(ranking, self.blocks, self.templates, moved_only=self.order_form == "moved")

    @property
    def sequence(self) -> list[Block | Reference]:
        """What the model reads, in order: blocks sent in full and references. Blocks sent as
        their text alone (a later turn) keep the retriever's order, each reference in its
        block's place, the top block last where :attr:`top_last`; labelled blocks (the paper's
        form) put references after them."""
        if self.labels or not self.references:
            return [*self.blocks, *self.references]
        parts: dict[str, Block | Reference] = {block.id: block for block in self.blocks}
        parts.update((reference.block.id, reference) for reference in self.references)
        read = [parts[block.id] for block in self.ranking if block.id in parts]
        if self.top_last and len(read) > 1:
            read.append(read.pop(0))
        return read

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

    def rendered(self, part: Block | Reference) -> str:
        """A part of :attr:`sequence` as this prompt shows it (a block: in full, labelled or not)."""
        return part.text if isinstance(part, Reference) else render_block(part, self.templates, self.labels)

    def render_context(self) -> str:
        """The blocks (the shareable prefix) and the location references (:attr:`sequence`)."""
        return self.templates.separator.join(map(self.rendered, self.sequence))

    def reference_offsets(self) -> list[tuple[Reference, int]]:
        """Each reference with where :meth:`render_context` places it (characters from its
        start): the very sentence this request wrote, told apart from the same sentence
        inside a document."""
        offsets = []
        at = 0
        for part in self.sequence:
            if isinstance(part, Reference):
                offsets.append((part, at))
            at += len(self.rendered(part)) + len(self.templates.separator)
        return offsets

    def render(self, include_question: bool = True) -> str:
        """The full user prompt: context, order annotation, question."""
        parts = [self.render_context(), self.order_annotation]
        if include_question:
            parts.append(self.templates.question.format(query=self.query))
        return self.templates.separator.join(part for part in parts if part)

    def to_messages(
        self, system_prompt: str | None = None, history: Sequence[Mapping[str, str]] = ()
    ) -> list[dict[str, str]]:
        """OpenAI-style chat messages: an optional system message, the ``history`` you send
        (earlier turns, ``{"role": ..., "content": ...}``), then the prompt. A reference whose
        block is not in those messages goes out as the block's full text."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages += [{"role": str(m["role"]), "content": str(m["content"])} for m in history]
        messages.append({"role": "user", "content": self.render()})
        texts = [m["content"] for m in messages]
        if resolve_request(texts, self):
            messages[-1]["content"] = texts[-1]
        return messages


def resolve_request(texts: MutableSequence[str], request: PreparedRequest, *, last: bool = True) -> list[str]:
    """Put back the full text of every reference of ``request`` that would not name exactly
    one text in ``texts`` (a request's messages, in order; edited in place): see
    :func:`resolve_references`. Each reference is the one the request placed: found where
    the request's rendered context is in ``texts`` (the last such place), else as the last
    copy of its sentence outside every copy of the request's own blocks; never the same
    sentence inside a document or an earlier message.

    ``last``: ``request`` is the one these messages send (every text counts against its
    quotes); ``False`` for an earlier turn in a history (the texts up to its message count,
    as they did when it was sent). Returns the block ids restored."""
    placed = _placed(texts, request)
    return _resolve(texts, placed, request.templates, request.labels, last)


def resolve_references(
    texts: MutableSequence[str],
    references: Iterable[Reference],
    templates: Templates = DEFAULT_TEMPLATES,
    labels: bool = True,
) -> list[str]:
    """Put back the full text of every reference that would not name exactly one text in
    ``texts`` (a request's messages, in order; edited in place). ``labels``: whether the
    request renders its blocks labelled (how a restored block is written). Returns the
    block ids restored.

    A reference by label stays where its block is rendered, labelled, before it. A quote
    reference stays where its opening words name exactly one text
    (:func:`~.annotations.quote_status`, judged in every text: another block, the question,
    the system prompt, an answer, before or after it): outside reference sentences the
    words occur only where a copy of the quoted block begins a line (or in that copy's first
    paragraph), and one such copy comes before the quote. Restoring one reference can make
    another's words ambiguous (its text now carries them): checked again until none is.

    Each reference is taken to be the last copy of its sentence outside every copy of these
    references' blocks; :func:`resolve_request` knows the request's own rendering."""
    references = list(references)
    blocks = [reference.block.text for reference in references]
    placed = [(reference, *found) for reference in references if (found := _last_sentence(texts, reference, blocks))]
    return _resolve(texts, placed, templates, labels, True)


def resolve_history(texts: MutableSequence[str], requests: Iterable[PreparedRequest]) -> bool:
    """Write out, in ``texts`` (the history sent, in order; edited in place), every reference
    of these earlier requests (oldest first) whose block the history no longer carries: a
    kept turn's message may refer to a turn that left the window. Returns whether any was."""
    return any([bool(resolve_request(texts, request, last=False)) for request in requests])


def _placed(texts: Sequence[str], request: PreparedRequest) -> list[tuple[Reference, int, int]]:
    """(reference, text index, position) of each reference ``request`` placed in ``texts``."""
    if not request.references:
        return []
    offsets = request.reference_offsets()
    context = request.render_context()
    for index in range(len(texts) - 1, -1, -1):
        at = texts[index].rfind(context)
        if at != -1:
            return [(reference, index, at + offset) for reference, offset in offsets]
    own = [block.text for block in request.ranking] or [r.block.text for r in request.references]
    return [
        (reference, *found) for reference, _ in offsets if (found := _last_sentence(texts, reference, own)) is not None
    ]


def _last_sentence(texts: Sequence[str], reference: Reference, own: Sequence[str]) -> tuple[int, int] | None:
    """The last copy of ``reference``'s sentence in ``texts`` that no copy of ``own`` (the
    request's block texts) holds: the one the request wrote."""
    sentence = reference.text
    for index in range(len(texts) - 1, -1, -1):
        text = texts[index]
        at = text.rfind(sentence)
        while at != -1:
            end = at + len(sentence)
            inside = any(
                len(block) >= len(sentence) and text.find(block, max(0, end - len(block)), at + len(block)) != -1
                for block in own
            )
            if not inside:
                return index, at
            at = text.rfind(sentence, 0, end - 1)
    return None


def _resolve(
    texts: MutableSequence[str],
    placed: list[tuple[Reference, int, int]],
    templates: Templates,
    labels: bool,
    last: bool,
) -> list[str]:
    restored: set[str] = set()
    order = [reference.block.id for reference, _, _ in placed]
    while placed:
        masks = [reference_spans(text, templates) for text in texts]
        going = [entry for entry in placed if not _stays(texts, entry, templates, masks, last)]
        if not going:
            break
        for reference, index, position in sorted(going, key=lambda entry: (entry[1], -entry[2])):
            full = render_block(reference.block, templates, labels)
            text = texts[index]
            texts[index] = text[:position] + full + text[position + len(reference.text) :]
            shift = len(full) - len(reference.text)
            placed = [
                (other, i, p + shift if i == index and p > position else p)
                for other, i, p in placed
                if other is not reference
            ]
            restored.add(reference.block.id)
    return [block_id for block_id in order if block_id in restored]


def _stays(
    texts: Sequence[str],
    entry: tuple[Reference, int, int],
    templates: Templates,
    masks: Sequence[Sequence[tuple[int, int]]],
    last: bool,
) -> bool:
    reference, index, position = entry
    if reference.labelled:
        target = reference.target(templates)
        return any(target in before for before in texts[:index]) or target in texts[index][:position]
    scope = texts if last else texts[: index + 1]
    return quote_status(scope, index, position, reference.quoted, templates, reference.block.text, masks) == "found"


def make_reference(
    block: Block, turn: int, templates: Templates, labelled: bool = True, words: str | None = None
) -> Reference:
    """The reference to ``block`` as ``turn`` sent it (``labelled`` or as its text alone,
    quoted by ``words``: default its first words)."""
    quote = "" if labelled or words is None else words
    return Reference(block, turn, render_reference(block, templates, labelled, quote or None), labelled, quote)
