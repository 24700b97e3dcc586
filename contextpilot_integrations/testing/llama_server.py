"""A real prefix-caching engine on any machine: llama.cpp's ``llama-server`` on CPU.

Used by the benchmarks and the test suites of all three distributions; the engine
comparison (``demo --engine-cmd``) starts the command :meth:`LlamaServer.command` gives
through :class:`~contextpilot_integrations.whatif.server_process.ServerProcess`. The
binary is built once from the llama-cpp-python sdist on PyPI by
``scripts/build_llama_server.sh`` (``./run.sh test`` does it) and cached outside the
repository. :func:`write_tiny_gguf` writes a random-weight llama GGUF (~7 MB, about
one token per character): its answers are noise, but prefill is real, so cached tokens and
time to first token are real. :func:`real_llama_server` serves the real model instead
(Gemma 3 270M, :mod:`.real_model`), whose answers can be read. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ..whatif.server_process import ServerProcess, free_port
from .real_model import cache_dir, real_model_gguf

__all__ = [
    "LlamaServer",
    "ServerProcess",
    "free_port",
    "llama_server_binary",
    "real_llama_server",
    "tiny_llama_server",
    "tiny_llama_servers",
    "write_tiny_gguf",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama_server_binary() -> Path | None:
    """``$LLAMA_SERVER``, else the cached build, else ``llama-server`` on ``PATH``."""
    explicit = os.environ.get("LLAMA_SERVER")
    if explicit:
        return Path(explicit)
    candidate = cache_dir() / "llama-server" / "bin" / "llama-server"
    if candidate.exists():
        return candidate
    found = shutil.which("llama-server")
    return Path(found) if found else None


def write_tiny_gguf(
    path: Path, dim: int = 256, layers: int = 4, ff: int = 768, heads: int = 4, ctx: int = 8192
) -> Path:
    """A random-weight llama GGUF with a byte-fallback SentencePiece-style vocabulary.

    Needs the ``gguf`` package (in the ``dev`` extra).
    """
    import numpy as np
    from gguf import GGUFWriter, TokenType

    tokens: list[str] = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
    tokens += [chr(c) for c in range(33, 127)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (1 + 94)
    scores = [0.0] * 259 + [-1.0] + [-2.0] * 94
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    head_dim = dim // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(ctx)
    writer.add_embedding_length(dim)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML)
    writer.add_tensor("token_embd.weight", weight(len(tokens), dim))
    writer.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    writer.add_tensor("output.weight", weight(len(tokens), dim))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(p + name + ".weight", weight(dim, dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
        writer.add_tensor(p + "ffn_gate.weight", weight(ff, dim))
        writer.add_tensor(p + "ffn_up.weight", weight(ff, dim))
        writer.add_tensor(p + "ffn_down.weight", weight(dim, ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaServer(ServerProcess):
    """``llama-server`` on 127.0.0.1, one slot and no RAM prompt cache by default."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        log: Path | None = None,
        extra_args: Sequence[str] = (),
        *,
        context: int = 8192,
        slots: int = 1,
        threads: int = 2,
    ) -> None:
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}"]
        args += ["-c", str(context), "-np", str(slots), "-t", str(threads), "--cache-ram", "0", *extra_args]
        super().__init__(args, log, startup_timeout=60.0)

    @classmethod
    def command(cls, binary: Path, model: Path, extra_args: Sequence[str] = ()) -> str:
        """The command line ``demo --engine-cmd`` takes for this server (``{port}`` kept)."""
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}"]
        args += ["-c", "8192", "-np", "1", "-t", "2", "--cache-ram", "0", *extra_args]
        return shlex.join(args)


def _required(found: Path | None, what: str, how: str, skip: Callable[[str], object]) -> Path:
    """``found``; else ``skip(reason)`` (e.g. ``pytest.skip``), or a ``RuntimeError`` where
    ``CONTEXTPILOT_REQUIRE_ENGINE`` is set (CI: the test must run, not skip)."""
    if found is not None:
        return found
    if os.environ.get("CONTEXTPILOT_REQUIRE_ENGINE"):
        raise RuntimeError(f"{what} not found; run {how}")
    skip(f"{what} not found; ./run.sh test runs {how}")
    raise RuntimeError(f"{what} not found")  # skip() raises in pytest; here for other callers


def tiny_llama_server(
    workdir: Path, skip: Callable[[str], object], log_name: str = "llama-server.log", **options: Any
) -> LlamaServer:
    """A llama-server with the tiny model (written once into ``workdir``), for test suites.

    Without a binary: ``skip(reason)`` (e.g. ``pytest.skip``), or a ``RuntimeError`` where
    ``CONTEXTPILOT_REQUIRE_ENGINE`` is set (CI: the test must run, not skip).
    """
    binary = _required(llama_server_binary(), "llama-server", "scripts/build_llama_server.sh", skip)
    model = workdir / "tiny.gguf"
    if not model.exists():
        write_tiny_gguf(model)
    return LlamaServer(binary, model, workdir / log_name, **options)


def real_llama_server(
    workdir: Path, skip: Callable[[str], object], log_name: str = "llama-server-real.log", **options: Any
) -> LlamaServer:
    """A llama-server with the real model (:func:`~.real_model.real_model_gguf`), one slot:
    greedy answers are the same on every run of one build. Skips (or raises, as
    :func:`tiny_llama_server`) without the binary or the model."""
    binary = _required(llama_server_binary(), "llama-server", "scripts/build_llama_server.sh", skip)
    model = _required(real_model_gguf(), "the real model (Gemma 3 270M)", "scripts/fetch_real_model.sh", skip)
    return LlamaServer(binary, model, workdir / log_name, **{"context": 16384, **options})


@contextmanager
def tiny_llama_servers(
    workdir: Path, skip: Callable[[str], object], count: int, **options: Any
) -> Iterator[list[LlamaServer]]:
    """``count`` tiny llama-servers (replicas to route between), stopped on exit."""
    with ExitStack() as stack:
        servers = []
        for n in range(count):
            server = tiny_llama_server(workdir, skip, f"server{n}.log", **options)
            stack.callback(server.stop)
            servers.append(server)
        yield servers
