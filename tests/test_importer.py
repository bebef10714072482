"""`peagle import` (peagle/heads/importer.py). Heads shaped like the published P-EAGLE ones, against a matching
tiny GPT-OSS target: a 4-layer head with a full-vocabulary lm_head and no d2t, a mask (placeholder) token id
outside the tokenizer's special tokens, mask_hidden [1,1,3H]; it converts, validates, and decodes losslessly,
and a head that does not match the target (hidden size, vocabulary, aux ids) is refused with the field named.
Then the layouts others publish against a flat target directory: vLLM's flat EAGLE-3 (midlayer, no d2t / t2d,
nested aux ids), speculators' eagle3 (vLLM's defaults filled in and checked), broken P-EAGLE heads refused."""
import json
import os

import pytest
import torch
from headfiles import HD, MASK, H, V, make_config, make_tensors, same_tensors, target_config, write_head, write_target
from safetensors.torch import load_file, save_file
from tiny import hf_greedy

from peagle import LLM, SamplingParams
from peagle.errors import PeagleError
from peagle.heads.export import export_head
from peagle.heads.format import HeadValidationError, validate_head
from peagle.heads.importer import import_head
from peagle.heads.io import load_head_dir
from peagle.heads.model import DrafterHead


def published_peagle_head(path, target_dir, mask_id, layers=4, **over):
    """Written the way the published heads ship: model. prefixes, no d2t / t2d, 3-D mask_hidden, mask token as
    ptd_token_id / pard_token, the hidden sizes and vocabulary of the target."""
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    L = t["num_hidden_layers"]
    cfg = dict(hidden_size=t["hidden_size"], intermediate_size=2 * t["hidden_size"], num_hidden_layers=layers,
               num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
               head_dim=t["head_dim"], rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=2048,
               vocab_size=t["vocab_size"], draft_vocab_size=t["vocab_size"], target_hidden_size=t["hidden_size"],
               eagle_aux_hidden_state_layer_ids=[1, L // 2, L - 1], norm_before_residual=False,
               ptd_token_id=mask_id, pard_token=mask_id)
    cfg.update(over)
    torch.manual_seed(0)
    h = DrafterHead(cfg)
    with torch.no_grad():
        for p in h.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    sd = {("" if k.startswith("lm_head") else "model.") + k: v.contiguous()
          for k, v in h.state_dict().items() if k not in ("d2t", "t2d")}
    assert sd["model.mask_hidden"].shape == (1, 1, 3 * cfg["target_hidden_size"])
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "model.safetensors"))
    pub = dict(cfg, architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
               tie_word_embeddings=False, eagle_config={"use_aux_hidden_state": True})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(pub, f)
    return str(path)


@pytest.fixture(scope="module")
def gpt_oss(family_dirs):
    from transformers import AutoTokenizer
    target = family_dirs["gpt_oss"]
    tok = AutoTokenizer.from_pretrained(target)
    mask_id = 509                               # a placeholder: in the model's vocabulary, not the tokenizer's
    assert mask_id >= len(tok) and mask_id not in tok.all_special_ids
    return target, mask_id


def test_published_shapes_convert_validate_and_decode_losslessly(gpt_oss, tmp_path):
    target, mask_id = gpt_oss
    src = published_peagle_head(tmp_path / "pub", target, mask_id)
    notes = []
    cfg, ts = import_head(src, tmp_path / "native", target_dir=target, notes=notes)
    assert cfg["num_hidden_layers"] == 4 and cfg["draft_vocab_size"] == cfg["vocab_size"] == 512
    assert cfg["ptd_token_id"] == cfg["pard_token"] == mask_id and cfg["peagle"]["method"] == "peagle"
    assert torch.equal(ts["d2t"], torch.zeros(512, dtype=torch.int64)) and bool(ts["t2d"].all())
    assert any("identity d2t" in n for n in notes)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in (5, 19, 27)]
    want = hf_greedy(target, prompts, 12)
    spec = {"method": "eagle3", "model": str(tmp_path / "native"), "num_speculative_tokens": 5,
            "parallel_drafting": True}
    llm = LLM(target, speculative_config=spec)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == want
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("over,field", [
    ({"target_hidden_size": 48, "hidden_size": 48, "head_dim": 12}, "target_hidden_size"),
    ({"vocab_size": 600, "draft_vocab_size": 600}, "vocab_size"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}, "eagle_aux_hidden_state_layer_ids"),
])
def test_a_head_for_another_target_is_refused_naming_the_field(gpt_oss, tmp_path, over, field):
    target, mask_id = gpt_oss
    src = published_peagle_head(tmp_path / "pub", target, mask_id, layers=1, **over)
    with pytest.raises(HeadValidationError, match=field):
        import_head(src, tmp_path / "native", target_dir=target)
    assert not os.path.exists(tmp_path / "native")
    import_head(src, tmp_path / "unchecked", validate=False)          # converted without the target check ...
    spec = {"method": "eagle3", "model": str(tmp_path / "unchecked"), "num_speculative_tokens": 3,
            "parallel_drafting": True}
    with pytest.raises(PeagleError, match=field):                     # ... the engine still refuses it
        LLM(target, speculative_config=spec)


