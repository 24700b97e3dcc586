"""Context blocks: a stable identity, and a label that depends on the block alone.

Two sessions only share a KV-cache prefix if they send byte-identical text, so a block's
identity (and hence its label) must never depend on the request, the position or time:
the id given by the caller, otherwise a hash of the text.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import BlockTypeError, DuplicateBlockError, InvalidBlockError
from .usage import MAX_TOKENS

__all__ = ["Block", "BlockLike", "content_id", "normalize_blocks"]

_SHORT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,8}")
LABEL_HASH_CHARS = 6
"""Characters of a label derived from a long id (base32: 30 bits, so two blocks of one
prompt share a label about once in 10^7 prompts of 15 blocks)."""
CHARS_PER_TOKEN = 4
"""Characters a token, roughly: the estimate used when no token count is given."""


def content_id(text: str) -> str:
    """The identity of a block that came without an id: 16 hex digits of SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Block(BaseModel):
    """One retrieved context block (a document, chunk or node).

    Attributes:
        id: stable identity; defaults to :func:`content_id` of the text.
        text: the content sent to the model; must be a non-blank ``str``.
        rank: position in the retriever's ranking (0 = best); ``None`` until known.
        metadata: free-form data carried along untouched (scores, sources...).
        tokens: token count if known (at most :data:`~.usage.MAX_TOKENS`); otherwise
            estimated from the text length.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    id: str = Field(min_length=1)
    text: str
    rank: int | None = Field(default=None, ge=0)
    metadata: Mapping[str, Any] = Field(default_factory=dict)
    tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**_prepare_fields(data))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise InvalidBlockError(f"{where}: {error['msg']}" if where else error["msg"]) from exc

    @model_validator(mode="before")
    @classmethod
    def _fill_id(cls, data: Any) -> Any:
        return _prepare_fields(data) if isinstance(data, dict) else data

    def __hash__(self) -> int:
        return hash((self.id, self.text))

    @cached_property
    def label(self) -> str:
        """Stable label, as short as a stable identity allows: a short id as given (``545``),
        else :data:`LABEL_HASH_CHARS` base32 characters of its SHA-256 (``k3x9ab``). Derived
        from the id alone; every block of every prompt pays for it, so it is kept short."""
        if _SHORT_ID.fullmatch(self.id):
            return self.id
        digest = hashlib.sha256(self.id.encode("utf-8")).digest()
        return base64.b32encode(digest).decode("ascii")[:LABEL_HASH_CHARS].lower()

    @cached_property
    def token_count(self) -> int:
        """The given token count, else an estimate (about four characters a token)."""
        if self.tokens is not None:
            return self.tokens
        return max(1, len(self.text) // CHARS_PER_TOKEN)

    def counted(self, tokens: int) -> Block:
        """This block with its token count given (the engine's tokenizer counted it), so
        every use of :attr:`token_count` weighs it in the engine's units."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= MAX_TOKENS:
            raise InvalidBlockError(f"tokens must be an int in 1..{MAX_TOKENS}, got {tokens!r}")
        copy = self.model_copy(update={"tokens": tokens})
        copy.__dict__.pop("token_count", None)  # the original's cached estimate must not carry over
        return copy


def _prepare_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Check the text first (clear errors for non-text content), then derive the id."""
    text = data.get("text")
    if not isinstance(text, str):
        missing = " (no 'text' given)" if text is None else ""
        raise BlockTypeError(f"block text must be str, got {type(text).__name__}{missing}")
    if not text.strip():
        raise InvalidBlockError("block text is empty or blank")
    _check_encodable(text, "text")
    raw_id = data.get("id")
    if isinstance(raw_id, str):
        _check_encodable(raw_id, "id")
    if raw_id is None or raw_id == "":
        return {**data, "id": content_id(text)}
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        return {**data, "id": str(raw_id)}
    return data


def _check_encodable(value: str, field: str) -> None:
    """Text that cannot be sent (a lone surrogate, e.g. half of an emoji cut by a splitter)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidBlockError(
            f"block {field} is not valid Unicode: a lone surrogate {value[exc.start]!r} at character {exc.start}"
        ) from None


BlockLike = Block | str | Mapping[str, Any]
"""What :meth:`ContextPilot.prepare` accepts: a :class:`Block`, a text, or a mapping of
``Block`` fields (``{"id": ..., "text": ..., "tokens": ...}``)."""


def _to_block(item: BlockLike, position: int) -> Block:
    if isinstance(item, Block):
        return item
    try:
        if isinstance(item, str):
            return Block(text=item)
        if isinstance(item, Mapping):
            return Block(**item)
    except (BlockTypeError, InvalidBlockError) as exc:
        raise type(exc)(f"block #{position}: {exc}") from exc
    raise BlockTypeError(f"block #{position}: expected a Block, a str or a mapping, got {type(item).__name__}")


def normalize_blocks(items: Iterable[BlockLike]) -> tuple[list[Block], list[str]]:
    """Validate a retrieval and put it in the retriever's order.

    The order is ``rank`` where given, else the position in ``items`` (blocks with a rank
    and without one are ordered by rank-or-position). A block repeated with the same text
    is kept once, at its best rank (the model still sees it), and its id is returned as
    merged; the same id with a different text raises :class:`DuplicateBlockError`, since
    one of the two texts would be lost.

    Returns:
        The blocks in retrieval order, and the ids of merged duplicates.
    """
    if type(items) is not list and type(items) is not tuple:  # those two pass both checks: skip the ABCs
        if isinstance(items, (str, bytes, Mapping, Block)):
            raise BlockTypeError("blocks must be a sequence of blocks, not a single value")
        if not isinstance(items, Iterable):
            raise BlockTypeError(
                f"blocks must be a sequence of blocks (Block, str or mapping), got {type(items).__name__}"
            )
    items = list(items)
    ids = set()
    for item in items:  # the common case, Blocks without ranks and distinct ids: nothing to do
        if type(item) is not Block or item.rank is not None:
            break
        ids.add(item.id)
    else:
        if len(ids) == len(items):
            return items, []  # type: ignore[return-value]
    seen: dict[str, tuple[int, int, Block]] = {}
    merged: list[str] = []
    needs_sort = False
    for position, item in enumerate(items):
        block = _to_block(item, position)
        rank = position if block.rank is None else block.rank
        previous = seen.get(block.id)
        if previous is None:
            if block.rank is not None and block.rank != position:
                needs_sort = True
            seen[block.id] = (rank, position, block)
        elif previous[2].text == block.text:
            merged.append(block.id)
            needs_sort = needs_sort or rank < previous[0]
            if rank < previous[0]:
                seen[block.id] = (rank, position, block)
        else:
            raise DuplicateBlockError(f"block #{position}: id {block.id!r} was already given with a different text")
    entries = sorted(seen.values(), key=lambda entry: entry[:2]) if needs_sort else seen.values()
    return [block for _, _, block in entries], merged
