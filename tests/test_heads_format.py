"""Head format validation (peagle/heads/format.py): a valid head has no problems; each broken field, shape,
aux id or vocabulary rule is reported by name, all at once."""
from __future__ import annotations

import pytest
import torch
from headfiles import HD, MASK, NH, H, V, make_config, make_tensors, target_config

from peagle.heads.format import validate_head


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


def test_d2t_onto_exactly_vocab_size_is_outside_the_vocabulary():
    """A draft id mapped to target id V (one past the last) is out of range too, not only ids beyond it."""
    cfg = make_config(draft_vocab=48)
    ts = make_tensors(cfg)
    ts["d2t"] = ts["d2t"].clone()
    ts["d2t"][-1] = V - (48 - 1)            # draft 47 -> target V
    assert "outside the target vocabulary" in problems(cfg, ts)


def test_a_mask_hidden_of_the_wrong_size_is_refused():
    """mask_hidden may come in any shape holding 3 * target_hidden_size values (it is reshaped to [1, 1, 3T]);
    another count is refused by name (it failed later, in a reshape or load_state_dict)."""
    cfg = make_config()
    ts = make_tensors(cfg)
    ts["mask_hidden"] = torch.zeros(3 * H)
    assert problems(cfg, ts) == ""
    ts["mask_hidden"] = torch.zeros(1, 1, 2 * H)
    assert "tensor mask_hidden has shape" in problems(cfg, ts)


def test_an_integer_weight_is_refused():
    """Weights must be floating point (an int8 tensor is a quantized checkpoint's codes: loading it into float
    parameters casts the codes, silently giving another head)."""
    cfg = make_config()
    ts = make_tensors(cfg)
    ts["norm.weight"] = torch.ones(H, dtype=torch.int8)
    assert "tensor norm.weight must be floating point" in problems(cfg, ts)
