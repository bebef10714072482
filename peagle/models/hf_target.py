"""Transformers-backed target: any ``AutoModelForCausalLM`` behind the native target's interface (batched
forward over a per-row KV cache, aux hidden states, per-row append and rollback, continuous batching).

Invariants:
* The model runs its own code (attention sinks, softcapping, MoE routing, per-layer inputs, KV sharing, ...);
  peagle only supplies position_ids, the cache and explicit attention masks.
* Cache: peagle's :class:`~peagle.cache.KVCache` (rows x absolute positions, every layer allocated on its
  first write with its own shape).  transformers' attention calls ``cache.update``; the block's keys and
  values are written at each row's positions and the row's whole prefix is returned.
* Masks: key p is visible to the query at position q iff p <= q and, in a sliding-window layer, p > q - window
  (transformers' rule, ``masking_utils.sliding_window_overlay``), one mask per attention type.  Keys at or
  past a row's length are stale but never visible, so rollback is a length change, prompts longer than the
  window need no eviction, and per-token MoE routing never sees another row.  (The price: sliding-window
  layers keep the whole context, as much memory as a full-attention layer.)
* aux id i = the residual stream entering decoder layer i (= transformers' ``hidden_states[i]``), and id L =
  the input of the final norm: vLLM's EAGLE-3 taps (``EagleModelMixin``: id 0 is the embedding output after
  Gemma's sqrt(H) scaling, id i+1 the output of layer i after Gemma 4's per-layer scalar), taken by forward
  pre-hooks on the decoder layers and the final norm.  Returned in ascending id order, like the native target.
* Logits are the model's own (lm_head + softcapping); for prefill only the rows' ``logits_at`` positions go
  through the head (a hook on the decoder's output).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..errors import PeagleError
from .config import ModelConfig
from .layers import causal_block_mask


def _cache_base():
    from transformers.cache_utils import Cache
    return Cache


class _RowWrites(_cache_base()):
    """transformers' Cache interface over a KVCache for one forward: writes the block at each row's positions
    (one slice when every row starts at host position s0) and returns the rows' keys [0, span)."""

    is_compileable = False

    def __init__(self, kv: KVCache, b0: int, pos: torch.Tensor, span: int, s0: int | None):
        super().__init__(layers=[])
        self.kv, self.b0, self.pos, self.span, self.s0 = kv, b0, pos, span, s0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kv, b0, B = self.kv, self.b0, key_states.shape[0]
        if kv.k[layer_idx] is None:
            kv.alloc(layer_idx, key_states.shape[1], key_states.shape[3])
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)      # -> [B,T,n_kv,hd]
        kv.reserve(self.span)
        if self.s0 is not None:
            kv.write_at(layer_idx, b0, self.s0, k, v)
        else:
            kv.write(layer_idx, b0, self.pos, k, v)
        return kv.view(layer_idx, b0, B, self.span)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span


