"""This scope's snapshots in the broker's object store: the newest loaded at start, one written now and then.

A worker starting late loads the newest snapshot of its scope and replays the stream after
it (:class:`~.follower.Follower` subscribes from the snapshot's sequence). Snapshots are
sealed and kept under the name of the secret that signs them, so a worker with another
secret never replaces them; one that is not of this stream (its identity), or claims more
than the stream holds, is ignored. A worker whose view no other worker's message confirmed
offers none.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from .apply import Applier, Snapshot
from .entries import context, key_id, seal, unseal
from .follower import Follower
from .options import SharedOptions

__all__ = ["Snapshots"]

log = logging.getLogger("contextpilot_integrations.shared")

_BUCKET = "contextpilot-snapshots"
_KEY_ID = re.compile(r"[0-9a-f]{16}")


class Snapshots:
    """Loads and writes the snapshots of the index ``follower`` keeps in step."""

    def __init__(self, options: SharedOptions, applier: Applier, follower: Follower) -> None:
        self.options, self.applier, self.follower = options, applier, follower
        self.seq = 0  # the sequence the newest snapshot loaded or written covers
        self.loaded = False  # a snapshot was looked for (and applied when there was one to use)

    async def store(self, js: Any) -> Any:
        """The object store (``None``: unavailable, or neither read nor written any more)."""
        if self.options.snapshot_interval <= 0 and self.loaded:
            return None
        try:
            return await js.create_object_store(_BUCKET)
        except Exception:
            try:
                return await js.object_store(_BUCKET)
            except Exception:
                return None

    def _name(self, key: bytes) -> str:
        """Where the snapshots signed with ``key`` are kept: a worker with another secret
        writes elsewhere, and never replaces them."""
        return f"{self.options.snapshot_name}.{key_id(key)}"

    async def load(self, store: Any, last_seq: int) -> None:
        """Load the newest snapshot of this stream signed with one of this worker's secrets."""
        follower = self.follower
        assert follower.stream_id is not None
        mine = {self._name(key): key for key in self.options.keys}
        best: Snapshot | None = None
        for name, key in mine.items():
            try:
                result = await store.get(name)
            except Exception:
                continue  # none yet
            body = unseal(key, context(follower.stream_id, name), result.data or b"")
            if body is None:
                follower.rejected += 1
                log.warning(
                    "shared index: the snapshot %s does not verify under this worker's secret (another stream's, or "
                    "written by a client of the broker without the secret); ignored",
                    name,
                )
                continue
            try:
                checked = Applier.check(json.loads(body), follower.stream_id, last_seq)
            except (ValueError, RecursionError):
                checked = None
            if checked is None:
                log.warning("shared index: the snapshot %s is not of this stream; replaying the stream instead", name)
            elif best is None or checked.seq > best.seq:
                best = checked
        if best is None and await self._foreign(store, set(mine)):
            follower.doubt = True
            log.warning(
                "shared index: snapshots of %s exist signed with another secret, none with this worker's: if the "
                "other workers run with that secret, this worker's is not theirs (its status says "
                "'unauthenticated' until a message of another worker verifies)",
                self.options.subject,
            )
        if best is None:
            return
        with follower.applying():
            self.applier.restore(best)
        follower.seq = self.seq = best.seq

    async def _foreign(self, store: Any, mine: set[str]) -> int:
        """Snapshots of this scope kept under secrets this worker does not have."""
        try:
            infos = await store.list(ignore_deletes=True)
        except Exception:
            return 0
        prefix = f"{self.options.snapshot_name}."
        return sum(
            1
            for info in infos
            if info.name.startswith(prefix) and _KEY_ID.fullmatch(info.name[len(prefix) :]) and info.name not in mine
        )

    async def write(self, store: Any) -> None:
        follower = self.follower
        if follower.seq <= self.seq or follower.stream_id is None:
            return
        if not follower.authenticated:
            return  # a view no other worker's message confirmed is never offered to others
        name = self._name(self.options.key)
        snapshot = self.applier.snapshot(follower.stream_id, follower.seq)
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        try:
            await store.put(name, seal(self.options.key, context(follower.stream_id, name), data))
            self.seq = snapshot["seq"]
        except Exception as exc:
            log.debug("shared index: snapshot not written: %s", exc)
