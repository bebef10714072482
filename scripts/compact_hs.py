"""Renumber the finished samples of a (stopped) `datagen --hidden-states` run into a complete cache.

    python scripts/compact_hs.py data/smol-self data/smol-self-hs

A run stopped by the clock leaves hs_{i} files with gaps (two workers, rows in flight); training needs
hs_0..hs_{n-1}. The files are hard-linked (no copy) in index order; hidden_states.json gets the new count."""
import json
import os
import re
import sys

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
idx = sorted(int(m.group(1)) for f in os.listdir(src) if (m := re.fullmatch(r"hs_(\d+)\.safetensors", f)))
for j, i in enumerate(idx):
    out = os.path.join(dst, f"hs_{j}.safetensors")
    if not os.path.exists(out):
        os.link(os.path.join(src, f"hs_{i}.safetensors"), out)
with open(os.path.join(src, "hidden_states.json")) as f:
    cfg = json.load(f)
cfg["num_samples"] = len(idx)
cfg["source"] = {"dir": os.path.basename(os.path.normpath(src)), "indices": f"{len(idx)} of {idx[-1] + 1 if idx else 0}"}
with open(os.path.join(dst, "hidden_states.json"), "w") as f:
    json.dump(cfg, f, indent=1)
print(f"{len(idx)} samples -> {dst}")
