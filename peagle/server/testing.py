"""Test/bench helpers: a tiny byte-level BPE tokenizer with a ChatML template for tiny random models."""
from __future__ import annotations

import os

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]     # ids 0..4 (tiny config: bos 1, eos 2)

_TEXT = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with a small
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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   clean_up_tokenization_spaces=False, model_max_length=model_max_length)
    fast.chat_template = CHATML
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
