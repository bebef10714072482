"""Target features for drafter training: the three aux hidden states and the teacher distribution over the
draft vocabulary, from ONE target forward per batch of documents (no giant caches).

The final residual is requested as a 4th aux state (id = num_layers), so the teacher logits are computed
only over the draft-vocabulary rows of lm_head.  Runs that revisit the data (several epochs, both heads, a
study) read the same features from a hidden-state cache instead (peagle/train/hidden_states.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import PeagleError


@torch.no_grad()
def layer_states(target, docs: list[torch.Tensor], layer_ids, max_batch_tokens: int = 16384):
    """Yields (document index, its residual states entering each layer id [n, len(layer_ids) * H], ascending
    ids, target dtype, on the target's device) for every document, longest first, in padded batches of at most
    max_batch_tokens tokens: one target forward per batch (the final state is id num_layers)."""
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    dev, i = target.device, 0
    while i < len(order):
        Tm = len(docs[order[i]])
        grp = order[i: i + max(1, max_batch_tokens // max(Tm, 1))]
        toks = torch.zeros(len(grp), Tm, dtype=torch.long, device=dev)
        for j, g in enumerate(grp):
            toks[j, : len(docs[g])] = docs[g]
        zeros = torch.zeros(len(grp), dtype=torch.long, device=dev)
        _, aux = target.forward(toks, target.new_cache(len(grp), Tm + 8), 0, zeros, aux_ids=tuple(layer_ids),
                                logits_at=zeros, span=Tm, s0=0)
        for j, g in enumerate(grp):
            yield g, aux[j, : len(docs[g])]
        i += len(grp)


class Teacher:
    def __init__(self, target, aux_ids, draft_ids: torch.Tensor):
        self.target = target
        self.aux_ids = tuple(int(a) for a in aux_ids)
        self.L = target.cfg.num_hidden_layers
        # the final residual (teacher) is requested as one more aux state unless an aux id already is it
        self.req = self.aux_ids if self.L in self.aux_ids else self.aux_ids + (self.L,)
        self.T = target.cfg.hidden_size
        self.draft_ids = draft_ids.to(target.device)
        self.check()

    @torch.no_grad()
    def check(self):
        """The teacher's logits (final_logits of the final residual) must be the target's own: a family that
        scales its logits where final_logits does not would train heads on another distribution."""
        t = self.target
        toks = (torch.arange(8, device=t.device) * 7919 % t.cfg.vocab_size)[None]
        zeros = torch.zeros(1, dtype=torch.long, device=t.device)
        logits, aux = t.forward(toks, t.new_cache(1, 16), 0, zeros, aux_ids=(self.L,),
                                logits_at=torch.full((1,), 7, device=t.device), span=8, s0=0)
        mine = t.final_logits(aux[0, 7:8, -self.T:])[0]
        ref = logits.reshape(-1, logits.shape[-1])[-1].float()
        if not torch.allclose(mine, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max())):
            raise PeagleError(f"{t.cfg.model_type}: the target's logits are not final_logits of its final state "
                              f"(max difference {float((mine - ref).abs().max()):.3g}): the teacher would be wrong "
                              "for this family")

    @torch.no_grad()
    def doc_features(self, docs: list[torch.Tensor], max_batch_tokens: int = 16384) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per document: (aux [n, 3T], last [n, T]) (target dtype, on the target's device)."""
        out: list = [None] * len(docs)
        for g, h in layer_states(self.target, docs, self.req, max_batch_tokens):
            out[g] = (h[:, : 3 * self.T].clone(), h[:, -self.T:].clone())
        return out

    @torch.no_grad()
    def teacher_logp(self, last: torch.Tensor) -> torch.Tensor:
        """log-probs over the draft vocabulary [n, Vd] (fp32), renormalised over the draft vocab."""
        return F.log_softmax(self.target.final_logits(last, self.draft_ids), -1)


def pack_row(docs: list[tuple[torch.Tensor, torch.Tensor]], feats: list[tuple[torch.Tensor, torch.Tensor]],
             teacher: Teacher | None, index: torch.Tensor, max_tokens: int) -> dict:
    """Concatenate documents (truncated to max_tokens) into one training row.  The token bookkeeping (ids,
    doc, pos, lmask, label) stays on the CPU, where COD sampling reads it; aux and tlogp are on the
    features' device; without a teacher (hard labels need none) tlogp is None.  :func:`to_device` moves a
    row (and its elements) to the training device once."""
    ids, doc, pos, lm, aux, last = [], [], [], [], [], []
    cpu = torch.device("cpu")
    for j, ((t, m), (a, l)) in enumerate(zip(docs, feats)):
        n = min(len(t), max_tokens)
        ids.append(t[:n])
        lm.append(m[:n].bool())
        aux.append(a[:n])
        last.append(l[:n])
        doc.append(torch.full((n,), j, dtype=torch.long, device=cpu))
        pos.append(torch.arange(n, device=cpu))
    ids = torch.cat(ids)
    last = torch.cat(last)
    return {"ids": ids, "doc": torch.cat(doc), "pos": torch.cat(pos), "lmask": torch.cat(lm),
            "aux": torch.cat(aux).float(), "tlogp": None if teacher is None else teacher.teacher_logp(last), "label": index[ids]}


def to_device(tensors: dict, device: torch.device) -> dict:
    """The same dict with every tensor on ``device`` (one copy each; nothing when already there)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in tensors.items()}
