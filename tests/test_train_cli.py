"""The training-data commands (datagen, hidden-states, train) as a user meets them: data made by another target
is refused before anything loads, no run writes into a model's directory or leaves an empty --out behind,
numeric flags are checked first, data files get the modes a plain write gives, and what a run drops or skips
is said (documents too short to train on, a --resume with nothing to resume, the totals of a datagen run)."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from headfiles import write_target

from peagle.cli import main
from peagle.llm import DEFAULT_MODEL
from peagle.train.checks import check_data_model
from peagle.train.data import read_shard, shard_path, write_shard

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo-target"


def one_line(capsys, args) -> str:
    """Run `peagle ARGS` in-process; its single error line (`peagle: error: ...`), nothing else on stderr."""
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("peagle: error:"), err
    return lines[0]


def docs(n: int, short: int = 0, seed: int = 0) -> list:
    """n documents of 6 prompt tokens + 10 supervised ones; the last `short` have a single supervised token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        gen = 1 if i >= n - short else 10
        out.append((torch.randint(5, 90, (6 + gen,), generator=g).tolist(), [0] * 6 + [1] * gen))
    return out


def datagen_dir(d, model, rows) -> str:
    """A datagen-format directory whose prompts.json says `model` made it."""
    os.makedirs(d, exist_ok=True)
    write_shard(shard_path(str(d), 0), rows)
    with open(os.path.join(d, "prompts.json"), "w") as f:
        json.dump({"settings": {"model": str(model)}, "items": []}, f)
    return str(d)


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target")


def test_data_files_get_the_umask_modes(tmp_path):
    """safetensors writes 0600: a shard and a hidden-state sample were unreadable to another user (a training
    job, a server) whatever the umask; they get 0666 & ~umask, as a plain open gives."""
    from peagle.train.hidden_states import sample_path, write_sample
    old = os.umask(0o022)
    try:
        for umask in (0o022, 0o007):
            os.umask(umask)
            d = tmp_path / f"u{umask:o}"
            d.mkdir()
            write_shard(shard_path(str(d), 0), docs(2))
            write_sample(str(d), 0, torch.arange(4), torch.zeros(4, 2, 8), torch.ones(4))
            for fn in (shard_path(str(d), 0), sample_path(str(d), 0)):
                assert os.stat(fn).st_mode & 0o777 == 0o666 & ~umask, (fn, oct(os.stat(fn).st_mode))
    finally:
        os.umask(old)


def test_train_and_hidden_states_refuse_data_of_another_target(tmp_path, target, capsys):
    """Token ids (and states) of one model mean nothing to another: a garbage head was trained and saved with
    exit 0. The refusal names both models, before either loads."""
    data = datagen_dir(tmp_path / "gen", DEMO, docs(4))
    err = one_line(capsys, ["train", "--method", "eagle3", "--target", target, "--data", data,
                            "--out", tmp_path / "h"])
    assert f"{data} was made by {DEMO}" in err and f"--target is {target}" in err and "vocab_size" in err
    err = one_line(capsys, ["hidden-states", "--model", target, "--data", data, "--out", tmp_path / "hs"])
    assert str(DEMO) in err and f"--model is {target}" in err
    assert not (tmp_path / "h").exists() and not (tmp_path / "hs").exists()
    # a hidden-state cache records its model too (portable: relative to the checkout, found from anywhere)
    hs = tmp_path / "cache"
    hs.mkdir()
    (hs / "hidden_states.json").write_text(json.dumps({"format": "speculators-hs", "layer_ids": [1, 4],
                                                       "hidden_size": 32, "model": "models/demo-target"}))
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        err = one_line(capsys, ["train", "--method", "eagle3", "--target", target, "--data", hs, "--out", "h2"])
    finally:
        os.chdir(old)
    assert "was made by models/demo-target" in err
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")):      # no --target: the default one's
        err = one_line(capsys, ["train", "--method", "eagle3", "--data", data, "--out", tmp_path / "h3"])
        assert str(DEMO) in err and "(the default)" in err


