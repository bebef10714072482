"""The default target, SmolLM2-135M-Instruct, in the engine: speculative decoding with either drafter is
token-identical to plain decoding (batched, ragged prompts), and P-EAGLE's mask token defaults to a reserved
special token SmolLM2 never generates."""
from __future__ import annotations

import os

import pytest

from peagle import LLM, SamplingParams
from peagle.heads.config import resolve_mask_token
from peagle.heads.init import random_head

QUESTIONS = ["What is the difference between a list and a tuple in Python?",
             "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def smollm2():
    from peagle.default_target import ensure
    return ensure(verbose=False)


@pytest.fixture(scope="module")
def plain(smollm2):
    llm = LLM(smollm2, max_num_seqs=4)
    prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])} for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return prompts, sp, [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def test_mask_token_default_is_a_reserved_special_token(smollm2):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    m = resolve_mask_token(smollm2)
    assert tok.convert_ids_to_tokens(m) == "<empty_output>"
    assert m not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert resolve_mask_token(smollm2, 7) == 7                     # an explicit id wins


@pytest.mark.parametrize("parallel,k", [(True, 5), (False, 3)])
def test_speculative_decoding_is_identical_to_plain(smollm2, plain, tmp_path, parallel, k):
    prompts, sp, ref = plain
    head = random_head(smollm2, str(tmp_path / "head"), parallel=parallel, draft_vocab=8192, seed=3)
    llm = LLM(smollm2, max_num_seqs=4, speculative_config={"method": "eagle3", "model": head,
                                                           "num_speculative_tokens": k, "parallel_drafting": parallel})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == ref
    assert llm.get_metrics()["num_drafts"] > 0
    assert os.path.isfile(os.path.join(head, "config.json"))


def test_peagle_setup_finds_a_prepared_home_current(smollm2, capsys):
    """`peagle setup` (an installed peagle's `make setup`) on a home already set up: it names the home, finds the
    kernels' build current and the converted target matching its pinned hash, and changes nothing."""
    from peagle.cli import main
    from peagle.models import quant_ext
    from peagle.paths import HOME
    st = os.stat(os.path.join(smollm2, "model.safetensors"))
    assert main(["setup"]) == 0
    out = capsys.readouterr().out
    assert f"peagle home: {HOME}" in out and f"default target: {smollm2}" in out
    assert ("built peagle_quant" in out) == (quant_ext.get() is not None)
    assert os.stat(os.path.join(smollm2, "model.safetensors")).st_mtime == st.st_mtime


def test_a_stamp_over_other_weights_is_not_trusted_nor_is_another_gguf(tmp_path, monkeypatch):
    """ensure() trusts a converted directory only when its weights hash to the pinned value (a stamp that claims
    so over other bytes is converted again), and converts only the pinned GGUF (another file: one PeagleError)."""
    import json as _json

    from peagle import default_target
    from peagle.errors import PeagleError
    out = tmp_path / "target"
    out.mkdir()
    (out / "conversion.json").write_text(_json.dumps({"safetensors_sha256": default_target.SAFETENSORS_SHA256}))
    (out / "model.safetensors").write_bytes(b"not the pinned weights")
    fake = tmp_path / default_target.GGUF_NAME
    fake.write_bytes(b"GGUF not the pinned file")
    monkeypatch.setattr(default_target, "gguf_path", lambda: str(fake))
    with pytest.raises(PeagleError, match="is not the pinned"):
        default_target.ensure(str(out), verbose=False)
