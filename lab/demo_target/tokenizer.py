"""Byte-level BPE tokenizer for the demo target model.

Special tokens have fixed ids 0..5 (see ``SPECIAL_TOKENS``):
``<|endoftext|>``=0 (document EOS/BOS), ``<|pad|>``=1, ``<|im_start|>``=2,
``<|im_end|>``=3, ``<|mask|>``=4 (reserved for P-EAGLE drafters, never in the
data), ``<|bos|>``=5 (unused).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, Iterator

from peagle.data.corpus import read_jsonl_texts
from peagle.data.sources import SPECIAL_TOKENS

EOS_ID, PAD_ID, IM_START_ID, IM_END_ID, MASK_ID, BOS_ID = range(6)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with the fixed special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def wrap(tok):
    """Wrap a ``tokenizers.Tokenizer`` as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|mask|>", "<|bos|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def generation_config_dict() -> dict:
    return {"bos_token_id": EOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID,
            "do_sample": False}


def save_tokenizer(tok, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrap(tok).save_pretrained(str(out))


def _sample(paths_and_bytes: list[tuple[Path, int]], seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for path, budget in paths_and_bytes:
        texts = list(read_jsonl_texts(path))
        rng.shuffle(texts)
        used = 0
        for t in texts:
            if used >= budget:
                break
            yield t
            used += len(t)


def build_tokenizer(corpus_dir: str | Path, out_dir: str | Path, vocab_size: int = 8192,
                    sample_bytes: int = 40_000_000, seed: int = 0, log=print):
    """Train on ~``sample_bytes`` of the training corpus (half code, half chat);
    reuse ``out_dir`` if it already holds a tokenizer.  Returns the HF tokenizer."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if not (out / "tokenizer.json").exists():
        c = Path(corpus_dir)
        log(f"tokenizer: training byte-level BPE, vocab {vocab_size}, on ~{sample_bytes / 1e6:.0f} MB ...")
        tok = train_bpe(_sample([(c / "code.train.jsonl", sample_bytes // 2),
                                 (c / "chat.train.jsonl", sample_bytes // 2)], seed), vocab_size)
        save_tokenizer(tok, out)
        (out / "generation_config.json").write_text(json.dumps(generation_config_dict(), indent=2))
    return AutoTokenizer.from_pretrained(str(out))
