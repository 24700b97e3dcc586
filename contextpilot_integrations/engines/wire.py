"""The engines' wire formats, in one place: what SGLang, vLLM and OpenAI-compatible servers
send and expect.

- KV-cache events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in batches with
  a sequence number): validated models, as our SGLang plugin posts them in JSON, and as
  SGLang and vLLM publish them natively over ZMQ (multipart ``[topic, 8-byte big-endian
  seq, msgpack [ts, [events...], dp_rank]]``, each event a map tagged by ``type``; SGLang's
  block hashes are int64, vLLM's are SHA-256 bytes, or uint64 with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; a replay ROUTER socket answers a start
  sequence number with the batches it still holds, then ``seq == -1``);
- the plugin's conversion of SGLang's msgspec events to JSON;
- the request-id body fields each engine reads, and the parts of an OpenAI-style answer we
  read back (usage with ``prompt_tokens_details.cached_tokens``, SGLang's
  ``sglext.input_ids``, error objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..core.partitions import cache_partition
from ..core.usage import check_token_count
from ..core.validation import MAX_BLOCKS
from ..errors import EngineError

__all__ = [
    "REQUEST_ID_FIELDS",
    "AllBlocksClearedEvent",
    "BlockRemovedEvent",
    "BlockStoredEvent",
    "KvEvent",
    "KvEventBatch",
    "event_to_dict",
    "answer_error",
    "decode_zmq_batch",
    "input_ids",
    "prompt_ms",
    "usage",
]

ENGINES = ("sglang", "vllm", "llamacpp", "openai")

REQUEST_ID_FIELDS: dict[str, tuple[str, ...]] = {
    "sglang": ("rid", "session_id"),  # SGLang copies session_id into its stored-block events
    "vllm": ("request_id",),
    "llamacpp": (),
    "openai": (),
}
"""Body fields that carry our request id, per engine."""

PROMPT_IDS_REQUEST: dict[str, dict[str, Any]] = {
    "sglang": {"return_input_ids_in_sglext": True},  # answered in sglext.input_ids
    "vllm": {"return_token_ids": True},  # answered in prompt_token_ids (a stream's first chunk)
    "llamacpp": {},
    "openai": {},
}
"""Body fields that ask the engine for the prompt's token ids (to map KV events to requests)."""

BlockHash = Annotated[int, Field(ge=-(2**63), lt=2**64)] | Annotated[bytes, Field(min_length=1, max_length=64)]
"""SGLang: int64; vLLM: SHA-256 bytes (or uint64)."""

END_OF_REPLAY = -1
"""The sequence number that ends a replay answer."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class BlockStoredEvent(_Event):
    type: Literal["BlockStored"]
    block_hashes: list[BlockHash] = Field(fail_fast=True)
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = Field(fail_fast=True)
    block_size: int = Field(gt=0)
    medium: str | None = None
    cache_salt: str | None = Field(default=None, max_length=4096)
    """SGLang: the salt of the request that stored the blocks."""
    lora_name: str | None = Field(default=None, max_length=4096)
    """The LoRA adapter's name (SGLang, vLLM)."""
    extra_keys: list[Any] | None = Field(default=None, max_length=MAX_BLOCKS)
    """vLLM: per block, what its hash covers beside the tokens (the LoRA name if any, media
    pairs, then the ``cache_salt`` on a first block)."""

    @property
    def partition(self) -> str | None:
        """The cache partition the blocks were stored in (:func:`~..core.partitions.cache_partition`)."""
        salt = self.cache_salt
        if salt is None and self.parent_block_hash is None and self.extra_keys:
            first = self.extra_keys[0]
            names = [key for key in first if isinstance(key, str)] if isinstance(first, (list, tuple)) else []
            if self.lora_name is not None and names and names[0] == self.lora_name:
                names = names[1:]
            salt = names[0] if names else None
        try:
            return cache_partition(salt=salt, adapter=self.lora_name)
        except ValueError:  # a name too long for a partition: none we could have sent
            return None

    @model_validator(mode="after")
    def _pages_match_tokens(self) -> BlockStoredEvent:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"{len(self.block_hashes)} blocks of {self.block_size} tokens but {len(self.token_ids)} token ids"
            )
        return self


class BlockRemovedEvent(_Event):
    type: Literal["BlockRemoved"]
    block_hashes: list[BlockHash] = Field(fail_fast=True)
    medium: str | None = None


class AllBlocksClearedEvent(_Event):
    type: Literal["AllBlocksCleared"]


KvEvent = Annotated[BlockStoredEvent | BlockRemovedEvent | AllBlocksClearedEvent, Field(discriminator="type")]


class KvEventBatch(BaseModel):
    """One batch as our SGLang plugin sends it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seq: int = Field(ge=0, lt=2**63)
    events: list[KvEvent] = Field(fail_fast=True)
    """Validated up to the first bad item: a body of invalid ones costs one error, not one each."""
    ts: float | None = Field(default=None, allow_inf_nan=False)
    """Publisher's wall-clock time when the batch was published (for latency)."""
    rank: int = Field(default=0, ge=0, lt=2**31)
    publisher: str = Field(default="default", min_length=1, max_length=200)

    @property
    def block_count(self) -> int:
        return sum(len(getattr(event, "block_hashes", ())) for event in self.events)


