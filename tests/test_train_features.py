"""peagle/train/features.py: the teacher's logits (final_logits of the final residual) are the target's own,
checked when a teacher is made; transformers-backed families that scale their logits (Granite, Cohere)
included."""
import pytest
import torch

from peagle.errors import PeagleError
from peagle.models.loader import load_target
from peagle.train.features import Teacher


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_the_teacher_is_the_targets_own_distribution(tmp_path, family, monkeypatch):
    """Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale: final_logits did
    neither, so heads of such targets trained on a 4x (16x) sharper distribution than the target's. Negative
    control: a final_logits off by a factor is refused when the teacher is made."""
    import transformers as tf
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    cfg = tf.GraniteConfig(**kw, logits_scaling=4.0) if family == "granite" else tf.CohereConfig(**kw, logit_scale=0.0625)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    t = load_target(str(tmp_path / "m"), backend="transformers")
    Teacher(t, (1, 2, 3), torch.arange(256))
    orig = t.final_logits
    monkeypatch.setattr(t, "final_logits", lambda h, rows=None: orig(h, rows) * 4)
    with pytest.raises(PeagleError, match="teacher would be wrong"):
        Teacher(t, (1, 2, 3), torch.arange(256))
