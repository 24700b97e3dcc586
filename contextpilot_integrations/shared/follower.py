"""Following the shared log: every message of the stream, in order, checked, then applied.

Every message is signed (see :mod:`.entries`): one that does not verify under this
worker's secrets is never applied, and the first one is logged; one stored long after it
was signed (a copy, by the broker's clock), or one of an origin's batches already applied
(a replay), is not applied either. A worker that reads only what it cannot verify says so
(:attr:`Follower.authenticated` is false until a message of another worker verifies).
What this thread changes in the pilot while it applies is not published again
(:meth:`Follower.applying`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .apply import Applier
from .broker import BrokerClock, StreamFacts, stored_at
from .entries import Batch, context, decode_batch, unseal
from .options import SharedOptions

__all__ = ["Follower"]

log = logging.getLogger("contextpilot_integrations.shared")

_FRESH = 5.0  # seconds: a message is stored this close to when it was signed (the broker's clock)


class Follower:
    """Where this worker is in the stream, what it applied and what it refused.

    ``origin``: this worker's own origin now (its own messages are applied again, unchecked
    for staleness); ``dropped``: called when the pilot is gone while a message is applied.
    """

    def __init__(
        self,
        applier: Applier,
        options: SharedOptions,
        clock: BrokerClock,
        origin: Callable[[], str],
        dropped: Callable[[], None],
    ) -> None:
        self.applier, self.options, self.clock = applier, options, clock
        self._origin, self._dropped = origin, dropped
        self._local = threading.local()
        self.seq = 0  # last stream sequence applied
        self.last = 0  # the stream's last sequence, as last seen
        self.stream_id: str | None = None  # the stream's identity (name and creation time), once seen
        self.confirmed = False  # a message of another worker verified: this worker's secret is the deployment's
        self.doubt = False  # something it read did not verify (a message; snapshots under another secret only)
        self.measure_clock = False  # an own message came back stored far from its signing: measure again
        self.rejected = 0
        self.malformed = 0
        self.replayed = 0
        self.stale = 0
        self.gaps = 0
        self.lags: deque[float] = deque(maxlen=20_000)
        self._warned_rejected = False
        self._warned_stale = False

    @property
    def authenticated(self) -> bool:
        """False while it read only what it cannot verify (its secret is likely not the others')."""
        return not (self.doubt and not self.confirmed)

    @property
    def behind(self) -> int:
        return max(0, self.last - self.seq)

    def newest_lag(self) -> float | None:
        """The newest applied entry's lag (``None``: none yet); the deque is appended on another thread."""
        try:
            return self.lags[-1]
        except IndexError:
            return None

    def is_applying(self) -> bool:
        """Whether this thread is applying the stream now (what it changes is not published)."""
        return bool(getattr(self._local, "applying", False))

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        self._local.applying = True
        try:
            yield
        finally:
            self._local.applying = False

    # ---- a session starts ----------------------------------------------------------------------
    def at(self, facts: StreamFacts) -> None:
        """The stream as a new session finds it: made again, or a new empty broker's, it is followed from its start."""
        if self.stream_id is not None and facts.identity != self.stream_id:
            log.warning("shared index: the stream %s was made again; following it from its start", self.options.stream)
            self.seq = 0  # its sequences are not the old stream's
        elif facts.last_seq < self.seq:  # a new, empty broker: follow its stream from the start
            self.seq = 0
        self.stream_id = facts.identity
        self.last = facts.last_seq

    def check_gap(self, first_seq: int) -> None:
        """Count (and say) entries retention dropped before this worker read them (the snapshot was older)."""
        if self.seq and first_seq > self.seq + 1:
            self.gaps += 1
            log.warning("shared index: %s entries expired before this worker read them", self.options.subject)

    async def subscribe(self, js: Any) -> Any:
        """Follow the stream from after the last message applied (all of it: none yet)."""
        from nats.js import api

        return await js.subscribe(
            self.options.subject,
            cb=self.on_message,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if self.seq else api.DeliverPolicy.ALL,
                opt_start_seq=self.seq + 1 if self.seq else None,
            ),
        )

    async def newest(self, js: Any) -> int:
        """The stream sequence of this scope's newest message (0: none)."""
        try:
            message = await js.get_last_msg(self.options.stream, self.options.subject)
        except Exception as exc:
            if type(exc).__name__ == "NotFoundError":
                return 0
            raise
        self.last = max(self.last, int(message.seq))
        return int(message.seq)

    # ---- each message --------------------------------------------------------------------------
    async def on_message(self, message: Any) -> None:
        try:
            seq = int(message.metadata.sequence.stream)
        except Exception:
            return
        if seq <= self.seq:
            return  # seen (a resubscription can deliver it again)
        assert self.stream_id is not None
        body = unseal(self.options.keys, context(self.stream_id, self.options.subject), message.data or b"")
        batch = decode_batch(body) if body is not None else None
        origin = self._origin()
        if body is None:
            self.rejected += 1  # not signed with this deployment's secret for this stream: never applied
            self._not_verified(seq)
        elif batch is None:
            self.malformed += 1
        elif batch.origin != origin and not self._timely(batch, message):
            self.stale += 1
        elif not self.applier.fresh(batch.origin, batch.first):
            self.replayed += 1
        else:
            own = batch.origin == origin
            stored = stored_at(message)
            if own and stored is not None and abs(stored - batch.signed) > _FRESH / 2:
                self.measure_clock = True  # this worker's clock moved since it was measured
            if not own and not self.confirmed:
                self.confirmed = True
                if self.doubt:
                    log.warning("shared index: a message of another worker verifies under this worker's secret")
            try:
                with self.applying():
                    for entry in batch.entries:  # checked whole before the first is applied
                        self.applier.apply(entry, own)
                        if not own:  # both times by the broker's clock
                            self.lags.append(max(0.0, self.clock.now() - entry[-1]))
            except ReferenceError:
                self._dropped()  # the pilot was dropped
                return
        self.seq = seq
        self.last = max(self.last, seq)

    def _not_verified(self, seq: int) -> None:
        """A message that does not verify: said at the first, loudly (a worker whose secret is
        not the deployment's reads nothing else)."""
        self.doubt = True
        if not self._warned_rejected:
            self._warned_rejected = True
            log.warning(
                "shared index: the message at sequence %d of %s does not verify under this worker's secret%s and was "
                "not applied. If every other worker's message is refused, this worker's secret is not theirs (its "
                "stats say shared_status='unauthenticated' and it writes no snapshot); else a client of the broker "
                "without the secret published it. details()['rejected_messages'] counts them",
                seq,
                self.options.subject,
                "s" if len(self.options.keys) > 1 else "",
            )

    def _timely(self, batch: Batch, message: Any) -> bool:
        """Whether another worker's message was stored when it was signed (both by the broker's
        clock), and is no older than the stream keeps: a signed message stored again later (a
        copy, its worker gone and no snapshot knowing it) is not applied."""
        stored = stored_at(message)
        if stored is None:
            return True  # the broker did not say: the per-origin numbering still applies
        if abs(stored - batch.signed) > _FRESH:
            self._stale_warning(stored - batch.signed)
            return False
        return self.clock.now() - batch.signed <= self.options.max_age - _FRESH  # its original is gone

    def _stale_warning(self, late: float) -> None:
        if not self._warned_stale:
            self._warned_stale = True
            log.warning(
                "shared index: a signed message of %s was stored %.0f s from when it was signed (a copy stored again, "
                "or its worker's time is off); not applied. details()['stale_messages'] counts them",
                self.options.subject,
                late,
            )