def _text_stack(model):
    """(decoder layers, final norm, decoder module) of a causal LM, also when it wraps a language model."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    for _ in range(3):
        if base is not None and hasattr(base, "layers") and hasattr(base, "norm"):
            return base.layers, base.norm, base
        base = getattr(base, "language_model", None) or getattr(base, "model", None)
    raise PeagleError(f"{type(model).__name__}: cannot find its decoder layers and final norm "
                      "(the transformers backend needs model.layers and model.norm)")


def text_model_config(tcfg, raw: dict, eos: list) -> ModelConfig:
    """peagle's ModelConfig (the fields engine, drafter config and training read) from a transformers config
    (read as a dict: per-layer attributes, e.g. Gemma 4's, refuse attribute access)."""
    c = ModelConfig.describe(tcfg.to_dict())
    c.eos_token_ids, c.raw = eos, raw
    return c


def attention_windows(tcfg) -> dict:
    """{attention type: sliding window or None} of a transformers text config ("all" when layers share one)."""
    if getattr(tcfg, "use_bidirectional_attention", False):
        raise PeagleError(f"{tcfg.model_type}: bidirectional attention is not a causal target")
    types = getattr(tcfg, "layer_types", None)
    if not types:       # a window only where the family has one (a stray config key is kept as an attribute)
        return {"all": getattr(tcfg, "sliding_window", None) if hasattr(type(tcfg), "sliding_window") else None}
    out = {}
    for t in dict.fromkeys(types):
        if t == "full_attention":
            out[t] = None
        elif t == "sliding_attention":
            out[t] = int(tcfg.sliding_window)
        else:
            raise PeagleError(f"{tcfg.model_type}: attention type {t!r} is not supported by the transformers backend")
    return out


class HFTarget:
    """Target model run by transformers. forward() has the native Transformer's signature and semantics."""

    backend = "transformers"

    def __init__(self, model, raw: dict, dtype=torch.float32, device="cpu"):
        import inspect
        self.model, self.dtype, self.device = model.eval(), dtype, torch.device(device)
        self.tcfg = model.config.get_text_config()
        eos = getattr(self.tcfg, "eos_token_id", None)
        eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        g = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        for t in ([] if g is None else g if isinstance(g, (list, tuple)) else [g]):
            if t not in eos:
                eos.append(t)
        self.cfg = text_model_config(self.tcfg, raw, eos)
        self.layers, self.final_norm, decoder = _text_stack(model)
        if len(self.layers) != self.cfg.num_hidden_layers:
            raise PeagleError(f"{type(model).__name__}: {len(self.layers)} decoder layers, config says "
                              f"{self.cfg.num_hidden_layers}")
        self.windows = attention_windows(self.tcfg)
        impl = model.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise PeagleError(f"attention implementation {impl!r}: the transformers backend runs 'eager' or 'sdpa'")
        self.additive = impl == "eager"
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._tap: dict | None = None
        self._logits_at: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
        self.final_norm.register_forward_pre_hook(self._pre_hook(len(self.layers)), with_kwargs=True)
        decoder.register_forward_hook(self._select_rows)

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu") -> "HFTarget":
        from transformers import AutoModelForCausalLM
        fn = os.path.join(path, "config.json")
        if not os.path.isfile(fn):
            raise PeagleError(f"no config.json in {path}")
        with open(fn) as f:
            raw = json.load(f)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        except (ValueError, OSError, KeyError) as e:
            raise PeagleError(f"transformers cannot load {path} as a causal LM: {e}") from None
        return cls(model, raw, dtype, device)

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, i):
        def hook(module, args, kwargs):
            if self._tap is not None and i in self._tap:
                self._tap[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _select_rows(self, module, args, out):
        if self._logits_at is not None:
            h = out.last_hidden_state
            out.last_hidden_state = h[torch.arange(h.shape[0], device=h.device), self._logits_at][:, None]
        return out

    # ------------------------------------------------------------------ interface
    def new_cache(self, rows: int, max_len: int) -> KVCache:
        return KVCache(self.cfg.num_hidden_layers, None, None, max_len, rows, self.dtype, self.device)

    def masks(self, start: torch.Tensor, T: int, S: int, tree=None):
        """One mask per attention type (tree: a peagle.tree.TreeAttn's mask instead of the causal one)."""
        out = {}
        for t, w in self.windows.items():
            m = causal_block_mask(start, T, S, w) if tree is None else tree.mask(S, w)
            if self.additive:
                m = torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(~m, torch.finfo(self.dtype).min)
            out[t] = m
        return out["all"] if "all" in out else out if len(out) > 1 else next(iter(out.values()))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache, b0: int, start: torch.Tensor,
                aux_ids: tuple = (), logits_at: torch.Tensor | None = None, span: int | None = None,
                s0: int | None = None, tree=None):
        """tokens [B,T] for cache rows b0..b0+B-1, each row's block starting at position start[b] (tree: a
        peagle.tree.TreeAttn: node positions and the tree mask, the block in slots start..start+T-1); span, s0:
        host-side facts as for the native target (layers.BlockCtx: keys [0, span) are read; s0 = the common
        start, or None).  Returns (logits [B,T,V] or [B,V] at logits_at per row, aux [B,T,len(aux_ids)*H] or
        None).  Does not change cache.lens: the caller sets lengths after deciding what to keep."""
        dev = self.device
        tokens, start = tokens.to(dev), start.to(dev)
        B, T = tokens.shape
        if span is None:
            span = int(start.max()) + T
            s0 = int(start[0]) if bool((start == start[0]).all()) else None
        pos = start[:, None] + torch.arange(T, device=dev)[None]
        pos_w = pos
        if span > cache.max_len:          # padding of a ragged block past the cache end (see layers.BlockCtx)
            span, pos_w, s0 = cache.max_len, pos.clamp(max=cache.max_len - 1), None
        self._tap = dict.fromkeys(sorted(set(aux_ids)))
        self._logits_at = None if logits_at is None else logits_at.to(dev)
        try:
            out = self.model(input_ids=tokens, attention_mask=self.masks(start, T, span, tree),
                             position_ids=pos if tree is None else tree.pos,
                             use_cache=True, **{self._cache_kw: _RowWrites(cache, b0, pos_w, span, s0)})
            taps = self._tap
        finally:
            self._tap, self._logits_at = None, None
        logits = out.logits.float()
        if logits_at is not None:
            logits = logits[:, 0]
        missing = [i for i, a in taps.items() if a is None]
        if missing:
            raise PeagleError(f"aux ids {missing} are not layers of this target (0..{len(self.layers)})")
        aux = torch.cat([taps[i] for i in taps], -1) if taps else None
        return logits, aux

    @torch.no_grad()
    def final_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits over vocabulary ids `rows` (all if None) from final residuals h (aux id L)."""
        head = self.model.get_output_embeddings()
        w = head.weight if rows is None else head.weight[rows]
        b = getattr(head, "bias", None)
        logits = F.linear(self.final_norm(h.to(self.device, self.dtype)), w, None if b is None else
                          (b if rows is None else b[rows])).float()
        scale = getattr(self.tcfg, "logits_scaling", None)         # Granite divides by it
        logits = logits / scale if scale else logits
        scale = getattr(self.tcfg, "logit_scale", None)            # Cohere multiplies by it
        logits = logits * scale if scale else logits
        cap = getattr(self.tcfg, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    # the weights drafter training initialises from (see peagle.heads.init.init_head)
    @property
    def embed(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()

    @property
    def norm(self) -> torch.Tensor:
        """The final norm's effective per-channel scale (Gemma's 1 + w, others' w; the drafter's first norm): from
        x = +-1 alternating (mean 0, mean square 1 for an even width), (f(x) - f(-x)) / 2x, which leaves out a
        LayerNorm's mean and bias (a vector of ones gave its bias, or zeros)."""
        with torch.no_grad():
            x = torch.ones(1, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            x[:, 1::2] = -1
            scale = (self.final_norm(x)[0] - self.final_norm(-x)[0]) / (2 * x[0])
            return (scale * (1 + self.cfg.rms_norm_eps) ** 0.5).detach()
