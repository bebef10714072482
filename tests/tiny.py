"""Tiny random-initialised HF models of each supported family, saved to disk (the real peer for parity)."""
from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(family: str, vocab=512, hidden=64, layers=4, heads=4, kv=2, **kw):
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    common.update(kw)
    if family == "llama":
        rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 128, "rope_theta": 500000.0}
        return tf.LlamaConfig(rope_parameters=rs, **common)
    if family == "qwen2":
        return tf.Qwen2Config(tie_word_embeddings=True, **{k: v for k, v in common.items() if k != "tie_word_embeddings"})
    if family == "qwen3":
        return tf.Qwen3Config(head_dim=32, **common)
    if family == "mistral":
        return tf.MistralConfig(sliding_window=None, **common)
    raise ValueError(family)


def save_tiny(family: str, path: str, seed=0, **kw) -> str:
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger-than-default init so logits are not flat (ties would hide bugs)
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    model.eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(path: str, vocab=400) -> str:
    """A small byte-level BPE with EOS/pad/ChatML/mask specials (ids 0..4), trained in well under a second."""
    import inspect
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = inspect.getsource(inspect) * 2
    tok.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)],
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return path


def save_tiny_text_model(path: str, family="llama", seed=0) -> str:
    """Tiny random model + tokenizer + chat template, EOS id 0 (for text-level tests: CLI, server)."""
    save_tiny(family, path, seed=seed, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    save_tiny_tokenizer(path)
    return path