def event_to_dict(event: Any) -> dict[str, Any]:
    """An SGLang (msgspec) KV event as JSON-ready data, tagged with its type."""
    import msgspec

    data: dict[str, Any] = msgspec.to_builtins(event)
    data["type"] = type(event).__name__
    return data


def _count(value: object, what: str, where: str) -> int | None:
    if value is None:
        return None
    try:
        return check_token_count(what, value)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"{where} answered a malformed {what}: {exc}") from None


def usage(raw: object, where: str) -> dict[str, Any]:
    """The ``usage`` object, checked: counts are ints in 0..MAX_TOKENS where present.

    Cached tokens above the prompt tokens are left to the caller (the answer itself is
    fine; :func:`~.feedback.report_served` skips such a report with a warning)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise EngineError(f"{where} answered a malformed usage: {raw!r:.100}")
    for name in ("prompt_tokens", "completion_tokens"):
        _count(raw.get(name), name, where)
    details = raw.get("prompt_tokens_details")
    if details is not None:
        if not isinstance(details, dict):
            raise EngineError(f"{where} answered malformed prompt_tokens_details: {details!r:.100}")
        _count(details.get("cached_tokens"), "cached_tokens", where)
    return raw


def prompt_ms(payload: object) -> float | None:
    """llama-server's own prefill time (``timings.prompt_ms``), if the answer says it."""
    timings = payload.get("timings") if isinstance(payload, dict) else None
    value = timings.get("prompt_ms") if isinstance(timings, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def input_ids(payload: dict[str, Any], where: str) -> list[int] | None:
    """The prompt's token ids, when the engine was asked for them: SGLang's
    ``sglext.input_ids``, vLLM's ``prompt_token_ids``."""
    sglext = payload.get("sglext")
    ids = sglext.get("input_ids") if isinstance(sglext, dict) else payload.get("prompt_token_ids")
    if ids and isinstance(ids, list) and isinstance(ids[0], list):  # one list per choice
        ids = ids[0]
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EngineError(f"{where} answered malformed sglext.input_ids")
    return ids


def answer_error(payload: dict[str, Any]) -> str | None:
    """The message of an error object in an answer (``{"error": ...}``), if it is one."""
    error = payload.get("error")
    if error is None or (payload.get("choices") and payload.get("object") != "error"):
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


_KNOWN_EVENTS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """A natively published batch, decoded: what to apply, and what was left out."""

    batch: KvEventBatch
    unknown_events: int
    """Events of a type this version does not know (skipped, counted)."""
    other_groups: int
    """Events of a KV-cache group other than the first (hybrid models; skipped)."""


MAX_BATCH_BYTES = 32 * 1024 * 1024
"""A larger native batch is refused unread (:data:`MAX_BLOCKS` blocks of 16-token pages
take about 20 MB of msgpack)."""


def decode_zmq_batch(
    payload: bytes, seq: int, publisher: str, *, max_blocks: int = MAX_BLOCKS, max_bytes: int = MAX_BATCH_BYTES
) -> DecodedBatch:
    """A native ZMQ payload (SGLang or vLLM ``KVEventBatch``, msgpack) as a validated batch.

    Raises:
        ValueError: the payload is not a batch (malformed or too deeply nested msgpack,
            wrong shape, or an event that fails validation), or it is larger than
            ``max_bytes`` or names more than ``max_blocks`` blocks (refused before any
            event is validated or applied).
    """
    try:
        import msgspec
    except ImportError as exc:
        raise ImportError("reading ZMQ events needs msgspec: pip install 'contextpilot-integrations[engines]'") from exc

    if len(payload) > max_bytes:
        raise ValueError(f"batch of {len(payload):,} bytes, over {max_bytes:,}")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed msgpack: {exc}") from None
    except RecursionError:  # msgspec recurses per level of nesting
        raise ValueError("msgpack nested too deeply") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a batch is [ts, [events...], dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else 0
    known, unknown, other_groups = [], 0, 0
    for event in events:
        if not isinstance(event, dict) or event.get("type") not in _KNOWN_EVENTS:
            unknown += 1
        elif event.get("group_idx") not in (None, 0):
            other_groups += 1
        else:
            known.append(event)
    blocks = sum(len(hashes) for event in known if isinstance(hashes := event.get("block_hashes"), list))
    if blocks > max_blocks:
        raise ValueError(f"batch names {blocks:,} blocks, over {max_blocks:,}")
    try:
        batch = KvEventBatch.model_validate(
            {"seq": seq, "ts": ts if isinstance(ts, (int, float)) else None, "rank": rank,
             "publisher": publisher, "events": known}
        )  # fmt: skip
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"invalid batch: {where}: {error['msg']}") from None
    except RecursionError:
        raise ValueError("batch nested too deeply") from None
    return DecodedBatch(batch, unknown, other_groups)
