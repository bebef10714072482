"""`peagle train --method eagle3|peagle`: train a drafter head for a target on `peagle datagen` data.

The output directory is a head in vLLM's flat EAGLE-3 layout (config.json + model.safetensors, usable as
speculative_config {"model": OUT}); OUT/checkpoint/ckpt.pt holds the resumable state and
OUT/train_log.jsonl the loss / per-depth accuracy log.  Run under `torchrun --nproc-per-node N -m
peagle.cli train ...` for data parallelism."""
from __future__ import annotations

import argparse
import os
import sys

from ..device import add_arguments as add_device_arguments
from ..errors import PeagleError
from ..llm import DEFAULT_MODEL
from ..models.loader import add_backend_argument
from ..paths import portable_path
from ..train.checks import check_data_dirs, check_data_model, check_out, model_identity, out_dir
from ..train.common import tune_malloc
from ..train.config import TrainConfig
from ..train.loop import Trainer


def _layer_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated layer numbers, e.g. 2,15,27; got {s!r}") from None


def add_arguments(p):
    p.add_argument("--method", choices=["eagle3", "peagle"], required=True)
    p.add_argument("--target", "--model", dest="target", default=None,
                   help="target HF directory (default: the default target, SmolLM2-135M-Instruct; --model, as "
                        "datagen and hidden-states name it, is the same)")
    add_backend_argument(p)
    p.add_argument("--data", required=True, help="`peagle datagen` output directory (several: comma-separated), "
                   "or a hidden-state cache (`peagle hidden-states`, speculators' hs_{i}.safetensors)")
    p.add_argument("--out", required=True, help="output head directory")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: target's)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size (0 = full)")
    p.add_argument("--aux-ids", type=_layer_ids, default=None,
                   help="target aux layer ids (default vLLM's 2,L//2,L-3; 1,L//2,L-1 below 7 target layers)")
    p.add_argument("--depths", type=int, default=8, help="P-EAGLE parallel depths K")
    p.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 test-time-training unroll")
    p.add_argument("--decay", type=float, default=0.8, help="EAGLE-3 per-step loss weight decay")
    p.add_argument("--ttt-keep", type=float, default=1.0,
                   help="EAGLE-3 anchor subsampling: step k continues ~keep^k of its supervised anchors (1 = all)")
    p.add_argument("--loss", choices=["kl", "hard"], default="kl",
                   help="kl: KL to the target's distribution over the draft vocabulary; hard: cross-entropy on the "
                        "drafted (target-chosen) token")
    p.add_argument("--cod-r", type=float, default=0.7)
    p.add_argument("--cod-rmin", type=float, default=0.2)
    p.add_argument("--mask-token", type=int, default=None,
                   help="P-EAGLE mask token id (default: the target tokenizer's <|mask|>; required without one)")
    p.add_argument("--share-embedding", action="store_true",
                   help="use the target's embedding, frozen, and store none in the head (vLLM shares it too): "
                        "a full-vocabulary embedding is most of a small head's file")
    p.add_argument("--segment-len", type=int, default=1024,
                   help="P-EAGLE sequence partitioning: anchors per segment (0 = one flat pass); the same gradients "
                        "at any length, fewer segments cost less CPU, more bound the memory")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed row")
    p.add_argument("--batch-rows", type=int, default=1, help="packed rows per optimizer step (global batch)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs)")
    p.add_argument("--max-minutes", type=float, default=0, help="stop early after this much wall time")
    p.add_argument("--max-docs", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of steps (< 1) or steps (>= 1)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    add_device_arguments(p, "the head's compute dtype (autocast; weights stay float32). auto: bfloat16 on CUDA; on a "
                            "CPU bfloat16 where it has AMX-BF16, else float32; the target runs float32 on a CPU "
                            "(default auto)")   # device.train_compute_dtype
    p.add_argument("--save-dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the saved head weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--feature-cache", default=None,
                   help="hidden-state cache directory: extracted from --data on first use (resumable), then reused")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", default=None,
                   help="continue training an existing head directory (its config and draft vocabulary; fresh optimizer)")
    p.add_argument("--init-from-eagle3", default=None, metavar="HEAD",
                   help="start a P-EAGLE head from a trained EAGLE-3 head of the same target: fc, first layer, norm, "
                        "lm_head, embeddings and draft vocabulary copied; extra layers start as identities, "
                        "mask_hidden at zero (fresh optimizer)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=0, help=argparse.SUPPRESS)


def run(a):
    label = None
    if a.target is None:
        a.target, label = DEFAULT_MODEL, f"{portable_path(DEFAULT_MODEL)} (the default)"
    check_data_dirs(a.data)                       # before the target loads
    check_out(a.out, a.target)
    check_data_model(a.data, a.target, "--target", label)
    if a.feature_cache:
        check_out(a.feature_cache, a.target, "--feature-cache")
        check_data_model(a.feature_cache, a.target, "--target", label, "--feature-cache")
    ckpt = os.path.join(a.out, "checkpoint", "ckpt.pt")
    if os.path.isfile(ckpt) and not a.resume:
        raise PeagleError(f"--out {a.out} holds a run's checkpoint: --resume continues it; to start over, give "
                          f"another --out or delete {os.path.dirname(ckpt)}")
    cfg = TrainConfig.from_namespace(a)
    vocab = (model_identity(a.target) or {}).get("vocab_size")
    if a.draft_vocab and a.draft_vocab != TrainConfig.draft_vocab and vocab and a.draft_vocab > vocab \
            and not (a.init or a.init_from_eagle3) and os.environ.get("RANK", "0") == "0":   # given, not the default
        print(f"note: --draft-vocab {a.draft_vocab} is above the target's vocabulary ({vocab}): the draft vocabulary "
              "is the full one", file=sys.stderr, flush=True)
    if a.resume and not os.path.isfile(ckpt) and os.environ.get("RANK", "0") == "0":   # a typo'd --out: say so
        print(f"note: no checkpoint in {os.path.dirname(ckpt)}: starting a new run", file=sys.stderr, flush=True)
    tune_malloc()     # a step's large buffers stay in the heap instead of page-faulting back in
    with out_dir(a.out):                          # a run that fails before writing anything leaves no empty --out
        t = Trainer(cfg)
        rec = t.run()
    if t.rank == 0:
        print(f"saved {cfg.method} head to {cfg.out}: step {t.step}, loss {rec.get('loss')}, per-depth acc {rec.get('acc')}")
    return 0


def add_parser(sub):
    p = sub.add_parser("train", help="train an EAGLE-3 or P-EAGLE drafter head", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="peagle train")
    add_arguments(ap)
    return run(ap.parse_args(argv))
