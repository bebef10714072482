"""Head format validation, `peagle export` (vLLM flat + speculators layouts) and `peagle import` (fast)."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.cli import export as export_cli
from peagle.cli import import_ as import_cli
from peagle.heads.export import export_head
from peagle.heads.format import HeadValidationError, validate_head
from peagle.heads.importer import import_head
from peagle.heads.io import load_head_dir

H, NH, NKV, HD, I, V, T_LAYERS, MAXPOS = 32, 4, 2, 8, 64, 96, 4, 1024
MASK = 5


def make_config(method="peagle", layers=2, draft_vocab=None, aux=(1, 2, 3), **over):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": HD, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAXPOS, "rope_theta": 10000.0, "vocab_size": V,
        "draft_vocab_size": draft_vocab or V, "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": list(aux), "norm_before_residual": False,
        "tie_word_embeddings": False, "eagle_config": {"use_aux_hidden_state": True},
        "peagle": {"method": method, "train_depths": 4},
    }
    if method == "peagle":
        cfg["ptd_token_id"] = cfg["pard_token"] = MASK
    cfg.update(over)
    return cfg


def make_tensors(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    Vd = cfg["draft_vocab_size"]
    ts = {"embed_tokens.weight": r(V, H), "fc.weight": r(H, 3 * H), "norm.weight": r(H), "lm_head.weight": r(Vd, H)}
    for i in range(cfg["num_hidden_layers"]):
        inp, p = (2 * H if i == 0 else H), f"layers.{i}."
        ts.update({p + "self_attn.q_proj.weight": r(NH * HD, inp), p + "self_attn.k_proj.weight": r(NKV * HD, inp),
                   p + "self_attn.v_proj.weight": r(NKV * HD, inp), p + "self_attn.o_proj.weight": r(H, NH * HD),
                   p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                   p + "mlp.down_proj.weight": r(H, I), p + "input_layernorm.weight": r(H),
                   p + "post_attention_layernorm.weight": r(H)})
        if i == 0:
            ts[p + "hidden_norm.weight"] = r(H)
    ids = torch.arange(Vd) * (V // Vd)  # every (V//Vd)-th target id
    ts["d2t"] = (ids - torch.arange(Vd)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    ts["t2d"] = t2d
    if cfg.get("peagle", {}).get("method") == "peagle":
        ts["mask_hidden"] = r(1, 1, 3 * H)
    return ts


def write_head(path, cfg, ts):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in ts.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def target_config(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": T_LAYERS,
           "vocab_size": V, "max_position_embeddings": 1024, "num_attention_heads": NH, "intermediate_size": I}
    cfg.update(over)
    return cfg


@pytest.fixture
def target(tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(target_config()))
    g = torch.Generator().manual_seed(7)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g),
               "lm_head.weight": torch.randn(V, H, generator=g)}, str(d / "model.safetensors"))
    return str(d)


def head(tmp_path, name="head", **kw):
    cfg = make_config(**kw)
    return write_head(tmp_path / name, cfg, make_tensors(cfg)), cfg


def same_tensors(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------ validate
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_valid_head_has_no_problems(method, draft_vocab):
    cfg = make_config(method, draft_vocab=draft_vocab)
    ts = make_tensors(cfg)
    assert validate_head(cfg, ts, target_config(), parallel=method == "peagle") == []
    assert validate_head(cfg, {k: tuple(v.shape) for k, v in ts.items()}, None) == []  # shapes only


def problems(cfg, ts, tc=None, parallel=None):
    return "\n".join(validate_head(cfg, ts, tc, parallel))


def test_missing_mask_hidden_on_peagle_head():
    cfg = make_config("peagle")
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    assert "missing tensor mask_hidden" in problems(cfg, ts)
    # the same head run as autoregressive EAGLE-3 does not need it
    assert problems(cfg, ts, parallel=False) == ""


@pytest.mark.parametrize("aux, msg", [([1, 2, 9], "out of range"), ([1, 2], "list of 3"), ([3, 2, 1], "ascending"),
                                      ([1, 1, 2], "distinct"), ([-1, 1, 2], "negative")])
def test_wrong_aux_ids(aux, msg):
    cfg = make_config(aux=aux)
    assert msg in problems(cfg, make_tensors(cfg), target_config())


def test_aux_id_range_is_target_relative():
    cfg = make_config(aux=(2, 3, 4))  # 4 = output of the last of 4 target layers: valid
    assert problems(cfg, make_tensors(cfg), target_config()) == ""
    assert "out of range" in problems(cfg, make_tensors(cfg), target_config(num_hidden_layers=3))


def test_missing_aux_ids_and_nested_only():
    cfg = make_config()
    ts = make_tensors(cfg)
    del cfg["eagle_aux_hidden_state_layer_ids"]
    assert "missing at top level" in problems(cfg, ts)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    assert "only nested" in problems(cfg, ts)


def test_wrong_fc_shape():
    cfg = make_config()
    ts = make_tensors(cfg)
    ts["fc.weight"] = torch.zeros(H, 2 * H)
    assert f"tensor fc.weight has shape [{H}, {2 * H}], expected [{H}, {3 * H}]" in problems(cfg, ts)


def test_wrong_layer0_attention_input():
    cfg = make_config()
    ts = make_tensors(cfg)
    ts["layers.0.self_attn.q_proj.weight"] = torch.zeros(NH * HD, H)  # layer 0 takes 2H
    assert "layers.0.self_attn.q_proj.weight has shape" in problems(cfg, ts)


def test_vocab_mismatch_vs_target():
    cfg = make_config()
    p = problems(cfg, make_tensors(cfg), target_config(vocab_size=V + 32))
    assert f"vocab_size {V} != target vocab_size {V + 32}" in p


def test_target_hidden_and_context_checks():
    cfg = make_config()
    p = problems(cfg, make_tensors(cfg), target_config(hidden_size=2 * H, max_position_embeddings=4096))
    assert "target_hidden_size" in p and "max_position_embeddings" in p


def test_unknown_and_missing_tensors():
    cfg = make_config()
    ts = make_tensors(cfg)
    ts["foo.weight"] = torch.zeros(3)
    ts["midlayer.hidden_norm.weight"] = torch.zeros(H)
    del ts["layers.1.mlp.down_proj.weight"]
    p = problems(cfg, ts)
    assert "unknown tensor foo.weight" in p and "unknown tensor midlayer.hidden_norm.weight" in p
    assert "peagle import" in p
    assert "missing tensor layers.1.mlp.down_proj.weight" in p
    # optional: hidden_norm on later layers is accepted by vLLM
    ts = make_tensors(cfg)
    ts["layers.1.hidden_norm.weight"] = torch.ones(H)
    assert problems(cfg, ts) == ""


def test_peagle_token_and_hidden_size_rules():
    cfg = make_config(ptd_token_id=V + 3, pard_token=V + 3)
    assert "ptd_token_id" in problems(cfg, make_tensors(cfg))
    cfg = make_config(pard_token=MASK + 1)
    assert "!= pard_token" in problems(cfg, make_tensors(cfg))
    cfg = make_config()
    del cfg["pard_token"]
    assert "needs both ptd_token_id and pard_token" in problems(cfg, make_tensors(cfg))
    cfg = make_config(mask_token_id=MASK + 1)
    assert "conflicts" in problems(cfg, make_tensors(cfg))
    cfg = make_config(target_hidden_size=2 * H)  # parallel drafting on vLLM 0.16-0.19 needs H == T
    ts = make_tensors(cfg)
    ts["fc.weight"], ts["mask_hidden"] = torch.zeros(H, 6 * H), torch.zeros(1, 1, 6 * H)
    assert "hidden_size == target_hidden_size" in problems(cfg, ts)
    assert problems(cfg, {k: v for k, v in ts.items() if k != "mask_hidden"}, parallel=False) == ""


def test_d2t_checks():
    cfg = make_config(draft_vocab=48)
    ts = make_tensors(cfg)
    ts["d2t"] = ts["d2t"].clone()
    ts["d2t"][-1] = V  # maps outside the vocabulary
    assert "outside the target vocabulary" in problems(cfg, ts)
    ts = make_tensors(cfg)
    ts["d2t"] = ts["d2t"].to(torch.int32)
    assert "int64" in problems(cfg, ts)
    ts = make_tensors(cfg)
    ts["t2d"] = ~ts["t2d"]
    assert "t2d is inconsistent" in problems(cfg, ts)
    cfg = make_config()  # full vocabulary: d2t must be the identity (vLLM keeps no map)
    ts = make_tensors(cfg)
    ts["d2t"] = torch.roll(torch.arange(V), 1) - torch.arange(V)
    assert "non-identity d2t" in problems(cfg, ts)


def test_config_basics():
    cfg = make_config(architectures=["PeagleLlamaForCausalLM"], tie_word_embeddings=True)
    del cfg["norm_before_residual"], cfg["rope_theta"]
    p = problems(cfg, make_tensors(cfg))
    for s in ("architectures", "tie_word_embeddings", "norm_before_residual", "rope_theta"):
        assert s in p


# -------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_vllm_export_import_round_trip(tmp_path, target, method, draft_vocab):
    src, cfg = head(tmp_path, method=method, draft_vocab=draft_vocab, max_position_embeddings=128,
                    mask_token_id=MASK if method == "peagle" else None)
    cfg.pop("mask_token_id")
    notes = []
    out = export_head(src, tmp_path / "vllm", "vllm", target_dir=target, notes=notes)
    ocfg, ots = load_head_dir(tmp_path / "vllm")
    assert ocfg == out
    assert ocfg["architectures"] == ["LlamaForCausalLMEagle3"] and ocfg["model_type"] == "llama"
    assert ocfg["max_position_embeddings"] == 1024  # raised to the target's
    assert "mask_token_id" not in ocfg
    assert ocfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert not any(k.startswith("model.") for k in ots)
    assert not any(f.startswith("tokenizer") for f in os.listdir(tmp_path / "vllm"))
    if method == "peagle":
        assert ocfg["ptd_token_id"] == ocfg["pard_token"] == MASK
        assert ots["mask_hidden"].shape == (1, 1, 3 * H)
    else:
        assert "mask_hidden" not in ots and "ptd_token_id" not in ocfg
    if draft_vocab is None:  # vLLM refuses d2t on a full-vocabulary head
        assert "d2t" not in ots and "t2d" not in ots
    else:
        assert ots["d2t"].dtype == torch.int64 and ots["t2d"].dtype == torch.bool
    assert validate_head(ocfg, ots, json.load(open(os.path.join(target, "config.json")))) == []

    icfg, its = import_head(tmp_path / "vllm", tmp_path / "native", target_dir=target)
    same_tensors(its, load_file(os.path.join(src, "model.safetensors")))
    for k, v in cfg.items():
        if k not in ("max_position_embeddings", "peagle"):
            assert icfg[k] == v, k
    assert icfg["peagle"]["method"] == method


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_speculators_export_fields_and_round_trip(tmp_path, target, method):
    src, cfg = head(tmp_path, method=method, layers=1)
    out = export_head(src, tmp_path / "spec", "speculators", target_dir=target, num_speculative_tokens=7)
    on_disk = json.load(open(tmp_path / "spec" / "config.json"))
    assert on_disk == out
    par = method == "peagle"
    assert out["speculators_model_type"] == ("peagle" if par else "eagle3")
    assert out["architectures"] == (["PEagleSpeculator"] if par else ["Eagle3Speculator"])
    assert out["norm_before_residual"] is False  # explicit: the eagle3 speculators default is True
    assert out["draft_vocab_size"] == V and out["target_hidden_size"] == H
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tl = out["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["hidden_size"] == H and tl["num_hidden_layers"] == 1
    assert tl["vocab_size"] == V and tl["num_key_value_heads"] == NKV and tl["rope_theta"] == 10000.0
    assert "ptd_token_id" not in tl and "eagle_aux_hidden_state_layer_ids" not in tl
    sc = out["speculators_config"]
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7}]
    assert sc["verifier"]["name_or_path"] == os.path.realpath(target)
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    if par:
        assert out["mask_token_id"] == MASK
    else:
        assert "mask_token_id" not in out
    icfg, its = import_head(tmp_path / "spec", None, target_dir=target)
    same_tensors(its, load_file(os.path.join(src, "model.safetensors")))
    assert icfg["peagle"]["method"] == method and icfg["peagle"]["train_depths"] == 4
    assert icfg.get("ptd_token_id") == (MASK if par else None)
    assert icfg["num_hidden_layers"] == 1 and icfg["norm_before_residual"] is False


def _refused(tmp_path, target, cfg, ts, needle):
    src = write_head(tmp_path / "bad", cfg, ts)
    out = tmp_path / "out"
    for fmt in ("vllm", "speculators"):
        with pytest.raises(HeadValidationError) as e:
            export_head(src, out, fmt, target_dir=target)
        assert needle in str(e.value)
        assert not out.exists()  # nothing written
    return str(e.value)


def test_export_refuses_missing_mask_hidden(tmp_path, target):
    cfg = make_config()
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    _refused(tmp_path, target, cfg, ts, "missing tensor mask_hidden")


def test_export_refuses_wrong_aux_ids(tmp_path, target):
    cfg = make_config(aux=(1, 2, 8))
    msg = _refused(tmp_path, target, cfg, make_tensors(cfg), "out of range")
    assert "4 layers" in msg


def test_export_refuses_wrong_fc_and_vocab_and_unknown(tmp_path, target):
    cfg = make_config(vocab_size=V + 1)
    ts = make_tensors(make_config())
    ts["fc.weight"] = torch.zeros(H, H)
    ts["extra.bias"] = torch.zeros(2)
    msg = _refused(tmp_path, target, cfg, ts, "fc.weight")
    assert "!= target vocab_size" in msg and "unknown tensor extra.bias" in msg
    assert "embed_tokens.weight has shape" in msg  # [V, H] vs vocab V+1


def test_export_lists_every_problem_at_once(tmp_path, target):
    cfg = make_config(aux=(1, 2, 9))
    ts = make_tensors(cfg)
    del ts["mask_hidden"], ts["norm.weight"]
    with pytest.raises(HeadValidationError) as e:
        export_head(write_head(tmp_path / "bad", cfg, ts), tmp_path / "o", target_dir=target)
    assert len(e.value.problems) == 3
    assert "3 problem(s)" in str(e.value)


def test_export_keeps_existing_dir_when_refused(tmp_path, target):
    good, _ = head(tmp_path, "good")
    export_head(good, tmp_path / "o", target_dir=target)
    cfg = make_config()
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    with pytest.raises(HeadValidationError):
        export_head(write_head(tmp_path / "bad", cfg, ts), tmp_path / "o", target_dir=target)
    assert "mask_hidden" in load_head_dir(tmp_path / "o")[1]


def test_export_drops_conflicting_mask_token_id(tmp_path):
    src, _ = head(tmp_path, mask_token_id=MASK + 2)
    notes = []
    out = export_head(src, tmp_path / "o", notes=notes)
    assert "mask_token_id" not in out and out["ptd_token_id"] == MASK
    assert any("conflicting mask_token_id" in n for n in notes)


def test_speculators_export_needs_a_verifier(tmp_path):
    src, _ = head(tmp_path)
    with pytest.raises(HeadValidationError, match="--target"):
        export_head(src, tmp_path / "o", "speculators")


# -------------------------------------------------------------------------------------------------- import
def test_import_published_flat_head_midlayer_full_vocab(tmp_path, target):
    """An EAGLE-3 head as published by others: model. prefixes, midlayer.*, no d2t/t2d, no embed_tokens,
    nested aux ids, max_position_embeddings below the target's."""
    cfg = make_config("eagle3", layers=1, max_position_embeddings=128)
    native = make_tensors(cfg)
    pub = {}
    for k, v in native.items():
        if k in ("d2t", "t2d", "embed_tokens.weight"):
            continue
        k = k.replace("layers.0.", "midlayer.")
        pub[k if k.startswith("lm_head") else "model." + k] = v
    pcfg = {k: v for k, v in cfg.items() if k not in ("peagle", "eagle_aux_hidden_state_layer_ids", "head_dim")}
    pcfg["architectures"] = ["LlamaForCausalLM"]
    pcfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    src = write_head(tmp_path / "pub", pcfg, pub)
    bare, _ = import_head(src, tmp_path / "bare")      # no target: the head keeps sharing the target's embedding
    assert "embed_tokens.weight" not in load_head_dir(tmp_path / "bare")[1]
    notes = []
    icfg, its = import_head(src, tmp_path / "native", target_dir=target, notes=notes)
    assert icfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert icfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert icfg["max_position_embeddings"] == 1024 and icfg["head_dim"] == HD
    assert torch.equal(its["d2t"], torch.zeros(V, dtype=torch.int64)) and bool(its["t2d"].all())
    tgt = load_file(os.path.join(target, "model.safetensors"))
    assert torch.equal(its["embed_tokens.weight"], tgt["model.embed_tokens.weight"])
    assert torch.equal(its["layers.0.hidden_norm.weight"], native["layers.0.hidden_norm.weight"])
    assert icfg["peagle"]["method"] == "eagle3"
    c2, t2 = load_head_dir(tmp_path / "native")
    assert validate_head(c2, t2, target_config()) == []
    # and the imported head exports again
    export_head(tmp_path / "native", tmp_path / "again", target_dir=target)


