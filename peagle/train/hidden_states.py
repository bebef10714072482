"""Drafter training data with the target's hidden states, in vllm-project/speculators' offline format, so
the target runs once per sample and every training run (both drafters, every recipe) reuses it.

Layout of a cache directory: speculators' hs_{i} files (what vLLM's extract_hidden_states writes and speculators
renames: the same keys, layout and layer semantics as vLLM's EAGLE-3 aux states), plus two things of peagle's
that speculators keeps elsewhere -- the loss mask in each file (speculators: in its dataset) and
hidden_states.json (speculators: the layer ids in its vLLM launch settings). A cache written by speculators is
read once a hidden_states.json naming its layer ids (ascending, the last = num_hidden_layers) is put beside it;
without loss masks every token is supervised, prompts included (said when the cache is opened).
    hs_{i}.safetensors     token_ids      int64 [seq]
                           hidden_states  model dtype [seq, n_layers, hidden]: the residual stream entering
                                          each layer id of `layer_ids` (id L = the final pre-norm state)
                           loss_mask      uint8 [seq] (1 = a token the target generated; absent = all ones)
    hidden_states.json     {"format": "speculators-hs", "layer_ids": [...], "hidden_size": H,
                            "dtype": "float32", "num_samples": N, "model": ..., "model_config": the
                            target's config.json fields that tell models apart (train/checks.py),
                            "max_tokens": the cut of the documents (`hidden-states --max-tokens`)}
Invariants: the last layer id is the final state L (the teacher: logits = lm_head(norm(h_L)), tied
embeddings are the target's lm_head); a file is written atomically (tmp + rename), so an interrupted
extraction resumes at the first missing file; the aux states the drafter reads are the columns of its aux ids
(each must be stored; checked when training starts, with each sample's tokens against the data's)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import PeagleError
from ..models.files import plain_mode
from .checks import config_identity
from .data import take_usable
from .features import layer_states

CONFIG = "hidden_states.json"


def sample_path(d: str, i: int) -> str:
    return os.path.join(d, f"hs_{i}.safetensors")


def is_cache(d: str) -> bool:
    return os.path.isfile(os.path.join(d, CONFIG)) or os.path.isfile(sample_path(d, 0))


def default_layer_ids(num_layers: int, aux_ids) -> list[int]:
    """The head's aux ids then the final state (speculators' default is [2, L//2, L-3, L])."""
    return [int(a) for a in aux_ids if int(a) != num_layers] + [num_layers]


def write_sample(d: str, i: int, token_ids: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor | None):
    fn = sample_path(d, i)
    t = {"token_ids": token_ids.to(torch.int64).contiguous(), "hidden_states": hidden.contiguous()}
    if loss_mask is not None:
        t["loss_mask"] = loss_mask.to(torch.uint8).contiguous()
    save_file(t, fn + ".tmp")
    plain_mode(fn + ".tmp")                       # safetensors writes 0600: readable like a plain file
    os.replace(fn + ".tmp", fn)


def extract(target, docs: list, out: str, layer_ids: list[int], max_batch_tokens: int = 8192,
            progress: bool = True, model_name: str | None = None, max_tokens: int | None = None) -> dict:
    """Run the target over docs [(token_ids, loss_mask)] and write hs_{i} for the ones missing. max_tokens: the
    cut the docs were given (recorded; a resume with another cut is refused: its samples would not match).
    Returns {"samples", "tokens", "seconds", "bytes_per_token"} of this call's work."""
    L = target.cfg.num_hidden_layers
    if layer_ids[-1] != L:
        raise PeagleError(f"the last layer id must be the final state {L}, got {layer_ids}")
    os.makedirs(out, exist_ok=True)
    old = read_config(out) if os.path.isfile(os.path.join(out, CONFIG)) else None
    kept = (old or {}).get("max_tokens")
    if None not in (kept, max_tokens) and kept != max_tokens:
        raise PeagleError(f"{out} holds documents cut to {kept} tokens; this run cuts them to {max_tokens}: resume "
                          f"with --max-tokens {kept}, or use another directory")
    cfg = {"format": "speculators-hs", "layer_ids": list(layer_ids), "hidden_size": target.cfg.hidden_size,
           "dtype": str(target.dtype).replace("torch.", ""), "num_samples": len(docs), "model": model_name,
           "model_config": config_identity(getattr(target.cfg, "raw", None) or {}),
           "max_tokens": kept if max_tokens is None else max_tokens}      # a resume that does not say keeps it
    if old is not None and {k: old.get(k) for k in ("layer_ids", "hidden_size", "dtype")} != \
            {k: cfg[k] for k in ("layer_ids", "hidden_size", "dtype")}:
        raise PeagleError(f"{out} holds hidden states of other layers or dtype ({old}); use another directory")
    with open(os.path.join(out, CONFIG) + ".tmp", "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(os.path.join(out, CONFIG) + ".tmp", os.path.join(out, CONFIG))
    todo = [i for i in range(len(docs)) if not os.path.isfile(sample_path(out, i))]
    bar = None
    if progress and todo:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(docs[i][0]) for i in todo), desc="hidden states", unit="tok", unit_scale=True)
    t0, ntok, nbytes, H = time.perf_counter(), 0, 0, target.cfg.hidden_size
    for i, h in layer_states(target, [docs[i][0] for i in todo], layer_ids, max_batch_tokens):
        i = todo[i]
        n = len(docs[i][0])
        h = h.reshape(n, len(layer_ids), H).cpu()                 # [seq, n_layers, H], model dtype
        write_sample(out, i, docs[i][0], h, docs[i][1])
        ntok += n
        nbytes += h.numel() * h.element_size()
        if bar is not None:
            bar.update(n)
            bar.set_postfix(tok_s=f"{ntok / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    return {"samples": len(todo), "tokens": ntok, "seconds": time.perf_counter() - t0,
            "bytes_per_token": nbytes / max(ntok, 1)}


