"""Bad input to every subcommand is one line (`peagle: error: ...`, or argparse's usage error) and costs nothing
already there: a head is never exported or imported over a model's directory, a wrong flag fails before any model
loads or anything is written, and an invalid prompt leaves nothing queued."""
import hashlib
import json
import os
import socket

import pytest
from headfiles import head, write_target

from peagle.cli import main
from peagle.errors import PeagleError
from peagle.paths import HOME
from peagle.server.start import resolve_config


def one_line(capsys, args) -> str:
    """Run `peagle ARGS` in-process (an uncaught exception fails the test); its single error line."""
    rc = main(args)
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("peagle: error:"), err
    return lines[0]


def digest(d) -> dict:
    return {f: hashlib.sha1(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


@pytest.fixture
def target(tmp_path):
    t = write_target(tmp_path / "target")
    (tmp_path / "target" / "tokenizer.json").write_text("{}")       # a model's file no head has
    return t


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_head_never_replaces_a_model(tmp_path, target, capsys, command):
    src, _ = head(tmp_path)
    before = digest(target)
    err = one_line(capsys, [command, str(src), str(target)])
    assert "not a drafter head's directory" in err
    assert digest(target) == before
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in one_line(capsys, [command, str(src), str(f)])
    assert "not a drafter head's directory" in one_line(capsys, [command, str(src), str(target), "--force"])
    assert digest(target) == before


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_head_replaces_a_head_only_with_force(tmp_path, capsys, command):
    """A second run replaced OUT silently, a training run's checkpoint/ and train_log.jsonl with it, and
    `export pe pe` replaced the source head: now OUT is refused unless --force, and the source head always."""
    src, _ = head(tmp_path)
    out = tmp_path / "out"
    assert main([command, str(src), str(out)]) == 0
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "ckpt.pt").write_text("x")
    (out / "train_log.jsonl").write_text("{}\n")
    before = {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    assert "exists (--force, overwrite=True in Python, replaces it)" in one_line(capsys, [command, str(src), str(out)])
    assert {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
    assert main([command, str(src), str(out), "--force"]) == 0           # --force replaces it
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    kept = digest(src)
    (tmp_path / "link").symlink_to(src)
    for o in (src, tmp_path / "link"):
        assert "is the source head itself" in one_line(capsys, [command, str(src), str(o), "--force"])
    assert digest(src) == kept


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_model_or_a_missing_path_as_the_head_says_so(tmp_path, capsys, command):
    """A target model given as the head listed the tensors a head lacks (import first noted 'renamed N
    tensor(s)'); a missing path was '.../config.json not found'. Now one line naming the mistake."""
    from peagle.models.tiny import save_tiny
    model = save_tiny("llama", str(tmp_path / "model"))
    capsys.readouterr()                                      # transformers' progress bar
    err = one_line(capsys, [command, model, str(tmp_path / "o")])
    assert "holds a model (LlamaForCausalLM)" in err and "not a drafter head" in err, err
    err = one_line(capsys, [command, str(tmp_path / "nope"), str(tmp_path / "o")])
    assert f"{tmp_path / 'nope'} does not exist" in err, err
    assert not (tmp_path / "o").exists()


def test_bench_checks_names_and_files_first(tmp_path, capsys):
    with pytest.raises(SystemExit):                      # argparse: a typo is not a run without the method
        main(["bench", "--methods", "baseline,p-eagle"])
    assert "unknown 'p-eagle'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--datasets", "humaneval,mt-bench"])
    assert "unknown 'mt-bench'" in capsys.readouterr().err
    with pytest.raises(SystemExit):                      # an unknown peer ran no peer, and said nothing
        main(["bench", "--peers", "hff"])
    assert "unknown 'hff'" in capsys.readouterr().err
    from peagle.cli.bench import _peers
    assert _peers("") == [] and _peers("hf-pld, hf") == ["hf-pld", "hf"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("kept")
    assert "--from-json" in one_line(capsys, ["bench", "--from-json", str(tmp_path / "none.json"), "--out", str(out)])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert "no 'runs'" in one_line(capsys, ["bench", "--from-json", str(bad), "--out", str(out)])
    assert "--notes" in one_line(capsys, ["bench", "--from-json", str(bad), "--out", str(out), "--notes",
                                          str(tmp_path / "none.md")])
    assert (out / "report.md").read_text() == "kept"


def test_datagen_checks_its_flags_and_model_before_writing(tmp_path, target, capsys):
    out = tmp_path / "dg"
    for flags, needle in [(["--part", "1"], "--part is i/n"), (["--part", "0/0"], "at least 1"),
                          (["--part", "3/2"], "0..1"), (["--shard-size", "0"], "--shard-size"),
                          (["--batch", "0"], "--batch")]:
        assert needle in one_line(capsys, ["datagen", "--model", target, "--out", str(out), *flags])
    assert "model directory not found" in one_line(capsys, ["datagen", "--model", str(tmp_path / "nope"), "--out",
                                                            str(out), "--num-prompts", "4"])
    assert not out.exists() or not os.listdir(out)        # no plan written with the wrong settings


def test_datagen_without_a_chat_template_or_tokenizer_stops_before_loading(tmp_path, target, capsys):
    """A model without a chat template failed with transformers' traceback (--responses original,
    --hidden-states) or after loading the model and starting a shard; one without tokenizer files crashed on
    its first prompt. Both are one line before the model loads, naming what is missing."""
    import glob
    import shutil

    from peagle.models.tiny import save_tiny_tokenizer
    m = str(tmp_path / "m")
    shutil.copytree(target, m)
    save_tiny_tokenizer(m)
    for f in glob.glob(os.path.join(m, "chat_template.*")):
        os.remove(f)
    with open(os.path.join(m, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc.pop("chat_template", None)
    with open(os.path.join(m, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    flags = ["--num-prompts", "4", "--code-fraction", "0.5", "--shard-size", "2"]
    for extra in ([], ["--responses", "original"], ["--hidden-states"]):
        assert "has no chat template" in one_line(capsys, ["datagen", "--model", m, "--out", str(tmp_path / "o"),
                                                           *flags, *extra])
    for f in glob.glob(os.path.join(m, "tokenizer*")) + glob.glob(os.path.join(m, "vocab.json")):
        os.remove(f)
    assert "has no tokenizer" in one_line(capsys, ["datagen", "--model", m, "--out", str(tmp_path / "o2"), *flags])


def test_train_and_hidden_states_name_missing_data(tmp_path, target, capsys):
    assert "data directory not found" in one_line(capsys, ["train", "--method", "eagle3", "--target", target,
                                                           "--data", str(tmp_path / "nope"), "--out",
                                                           str(tmp_path / "h")])
    assert "--layer-ids" in one_line(capsys, ["hidden-states", "--model", target, "--data", str(tmp_path),
                                              "--out", str(tmp_path / "hs"), "--layer-ids", "1,x"])
    shard = tmp_path / "shard-00000.safetensors"              # a file of the directory, given instead of it
    shard.write_bytes(b"")
    for cmd in (["train", "--method", "eagle3", "--target", target], ["hidden-states", "--model", target]):
        msg = one_line(capsys, [*cmd, "--data", str(shard), "--out", str(tmp_path / "o")])
        assert "is a file: give the directory" in msg, msg
    assert not (tmp_path / "o").exists()


def test_serve_checks_its_address_before_loading(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--port", "99999"])
    assert "0..65535" in capsys.readouterr().err
    with socket.socket() as s:                          # a port already listened on
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert "cannot listen" in one_line(capsys, ["serve", "models/none", "--port", str(port)])


def test_tune_checks_out_before_measuring(tmp_path, target, capsys):
    spec = json.dumps({"method": "eagle3", "model": str(tmp_path / "h"), "num_speculative_tokens": 2})
    assert "its directory does not exist" in one_line(capsys, ["tune", target, "--speculative-config", spec,
                                                               "--out", str(tmp_path / "no" / "s.json")])
    assert "is a directory: give the config file's path" in one_line(capsys, ["tune", target, "--speculative-config",
                                                                           spec, "--out", str(tmp_path)])
# appended to tests/test_cli_errors.py


def test_convert_gguf_force_replaces_only_a_model(tmp_path, capsys):
    g = tmp_path / "g"
    g.mkdir()
    (g / "model.gguf").write_bytes(b"GGUF")                 # never read: the checks come first
    (g / "NOTES.txt").write_text("mine")
    assert "the file being converted" in one_line(capsys, ["convert-gguf", str(g / "model.gguf"), str(g), "--force"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "NOTES.txt").write_text("mine")
    assert "not a model directory" in one_line(capsys, ["convert-gguf", str(g / "model.gguf"), str(other),
                                                        "--force"])
    f = tmp_path / "afile"
    f.write_text("x")
    assert "not a directory" in one_line(capsys, ["convert-gguf", str(g / "model.gguf"), str(f), "--force"])
    assert (g / "NOTES.txt").read_text() == (other / "NOTES.txt").read_text() == "mine"
    assert (g / "model.gguf").read_bytes() == b"GGUF"


@pytest.mark.parametrize("flags,needle", [(["--lr", "-1"], "--lr"), (["--batch-rows", "0"], "--batch-rows"),
                                          (["--log-every", "0"], "--log-every"), (["--ttt-steps", "0"], "--ttt-steps"),
                                          (["--max-tokens", "0"], "--max-tokens"), (["--epochs", "0"], "--epochs"),
                                          (["--draft-vocab", "-5"], "--draft-vocab"),
                                          (["--max-docs", "-1"], "--max-docs")])
def test_train_flags_out_of_range_are_one_line(tmp_path, target, capsys, flags, needle):
    args = ["train", "--method", "eagle3", "--target", target, "--data", str(tmp_path), "--out", str(tmp_path / "h")]
    assert needle in one_line(capsys, args + flags)


def test_train_never_writes_into_a_model(tmp_path, target, capsys):
    before = digest(target)
    base = ["train", "--method", "eagle3", "--target", target, "--data", str(tmp_path)]
    assert "target's directory" in one_line(capsys, base + ["--out", target])
    other = write_target(tmp_path / "other")
    assert "holds a model" in one_line(capsys, base + ["--out", other])
    f = tmp_path / "afile"
    f.write_text("x")
    assert "not a directory" in one_line(capsys, base + ["--out", str(f)])
    assert digest(target) == before


def test_tune_refuses_bad_threads_and_a_head_config_that_is_not_json(tmp_path, target, capsys):
    h = tmp_path / "h"
    h.mkdir()
    (h / "config.json").write_text("{not json")
    spec = json.dumps({"method": "eagle3", "model": str(h), "num_speculative_tokens": 2})
    assert "--threads" in one_line(capsys, ["tune", target, "--speculative-config", spec, "--threads", "-1"])
    assert "cannot read the head's config" in one_line(capsys, ["tune", target, "--speculative-config", spec])


def test_generate_checks_its_sampling_flags_before_loading(tmp_path, capsys):
    """--max-tokens 0 (or a bad --top-p) loaded the model first and then failed: checked before anything loads
    (a model path that does not exist shows it: the sampling error comes first)."""
    missing = str(tmp_path / "no-such-model")
    assert "max_tokens must be >= 1" in one_line(capsys, ["generate", "--model", missing, "--prompt", "hi",
                                                          "--max-tokens", "0"])
    assert "top_p" in one_line(capsys, ["generate", "--model", missing, "--prompt", "hi", "--top-p", "2"])


def test_tune_refuses_zero_threads_and_output_len_before_measuring(tmp_path, target, capsys):
    """--threads 0 (torch's default would run instead) and --output-len 0 are one error line each, before the
    head is read."""
    spec = json.dumps({"method": "eagle3", "model": str(tmp_path / "none"), "num_speculative_tokens": 2})
    assert "--threads" in one_line(capsys, ["tune", target, "--speculative-config", spec, "--threads", "0"])
    assert "--output-len" in one_line(capsys, ["tune", target, "--speculative-config", spec, "--output-len", "0"])


def test_generate_checks_its_speculative_config_before_loading(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    bad = json.dumps({"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "foo": 1})
    assert "unknown speculative config key" in one_line(capsys, ["generate", "--model", missing, "--prompt", "hi",
                                                                 "--speculative-config", bad])


def test_documented_defaults_and_port_range():
    """What README / docs/security.md promise: serve binds 127.0.0.1:8000 by default, any port 0..65535 is taken;
    generate writes 128 tokens unless told."""
    from peagle.cli import build_parser
    a = build_parser("serve").parse_args(["serve"])
    assert (a.host, a.port, a.max_num_seqs) == ("127.0.0.1", 8000, 128)
    assert build_parser("serve").parse_args(["serve", "--port", "65535"]).port == 65535
    assert build_parser("serve").parse_args(["serve", "--port", "0"]).port == 0
    g = build_parser("generate").parse_args(["generate", "--prompt", "x"])
    assert (g.max_tokens, g.temperature, g.top_p, g.top_k) == (128, 0.0, 1.0, 0)


def test_generate_says_when_the_context_cuts_max_tokens(capsys):
    """--max-tokens past what the context leaves after the prompt was cut silently (5000 became 2046): the
    engine still stops there (finish_reason length, as vLLM's LLM), and generate says so first."""
    from peagle.llm import DEMO_TARGET
    assert main(["generate", "--model", DEMO_TARGET, "--prompt", "hello", "--max-tokens", "40",
                 "--max-model-len", "16"]) == 0
    err = capsys.readouterr().err
    assert "peagle: --max-tokens 40: the context (16) leaves" in err and "finish_reason=length" in err, err
    assert main(["generate", "--model", DEMO_TARGET, "--prompt", "hello", "--max-tokens", "4",
                 "--max-model-len", "16"]) == 0
    assert "--max-tokens" not in capsys.readouterr().err                  # within the context: no note


def test_version_and_a_bad_aux_ids_list(capsys):
    """`peagle --version` exists; a bad --aux-ids was "invalid <lambda> value"."""
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("peagle ")
    with pytest.raises(SystemExit) as e:
        main(["train", "--aux-ids", "a,b", "--data", "d", "--out", "o"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "comma-separated layer numbers" in err and "lambda" not in err, err


def test_a_relative_path_from_another_directory_gets_a_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    head = os.path.join("models", "demo-target-peagle")
    msg = one_line(capsys, ["bench", "--model", os.path.join(HOME, "models", "demo-target"), "--methods",
                            "peagle", "--peagle-head", head, "--out", str(tmp_path / "b")])
    assert msg.endswith(f"did you mean {os.path.join(HOME, head)}?"), msg
    msg = one_line(capsys, ["generate", "--model", os.path.join("models", "demo-target"), "--prompt", "hi"])
    assert msg.endswith(f"did you mean {os.path.join(HOME, 'models', 'demo-target')}?"), msg
    # serve's own checks, before it loads
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 1})
    for model, spec in ((os.path.join("models", "demo-target"), None),
                        (os.path.join(HOME, "models", "demo-target"), spec)):
        with pytest.raises(PeagleError, match=r"did you mean .*\?$"):
            resolve_config(model, spec, {})


def test_the_target_is_model_in_every_command_that_takes_one(tmp_path, target, capsys):
    """train's --target and tune's positional target are also --model, as datagen, hidden-states, generate, bench
    and serve name it; tune refuses two different targets."""
    from peagle.cli import build_parser
    for argv, field in ((["train", "--method", "eagle3", "--data", "d", "--out", "o"], "target"),
                        (["datagen", "--out", "o"], "model"), (["hidden-states", "--data", "d", "--out", "o"], "model"),
                        (["generate", "--prompt", "p"], "model"), (["bench"], "model"), (["serve"], "model_opt"),
                        (["tune", "--speculative-config", "{}"], "model_opt")):
        a = build_parser().parse_args(argv + ["--model", "M"])
        assert getattr(a, field) == "M", argv[0]
    assert build_parser().parse_args(["train", "--method", "eagle3", "--data", "d", "--out", "o",
                                      "--target", "T"]).target == "T"
    spec = json.dumps({"method": "eagle3", "model": str(tmp_path / "h"), "num_speculative_tokens": 2})
    assert "two targets" in one_line(capsys, ["tune", target, "--model", str(tmp_path), "--speculative-config", spec])
