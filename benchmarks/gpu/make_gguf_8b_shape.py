"""Write a random-weight GGUF with a real model's shape (default: Llama-3.1-8B) and a
character-level SentencePiece-style vocabulary (about one token per ASCII character).

The weights are random, so answers are noise; prefill cost is what it is for the real
shape, which is all a time-to-first-token comparison needs. One random matrix per shape
is reused by every layer, so writing 16 GB takes seconds, not minutes.

Copied from the team's shared recipes (recipes/gpu/make_gguf_8b_shape.py) so that the GPU
benchmark runs from this repository alone; needs numpy and gguf.
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGUFWriter, TokenType

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocab():
    toks, scores, types = ["<unk>", "<s>", "</s>"], [0.0] * 3, [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        toks.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(TokenType.BYTE)
    toks.append("\u2581")
    scores.append(-1.0)
    types.append(TokenType.NORMAL)
    for c in range(33, 127):
        toks.append(chr(c))
        scores.append(-2.0)
        types.append(TokenType.NORMAL)
    return toks, scores, types


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=65536)
    a = ap.parse_args()
    toks, scores, types = vocab()
    nv, d, hd = len(toks), a.dim, a.dim // a.heads
    kv = hd * a.kv_heads
    rng = np.random.default_rng(0)
    cache = {}

    def w(*shape):
        if shape not in cache:
            cache[shape] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        return cache[shape]

    ones = np.ones(d, dtype=np.float32)
    g = GGUFWriter(a.out, "llama")
    g.add_name("random-llama-shape")
    g.add_context_length(a.ctx)
    g.add_embedding_length(d)
    g.add_block_count(a.layers)
    g.add_feed_forward_length(a.ff)
    g.add_head_count(a.heads)
    g.add_head_count_kv(a.kv_heads)
    g.add_rope_dimension_count(hd)
    g.add_rope_freq_base(500000.0)
    g.add_layer_norm_rms_eps(1e-5)
    g.add_vocab_size(nv)
    g.add_file_type(1)
    g.add_tokenizer_model("llama")
    g.add_token_list(toks)
    g.add_token_scores(scores)
    g.add_token_types(types)
    g.add_unk_token_id(0)
    g.add_bos_token_id(1)
    g.add_eos_token_id(2)
    g.add_add_bos_token(True)
    g.add_add_eos_token(False)
    g.add_chat_template(CHATML)
    g.add_tensor("token_embd.weight", w(nv, d))
    g.add_tensor("output_norm.weight", ones)
    g.add_tensor("output.weight", w(nv, d))
    for i in range(a.layers):
        p = f"blk.{i}."
        g.add_tensor(p + "attn_norm.weight", ones)
        g.add_tensor(p + "attn_q.weight", w(d, d))
        g.add_tensor(p + "attn_k.weight", w(kv, d))
        g.add_tensor(p + "attn_v.weight", w(kv, d))
        g.add_tensor(p + "attn_output.weight", w(d, d))
        g.add_tensor(p + "ffn_norm.weight", ones)
        g.add_tensor(p + "ffn_gate.weight", w(a.ff, d))
        g.add_tensor(p + "ffn_up.weight", w(a.ff, d))
        g.add_tensor(p + "ffn_down.weight", w(d, a.ff))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    print(f"wrote {a.out}: vocab={nv} dim={d} layers={a.layers} ff={a.ff} heads={a.heads}/{a.kv_heads}", flush=True)


if __name__ == "__main__":
    main()