def test_import_speculators_eagle3_defaults_and_missing_aux(tmp_path):
    """A speculators eagle3 head without norm_before_residual (vLLM default True) or aux ids (vLLM default)."""
    target = tmp_path / "t8"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(target_config(num_hidden_layers=8)))
    save_file({"model.embed_tokens.weight": torch.zeros(V, H)}, str(target / "model.safetensors"))
    cfg = make_config("eagle3", layers=1)
    ts = make_tensors(cfg)
    layer = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                                 "vocab_size", "rope_theta")}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"])
    scfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": V,
            "target_hidden_size": H, "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy",
                                                                                 "speculative_tokens": 5}],
                                   "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}}}
    src = write_head(tmp_path / "spec", scfg, {"midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k: v
                                               for k, v in ts.items()})
    icfg, its = import_head(src, None, target_dir=target)
    assert icfg["norm_before_residual"] is True
    assert icfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's default (2, L//2, L-3), L = 8
    assert icfg["peagle"] == {"method": "eagle3", "train_depths": 5, "target": "org/target",
                              "imported_from": "speculators:eagle3"}
    same_tensors(its, ts)


def test_import_speculators_aux_default_is_validated(tmp_path):
    """vLLM's default aux ids (2, L//2, L-3) collide on a 4-layer target ([2, 2, 1]): import must refuse."""
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(target_config(num_hidden_layers=4)))
    save_file({"model.embed_tokens.weight": torch.zeros(V, H)}, str(d / "model.safetensors"))
    cfg = make_config("eagle3", layers=1)
    ts = make_tensors(cfg)
    del cfg["eagle_aux_hidden_state_layer_ids"]
    src = write_head(tmp_path / "h", cfg, ts)
    with pytest.raises(HeadValidationError, match="distinct and ascending"):
        import_head(src, None, target_dir=str(d))


