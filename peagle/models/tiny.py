"""Tiny random-initialised HF models of each supported family (and a tiny tokenizer), saved to disk: the
tests' real peer for parity, and what `lab/measure/load_test.py --tiny` serves. Random weights: gibberish text."""
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
        return tf.MistralConfig(**{"sliding_window": None, **common})
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


# the server tests' tokenizer: ChatML specials at ids 0..4 and a generic English/Unicode/code text
SERVE_SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]     # ids 0..4 (tiny config: bos 1, eos 2)

_SERVE_TEXT = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with a small
head and verifies them with the target model in one forward pass, so the output is exactly what the target
alone would produce. Continuous batching lets requests join and leave the running batch at every step.
Servers stream tokens to clients with server-sent events; each event carries a small JSON chunk.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\
Unicode: café naïve résumé über Straße 東京 日本語 中文 한국어 😀 🚀 ✓ € £ ¥ — “quotes” ‘single’ …
def main(): return sum(x * x for x in range(10))  # code is text too
Once upon a time, in a land far away, there lived a curious engineer who liked fast inference.
"""


def make_tiny_tokenizer(out_dir: str, vocab_size: int = 512, model_max_length: int = 1024):
    """Train a byte-level BPE on a few KB of text and save it (with a ChatML chat template) into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SERVE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_SERVE_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   clean_up_tokenization_spaces=False, model_max_length=model_max_length)
    fast.chat_template = CHATML
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
