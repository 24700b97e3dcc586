# mypy: disable-error-code="no-untyped-call,call-arg,arg-type,unused-ignore"
# (transformers typing differs between the engine venvs that run this file)
"""Write a tiny random-weight Llama in Hugging Face format for engines that load HF
directories (vLLM, SGLang): ``config.json``, ``model.safetensors``, a byte-level tokenizer
(one token per byte, plus ``<s>``/``</s>``) and a ChatML chat template. No download.

Its answers are noise, but prefill, prefix caching and KV events are real. Run with the
engine's own Python (it needs torch, transformers and tokenizers, which this package does
not): ``python tiny_hf.py OUT_DIR``. Adapted from the project's CPU recipes
(make_tiny_hf.py, used by live_vllm_cpu.sh / live_sglang_cpu.sh).
"""

from __future__ import annotations

import argparse

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_hf(out: str, dim: int = 256, layers: int = 4, ff: int = 768, heads: int = 4, ctx: int = 8192) -> None:
    """Write the model and tokenizer into ``out`` (seeded: the same weights every time)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):  # 256 printable stand-ins for bytes
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=dim, intermediate_size=ff, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=ctx,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    write_tiny_hf(parser.parse_args().out)


if __name__ == "__main__":
    main()
