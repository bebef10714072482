"""The hidden-state cache (speculators' offline format): documented keys, shapes and dtypes; features equal
the target's own; resumable extraction; and training from the cache equals training with the target in the
loop (same losses on the same rows)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from peagle.errors import PeagleError
from peagle.models.llama import Transformer
from peagle.train.features import Teacher
from peagle.train.hidden_states import CONFIG, HiddenStateCache, extract, sample_path


def _docs(n=5):
    g = torch.Generator().manual_seed(1)
    out = []
    for L in torch.randint(4, 30, (n,), generator=g).tolist():
        m = torch.zeros(L, dtype=torch.bool)
        m[L // 2:] = True
        out.append((torch.randint(5, 500, (L,), generator=g), m))
    return out


def test_round_trip_keys_shapes_and_features(tiny_dirs, tmp_path):
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    L, H = target.cfg.num_hidden_layers, target.cfg.hidden_size
    docs, d = _docs(), str(tmp_path / "hs")
    layers = [1, 2, L - 1, L]
    r = extract(target, docs, d, layers, max_batch_tokens=40, progress=False)
    assert r["samples"] == len(docs) and r["tokens"] == sum(len(t) for t, _ in docs)
    assert r["bytes_per_token"] == len(layers) * H * 4
    with open(os.path.join(d, CONFIG)) as f:
        cfg = json.load(f)
    assert cfg["layer_ids"] == layers and cfg["hidden_size"] == H and cfg["num_samples"] == len(docs)
    teacher = Teacher(target, tuple(layers[:-1]), torch.arange(64))
    want = teacher.doc_features([t for t, _ in docs])
    cache = HiddenStateCache(d)
    for i, (t, m) in enumerate(docs):
        with safe_open(sample_path(d, i), "pt") as f:
            assert set(f.keys()) == {"token_ids", "hidden_states", "loss_mask"}
            ids, hs = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
        assert ids.dtype == torch.int64 and torch.equal(ids, t)
        assert hs.shape == (len(t), len(layers), H) and hs.dtype == torch.float32
        ci, cm = cache.doc(i)
        assert torch.equal(ci, t) and torch.equal(cm, m)
        aux, last = cache.features(i)
        assert torch.allclose(aux, want[i][0], atol=1e-5) and torch.allclose(last, want[i][1], atol=1e-5)
    cache.check_aux(layers[:-1])
    with pytest.raises(PeagleError, match="reads aux"):
        cache.check_aux([0, 1, 2])


def test_extraction_resumes_and_refuses_other_layers(tiny_dirs, tmp_path):
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    L = target.cfg.num_hidden_layers
    docs, d = _docs(4), str(tmp_path / "hs")
    extract(target, docs, d, [1, L], progress=False)
    os.remove(sample_path(d, 2))
    with pytest.raises(PeagleError, match="missing"):
        HiddenStateCache(d)
    assert extract(target, docs, d, [1, L], progress=False)["samples"] == 1     # only the missing one
    from peagle.train.checks import config_identity
    assert json.loads(open(os.path.join(d, "hidden_states.json")).read())["model_config"] == \
        config_identity(target.cfg.raw)
    assert len(HiddenStateCache(d)) == 4
    with pytest.raises(PeagleError, match="other layers"):
        extract(target, docs, d, [2, L], progress=False)
    with pytest.raises(PeagleError, match="final state"):
        extract(target, docs, str(tmp_path / "x"), [1, 2], progress=False)


def test_extraction_records_the_document_cut_and_refuses_a_resume_with_another(tiny_dirs, tmp_path):
    """The cut the documents were given (`hidden-states --max-tokens`) is recorded; resuming into the cache with
    another cut is refused before any sample is written (its samples would be other documents); the same cut,
    or a resume that does not say (train's feature cache of an older cache), goes on."""
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    L = target.cfg.num_hidden_layers
    docs, d = _docs(4), str(tmp_path / "hs")
    extract(target, [(t[:12], m[:12]) for t, m in docs], d, [1, L], progress=False, max_tokens=12)
    assert json.loads(open(os.path.join(d, CONFIG)).read())["max_tokens"] == 12
    os.remove(sample_path(d, 3))
    with pytest.raises(PeagleError, match="cut to 12 tokens; this run cuts them to 20: resume with --max-tokens 12"):
        extract(target, [(t[:20], m[:20]) for t, m in docs], d, [1, L], progress=False, max_tokens=20)
    assert not os.path.exists(sample_path(d, 3))
    assert extract(target, [(t[:12], m[:12]) for t, m in docs], d, [1, L], progress=False)["samples"] == 1
    assert json.loads(open(os.path.join(d, CONFIG)).read())["max_tokens"] == 12


def test_the_command_records_its_max_tokens(tiny_dirs, tmp_path, capsys):
    """`peagle hidden-states --max-tokens N` records N; rerun on the cache with another cut it stops with one line
    saying the recorded one."""
    from tiny import write_greedy_shard

    from peagle.cli import main
    target = tiny_dirs["llama"]
    data = write_greedy_shard(target, str(tmp_path / "data"), n=3)
    hs = str(tmp_path / "hs")
    base = ["hidden-states", "--model", target, "--data", data, "--out", hs, "--threads", "1"]
    assert main(base + ["--max-tokens", "16"]) == 0
    assert json.loads(open(os.path.join(hs, CONFIG)).read())["max_tokens"] == 16
    capsys.readouterr()
    assert main(base + ["--max-tokens", "24"]) == 1
    assert "cut to 16 tokens; this run cuts them to 24" in capsys.readouterr().err


@pytest.mark.parametrize("method,extra", [("peagle", ["--depths", "3", "--mask-token", "4"]),
                                          ("eagle3", ["--ttt-steps", "3"])])
def test_training_from_the_cache_equals_training_with_the_target(tiny_dirs, tmp_path, method, extra):
    """Same rows, same seed: the losses of 6 steps match whether features come from the target or the cache
    (float32 cache: equal up to the order of floating-point sums); a cache made from other data is refused."""
    from tiny import write_greedy_shard
    from training import trainer_losses
    target = tiny_dirs["llama"]
    data = write_greedy_shard(target, str(tmp_path / "data"), n=16)
    live = trainer_losses(target, data, str(tmp_path / "live"), method, extra)
    hs = str(tmp_path / "hs")
    cached = trainer_losses(target, data, str(tmp_path / "cached"), method, extra + ["--feature-cache", hs])
    assert len(os.listdir(hs)) == 17                             # 16 samples + the config
    again = trainer_losses(target, hs, str(tmp_path / "from-dir"), method, extra)   # --data = the cache itself
    for a, b, c in zip(live, cached, again):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)
        assert b["loss"] == pytest.approx(c["loss"], rel=1e-6, abs=1e-7)
    # negative control: the trainer notices features that belong to other documents
    with safe_open(sample_path(hs, 0), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    from safetensors.torch import save_file
    save_file({k: v[:-1] for k, v in t.items()}, sample_path(hs, 0))
    with pytest.raises(PeagleError, match="other data"):
        trainer_losses(target, data, str(tmp_path / "bad"), method, extra + ["--feature-cache", hs])


def test_cache_samples_longer_than_max_tokens_or_too_short_and_aux_at_the_final_state(tiny_dirs, tmp_path):
    """--data = a cache: a sample longer than --max-tokens is cut like its document (it failed at its first
    row), samples with < 2 supervised tokens are left out like load_docs' (one crashed a step), a cache with no
    usable sample is one line; a head reading the final state L as an aux state trains from the cache its own
    run built (refused before: the cache stored L once, as the final state)."""
    import argparse

    from tiny import write_greedy_shard
    from training import trainer_losses

    from peagle.cli import train as cli
    from peagle.train.loop import Trainer
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    L = target.cfg.num_hidden_layers
    docs = _docs(6)
    docs.append((torch.randint(5, 500, (300,)), torch.ones(300, dtype=torch.bool)))   # longer than 192
    docs.append((torch.tensor([7]), torch.ones(1, dtype=torch.bool)))                # 1 token
    d = str(tmp_path / "hs")
    extract(target, docs, d, [1, 2, 3, L], progress=False)
    flags = ["--ttt-steps", "2", "--aux-ids", "1,2,3"]
    recs = trainer_losses(tiny_dirs["llama"], d, str(tmp_path / "o"), "eagle3", flags, steps=6)
    assert len(recs) == 6 and all(r["loss"] > 0 for r in recs)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    a = ap.parse_args(["--method", "eagle3", "--target", tiny_dirs["llama"], "--data", d, "--out",
                       str(tmp_path / "o2"), "--max-tokens", "192", "--steps", "1", "--quiet", "--device", "cpu",
                       *flags])
    a.max_docs = None
    assert Trainer(a).hs_ids == list(range(7))                       # the 1-token sample left out
    empty = str(tmp_path / "empty")
    extract(target, [docs[-1]], empty, [1, 2, 3, L], progress=False)
    with pytest.raises(PeagleError, match="no document"):
        trainer_losses(tiny_dirs["llama"], empty, str(tmp_path / "o3"), "eagle3", flags)
    data = write_greedy_shard(tiny_dirs["llama"], str(tmp_path / "data"), n=8)
    recs = trainer_losses(tiny_dirs["llama"], data, str(tmp_path / "o4"), "eagle3",
                          ["--ttt-steps", "2", "--aux-ids", f"1,2,{L}", "--feature-cache", str(tmp_path / "fc")],
                          steps=2)
    assert len(recs) == 2


def test_a_feature_cache_of_other_documents_is_refused(tiny_dirs, tmp_path):
    """Samples matched to documents by their tokens, not their lengths: a cache built from data B, reused by
    a run on data A with the same lengths, used to train A's documents on B's states."""
    from tiny import write_greedy_shard
    from training import trainer_losses
    target = tiny_dirs["llama"]
    a = write_greedy_shard(target, str(tmp_path / "a"), n=6, seed=0)
    b = write_greedy_shard(target, str(tmp_path / "b"), n=6, seed=1)
    fc = str(tmp_path / "fc")
    trainer_losses(target, b, str(tmp_path / "ob"), "eagle3", ["--ttt-steps", "2", "--feature-cache", fc], steps=1)
    trainer_losses(target, b, str(tmp_path / "ob2"), "eagle3", ["--ttt-steps", "2", "--feature-cache", fc], steps=1)
    with pytest.raises(PeagleError, match="other tokens than document 0"):
        trainer_losses(target, a, str(tmp_path / "oa"), "eagle3", ["--ttt-steps", "2", "--feature-cache", fc],
                       steps=1)


def test_a_speculators_cache_is_read_with_a_config_and_says_it_has_no_masks(tiny_dirs, tmp_path, capsys):
    """speculators writes hs_{i} files with token_ids and hidden_states only (no hidden_states.json, no
    loss_mask): refused with what to add, then read, saying that every token is supervised."""
    from safetensors.torch import save_file
    target = Transformer.from_pretrained(tiny_dirs["llama"])
    L = target.cfg.num_hidden_layers
    d = str(tmp_path / "spec")
    extract(target, _docs(3), d, [1, 2, 3, L], progress=False)
    for i in range(3):                                          # as speculators leaves them
        with safe_open(sample_path(d, i), "pt") as f:
            t = {k: f.get_tensor(k) for k in ("token_ids", "hidden_states")}
        save_file(t, sample_path(d, i))
    cfg = os.path.join(d, CONFIG)
    with open(cfg) as f:
        keep = json.load(f)
    os.remove(cfg)
    with pytest.raises(PeagleError, match='"layer_ids"'):
        HiddenStateCache(d)
    with open(cfg, "w") as f:
        json.dump({"format": "speculators-hs", "layer_ids": keep["layer_ids"], "hidden_size": keep["hidden_size"]}, f)
    cache = HiddenStateCache(d)
    assert len(cache) == 3 and "every token is supervised" in capsys.readouterr().err
    assert bool(cache.doc(0)[1].all())


def test_cli_layer_ids_take_the_final_state_and_refuse_past_it(tiny_dirs, tmp_path, capsys):
    """--layer-ids' last id is num_layers (the final state, as the help says); one past it is one error line."""
    from tiny import write_greedy_shard

    from peagle.cli import main
    t = tiny_dirs["llama"]
    with open(os.path.join(t, "config.json")) as f:
        L = json.load(f)["num_hidden_layers"]
    data = write_greedy_shard(t, str(tmp_path / "data"), n=2, gen=4)
    base = ["hidden-states", "--model", t, "--data", data]
    assert main(base + ["--out", str(tmp_path / "hs"), "--layer-ids", f"1,{L}"]) == 0
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "hs2"), "--layer-ids", f"1,{L + 1}"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and f"0..{L}" in err[0], err


def test_usable_docs_leave_out_and_count_samples_too_short_to_train_on(tmp_path):
    """A cache written elsewhere (speculators) may hold samples with < 2 supervised tokens: the trainer takes the
    others, in order, up to --max-docs, and counts what it read and skipped (the line `train` prints)."""
    from peagle.train.hidden_states import write_sample
    d = str(tmp_path / "hs")
    os.makedirs(d)
    masks = ([0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0])
    for i, m in enumerate(masks):
        write_sample(d, i, torch.arange(4), torch.zeros(4, 2, 8), torch.tensor(m))
    with open(os.path.join(d, "hidden_states.json"), "w") as f:
        json.dump({"format": "speculators-hs", "layer_ids": [1, 2], "hidden_size": 8, "num_samples": 5}, f)
    cache, counts = HiddenStateCache(d), {}
    ids, docs = cache.usable_docs(None, counts)
    assert ids == [0, 2, 4] and counts == {"read": 5, "skipped": 2}
    assert all(torch.equal(doc[1], torch.tensor(masks[i], dtype=torch.bool)) for i, doc in zip(ids, docs))
    counts = {}
    assert cache.usable_docs(2, counts)[0] == [0, 2] and counts == {"read": 3, "skipped": 1}
