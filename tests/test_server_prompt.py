"""peagle/server/prompt.py (and LLM.generate's text prompts): a text prompt is encoded as vLLM encodes it, with
the tokenizer's special tokens (a Llama tokenizer's BOS) unless the request's add_special_tokens is false."""
import json
import os
import shutil
import types

from tiny import make_tiny_tokenizer
from transformers import AutoTokenizer

from peagle import LLM
from peagle.server.prompt import completion_prompt
from peagle.server.protocol import CompletionRequest


def _bos_tokenizer_dir(src, d):
    """src's model with the tiny tokenizer made to put <s> first, as Llama's does."""
    shutil.copytree(src, d)
    make_tiny_tokenizer(d)
    with open(os.path.join(d, "tokenizer.json")) as f:
        tj = json.load(f)
    bos = next(t["id"] for t in tj["added_tokens"] if t["content"] == "<s>")
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    return d, bos


def test_text_prompts_get_the_tokenizers_special_tokens_as_in_vllm(tiny_dirs, tmp_path):
    d, bos = _bos_tokenizer_dir(tiny_dirs["llama"], str(tmp_path / "m"))
    tok = AutoTokenizer.from_pretrained(d)
    bare = tok("Hello there", add_special_tokens=False)["input_ids"]
    assert bare[0] != bos
    state = types.SimpleNamespace(tokenizer=tok, vocab_size=512, max_model_len=1024,
                                  limits=types.SimpleNamespace(prompt_tokens=lambda ctx: ctx - 1, max_prompt_chars=None))
    req = CompletionRequest(prompt="Hello there")
    assert req.add_special_tokens is True
    assert completion_prompt(state, req.prompt, req.add_special_tokens)[0] == [bos] + bare
    assert completion_prompt(state, "Hello there", False)[0] == bare               # vLLM's add_special_tokens=false
    assert completion_prompt(state, [5, 6], True)[0] == [5, 6]                     # token ids are taken as given
    out = LLM(d).generate("Hello there")[0]
    assert out.prompt_token_ids == [bos] + bare


def test_many_empty_messages_are_refused_before_the_template(tiny_dirs, tmp_path):
    """The cheap bound counted the messages' content only: 500,000 empty messages (8 MB, under the body limit)
    passed it and were rendered and tokenized (15-20 s on the event loop, ~2 GB) before the length check."""
    from peagle.server.prompt import chat_prompt
    from peagle.server.protocol import ApiError, ChatRequest
    d = str(tmp_path / "m")
    shutil.copytree(tiny_dirs["llama"], d)
    make_tiny_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(d)
    calls = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or real(*a, **k)
    state = types.SimpleNamespace(tokenizer=tok, vocab_size=512, max_model_len=100, model_name="m",
                                  limits=types.SimpleNamespace(prompt_tokens=lambda ctx: ctx - 1))
    many = ChatRequest(messages=[{"role": "user"}] * 5000)       # 64 x 99 + 4096 = 10,432 chars allowed
    try:
        chat_prompt(state, many)
        raise AssertionError("not refused")
    except ApiError as e:
        assert e.status == 400 and e.param == "messages" and "far longer" in e.message, e.message
    assert not calls                                            # refused before rendering
    assert chat_prompt(state, ChatRequest(messages=[{"role": "user"}] * 3)) and calls   # a few: rendered