def test_the_data_model_is_compared_by_its_config_not_its_path(tmp_path, capsys, monkeypatch):
    """The same model by a relative path or as a copy is accepted; token shards need only the target's tokenizer
    (a sibling of another size may have written the answers), a hidden-state cache the very model; the fields
    recorded in the data decide where the recorded path names nothing here (peagle writes <external>/NAME for
    models outside the checkout); with neither, a note says it was not checked."""
    from peagle.errors import PeagleError
    from peagle.train.checks import model_identity
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(DEMO / "config.json", copy / "config.json")
    data = datagen_dir(tmp_path / "gen", DEMO, docs(2))
    check_data_model(data, str(copy), "--target")
    monkeypatch.chdir(DEMO.parent.parent)
    check_data_model(datagen_dir(tmp_path / "rel", "models/demo-target", docs(2)), str(DEMO), "--target")
    check_data_model(data, "models/demo-target", "--target")
    assert capsys.readouterr().err == ""
    gone = datagen_dir(tmp_path / "gone", tmp_path / "deleted-model", docs(2))
    check_data_model(gone, str(copy), "--target")
    assert "not found here: not checked" in capsys.readouterr().err
    states = tmp_path / "states"
    states.mkdir()
    (states / "hidden_states.json").write_text(json.dumps({"model": "<external>/demo", "model_config":
                                                           model_identity(str(DEMO))}))
    check_data_model(str(states), str(copy), "--target")                  # recorded fields: checked, equal
    assert capsys.readouterr().err == ""
    cfg = json.loads((copy / "config.json").read_text())
    cfg["num_hidden_layers"] += 1                                          # a sibling: same tokenizer
    (copy / "config.json").write_text(json.dumps(cfg))
    check_data_model(f"{gone},{data}", str(copy), "--target")
    with pytest.raises(PeagleError, match="hidden states are another model's .*num_hidden_layers"):
        check_data_model(str(states), str(copy), "--target")
    with pytest.raises(PeagleError, match="give another --out"):
        check_data_model(str(states), str(copy), "--model", data_flag="--out")
    cfg["vocab_size"] += 1                                                 # another tokenizer
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PeagleError, match="token ids are another tokenizer's .*vocab_size"):
        check_data_model(f"{gone},{data}", str(copy), "--target")


def test_datagen_and_hidden_states_never_write_into_a_model(tmp_path, target, capsys):
    """datagen wrote prompts.json and shards among the target's files, hidden-states its cache: the refusal
    train gives, for both."""
    before = sorted(os.listdir(target))
    base = ["datagen", "--model", target, "--num-prompts", 2, "--code-fraction", 1]
    assert "is the target's directory" in one_line(capsys, base + ["--out", target])
    other = write_target(tmp_path / "other")
    assert "holds a model" in one_line(capsys, base + ["--out", other])
    data = datagen_dir(tmp_path / "gen", target, docs(2))
    assert "is the target's directory" in one_line(capsys, ["hidden-states", "--model", target, "--data", data,
                                                            "--out", target])
    assert "holds a model" in one_line(capsys, ["hidden-states", "--model", target, "--data", data, "--out", other])
    assert sorted(os.listdir(target)) == before and sorted(os.listdir(other)) == before


