"""The demo-target trainer on a tiny corpus: bit-identical resume, warm restart (--init), shape flags."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lab.demo_target import train

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo-target"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target-data")
    corpus = d / "corpus"
    corpus.mkdir()
    code = [f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n    return x + {i}\n" * 4 for i in range(40)]
    chat = [f"<|im_start|>user\nWhat is {i}?<|im_end|>\n<|im_start|>assistant\nIt is {i}.<|im_end|>\n" * 3
            for i in range(40)]
    for src, docs in (("code", code), ("chat", chat)):
        for split, part in (("train", docs[:28]), ("heldout", docs[28:])):
            (corpus / f"{src}.{split}.jsonl").write_text("".join(json.dumps({"id": str(k), "text": t}) + "\n"
                                                                  for k, t in enumerate(part)))
    (corpus / "manifest.json").write_text("{}")
    (d / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO / f).exists():
            shutil.copy(DEMO / f, d / "tokenizer" / f)
    return d


def run(data_dir, tmp, name, *extra):
    out, rd = tmp / name, tmp / f"{name}-run"
    train.main(["--tiny", "--data-dir", str(data_dir), "--run-dir", str(rd), "--out", str(out), "--max-tokens",
                str(8 * 2 * 64), "--batch-size", "2", "--seq-len", "64", "--warmup-steps", "2", "--eval-rows", "4",
                "--threads", "1", "--device", "cpu", *extra])
    return out, rd


def weights(out):
    return load_file(str(out / "model.safetensors"))


def test_resume_is_bit_identical_and_init_loads_weights(data_dir, tmp_path):
    full, _ = run(data_dir, tmp_path, "full")
    stats = json.loads((full / "training_stats.json").read_text())
    assert stats["steps"] == 8
    part, rd = run(data_dir, tmp_path, "part", "--max-steps", "3")
    assert json.loads((part / "training_stats.json").read_text())["steps"] == 3
    train.main(["--tiny", "--data-dir", str(data_dir), "--run-dir", str(rd), "--out", str(part), "--max-tokens",
                str(8 * 2 * 64), "--batch-size", "2", "--seq-len", "64", "--warmup-steps", "2", "--eval-rows", "4",
                "--threads", "1", "--device", "cpu", "--resume"])
    a, b = weights(full), weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # --init with no steps writes the initial weights back unchanged; a trained step moves them
    same, _ = run(data_dir, tmp_path, "init0", "--init", str(full), "--max-steps", "0")
    c = weights(same)
    assert all(torch.equal(a[k], c[k]) for k in a)
    moved, _ = run(data_dir, tmp_path, "init1", "--init", str(full), "--max-steps", "1")
    assert any(not torch.equal(a[k], weights(moved)[k]) for k in a)


def test_init_refuses_a_different_shape(data_dir, tmp_path):
    full, _ = run(data_dir, tmp_path, "full", "--max-steps", "1")
    with pytest.raises(SystemExit, match="num_hidden_layers"):
        run(data_dir, tmp_path, "other", "--init", str(full), "--layers", "3")


def test_evaluate_target_runs_on_a_trained_model(data_dir, tmp_path):
    """The goals' evaluator (held-out loss vs unigram, HumanEval parse/repetition) on a tiny trained model."""
    from lab.demo_target import evaluate_target

    out, _ = run(data_dir, tmp_path, "m", "--max-steps", "2")
    evaluate_target.main([str(out), "--data-dir", str(data_dir), "--eval-rows", "2", "--limit", "2",
                          "--max-new-tokens", "8", "--threads", "1", "--device", "cpu"])
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev["heldout"]) == {"code", "chat"} and ev["heldout"]["code"]["loss"] > 0
    assert ev["humaneval"]["prompts"] == 2 and 0 <= ev["humaneval"]["parse_fraction"] <= 1
    assert 0 <= ev["humaneval"]["stopped_fraction"] <= 1


def test_start_row_moves_the_data_position_and_resume_keeps_it(data_dir, tmp_path):
    a, _ = run(data_dir, tmp_path, "r0", "--max-steps", "1")
    b, rd = run(data_dir, tmp_path, "r2", "--max-steps", "1", "--start-row", "2")
    assert json.loads((b / "training_stats.json").read_text())["start_row"] == 2
    assert torch.load(rd / "ckpt.pt", weights_only=False)["data_position"] == 2 + 1 * 2
    wa, wb = weights(a), weights(b)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # same step, other rows
    with pytest.raises(SystemExit, match="started at row 2"):
        run(data_dir, tmp_path, "r2", "--resume")  # same run directory, default --start-row 0
    with pytest.raises(SystemExit, match="--start-row -1"):
        run(data_dir, tmp_path, "neg", "--start-row", "-1")
