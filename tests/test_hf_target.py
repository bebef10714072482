"""The transformers-backed target against transformers itself, per family: logits and aux taps of ragged
(right-padded) batches, rollback and re-append past the sliding window, prefill logits at given positions, and
the teacher logits from the final residual."""
import pytest
import torch
from families import HF_FAMILIES, WINDOW

from peagle.models.hf_target import HFTarget

TOL = 1e-4


def hf(path):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=HF_FAMILIES)
def pair(request, family_dirs):
    path = family_dirs[request.param]
    return request.param, hf(path), HFTarget.from_pretrained(path)


def test_logits_and_every_aux_tap_match_transformers(pair):
    """aux id i = transformers' hidden_states[i] (embedding output after Gemma's scaling, each layer's output
    after Gemma 4's per-layer scalar); id L = the final norm's input (transformers normalises its last one)."""
    family, ref, ours = pair
    L, H = ours.cfg.num_hidden_layers, ours.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    lens = [3 * WINDOW, 5, 2 * WINDOW + 3]
    toks = torch.randint(2, 500, (len(lens), max(lens)), generator=g)
    logits, aux = ours.forward(toks, ours.new_cache(len(lens), 64), 0, torch.zeros(len(lens), dtype=torch.long),
                               aux_ids=tuple(range(L + 1)))
    assert aux.shape[-1] == (L + 1) * H
    for b, n in enumerate(lens):   # padding after a row's tokens must not change them (attention or routing)
        with torch.no_grad():
            out = ref(toks[b:b + 1, :n], output_hidden_states=True)
        assert (logits[b, :n] - out.logits[0]).abs().max() < TOL
        for i in range(L):
            assert (aux[b, :n, i * H:(i + 1) * H] - out.hidden_states[i][0]).abs().max() < TOL, (family, i)
        assert (ours.final_norm(aux[b, :n, L * H:]) - out.hidden_states[L][0]).abs().max() < TOL
        # teacher logits (training) from the final residual equal the model's own, softcapping included
        assert (ours.final_logits(aux[b, :n, L * H:]) - out.logits[0]).abs().max() < TOL
    rows = torch.tensor([7, 3, 300])
    assert (ours.final_logits(aux[0, :4, L * H:], rows) - logits[0, :4, rows]).abs().max() < TOL


def test_ragged_rollback_and_reappend_past_the_window(pair):
    """Rows at different lengths (all beyond the window) verify a block, roll back to different lengths after
    junk was written there, and continue: every logit equals a fresh transformers pass over the kept tokens."""
    family, ref, ours = pair
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(2, 500, (3, 4 * WINDOW), generator=g)
    c = ours.new_cache(3, 64)
    ours.forward(toks[:, : 2 * WINDOW], c, 0, torch.zeros(3, dtype=torch.long))
    start = torch.tensor([2 * WINDOW, WINDOW + 1, 2 * WINDOW - 3])       # rows 1, 2 roll back into their prompt
    ours.forward(torch.randint(2, 500, (3, 5), generator=g), c, 0, start)  # a rejected block: junk past start
    for step in range(2):
        blk = torch.stack([toks[b, s:s + 4] for b, s in enumerate(start.tolist())])
        got, _ = ours.forward(blk, c, 0, start)
        for b, s in enumerate(start.tolist()):
            with torch.no_grad():
                want = ref(toks[b:b + 1, : s + 4]).logits[0, s:]
            assert (got[b] - want).abs().max() < TOL, (family, step, b)
        start = start + torch.tensor([4, 2, 3])            # keep part of the block, as ragged acceptance does


