"""HeadConfig (peagle/heads/config.py): round trip of real head configs, the aux-id rules, the mask token
taken from the tokenizer or given (never assumed), one answer to "is this a parallel head"."""
from __future__ import annotations

import json
import os

import pytest
import torch
from heads import head_config, save_random_head
from tiny import make_tiny_tokenizer, save_tiny, save_tiny_text_model

from peagle.errors import PeagleError
from peagle.heads.config import (
    HeadConfig,
    default_aux_layer_ids,
    is_parallel_head,
    resolve_mask_token,
    validate_config,
    vllm_aux_layer_ids,
)
from peagle.heads.format import validate_head
from peagle.heads.io import load_head_dir
from peagle.heads.model import DrafterHead
from peagle.llm import DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD, DEMO_TARGET
from peagle.models.config import ModelConfig
from peagle.models.files import read_config

SHIPPED = [d for d in (DEMO_EAGLE3_HEAD, DEMO_PEAGLE_HEAD) if os.path.isfile(os.path.join(d, "config.json"))]


@pytest.mark.parametrize("head_dir", SHIPPED, ids=os.path.basename)
def test_shipped_head_config_round_trips_and_rebuilds(head_dir):
    """from_dict/to_dict keep every key of a real head config; HeadConfig.for_target on the demo target with
    the head's own choices gives the same config, so training builds what shipped."""
    cfg = read_config(head_dir)
    hc = HeadConfig.from_dict(cfg)
    assert hc.to_dict() == cfg
    assert hc.parallel == is_parallel_head(cfg) == (cfg["peagle"]["method"] == "peagle")
    built = HeadConfig.for_target(ModelConfig.from_dir(DEMO_TARGET), cfg["num_hidden_layers"],
                                  cfg["draft_vocab_size"], hc.mask_token_id, peagle=cfg["peagle"],
                                  torch_dtype=cfg["torch_dtype"])
    assert built.to_dict() == cfg
    assert built.validate(read_config(DEMO_TARGET)) == []


@pytest.mark.parametrize("head_dir", SHIPPED, ids=os.path.basename)
def test_shipped_aux_ids_are_vllm_default(head_dir):
    """The shipped heads were trained with (and pass vLLM parity on) vLLM's default aux layers."""
    L = read_config(DEMO_TARGET)["num_hidden_layers"]
    assert read_config(head_dir)["eagle_aux_hidden_state_layer_ids"] == vllm_aux_layer_ids(L) == \
        default_aux_layer_ids(L)


def test_default_aux_ids_are_valid_for_every_depth():
    for L in range(4, 129):
        ids = default_aux_layer_ids(L)
        assert len(ids) == 3 and ids == sorted(set(ids)) and 0 < ids[0] and ids[-1] < L, (L, ids)
        v = vllm_aux_layer_ids(L)
        if v == sorted(set(v)):
            assert ids == v, L                        # vLLM's rule wherever it gives valid ids
    assert default_aux_layer_ids(3) == [0, 1, 2]      # the shallow rule gave [1, 1, 2]: a head validation refused
    for L in (1, 2):
        with pytest.raises(PeagleError, match="three distinct"):
            default_aux_layer_ids(L)


def test_built_head_is_valid_and_loads(tmp_path, tiny_dirs):
    """A head built from HeadConfig validates against its target, saves atomically and loads as the same
    kind of head (parallel decided once)."""
    target = tiny_dirs["llama"]
    for parallel in (True, False):
        hc = head_config(target, layers=2, parallel=parallel, draft_vocab=256)
        assert hc.validate(read_config(target)) == []
        path = save_random_head(target, str(tmp_path / f"h{parallel}"), layers=2, parallel=parallel, draft_vocab=256)
        assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]   # no temporary files left
        cfg, ts = load_head_dir(path)
        assert validate_head(cfg, ts, read_config(target)) == []
        assert is_parallel_head(cfg, ts) == parallel == DrafterHead.from_pretrained(path).parallel
        assert ("mask_hidden" in ts) == parallel


