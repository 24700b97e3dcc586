"""A real prefix-caching engine for the tests: llama.cpp's ``llama-server`` on CPU.

The binary is built once from the llama-cpp-python sdist on PyPI by
``scripts/build_llama_server.sh`` (``./run.sh test`` does it) and cached outside the
repository. The model is a tiny random-weight llama GGUF written here with the ``gguf``
package (~7 MB, about one token per character): its answers are noise, but prefill is
real, so cached tokens and time-to-first-token are real. Loopback only.
Set ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI does) to fail instead of skip without a binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama_server_binary() -> Path | None:
    explicit = os.environ.get("LLAMA_SERVER")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("CONTEXTPILOT_CACHE", Path.home() / ".cache" / "contextpilot-integrations"))
    candidate = cache / "llama-server" / "bin" / "llama-server"
    if candidate.exists():
        return candidate
    found = shutil.which("llama-server")
    return Path(found) if found else None


def write_tiny_gguf(
    path: Path, dim: int = 256, layers: int = 4, ff: int = 768, heads: int = 4, ctx: int = 8192
) -> Path:
    """A random-weight llama GGUF with a byte-fallback SentencePiece-style vocabulary."""
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """``llama-server`` on 127.0.0.1 with one slot and no RAM prompt cache by default."""

    def __init__(self, binary: Path, model: Path, log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["-c", "8192", "-np", "1", "-t", "2", "--cache-ram", "0", *extra_args]
        self._log = log.open("w")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("llama-server did not become healthy in 60 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def start_llama_server(workdir: Path, extra_args: tuple[str, ...] = ()) -> LlamaServer:
    binary = llama_server_binary()
    if binary is None:
        if os.environ.get("CONTEXTPILOT_REQUIRE_ENGINE"):
            raise RuntimeError("llama-server not found; run scripts/build_llama_server.sh")
        pytest.skip("llama-server not built; ./run.sh test builds it")
    model = workdir / "tiny.gguf"
    if not model.exists():
        write_tiny_gguf(model)
    return LlamaServer(binary, model, workdir / "llama-server.log", extra_args)