def test_prefill_logits_at_positions_and_row_offset(pair):
    """logits_at picks each row's position before the head; rows written at b0 > 0 leave rows < b0 alone."""
    family, ref, ours = pair
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(2, 500, (2, 2 * WINDOW + 2), generator=g)
    c = ours.new_cache(4, 64)
    first, _ = ours.forward(toks[:1], c, 0, torch.zeros(1, dtype=torch.long))
    at = torch.tensor([2 * WINDOW + 1, 4])
    la, _ = ours.forward(toks, c, 2, torch.zeros(2, dtype=torch.long), logits_at=at)
    for b in range(2):
        with torch.no_grad():
            want = ref(toks[b:b + 1, : int(at[b]) + 1]).logits[0, -1]
        assert la.shape == (2, ours.cfg.vocab_size) and (la[b] - want).abs().max() < TOL
    nxt, _ = ours.forward(toks[:1, :1], c, 0, torch.tensor([2 * WINDOW + 2]))   # row 0 still holds its prompt
    with torch.no_grad():
        want = ref(torch.cat([toks[:1], toks[:1, :1]], 1)).logits[0, -1]
    assert (nxt[0, 0] - want).abs().max() < TOL


def test_unknown_aux_id_is_refused(pair):
    from peagle.errors import PeagleError
    _, _, ours = pair
    with pytest.raises(PeagleError, match="aux ids"):
        ours.forward(torch.tensor([[5, 6]]), ours.new_cache(1, 8), 0, torch.zeros(1, dtype=torch.long),
                     aux_ids=(ours.cfg.num_hidden_layers + 1,))


def test_model_config_of_any_target_and_a_new_head_for_it(pair, family_dirs):
    """ModelConfig.describe reads the sizes of any causal LM's config.json (also nested under text_config, as
    multimodal checkpoints ship it); a new head built from it fits the target."""
    import json
    import os

    from peagle.heads.config import HeadConfig
    from peagle.models.config import ModelConfig
    family, ref, ours = pair
    with open(os.path.join(family_dirs[family], "config.json")) as f:
        raw = json.load(f)
    for cfg in (raw, {"model_type": "wrapper", "text_config": raw}):
        c = ModelConfig.describe(cfg)
        assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.num_attention_heads) == (
            ref.config.hidden_size, len(ours.layers), ours.cfg.vocab_size, ours.cfg.num_attention_heads)
        hc = HeadConfig.for_target(c, layers=1, mask_token=4)
        assert hc.validate(raw) == [] and max(hc.eagle_aux_hidden_state_layer_ids) < len(ours.layers)


def test_a_window_only_where_the_family_has_one():
    """transformers keeps unknown config keys as attributes: a Llama config carrying a stray sliding_window got
    a windowed mask in the transformers backend that transformers' own Llama never applies (other output than
    transformers from the window on). A family with a window keeps it."""
    from transformers import LlamaConfig, MistralConfig

    from peagle.models.hf_target import attention_windows
    assert attention_windows(LlamaConfig(sliding_window=8)) == {"all": None}
    assert attention_windows(MistralConfig(sliding_window=8)) == {"all": 8}


@pytest.mark.parametrize("family", ["cohere", "stablelm", "qwen3"])
def test_the_final_norms_scale_is_its_weight_layernorms_included(tmp_path, family):
    """HFTarget.norm (a new head's first norm) fed a vector of ones through the final norm: a LayerNorm
    subtracts the mean and adds its bias, so Cohere's came out zeros and StableLM's its bias. Now its weight."""
    import transformers as tf

    from peagle.models.loader import load_target
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
    cfg = {"cohere": tf.CohereConfig, "stablelm": tf.StableLmConfig, "qwen3": tf.Qwen3Config}[family](**kw)
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in m.model.norm.parameters():
            p.copy_(torch.rand_like(p) + 0.5)            # a weight (and bias) that is not all ones (zeros)
    m.save_pretrained(tmp_path / "m")
    t = load_target(str(tmp_path / "m"), backend="transformers")
    assert torch.allclose(t.norm.float(), m.model.norm.weight.float(), rtol=1e-4), (t.norm[:4], m.model.norm.weight[:4])
