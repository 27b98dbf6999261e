"""Write a tiny Llama for the real vLLM of the e2e tests: no model can be downloaded there.

Usage: `/opt/vllm/bin/python make_tiny_llama.py DIR` (in the test tree's venv: transformers,
tokenizers and torch are vLLM's own dependencies). Deterministic: random weights from a fixed
seed, a byte-level BPE tokenizer trained on the lines below. head_dim must be 64: vLLM's CPU
attention refuses 16 ("Unsupported CPU attention configuration: head_dim=16"), so hidden 256 with
4 heads; 2 layers. It answers nonsense, quickly: the tests need its processes, not its words.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A restart loop of an inference server is a stale process holding GPU memory.",
    "gpuguard gates the next start until the memory of the ended run is free.",
    "Hello, my name is a tiny model with random weights and sixty-four wide heads.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
SPECIAL = ["<unk>", "<s>", "</s>"]
VOCAB = 512
SEED = 34


def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB tokens trained on LINES, as a transformers tokenizer."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))  # noqa: S106 - a token's name, no secret
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(LINES, trainer=trainer)
    names = dict(zip(("unk_token", "bos_token", "eos_token"), SPECIAL, strict=True))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **names)


def main() -> None:
    """Write the model and its tokenizer into the directory given."""
    out = Path(sys.argv[1])
    tok = tokenizer()
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"tiny llama: {sum(p.stat().st_size for p in out.iterdir())} bytes in {out}")  # noqa: T201


if __name__ == "__main__":
    main()
