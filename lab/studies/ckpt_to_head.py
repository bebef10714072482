"""A training checkpoint (OUT/checkpoint/ckpt.pt, or a copy of one) as a head directory the engine loads, so a
curve can judge a run part-way (lab/studies/smollm2_curve.py).

    .venv/bin/python lab/studies/ckpt_to_head.py runs/p4/pe_snap1.pt runs/p4/pe_snap1 \\
        --target models/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from peagle.heads.init import init_head
from peagle.models.loader import load_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--target", default="models/smollm2-135m-instruct")
    a = ap.parse_args()
    ck = torch.load(a.ckpt, map_location="cpu", weights_only=False)
    method = ck["config"]["method"]
    target = load_target(a.target)
    head = init_head(ck["head_cfg"], target, ck["draft_ids"], method, 0)
    if ck["config"].get("share_embedding"):
        head.share_embedding(target.embed)
    missing, unexpected = head.load_state_dict(ck["model"], strict=False)
    if unexpected or any(k != "embed_tokens.weight" for k in missing):
        raise SystemExit(f"checkpoint does not fit the head: missing {missing}, unexpected {unexpected}")
    head.to(torch.bfloat16).save_pretrained(a.out, extra={"torch_dtype": "bfloat16",
                                                          "peagle": {"method": method, "steps": ck["step"]}})
    print(f"{a.ckpt} (step {ck['step']}) -> {a.out}")


if __name__ == "__main__":
    main()
