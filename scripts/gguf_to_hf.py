"""Write a GGUF model out as a Hugging Face folder that vLLM and SGLang serve (the real model
for the live-engine benchmarks: Gemma 3 270M). Run by scripts/convert_real_model.sh in a
throwaway environment with torch, transformers, gguf and accelerate.

Usage: python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR

Two things transformers' GGUF loader (5.19) leaves to the caller: the weights must be
dequantized when loaded, or the model refuses to be saved; and the tokenizer it builds does
not add ``<bos>`` although the GGUF asks for it, without which Gemma answers nonsense.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(source: Path, out: Path) -> None:
    torch.set_num_threads(1)
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise SystemExit(f"still quantized after loading: {packed}")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    bos = tokenizer.bos_token
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    ids = AutoTokenizer.from_pretrained(out)("Hello world")["input_ids"]
    if ids[0] != tokenizer.bos_token_id:
        raise SystemExit(f"the saved tokenizer adds no <bos>: {ids}")
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
