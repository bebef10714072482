"""A drafter head's config: one dataclass for every place that builds, reads or writes one (training, random
heads, import, export, the engine's DrafterHead, tests).

Invariants:
- ``to_dict()`` is the ``config.json`` vLLM loads in the flat EAGLE-3 layout: every derived size written out
  (``num_key_value_heads``, ``head_dim``, ``draft_vocab_size``, ``target_hidden_size``), ``norm_before_residual``
  explicit (vLLM's defaults differ between layouts), and a parallel head's mask token written as both
  ``ptd_token_id`` and ``pard_token`` (what vLLM 0.16-0.19 and >= 0.22 read).  Keys the dataclass does not
  own (the ``peagle`` training record, ``torch_dtype``, biases, ...) pass through ``from_dict``/``to_dict``.
- Defaults live here only: :func:`missing_defaults` (what vLLM/transformers assume for an absent key),
  :func:`vllm_aux_layer_ids` (vLLM's rule for the target layers feeding a head that names none) and
  :func:`default_aux_layer_ids` (the ids a new head gets).
- "Is this a parallel (P-EAGLE) head" is decided by :func:`is_parallel_head` only.
- The mask token is never assumed: :func:`resolve_mask_token` takes it as given, or the target tokenizer's
  ``<|mask|>``, or refuses.
- :func:`validate_config` lists every way a config breaks vLLM's loader or the target (the config half of
  :func:`peagle.heads.format.validate_head`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import PeagleError

NATIVE_ARCH = "LlamaForCausalLMEagle3"
# architectures vLLM's EAGLEConfig keeps as-is or rewrites to Eagle3LlamaForCausalLM (flat layout)
ACCEPTED_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
NUM_AUX = 3  # vLLM 0.16-0.19 hard-code three aux hidden states
MASK_TOKEN = "<|mask|>"
# written by to_dict() whatever the input says (the flat layout vLLM loads)
FIXED = {"architectures": [NATIVE_ARCH], "model_type": "llama", "tie_word_embeddings": False,
         "eagle_config": {"use_aux_hidden_state": True}, "hidden_act": "silu"}


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def target_text_config(target_config: Mapping) -> Mapping:
    """The language-model part of a target config (multimodal configs nest it under ``text_config``)."""
    if "hidden_size" not in target_config and isinstance(target_config.get("text_config"), Mapping):
        return target_config["text_config"]
    return target_config


def vllm_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The aux layers vLLM uses for a head that names none: (2, L//2, L-3) for llama-like targets
    (``get_eagle3_aux_hidden_state_layers``)."""
    L = int(num_target_layers)
    return [2, L // 2, L - 3]


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The aux layers of a new head: vLLM's rule; for targets too shallow for it to give three distinct
    ascending ids (L < 7, tiny test models), (1, L//2, L-1), and (0, 1, 2) at L = 3 (that rule repeats 1)."""
    L = int(num_target_layers)
    if L < 3:
        raise PeagleError(f"an EAGLE-3 head reads three distinct target layers: this target has {L}")
    ids = vllm_aux_layer_ids(L)
    return ids if ids == sorted(set(ids)) else [1, L // 2, L - 1] if L > 3 else [0, 1, 2]


def is_parallel_head(config: Mapping, tensors: Mapping | None = None) -> bool:
    """A head meant for parallel drafting (P-EAGLE): method "peagle", a mask-token id, or a mask_hidden."""
    pb = config.get("peagle") or {}
    if isinstance(pb, Mapping) and pb.get("method") in ("peagle", "eagle3"):
        return pb["method"] == "peagle"  # peagle's own record is authoritative
    if any(config.get(k) is not None for k in ("ptd_token_id", "pard_token", "mask_token_id")):
        return True
    return bool(tensors) and "mask_hidden" in tensors


def fit_context(cfg: dict, target_config: Mapping, notes: list[str]) -> None:
    """Raise the head's max_position_embeddings to the target's (vLLM 0.16 sizes the drafter's rotary cache
    from it)."""
    tM = target_text_config(target_config).get("max_position_embeddings")
    if is_int(tM) and is_int(cfg.get("max_position_embeddings")) and cfg["max_position_embeddings"] < tM:
        notes.append(f"max_position_embeddings raised {cfg['max_position_embeddings']} -> {tM} (target's)")
        cfg["max_position_embeddings"] = tM


def missing_defaults(config: Mapping) -> dict:
    """The values vLLM / transformers assume for keys a head config leaves out (None counts as absent).
    A default that derives from an absent key is not given."""
    H, nh, V = config.get("hidden_size"), config.get("num_attention_heads"), config.get("vocab_size")
    d = {"num_key_value_heads": nh, "head_dim": H // nh if H and nh else None, "draft_vocab_size": V,
         "target_hidden_size": H, "norm_before_residual": False, "hidden_act": "silu",
         "rope_theta": None if "rope_parameters" in config else 10000.0}
    return {k: v for k, v in d.items() if v is not None and config.get(k) is None}


def mask_token_from_tokenizer(target_dir) -> int | None:
    """The P-EAGLE mask token a target's tokenizer offers: its ``<|mask|>``, else a reserved special token
    the model never generates (the highest-id added special token that is not BOS/EOS/PAD/UNK and does not
    occur in the chat template; SmolLM2: ``<empty_output>`` = 16). None without a (loadable) tokenizer or
    such a token. The drafter's own embedding row for it is trained, so only "never generated" matters."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception:  # noqa: BLE001 - no (loadable) tokenizer: the caller asks for an explicit id
        return None
    i = tok.convert_tokens_to_ids(MASK_TOKEN)
    if isinstance(i, int) and i != tok.unk_token_id:
        return i
    taken = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    special = [(t.content, i) for i, t in tok.added_tokens_decoder.items() if t.special]
    free = [i for content, i in special if i not in taken and content not in template]
    return max(free) if free else None


def resolve_mask_token(target_dir, explicit: int | None = None) -> int:
    """The P-EAGLE mask-token id: ``explicit`` when given, else the tokenizer's (mask_token_from_tokenizer)."""
    if explicit is not None:
        return int(explicit)
    i = mask_token_from_tokenizer(target_dir)
    if i is None:
        raise PeagleError(f"the target {target_dir} has no {MASK_TOKEN} token and no free reserved special token "
                          f"in its tokenizer: give the P-EAGLE mask-token id explicitly (--mask-token ID: a token "
                          f"id the target never generates)")
    return i


_OWNED_KEYS = ("ptd_token_id", "pard_token")


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    eagle_aux_hidden_state_layer_ids: list
    num_key_value_heads: int | None = None      # -> num_attention_heads
    head_dim: int | None = None                 # -> hidden_size // num_attention_heads
    draft_vocab_size: int | None = None         # -> vocab_size
    target_hidden_size: int | None = None       # -> hidden_size
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    mask_token_id: int | None = None            # P-EAGLE; written as ptd_token_id and pard_token
    extra: dict = field(default_factory=dict)   # every other key, kept as is

    def __post_init__(self):
        for k, v in missing_defaults(dataclasses.asdict(self)).items():
            if hasattr(self, k) and getattr(self, k) is None:
                setattr(self, k, v)
        self.eagle_aux_hidden_state_layer_ids = list(self.eagle_aux_hidden_state_layer_ids)

    @property
    def parallel(self) -> bool:
        return is_parallel_head(self.to_dict())

    @classmethod
    def from_dict(cls, config: Mapping) -> "HeadConfig":
        """Parse a flat head config (as stored, or as built); missing required keys raise PeagleError."""
        cfg = dict(config)
        names = {f.name for f in dataclasses.fields(cls)} - {"mask_token_id", "extra"}
        kw: dict[str, Any] = {k: cfg[k] for k in names if cfg.get(k) is not None}
        ptd, pard = cfg.get("ptd_token_id"), cfg.get("pard_token")
        kw["mask_token_id"] = ptd if ptd is not None else pard
        kw["extra"] = {k: v for k, v in cfg.items() if k not in names and k not in _OWNED_KEYS}
        rp = cfg.get("rope_parameters")
        if cfg.get("rope_theta") is None and isinstance(rp, Mapping) and rp.get("rope_theta") is not None:
            kw["rope_theta"] = rp["rope_theta"]             # transformers 5's form: the base inside rope_parameters
        try:
            return cls(**kw)
        except TypeError as e:
            raise PeagleError(f"head config is incomplete: {e}") from None

    @classmethod
    def for_target(cls, target, layers: int = 1, draft_vocab: int | None = None, mask_token: int | None = None,
                   aux_ids=None, intermediate_size: int | None = None, **extra) -> "HeadConfig":
        """A new head for a target (its peagle.models.config.ModelConfig; a config.json dict goes through
        ModelConfig.describe first): its widths, vocabulary, norm eps, rope base and context; ``mask_token``
        makes it a P-EAGLE head."""
        return cls(hidden_size=target.hidden_size, intermediate_size=intermediate_size or target.intermediate_size,
                   num_hidden_layers=layers, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab or target.vocab_size, target_hidden_size=target.hidden_size,
                   eagle_aux_hidden_state_layer_ids=list(aux_ids or default_aux_layer_ids(target.num_hidden_layers)),
                   mask_token_id=mask_token, extra=dict(extra))

    @property
    def rope_scaling(self) -> dict | None:
        """rope_scaling, or a non-default rope_parameters (transformers 5's name for it)."""
        return rope_scaling_of(self.extra)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name not in ("mask_token_id", "extra"):
                out[f.name] = getattr(self, f.name)
        out["eagle_aux_hidden_state_layer_ids"] = list(self.eagle_aux_hidden_state_layer_ids)
        if self.mask_token_id is not None:
            out["ptd_token_id"] = out["pard_token"] = self.mask_token_id
        out.update({k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                    for k, v in FIXED.items()})
        return out

    def validate(self, target_config: Mapping | None = None) -> list[str]:
        """Problems of this config as vLLM would load it (empty = valid), against the target if given."""
        return validate_config(self.to_dict(), target_config, self.parallel)


# ---------------------------------------------------------------------------------------------- validate
_REQUIRED_INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "vocab_size", "draft_vocab_size", "target_hidden_size",
                      "max_position_embeddings")


def int_problems(cfg: Mapping) -> list[str]:
    """The sizes the tensor shapes derive from must be positive integers."""
    out = [f"config.{k} must be a positive integer (got {cfg.get(k)!r})" for k in _REQUIRED_INT_KEYS
           if not is_int(cfg.get(k)) or cfg[k] <= 0]
    if cfg.get("head_dim") is not None and (not is_int(cfg["head_dim"]) or cfg["head_dim"] <= 0):
        out.append(f"config.head_dim must be a positive integer (got {cfg['head_dim']!r})")
    return out


ROPE_TYPES = ("default", "linear", "llama3")


def rope_scaling_of(config: Mapping) -> dict | None:
    """A config's rope scaling: rope_scaling, else rope_parameters when its type is not the default."""
    rs = config.get("rope_scaling")
    if isinstance(rs, Mapping):
        return dict(rs)
    rp = config.get("rope_parameters")
    if isinstance(rp, Mapping) and rp.get("rope_type", "default") != "default":
        return dict(rp)
    return None


def validate_config(config: Mapping, target_config: Mapping | None = None, parallel: bool | None = None) -> list[str]:
    """The config part of :func:`validate_head` (no tensors)."""
    problems: list[str] = []
    P = problems.append
    cfg = dict(config)
    if parallel is None:
        parallel = is_parallel_head(cfg)

    # --- config basics ------------------------------------------------------------------------------
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ACCEPTED_ARCHS:
        P(f"config.architectures must be [\"{NATIVE_ARCH}\"] (got {archs!r}); vLLM rejects e.g. "
          "PeagleLlamaForCausalLM in the flat layout")
    if cfg.get("model_type") != "llama":
        P(f"config.model_type must be \"llama\" (got {cfg.get('model_type')!r})")
    if "speculators_model_type" in cfg or "transformer_layer_config" in cfg:
        P("config is in the speculators layout; convert it with `peagle import` first")
    problems.extend(int_problems(cfg))
    if cfg.get("hidden_act", "silu") != "silu":
        P(f"config.hidden_act must be \"silu\" (got {cfg.get('hidden_act')!r})")
    if not isinstance(cfg.get("rms_norm_eps"), (int, float)) or isinstance(cfg.get("rms_norm_eps"), bool):
        P(f"config.rms_norm_eps must be a number (got {cfg.get('rms_norm_eps')!r})")
    if "rope_theta" not in cfg and "rope_parameters" not in cfg:
        P("config needs rope_theta (or rope_parameters); without it vLLM silently uses 10000")
    rs = rope_scaling_of(cfg)
    if rs is not None and rs.get("rope_type", rs.get("type")) not in ROPE_TYPES:
        P(f"rope type {rs.get('rope_type', rs.get('type'))!r}: peagle's drafter runs {', '.join(ROPE_TYPES)}")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(key):
            P(f"config.{key} is true: a norm vLLM applies and peagle's drafter does not (not supported)")
    def P_unsupported(what):
        P(f"{what}: vLLM applies it, peagle's drafter does not (not supported)")
    for key in ("attention_bias", "mlp_bias", "bias", "qkv_bias"):
        if cfg.get(key):
            P_unsupported(f"config.{key} is true (projection biases)")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []) or cfg.get("use_sliding_window"):
        P_unsupported(f"config.layer_types {cfg.get('layer_types')!r} (sliding-window attention)")
    if cfg.get("is_causal") is False:
        P_unsupported("config.is_causal is false (non-causal attention)")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    for where, v in (("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                     ("rope_parameters.partial_rotary_factor", rp.get("partial_rotary_factor"))):
        if v is not None and v != 1:
            P_unsupported(f"config.{where} {v!r} (rotary embedding on part of each head)")
    if cfg.get("logit_scale") not in (None, 1, 1.0):
        P_unsupported(f"config.logit_scale {cfg.get('logit_scale')!r}")
    if cfg.get("tie_word_embeddings", False) is not False:
        P("config.tie_word_embeddings must be false (the head has its own lm_head over the draft vocabulary)")
    if not isinstance(cfg.get("norm_before_residual"), bool):
        P("config.norm_before_residual must be written explicitly as true/false "
          f"(got {cfg.get('norm_before_residual')!r}; vLLM's defaults differ between layouts)")
    ec = cfg.get("eagle_config")
    if not isinstance(ec, Mapping) or ec.get("use_aux_hidden_state") is not True:
        P("config.eagle_config must be {\"use_aux_hidden_state\": true}")

    # --- aux ids ----------------------------------------------------------------------------------------
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        nested = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, Mapping) else None
        P("config.eagle_aux_hidden_state_layer_ids is missing at top level"
          + (" (it is only nested in eagle_config, which vLLM 0.16-0.19 ignore)" if nested else
             " (vLLM would fall back to the target's default (2, L//2, L-3))"))
    elif not isinstance(aux, list) or len(aux) != NUM_AUX or not all(is_int(a) for a in aux):
        P(f"config.eagle_aux_hidden_state_layer_ids must be a list of {NUM_AUX} integers (got {aux!r})")
        aux = None
    else:
        if any(a < 0 for a in aux):
            P(f"eagle_aux_hidden_state_layer_ids {aux} contains a negative id")
        if list(aux) != sorted(set(aux)):
            P(f"eagle_aux_hidden_state_layer_ids {aux} must be distinct and ascending "
              "(vLLM concatenates the aux states in layer order, so fc columns follow ascending ids)")

    # --- against the target -------------------------------------------------------------------------
    if target_config is not None:
        tc = target_text_config(target_config)
        tL = tc.get("num_hidden_layers")
        if aux is not None and is_int(tL):
            bad = [a for a in aux if a < 0 or a > tL]
            if bad:
                P(f"eagle_aux_hidden_state_layer_ids {aux}: id(s) {bad} out of range for a target with "
                  f"{tL} layers (valid 0..{tL}; id i is the input of target layer i)")
        tV = tc.get("vocab_size")
        if is_int(tV) and cfg.get("vocab_size") != tV:
            P(f"config.vocab_size {cfg.get('vocab_size')} != target vocab_size {tV}")
        tH = tc.get("hidden_size")
        if is_int(tH) and cfg.get("target_hidden_size") != tH:
            P(f"config.target_hidden_size {cfg.get('target_hidden_size')} != target hidden_size {tH}")
        tM = tc.get("max_position_embeddings")
        mp = cfg.get("max_position_embeddings")
        if is_int(tM) and is_int(mp) and mp < tM:
            P(f"config.max_position_embeddings {mp} < target's {tM} (vLLM 0.16 sizes the drafter's rotary "
              "cache from it; export raises it when given the target)")

    # --- P-EAGLE ------------------------------------------------------------------------------------
    V = cfg.get("vocab_size")
    if parallel:
        ptd, pard = cfg.get("ptd_token_id"), cfg.get("pard_token")
        if ptd is None or pard is None:
            P("P-EAGLE head needs both ptd_token_id and pard_token (the same mask-token id) in config.json "
              f"(got ptd_token_id={ptd!r}, pard_token={pard!r})")
        for name, v in (("ptd_token_id", ptd), ("pard_token", pard)):
            if v is not None and (not is_int(v) or (is_int(V) and not 0 <= v < V)):
                P(f"config.{name}={v!r} must be a token id in 0..{V - 1 if is_int(V) else 'vocab_size-1'}")
        if ptd is not None and pard is not None and ptd != pard:
            P(f"ptd_token_id ({ptd}) != pard_token ({pard})")
        mt = cfg.get("mask_token_id")
        if mt is not None and mt != ptd:
            P(f"config.mask_token_id={mt} conflicts with ptd_token_id={ptd} (vLLM >= 0.22 prefers mask_token_id)")
        if is_int(cfg.get("hidden_size")) and is_int(cfg.get("target_hidden_size")) and \
                cfg["hidden_size"] != cfg["target_hidden_size"]:
            P(f"parallel drafting needs hidden_size == target_hidden_size on vLLM 0.16-0.19 "
              f"(got {cfg['hidden_size']} vs {cfg['target_hidden_size']})")
    if is_int(cfg.get("draft_vocab_size")) and is_int(V) and cfg["draft_vocab_size"] > V:
        P(f"draft_vocab_size {cfg['draft_vocab_size']} > vocab_size {V}")

    return problems
