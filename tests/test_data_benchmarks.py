"""peagle/data/benchmarks.py: benchmark prompts encoded as the model expects them."""
from transformers import AutoTokenizer

from peagle.data.benchmarks import Prompt, encode_prompt
from peagle.llm import DEMO_TARGET


def test_a_prompt_starts_with_one_bos_whether_or_not_the_template_writes_it():
    """The demo target's corpus follows its BOS, so a prompt gets one; a chat template that writes the BOS itself
    (Llama 3's) must not get a second (a mutation review: always prepending it passed every test)."""
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    bos = tok.bos_token_id
    assert bos is not None
    msgs = [{"role": "user", "content": "Write a function."}]
    raw = encode_prompt(tok, len(tok), Prompt("t", "c", "1", "raw", text="def f(x):"))
    assert raw[0] == bos and raw.count(bos) == 1
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    ids = encode_prompt(tok, len(tok), Prompt("t", "c", "2", "chat", messages=msgs))
    assert ids[0] == bos and ids.count(bos) == 1
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    ids = encode_prompt(tok, len(tok), Prompt("t", "c", "3", "chat", messages=msgs))
    assert ids[0] == bos and ids.count(bos) == 1
