"""The shipped demo target loads with transformers (model + tokenizer + chat template) and with peagle's
native model, and their logits agree."""
import os

import pytest
import torch

from peagle.llm import DEMO_TARGET
from peagle.models.llama import Transformer

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_TARGET, "model.safetensors")),
                                reason="demo target not built")


def test_demo_target_transformers_and_native_logits_agree():
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(DEMO_TARGET)
    hf = tf.AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(DEMO_TARGET)
    texts = ["def add(a, b):\n    return a + b\n", "import os\nfor name in os.listdir('.'):\n"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi! What is a list?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    for t in texts + [chat]:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == t
        x = torch.tensor([ids])
        with torch.no_grad():
            want = hf(x).logits[0]
        got, _ = ours.forward(x, ours.new_cache(1, len(ids) + 4), 0, torch.zeros(1, dtype=torch.long))
        assert (got[0] - want).abs().max() < 1e-4
    assert tok.convert_tokens_to_ids("<|mask|>") == 4
