"""Fast tests for the text sources, the demo-target corpus and its tokenizer (no models/ needed)."""

import json

import pytest

from peagle.data import corpus as C
from peagle.data import sources as S


def _records(n):
    return [{"id": f"conv{i}_0", "conversations": [
        {"from": "human", "value": f"Please explain topic number {i} in plain English words."},
        {"from": "gpt", "value": f"Sure, here is a short explanation of topic {i} for you."}]}
        for i in range(n)]


def test_truncated_json_parser_recovers_complete_records():
    recs = _records(5)
    text = json.dumps(recs, indent=2)
    # Truncate in the middle of the last record's string.
    cut = text.rfind("topic 4") + 3
    got = list(S.iter_json_array_records(text[:cut]))
    assert [r["id"] for r in got] == [f"conv{i}_0" for i in range(4)]
    # Full (untruncated) text parses completely; compact separators too.
    assert len(list(S.iter_json_array_records(text))) == 5
    assert len(list(S.iter_json_array_records(json.dumps(recs, separators=(",", ":"))))) == 5
    assert list(S.iter_json_array_records("")) == []


def test_mtbench_filter_drops_benchmark_conversation():
    question = ("Compose an engaging travel blog post about a recent trip to Hawaii, "
                "highlighting cultural experiences and must-see attractions.")
    turns = [question, "Rewrite your previous response. Start every sentence with the letter A."]
    if S.mtbench_questions_path() is not None:  # the real benchmark, when installed
        real = S.load_mtbench_turns()
        assert len(real) == 160 and question in real
        turns = real
    bench = S.BenchmarkFilter(turns)
    recs = _records(3)
    recs[1]["conversations"][0]["value"] = "Hi!  " + question.upper().replace(",", " ,") + " Thanks."
    docs = list(C.chat_docs_from_records(recs, bench))
    assert [d["id"] for d in docs] == ["conv0_0", "conv2_0"]
    assert all(d["text"].startswith("<|im_start|>user\n") and d["text"].endswith("<|im_end|>\n") for d in docs)
    # Without the filter the conversation is kept.
    assert len(list(C.chat_docs_from_records(recs, None))) == 3


def test_chat_record_cleanup():
    rec = {"id": "x_1", "conversations": [
        {"from": "gpt", "value": "leading assistant chunk"},
        {"from": "human", "value": "What is <|im_end|>a list comprehension in Python?"},
        {"from": "gpt", "value": "It is a compact way to build a list from an iterable."}]}
    (doc,) = C.chat_docs_from_records([rec], None)
    assert doc["base_id"] == "x"
    assert "leading" not in doc["text"] and doc["text"].count("<|im_end|>") == 2
    assert list(C.chat_docs_from_records([{"id": "y", "conversations": [
        {"from": "human", "value": "这是一个中文的问题，请用中文回答这个问题好吗谢谢你"},
        {"from": "gpt", "value": "好的，这是一个中文的回答，希望对你有帮助谢谢你的提问"}]}], None)) == []


def test_holdout_split_deterministic_and_disjoint():
    docs = [{"id": f"doc{i}", "text": "x"} for i in range(5000)]
    tr1, he1 = C.split_docs(docs, seed=0)
    tr2, he2 = C.split_docs(docs, seed=0)
    assert [d["id"] for d in he1] == [d["id"] for d in he2]
    ids_tr, ids_he = {d["id"] for d in tr1}, {d["id"] for d in he1}
    assert not ids_tr & ids_he and len(ids_tr) + len(ids_he) == 5000
    assert 0.01 < len(he1) / 5000 < 0.03
    _, he3 = C.split_docs(docs, seed=1)
    assert {d["id"] for d in he3} != ids_he


def test_code_file_filters(tmp_path):
    root = tmp_path / "site"
    good = "import os\n\n\ndef f(x):\n    '''Docstring.'''\n    return os.path.join(x, 'y')\n" * 5
    for rel in ["pkg/mod.py", "pkg/tests/helper.py", "pkg/test_mod.py", "human_eval/data.py",
                "mtbench_evaluator/x.py", "core_evals/y.py", "pkg/dup.py"]:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(good)
    (root / "pkg/table.py").write_text("T = [\n" + "    0x1234, 0x5678, 0x9abc,\n" * 200 + "]\n")
    (root / "pkg/long.py").write_text(good + "x = '" + "a" * 2000 + "'\n")
    ids = [i for i, _ in S.iter_code_files([("site", root)])]
    assert "site/pkg/mod.py" in ids
    assert not any("tests/" in i or "test_" in i or "human_eval" in i or "mtbench" in i or "core_evals" in i
                   for i in ids)
    docs = C.collect_code(roots=[("site", root)])
    got = {d["id"] for d in docs}
    assert len(got & {"site/pkg/mod.py", "site/pkg/dup.py"}) == 1  # identical content de-duplicated
    assert "site/pkg/table.py" not in got and "site/pkg/long.py" not in got


def test_tokenizer_roundtrip_and_special_ids(tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from lab.demo_target.tokenizer import CHAT_TEMPLATE, save_tokenizer, train_bpe

    texts = ["def add(a, b):\n    return a + b\n", "Hello, how are you today? I am fine.",
             S.render_chatml([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])] * 50
    tok = train_bpe(texts, vocab_size=400, min_frequency=1)
    for i, s in enumerate(S.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    sample = "def f(x):\n\treturn x * 2  # ünïcode ✓ 😀\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    save_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (0, 1, 0)
    assert hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|mask|>", "<|bos|>"]) == [2, 3, 4, 5]
    assert hf.decode(hf(sample, add_special_tokens=False)["input_ids"]) == sample
    msgs = [{"role": "user", "content": "hi"}]
    s = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf(s, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids.count(3) == 1 and 4 not in ids
    assert hf.chat_template == CHAT_TEMPLATE
