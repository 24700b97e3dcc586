"""One unit for everything the send decision weighs: the engine's tokens.

The rule (:mod:`.gain`) weighs the reuse of blocks against the tokens that labels and the
order annotation add. Weighed in different units it errs: the tiny test models read one
token a character, while the default estimate is four characters a token, so a block
estimated at 50 tokens is 200 to the engine and an annotation estimated at 30 is 121. With
a ``token_counter`` (the engine's tokenizer) every piece is counted with it: blocks without
:attr:`~.blocks.Block.tokens` get their count from it (:meth:`TokenUnits.blocks`), and so do
labels, references, the question and the annotation's pieces.

A counter may be slow (a ``POST /tokenize`` to the engine): the pilot counts a request's
pieces before it takes its lock (:meth:`TokenUnits.prefetch`), and under the lock only looks
them up (:meth:`TokenUnits.known`); a piece not counted beforehand is then counted there if
the counter is local, and estimated at the tokens a character seen so far if it is remote
(``remote = True`` on the counter: :class:`~contextpilot_integrations.engines.tokens.EngineTokenCounter`).
Counts are remembered per text, bounded (least recently used go first).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .annotations import Templates, render_reference
from .blocks import Block
from .gain import TokenCounter
from .usage import MAX_TOKENS

__all__ = ["TokenUnits"]


class TokenUnits:
    """A token counter with a bounded memory per text; thread-safe (its own short lock,
    never held while counting).

    Args:
        counter: the tokens of a text (the engine's tokenizer). A counter with a true
            ``remote`` attribute is never called by :meth:`known`.
        max_texts: texts remembered; past it the least recently used are forgotten.
    """

    __slots__ = ("_chars", "_lock", "_memo", "_tokens", "counter", "max_texts", "remote")

    def __init__(self, counter: TokenCounter, max_texts: int = 65_536) -> None:
        if max_texts < 1:
            raise ValueError("max_texts must be at least 1")
        self.counter, self.max_texts = counter, max_texts
        self.remote = bool(getattr(counter, "remote", False))
        self._memo: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._chars = self._tokens = 0  # what was counted so far: the rate for a remote miss

    def __call__(self, text: str) -> int:
        """The tokens of ``text``: remembered, else counted (possibly I/O: keep it off other locks)."""
        if not text:
            return 0
        key = _key(text)
        with self._lock:
            known = self._memo.get(key)
            if known is not None:
                self._memo.move_to_end(key)
                return known
        tokens = self.counter(text)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
            raise ValueError(f"the token counter returned {tokens!r} for a text of {len(text)} characters")
        with self._lock:
            self._memo[key] = tokens
            self._chars += len(text)
            self._tokens += tokens
            while len(self._memo) > self.max_texts:
                self._memo.popitem(last=False)
        return tokens

    def known(self, text: str) -> int:
        """The tokens of ``text`` without I/O (what the pilot calls under its lock): as
        remembered; else counted if the counter is local; else the tokens a character
        counted so far (four characters a token before anything was counted), rounded up."""
        if not self.remote or not text:
            return self(text)
        with self._lock:
            known = self._memo.get(_key(text))
            rate = self._tokens / self._chars if self._chars else 0.25
        return known if known is not None else math.ceil(len(text) * rate)

    def prefetch(self, texts: Iterable[str]) -> None:
        """Count these texts now (off the pilot's lock), so :meth:`known` finds them."""
        for text in texts:
            self(text)

    def blocks(self, blocks: Sequence[Block]) -> list[Block]:
        """The blocks, each without a given token count counted in these units."""
        return [block if block.tokens is not None else block.counted(max(1, self(block.text))) for block in blocks]

    def request(
        self, blocks: Sequence[Block], question: str, templates: Templates, labels: bool, quotes: bool = False
    ) -> None:
        """Count, off the lock, the pieces a request's decision weighs besides its blocks:
        the question line, the annotation's frame and position items (see
        :func:`.gain.annotation_tokens`); where labels may be weighed (``labels``: the
        paper's form) each block's label, reference and place in a labelled ranking; and
        where a block may be quoted (``quotes``: a conversation's turn sent as its text
        alone) each block's quote reference."""
        texts = [templates.question.format(query=question), templates.order_joiner, templates.moved_joiner]
        texts += [templates.position_order.format(order=""), templates.moved_order.format(order="")]
        texts += [templates.position_item.format(position=p) for p in range(1, len(blocks) + 1)]
        if quotes:
            texts += [render_reference(block, templates, labelled=False) for block in blocks]
        if not labels:
            self.prefetch(texts)
            return
        texts.append(templates.order.format(order=""))
        for block in blocks:
            label = block.label
            texts.append(templates.block.format(label=label, text=""))
            texts.append(templates.reference.format(label=label))
            texts.append(templates.order_item.format(label=label))
            texts.append(templates.order_item.format(label=label) + templates.order_joiner)
        self.prefetch(texts)

    def __len__(self) -> int:
        return len(self._memo)


def _key(text: str) -> bytes:
    """A text's memory key: a digest, so long blocks are not kept twice."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
