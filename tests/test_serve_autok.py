"""`peagle serve` with K chosen per step: "auto" from the environment variable, greedy outputs identical to
plain decoding through the official openai client, and /metrics exposing the K of each step (histogram) and
the estimates behind the choice."""
import json
import shutil

import openai
import pytest
from heads import save_random_head
from serving import BackgroundServer
from tiny import make_tiny_tokenizer

from peagle import LLM, SamplingParams

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time, in a land", "def main(): return"]


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serve-autok") / "tiny")
    shutil.copytree(tiny_dirs["llama"], d)
    make_tiny_tokenizer(d)
    return d


def serve(model_dir, env):
    from peagle.server.start import ENV_SPEC, build_state, resolve_config
    m, name, sp = resolve_config(model_dir, None, env={ENV_SPEC: env})
    return sp, BackgroundServer(build_state(m, "tiny", sp, max_num_seqs=4)).start()


def scrape(srv) -> dict:
    import urllib.request
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


@pytest.mark.parametrize("k", ["auto", 3])
def test_serve_k_per_step_identical_and_observable(model_dir, tmp_path, k):
    head = save_random_head(model_dir, str(tmp_path / "h"), layers=1)
    cfg = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": True}
    if k == "auto":
        cfg["max_num_speculative_tokens"] = 3
    sp, srv = serve(model_dir, json.dumps(cfg))
    try:
        assert sp.num_speculative_tokens == k
        # 4 x 31 decode steps: auto's first plain reference takes 16-64 before the model chooses (guard.py)
        ref = LLM(model_dir).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for p, r in zip(PROMPTS, ref):
            out = c.completions.create(model="tiny", prompt=p, max_tokens=32, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert out.choices[0].text == r.outputs[0].text
        v = scrape(srv)
        lab = '{le="%s",model_name="tiny"}'
        count = v['peagle:spec_decode_num_speculative_tokens_count{model_name="tiny"}']
        assert count > 0 and v["peagle:spec_decode_num_speculative_tokens_bucket" + lab % "+Inf"] == count
        assert v["peagle:spec_decode_num_speculative_tokens_bucket" + lab % "3.0"] == count
        if k == 3:
            assert v["peagle:spec_decode_num_speculative_tokens_bucket" + lab % "2.0"] == 0
            assert v['peagle:spec_decode_num_speculative_tokens_sum{model_name="tiny"}'] == 3 * count
            assert not any(key.startswith("peagle:autok_") for key in v)
        else:
            assert 0 <= v['peagle:autok_chosen_k{model_name="tiny"}'] <= 3
            for i in range(4):
                assert v[f'peagle:autok_step_seconds_estimate{{k="{i}",model_name="tiny"}}'] > 0
                assert v[f'peagle:autok_expected_tokens_per_step{{k="{i}",model_name="tiny"}}'] >= 1
            assert 0 < v['peagle:autok_acceptance_estimate{model_name="tiny",position="0"}'] < 1
        import urllib.request
        with urllib.request.urlopen(srv.url + "/debug/engine", timeout=30) as r:
            dbg = json.loads(r.read())
        assert dbg["speculative"]["num_speculative_tokens"] == k and dbg["speculative"]["k_max"] == 3
        assert dbg["spec_metrics"]["k_policy"]["mode"] == ("auto" if k == "auto" else "fixed")
    finally:
        srv.stop()