@pytest.mark.parametrize("command,flags,needle", [
    ("datagen", ["--code-fraction", "2"], "--code-fraction must be in [0, 1], got 2.0"),
    ("datagen", ["--code-fraction", "-0.5"], "--code-fraction must be in [0, 1]"),
    ("datagen", ["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
    ("datagen", ["--temperature", "-1"], "--temperature must be >= 0"),
    ("hidden-states", ["--max-tokens", "0"], "--max-tokens must be at least 1"),
    ("hidden-states", ["--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1"),
    ("hidden-states", ["--max-docs", "-1"], "--max-docs must be >= 0")])
def test_numeric_flags_are_checked_before_anything_loads(tmp_path, target, capsys, command, flags, needle):
    """--code-fraction 2 turned 4 prompts into 8,511 (a negative chat count sliced the corpus); hidden-states
    --max-tokens 0 crashed in the target's forward and left a half-made cache."""
    out = tmp_path / "out"
    if command == "datagen":
        args = ["datagen", "--model", target, "--out", out, "--num-prompts", 4]
    else:
        args = ["hidden-states", "--model", target, "--data", datagen_dir(tmp_path / "gen", target, docs(2)),
                "--out", out]
    assert needle in one_line(capsys, args + flags)
    assert not out.exists()


def test_failed_runs_leave_no_empty_out(tiny_dirs, tmp_path, capsys):
    """A bad --init or --aux-ids (found after the target loads) and a bad --exclude left empty directories."""
    tgt = tiny_dirs["llama"]
    data = datagen_dir(tmp_path / "gen", tgt, docs(4))
    base = ["train", "--method", "eagle3", "--target", tgt, "--data", data, "--steps", 1, "--quiet", "--threads", 1]
    assert main([str(a) for a in base + ["--out", tmp_path / "a" / "b", "--init", tmp_path / "nope"]]) == 1
    assert main([str(a) for a in base + ["--out", tmp_path / "c", "--aux-ids", "1,2,99"]]) == 1
    assert main(["datagen", "--model", tgt, "--out", str(tmp_path / "g"), "--num-prompts", "2",
                 "--code-fraction", "1", "--exclude", str(tmp_path / "nope")]) == 1
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["gen"]
    kept = tmp_path / "kept"                      # a directory the run did not create stays, empty or not
    kept.mkdir()
    assert main([str(a) for a in base + ["--out", kept, "--aux-ids", "1,2,99"]]) == 1
    assert kept.is_dir()


def test_skipped_documents_a_resume_without_checkpoint_and_the_target_are_said(tiny_dirs, tmp_path, capsys):
    """Documents with < 2 generated tokens were dropped without a count; --resume on an --out without a
    checkpoint (a typo) started over in silence; the start-up line did not name the target."""
    tgt = tiny_dirs["llama"]
    data = datagen_dir(tmp_path / "gen", tgt, docs(6, short=2))
    out = tmp_path / "h"
    assert main(["train", "--method", "eagle3", "--target", tgt, "--data", data, "--out", str(out), "--steps", "1",
                 "--threads", "1", "--draft-vocab", "64", "--resume"]) == 0
    cap = capsys.readouterr()
    assert f"note: no checkpoint in {out / 'checkpoint'}: starting a new run" in cap.err
    assert "train: 2 of 6 documents skipped (< 2 generated tokens)" in cap.err
    start = next(x for x in cap.out.splitlines() if x.startswith("train eagle3:"))
    assert f"target {tgt} (float32)" in start
    assert main(["hidden-states", "--model", tgt, "--data", data, "--out", str(tmp_path / "hs"),
                 "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "hidden-states: 2 of 6 documents skipped (< 2 generated tokens)" in err
    assert main(["train", "--method", "eagle3", "--target", tgt, "--data", data, "--out", str(out), "--steps", "1",
                 "--threads", "1", "--draft-vocab", "64", "--resume", "--quiet"]) == 0
    assert "no checkpoint" not in capsys.readouterr().err            # a real resume: no note
    assert "--draft-vocab" not in cap.err                            # 64: below the vocabulary, no note
    assert main(["train", "--method", "eagle3", "--target", tgt, "--data", data, "--out", str(tmp_path / "h2"),
                 "--steps", "1", "--threads", "1", "--draft-vocab", "1000000", "--quiet"]) == 0
    vocab = json.loads((Path(tgt) / "config.json").read_text())["vocab_size"]
    assert f"note: --draft-vocab 1000000 is above the target's vocabulary ({vocab})" in capsys.readouterr().err
    assert json.loads((tmp_path / "h2" / "config.json").read_text())["draft_vocab_size"] == vocab


def test_datagen_ends_with_a_summary_of_all_its_rows(tmp_path, capsys):
    """The progress bar showed the last shard's rows (rows=2 of 4) and the run ended without a summary line;
    then its data, given to hidden-states or train of another target (the default), is refused."""
    out = tmp_path / "gen"
    assert main(["datagen", "--model", str(DEMO), "--out", str(out), "--num-prompts", "4", "--code-fraction", "1",
                 "--max-new-tokens", "8", "--shard-size", "2", "--threads", "1"]) == 0
    cap = capsys.readouterr()
    rows = [d for i in range(2) for d in read_shard(shard_path(str(out), i))]
    ntok = sum(int(m.sum()) for _, m in rows)
    last = cap.out.strip().splitlines()[-1]
    assert re.fullmatch(rf"datagen: {len(rows)} samples, {ntok} generated tokens in \d+ s \([\d.]+ tok/s\), "
                        rf"2 shards written to {re.escape(str(out))}", last), last
    assert len(rows) > 2 and re.findall(r"rows=(\d+)", cap.err)[-1] == str(len(rows))
    from peagle.train.checks import model_identity
    assert json.loads((out / "prompts.json").read_text())["model_config"] == model_identity(str(DEMO))
    assert "is the target's directory" in one_line(capsys, ["hidden-states", "--model", DEMO, "--data", out,
                                                            "--out", DEMO])
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")):
        assert "(the default)" in one_line(capsys, ["hidden-states", "--data", out, "--out", tmp_path / "hs"])
        assert "(the default)" in one_line(capsys, ["train", "--method", "eagle3", "--data", out,
                                                    "--out", tmp_path / "h"])