def test_validate_reports_a_mask_token_outside_the_vocabulary(tiny_dirs):
    t = read_config(tiny_dirs["llama"])
    hc = HeadConfig.for_target(ModelConfig.describe(t), mask_token=t["vocab_size"] + 3)
    assert any("ptd_token_id" in p for p in hc.validate(t))


def test_incomplete_config_is_a_peagle_error():
    with pytest.raises(PeagleError, match="incomplete"):
        HeadConfig.from_dict({"hidden_size": 64})


def test_mask_token_from_tokenizer_given_or_refused(tmp_path):
    """<|mask|> comes from the target's tokenizer; an explicit id wins; without either: refused."""
    from transformers import AutoTokenizer
    with_mask = save_tiny_text_model(str(tmp_path / "m"))
    want = AutoTokenizer.from_pretrained(with_mask).convert_tokens_to_ids("<|mask|>")
    assert resolve_mask_token(with_mask) == want
    assert resolve_mask_token(with_mask, explicit=7) == 7
    no_mask = save_tiny("llama", str(tmp_path / "n"))
    make_tiny_tokenizer(no_mask)                      # ChatML specials only
    with pytest.raises(PeagleError, match="mask-token"):
        resolve_mask_token(no_mask)
    no_tok = save_tiny("llama", str(tmp_path / "t"))
    with pytest.raises(PeagleError, match="mask-token"):
        resolve_mask_token(no_tok)
    assert resolve_mask_token(no_tok, explicit=3) == 3


def test_peagle_record_decides_parallel():
    """peagle's own method record is authoritative; otherwise a mask-token id or a mask_hidden tensor."""
    base = {"ptd_token_id": 4, "pard_token": 4}
    assert is_parallel_head(base)
    assert not is_parallel_head({**base, "peagle": {"method": "eagle3"}})
    assert not is_parallel_head({})
    assert is_parallel_head({}, {"mask_hidden": torch.zeros(1, 1, 6)})


def test_training_record_has_no_absolute_paths():
    for d in SHIPPED:
        with open(os.path.join(d, "config.json")) as f:
            rec = json.load(f)["peagle"]
        for key in ("data", "init"):
            for p in str(rec.get(key) or "").split(","):
                assert not os.path.isabs(p), (d, key, p)


def test_rope_in_rope_parameters_is_the_heads_rope(tiny_dirs):
    """transformers 5 stores the base and scaling in rope_parameters: the head drafts with them (it used the
    default 10000 and no scaling: other positions than vLLM's), and a rope type peagle lacks is a problem."""
    from peagle.models.layers import rope_inv_freq
    d = head_config(tiny_dirs["llama"], parallel=False).to_dict()
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hc = HeadConfig.from_dict(d)
    assert hc.rope_theta == 500000.0 and hc.validate() == []
    rope = DrafterHead(hc)._rope(torch.device("cpu"), torch.float32)
    hd = hc.head_dim
    assert torch.equal(rope.inv, rope_inv_freq(hd, 500000.0, d["rope_parameters"]))
    assert not torch.allclose(rope.inv, rope_inv_freq(hd, 500000.0, None))          # the scaling is applied
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}
    assert any("rope type 'yarn'" in p for p in HeadConfig.from_dict(d).validate())


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_rope_scaling_key_gives_transformers_rotary_values(tiny_dirs, scaling):
    """A head config's rope_scaling (transformers 4's key) is the head's rope: cos/sin equal transformers'."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    d = head_config(tiny_dirs["llama"], parallel=False).to_dict()
    d["rope_theta"], d["rope_scaling"] = 10000.0, scaling
    hc = HeadConfig.from_dict(d)
    rope = DrafterHead(hc)._rope(torch.device("cpu"), torch.float32)
    pos = torch.tensor([0, 1, 7, 50, 200])
    ref = LlamaRotaryEmbedding(tf.LlamaConfig(head_dim=hc.head_dim, max_position_embeddings=256,
                                              rope_parameters={**scaling, "rope_theta": 10000.0}))
    cos, sin = ref(torch.zeros(1, 5, hc.head_dim), pos[None])
    assert torch.allclose(rope.cos[pos, 0], cos[0], atol=1e-5) and torch.allclose(rope.sin[pos, 0], sin[0], atol=1e-5)


@pytest.mark.parametrize("key", ["norm_before_fc", "fc_norm", "norm_output"])
def test_norms_vllm_applies_and_peagle_does_not_are_refused(tiny_dirs, key):
    """A head with one of speculators' norm flags would draft from other states in peagle than in vLLM."""
    d = head_config(tiny_dirs["llama"], parallel=False).to_dict()
    assert validate_config(d) == []
    d[key] = True
    assert any(f"config.{key} is true" in p for p in validate_config(d))