def read_config(d: str) -> dict:
    fn = os.path.join(d, CONFIG)
    if not os.path.isfile(fn):
        raise PeagleError(f"{d} has no {CONFIG} (not a hidden-state cache; one written by speculators needs one: "
                          f'{{"format": "speculators-hs", "layer_ids": [its ids, ascending, the last = the number of '
                          f'layers], "hidden_size": H}})')
    with open(fn) as f:
        return json.load(f)


class HiddenStateCache:
    """Read side: samples (token ids, loss mask) and per-sample features (aux [n, len(aux) * H] float32,
    final [n, H] float32) in the order the trainer's Teacher used to compute them."""

    def __init__(self, d: str):
        self.dir, self.cfg = d, read_config(d)
        self.layer_ids = list(self.cfg["layer_ids"])
        n = self.cfg.get("num_samples")
        if n is None:
            n = 0
            while os.path.isfile(sample_path(d, n)):
                n += 1
        missing = [i for i in range(n) if not os.path.isfile(sample_path(d, i))]
        if missing:
            raise PeagleError(f"{d}: {len(missing)} of {n} samples are missing (first hs_{missing[0]}); "
                              "rerun the extraction to complete it")
        self.n = n
        self.aux_cols = list(range(len(self.layer_ids) - 1))     # columns features() returns as aux states
        if n:
            with safe_open(sample_path(d, 0), "pt") as f:
                if "loss_mask" not in f.keys():
                    print(f"peagle: {d}: no loss_mask in its samples (speculators keeps it in its dataset): every "
                          "token is supervised, prompts included", file=sys.stderr)

    def __len__(self) -> int:
        return self.n

    def usable_docs(self, max_docs: int | None = None, counts: dict | None = None) -> tuple[list[int], list]:
        """(sample ids, documents) of the samples with enough supervised tokens to train on, in order, at most
        max_docs; counts as data.take_usable fills it."""
        kept = take_usable((self.doc(i) for i in range(self.n)), max_docs, counts=counts)
        return [i for i, _ in kept], [d for _, d in kept]

    def check_aux(self, aux_ids) -> None:
        """Read the head's aux ids from here on (columns by id: the final state may be one of them, and the
        cache may hold more layers); PeagleError if one is not stored."""
        want = [int(a) for a in aux_ids]
        missing = [a for a in want if a not in self.layer_ids]
        if missing:
            raise PeagleError(f"{self.dir} holds layers {self.layer_ids} (the last one the final state); the "
                              f"head reads aux {want}: {missing} not stored")
        self.aux_cols = [self.layer_ids.index(a) for a in want]

    def check_tokens(self, docs: list[torch.Tensor]) -> None:
        """PeagleError unless sample i holds document i's tokens, for every document (a cache made from other
        data would give each document another one's states)."""
        if len(docs) > self.n:
            raise PeagleError(f"{self.dir} holds {self.n} samples, the data {len(docs)} documents: made from other "
                              "data; use another --feature-cache")
        for i, t in enumerate(docs):
            if not torch.equal(self.doc(i)[0], t.long()):
                raise PeagleError(f"{self.dir}: sample {i} holds other tokens than document {i} of the data (made "
                                  "from other data or --max-tokens); use another --feature-cache")

    def doc(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with safe_open(sample_path(self.dir, i), "pt") as f:
            ids = f.get_tensor("token_ids").long()
            m = f.get_tensor("loss_mask").bool() if "loss_mask" in f.keys() else torch.ones(len(ids), dtype=torch.bool)
        return ids, m

    def features(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with safe_open(sample_path(self.dir, i), "pt") as f:
            h = f.get_tensor("hidden_states").float()                  # [n, n_layers, H]
        n = h.shape[0]
        return h[:, self.aux_cols].reshape(n, -1), h[:, -1]
