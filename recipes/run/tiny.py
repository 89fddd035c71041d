"""The built-in model: a tiny Llama built from a config, and a character tokenizer built
locally, so the default recipe needs no download."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

SPECIAL = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character; specials first so their ids do not move with the alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", padding_side="right")


def tiny_llama(tokenizer, seed: int, hidden_size: int = 128, num_hidden_layers: int = 2,
               num_attention_heads: int = 4, num_key_value_heads: int = 2,
               intermediate_size: int | None = None, max_position_embeddings: int = 64):
    """Random-init Llama sized by the config's `tiny_model` dict (fp32: CPU training)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
