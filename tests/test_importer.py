"""`peagle import` of heads shaped like the published P-EAGLE ones, against a matching tiny GPT-OSS target: a
4-layer head with a full-vocabulary lm_head and no d2t, a mask (placeholder) token id outside the tokenizer's
special tokens, mask_hidden [1,1,3H].  It converts, validates, and decodes losslessly; a head that does not
match the target (hidden size, vocabulary, aux ids) is refused with the field named."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from tiny import hf_greedy

from peagle import LLM, SamplingParams
from peagle.errors import PeagleError
from peagle.heads.format import HeadValidationError
from peagle.heads.importer import import_head
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