# ---- heads in the layouts others publish (flat vLLM, speculators), against a flat target directory
def test_import_published_flat_head_midlayer_full_vocab(tmp_path):
    """An EAGLE-3 head as published by others: model. prefixes, midlayer.*, no d2t/t2d, no embed_tokens,
    nested aux ids, max_position_embeddings below the target's."""
    target = write_target(tmp_path / "target")
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
    target = write_target(tmp_path / "t8", num_hidden_layers=8)
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
    # the K it is served with, not a trained depth: an EAGLE-3 head's depth is its ttt_steps (when recorded)
    assert icfg["peagle"] == {"method": "eagle3", "num_speculative_tokens": 5, "target": "org/target",
                              "imported_from": "speculators:eagle3"}
    same_tensors(its, ts)


def test_import_speculators_aux_default_is_validated(tmp_path):
    """vLLM's default aux ids (2, L//2, L-3) collide on a 4-layer target ([2, 2, 1]): import must refuse."""
    d = write_target(tmp_path / "t", num_hidden_layers=4)
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


def test_a_dflash_mask_token_is_not_left_for_vllm_to_prefer(tmp_path):
    """vLLM reads dflash_config.mask_token_id before pard_token / ptd_token_id: left in, vLLM drafted with another
    mask token than peagle. Import keeps one mask token."""
    cfg = make_config()
    cfg["dflash_config"] = {"mask_token_id": MASK + 2, "other": 1}
    icfg, _ = import_head(write_head(tmp_path / "h", cfg, make_tensors(make_config())))
    assert icfg["ptd_token_id"] == icfg["pard_token"] == MASK and icfg["dflash_config"] == {"other": 1}


def test_depths_survive_a_speculators_round_trip_and_set_exports_k(tmp_path):
    """Exported to speculators with K = 2 and imported back, an EAGLE-3 head of ttt_steps 6 came back with
    train_depths 2 (auto K's bound fell to 2); export's default K ignored ttt_steps (3)."""
    from peagle.autok.factory import trained_depth
    tgt = str(tmp_path / "t")
    write_target(tgt)
    cfg = make_config("eagle3")
    cfg["peagle"] = {"method": "eagle3", "ttt_steps": 6}
    src = write_head(tmp_path / "h", cfg, make_tensors(cfg))
    out = str(tmp_path / "spec")
    export_head(src, out, format="speculators", target_dir=tgt, num_speculative_tokens=2)
    back, _ = import_head(out, None)
    assert trained_depth(back) == 6 and back["peagle"]["num_speculative_tokens"] == 2
    vout = str(tmp_path / "v")
    export_head(src, vout, target_dir=tgt)
    assert load_head_dir(vout)[0]["peagle"]["num_speculative_tokens"] == 6


def test_a_float_d2t_and_a_tied_bin_checkpoint(tmp_path):
    """A d2t stored as floats was cast to int64 (bfloat16 rounds offsets past 256): refused. A .bin checkpoint
    whose lm_head shares the embedding's storage crashed safetensors' writer: written as two tensors."""
    cfg = make_config("eagle3")
    ts = make_tensors(cfg)
    bad = dict(ts, d2t=ts["d2t"].to(torch.bfloat16))
    with pytest.raises(HeadValidationError, match="d2t is stored as bfloat16"):
        import_head(write_head(tmp_path / "f", cfg, bad))
    tied = dict(ts)
    tied["lm_head.weight"] = tied["embed_tokens.weight"]
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save(tied, d / "pytorch_model.bin")
    import_head(str(d), str(tmp_path / "out"))
    got = load_head_dir(str(tmp_path / "out"))[1]
    assert torch.equal(got["lm_head.weight"], ts["embed_tokens.weight"])


def test_export_into_a_symlinked_directory(tmp_path):
    """An empty directory reached through a symlink was accepted, then rmtree refused the link (a traceback)."""
    cfg = make_config("eagle3")
    src = write_head(tmp_path / "h", cfg, make_tensors(cfg))
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    export_head(src, str(tmp_path / "link"))
    assert (tmp_path / "link").is_symlink() and (real / "config.json").is_file()


def test_a_flat_head_without_norm_before_residual_gets_vllms_flat_default(tmp_path):
    """vLLM's flat layout reads an absent norm_before_residual as false (only speculators' eagle3 updater says
    true): an imported flat head that leaves it out must draft with the embedding-side residual, as vLLM does."""
    cfg = make_config("eagle3")
    del cfg["norm_before_residual"]
    icfg, _ = import_head(write_head(tmp_path / "h", cfg, make_tensors(cfg)))
    assert icfg["norm_before_residual"] is False


def test_a_ptd_pard_conflict_takes_the_token_vllm_reads(tmp_path):
    """vLLM 0.16-0.19 and >= 0.22 read pard_token before ptd_token_id: a head with both, differing, drafts with
    pard_token in vLLM, so the imported head keeps that one (for both keys) and says so."""
    cfg = make_config(pard_token=MASK + 1)
    notes = []
    icfg, _ = import_head(write_head(tmp_path / "h", cfg, make_tensors(make_config())), notes=notes)
    assert icfg["ptd_token_id"] == icfg["pard_token"] == MASK + 1
    assert any("!= pard_token" in n for n in notes)