def test_import_refuses_broken_peagle_head(tmp_path):
    cfg = make_config()
    ts = make_tensors(cfg)
    del ts["mask_hidden"]
    with pytest.raises(HeadValidationError, match="mask_hidden"):
        import_head(write_head(tmp_path / "h", cfg, ts), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_import_mask_token_id_only_flat(tmp_path):
    cfg = make_config()
    del cfg["ptd_token_id"], cfg["pard_token"], cfg["peagle"]
    cfg["mask_token_id"] = MASK
    ts = make_tensors(make_config())
    ts["mask_hidden"] = ts["mask_hidden"].reshape(-1)  # any shape with numel 3T
    icfg, its = import_head(write_head(tmp_path / "h", cfg, ts))
    assert icfg["ptd_token_id"] == icfg["pard_token"] == MASK and "mask_token_id" not in icfg
    assert icfg["peagle"]["method"] == "peagle" and its["mask_hidden"].shape == (1, 1, 3 * H)


# ----------------------------------------------------------------------------------------------------- CLI
def _cli(argv):
    ap = argparse.ArgumentParser(prog="peagle")
    sp = ap.add_subparsers(dest="cmd", required=True)
    export_cli.add_parser(sp)
    import_cli.add_parser(sp)
    a = ap.parse_args(argv)
    return a.func(a)


def test_cli_export_import(tmp_path, target, capsys):
    src, _ = head(tmp_path)
    assert _cli(["export", src, str(tmp_path / "v"), "--target", target, "-k", "5"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve" in out and '"parallel_drafting": true' in out and '"num_speculative_tokens": 5' in out
    assert _cli(["export", src, str(tmp_path / "s"), "--format", "speculators", "--target", target]) == 0
    assert json.load(open(tmp_path / "s" / "config.json"))["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 4  # the head's train_depths
    assert _cli(["import", str(tmp_path / "s"), str(tmp_path / "n"), "--target", target]) == 0
    assert "method=peagle" in capsys.readouterr().out


def test_cli_export_refusal_exit_code(tmp_path, target, capsys):
    cfg = make_config(aux=(1, 2, 9))
    src = write_head(tmp_path / "bad", cfg, make_tensors(cfg))
    assert _cli(["export", src, str(tmp_path / "o"), "--target", target]) == 2
    err = capsys.readouterr().err
    assert "out of range" in err and "nothing written" in err
    assert not (tmp_path / "o").exists()


def test_export_notes_version_dependent_aux_ids(tmp_path, target):
    src, _ = head(tmp_path, aux=(2, 3, 4))  # 4 = last layer output of the 4-layer target: vLLM 0.32+ only
    notes = []
    export_head(src, tmp_path / "o", target_dir=target, notes=notes)
    assert any("0..L" in n for n in notes)


def test_peagle_cli_entry_point(tmp_path, target, capsys):
    from peagle.cli import main
    src, _ = head(tmp_path)
    assert main(["export", src, str(tmp_path / "o"), "--format", "speculators", "--target", target, "-k", "2"]) == 0
    assert main(["import", str(tmp_path / "o"), str(tmp_path / "n")]) == 0
    pb = load_head_dir(tmp_path / "n")[0]["peagle"]
    assert pb["train_depths"] == 4 and pb["num_speculative_tokens"] == 2  # trained depth kept, serving K recorded
