"""GPT-OSS, Qwen3-MoE, Gemma 3 and Gemma 4 end to end through the transformers backend, on tiny random
checkpoints: `peagle datagen` -> `peagle train` (EAGLE-3 and P-EAGLE) -> the engine -> `peagle bench` ->
`peagle export`.  Greedy outputs, plain and speculative (both heads, K 3 and 7, batch 1 and a ragged batch of
8 with requests joining and leaving), equal transformers' own generate() token for token."""
import json
import os

import pytest
import torch
from families import HF_FAMILIES, WINDOW
from tiny import hf_greedy, write_greedy_shard

from peagle import LLM, SamplingParams
from peagle.cli import main
from peagle.train.data import load_docs


def peagle(*args):
    assert main([str(a) for a in args]) == 0, args


@pytest.fixture(scope="module", params=HF_FAMILIES)
def trained(request, family_dirs, tmp_path_factory):
    """datagen on the family's tiny target, then an EAGLE-3 and a P-EAGLE head trained on that data."""
    fam, target = request.param, family_dirs[request.param]
    root = tmp_path_factory.mktemp(fam)
    data = str(root / "data")
    # code prompts (the tiny tokenizer spends many tokens on them: 4 of these 12 fit in 400 tokens)
    peagle("datagen", "--model", target, "--out", data, "--num-prompts", 12, "--code-fraction", 1,
           "--max-prompt-tokens", 400, "--max-new-tokens", 32, "--batch", 6, "--shard-size", 6, "--threads", 1)
    # plus the target's continuations of short random prompts, like the identity test's (so drafts get accepted)
    regen = write_greedy_shard(target, str(root / "regen"))
    heads = {m: str(root / m) for m in ("eagle3", "peagle")}
    for method, flags in (("eagle3", ["--ttt-steps", 3]), ("peagle", ["--depths", 4])):
        peagle("train", "--method", method, "--target", target, "--data", f"{data},{regen}", "--out", heads[method],
               "--layers", 1, "--draft-vocab", 256, "--max-tokens", 512, "--steps", 30, "--lr", 3e-3,
               "--warmup", 3, "--log-every", 5, "--ckpt-every", 0, "--quiet", "--threads", 1, *flags)
    return fam, target, data, heads


def test_datagen_rows_are_the_targets_greedy_continuations(trained):
    _, target, data, _ = trained
    docs = load_docs(data)
    assert len(docs) >= 3
    for ids, mask in docs[:2]:
        prompt, gen = ids[mask == 0].tolist(), ids[mask == 1].tolist()
        assert len(gen) > 0 and mask[: len(prompt)].sum() == 0
        assert hf_greedy(target, [prompt], len(gen))[0] == gen     # EOS may end a row early: same prefix


def test_training_logs_and_greedy_identity_plain_and_speculative(trained):
    fam, target, _, heads = trained
    for h in heads.values():
        with open(os.path.join(h, "train_log.jsonl")) as f:
            log = [json.loads(x) for x in f]
        assert log[-1]["loss"] < log[0]["loss"], (fam, log[0], log[-1])
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(3, 3 * WINDOW, (8,), generator=g)
    prompts = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in lens]
    want = hf_greedy(target, prompts, 20)
    ps = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, sp)]

    assert run(LLM(target, max_num_seqs=8), ps) == want
    assert run(LLM(target, max_num_seqs=1), ps[:2]) == want[:2]
    accepted = 0
    for method in ("eagle3", "peagle"):
        for k in (3, 7):
            spec = {"method": "eagle3", "model": heads[method], "num_speculative_tokens": k,
                    "parallel_drafting": method == "peagle"}
            llm = LLM(target, speculative_config=spec, max_num_seqs=5)     # 8 requests through 5 rows
            assert run(llm, ps) == want, (fam, method, k)
            accepted += llm.get_metrics()["num_accepted_tokens"]
            assert run(LLM(target, speculative_config=spec, max_num_seqs=1), ps[:2]) == want[:2], (fam, method, k)
    assert accepted > 0, fam            # trained heads get drafts accepted: ragged rollback is exercised


def test_bench_and_export(trained, tmp_path):
    from peagle.heads.format import validate_head
    from peagle.heads.io import load_head_dir
    from peagle.models.files import read_config
    _, target, _, heads = trained
    out = tmp_path / "bench"
    peagle("bench", "--model", target, "--eagle3-head", heads["eagle3"], "--peagle-head", heads["peagle"],
           "--datasets", "humaneval", "--num-prompts", 2, "--output-len", 8, "--ks", 3, "--concurrency", 2,
           "--peers", "hf", "--peer-prompts", 1, "--threads", 1, "--out", out)
    res = json.loads((out / "results.json").read_text())
    # baseline, EAGLE-3, P-EAGLE, and the baseline again at the repeat's end (--ref-every)
    assert len(res["runs"]) == 4 and all(r["identity"]["ok"] for r in res["runs"])
    assert res["peers"] and all(p["identity"]["ok"] for p in res["peers"])   # transformers' generate agrees
    for method, h in heads.items():
        peagle("export", h, tmp_path / method, "--target", target)
        cfg, ts = load_head_dir(tmp_path / method)
        assert validate_head(cfg, ts, read_config(target), parallel=method == "peagle") == []