@pytest.mark.parametrize("over", [{"bias": True}, {"attention_bias": True}, {"mlp_bias": True},
                                  {"layer_types": ["sliding_attention"], "sliding_window": 16}, {"is_causal": False},
                                  {"partial_rotary_factor": 0.5}, {"logit_scale": 0.25},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}}])
def test_what_vllm_applies_and_peagle_does_not_is_refused(tiny_dirs, over):
    """vLLM obeys these keys (biases it would fill with uninitialised memory, sliding windows, non-causal
    attention, partial rotary, logit scaling); peagle's drafter ignored them and exported them: refused."""
    d = head_config(tiny_dirs["llama"], parallel=False).to_dict()
    assert validate_config(d) == []
    assert any("peagle's drafter does not" in p for p in validate_config({**d, **over})), over


def test_a_mask_token_of_exactly_vocab_size_is_outside_the_vocabulary(tiny_dirs):
    """Token ids run 0..vocab_size-1: a mask id equal to vocab_size indexes past vLLM's embedding (the boundary;
    vocab_size - 1 is fine)."""
    t = read_config(tiny_dirs["llama"])
    V = t["vocab_size"]
    assert HeadConfig.for_target(ModelConfig.describe(t), mask_token=V - 1).validate(t) == []
    assert any("ptd_token_id" in p for p in HeadConfig.for_target(ModelConfig.describe(t), mask_token=V).validate(t))


def test_an_activation_other_than_silu_is_refused(tiny_dirs):
    """vLLM applies the config's hidden_act; peagle's drafter always runs SiLU: a GELU head would draft other
    tokens in peagle than in vLLM."""
    d = head_config(tiny_dirs["llama"], parallel=False).to_dict()
    assert validate_config(d) == []
    assert any("hidden_act" in p for p in validate_config({**d, "hidden_act": "gelu"}))


def test_the_mask_token_is_the_highest_free_reserved_special_token(tmp_path):
    """Without <|mask|>: the highest-id added special token that is not BOS/EOS/PAD/UNK and not in the chat
    template (SmolLM2: <empty_output> = 16, what its shipped P-EAGLE head was trained with)."""
    from transformers import AutoTokenizer

    from peagle.heads.config import mask_token_from_tokenizer
    from peagle.llm import DEFAULT_MODEL, DEFAULT_PEAGLE_HEAD
    d = save_tiny("llama", str(tmp_path / "m"))
    tok = make_tiny_tokenizer(d)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<r_a>", "<r_b>"]})
    tok.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert resolve_mask_token(d) == tok.convert_tokens_to_ids("<r_b>") > tok.convert_tokens_to_ids("<r_a>")
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "tokenizer.json")) and os.path.isdir(DEFAULT_PEAGLE_HEAD):
        assert mask_token_from_tokenizer(DEFAULT_MODEL) == read_config(DEFAULT_PEAGLE_HEAD)["ptd_token_id"] == 16


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_training(tiny_dirs):
    """`peagle train` validates the new head's config alone (no tensors yet): a draft vocabulary past the target's
    would train for minutes and only then fail to load (its d2t cannot map every draft id to a target id)."""
    t = read_config(tiny_dirs["llama"])
    V = t["vocab_size"]
    assert HeadConfig.for_target(ModelConfig.describe(t), draft_vocab=V).validate(t) == []
    assert any("draft_vocab_size" in p for p in HeadConfig.for_target(ModelConfig.describe(t),
                                                                      draft_vocab=V + 1).validate(t))
