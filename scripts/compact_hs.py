"""Renumber the finished samples of (stopped) `datagen --hidden-states` runs into one complete cache.

    python scripts/compact_hs.py data/smol-self [data/smol-self-q4 ...] data/smol-self-hs

A run stopped by the clock leaves hs_{i} files with gaps (two workers, rows in flight); training needs
hs_0..hs_{n-1}. The files of every source, in source then index order, are hard-linked (no copy) into the
destination; its hidden_states.json is the first source's, with the new count and where the samples came from
(sources must agree on layers, width and dtype)."""
import json
import os
import re
import sys

if len(sys.argv) < 3 or any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
*srcs, dst = sys.argv[1:]
configs = []
for src in srcs:         # every source read before the destination exists: a bad one leaves nothing behind
    try:
        with open(os.path.join(src, "hidden_states.json")) as f:
            configs.append(json.load(f))
    except (OSError, ValueError) as e:
        sys.exit(f"{src}: not a hidden-states cache ({type(e).__name__}: {e})")
os.makedirs(dst, exist_ok=True)
cfg, sources, j = None, [], 0
for src, c in zip(srcs, configs):
    if cfg is None:
        cfg = c
    elif any(c[k] != cfg[k] for k in ("layer_ids", "hidden_size", "dtype")):
        sys.exit(f"{src}: layers, width or dtype differ from {srcs[0]}")
    idx = sorted(int(m.group(1)) for f in os.listdir(src) if (m := re.fullmatch(r"hs_(\d+)\.safetensors", f)))
    for i in idx:
        out = os.path.join(dst, f"hs_{j}.safetensors")
        if not os.path.exists(out):
            os.link(os.path.join(src, f"hs_{i}.safetensors"), out)
        j += 1
    sources.append({"dir": os.path.basename(os.path.normpath(src)), "indices": f"{len(idx)} of {idx[-1] + 1 if idx else 0}",
                    "generated": c.get("generated")})
cfg["num_samples"] = j
cfg["source"] = sources[0] if len(sources) == 1 else sources
with open(os.path.join(dst, "hidden_states.json"), "w") as f:
    json.dump(cfg, f, indent=1)
print(f"{j} samples -> {dst}")
