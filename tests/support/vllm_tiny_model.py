"""A tiny Llama for vLLM tests, made locally (no download): random weights from a fixed seed.

Hidden 128 with 4 heads (head size 32: vLLM's CPU attention refuses 16), 2 layers, a 1000-word
vocabulary with a word-level tokenizer ("w0 w1 ..."), float32. `python -m tests.support.vllm_tiny_model DIR`.
"""

from __future__ import annotations

import os
import sys

VOCAB = 1000
SEED = 0


def make(out: str) -> str:
    """Write the model and tokenizer to `out` (kept if already there); return `out`."""
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    tmp = out + ".part"
    LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    print(make(sys.argv[1]))
