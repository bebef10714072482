"""Model configuration: the fields peagle's native Llama-family model needs, parsed from an HF config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import PeagleError
from ..paths import missing_hint

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def uniform_window(cfg: dict) -> int | None:
    """The sliding window of every layer (None: full attention), read as transformers reads the config: per-layer
    ``layer_types``, else Mistral's window on all layers, Qwen2/3's ``use_sliding_window`` on layers >=
    ``max_window_layers``.  The native target runs one window for all layers: a mix raises PeagleError."""
    mt, w = cfg.get("model_type"), cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:
        on = w is not None and cfg.get("use_sliding_window", mt == "mistral")
        first = int(cfg.get("max_window_layers", 28)) if mt in ("qwen2", "qwen3") else 0
        types = ["sliding_attention" if on and i >= first else "full_attention"
                 for i in range(int(cfg.get("num_hidden_layers", 0)))]
    kinds = set(types)
    if kinds <= {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(w)
    raise PeagleError(f"{mt}: sliding-window attention on some layers only ({sorted(kinds)}); the native target runs "
                      "one window for all layers: use --target-backend transformers")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # qwen2, or llama attention_bias
    o_bias: bool = False            # llama / qwen3 attention_bias also biases o_proj
    qk_norm: bool = False           # qwen3
    sliding_window: int | None = None
    eos_token_ids: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if mt not in SUPPORTED:
            raise PeagleError(
                f"unsupported architecture: model_type={mt!r} architectures={archs} "
                f"(peagle supports {', '.join(sorted(SUPPORTED))})")
        try:
            H = int(cfg["hidden_size"])
            nh = int(cfg["num_attention_heads"])
            rp = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)))
            rs = cfg.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
            if rs is not None:
                kind = rs.get("rope_type", rs.get("type", "default"))
                if kind not in ("default", "llama3", "linear"):
                    raise PeagleError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
                if kind == "default":
                    rs = None
            eos = cfg.get("eos_token_id")
            eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
            # what transformers' modeling code of these families reads, and nothing the native target ignores:
            # SiLU only; attention_bias biases q/k/v/o in llama and qwen3 (qwen2: q/k/v always; mistral never);
            # mlp_bias (llama only) and quantized checkpoints (their scales) are not run natively
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                raise PeagleError(f"hidden_act={act!r} is not supported natively (SiLU only)")
            if cfg.get("quantization_config"):
                kind = cfg["quantization_config"].get("quant_method", "?") if isinstance(
                    cfg["quantization_config"], dict) else "?"
                raise PeagleError(f"a quantized checkpoint (quantization_config: {kind}) is not run natively")
            if mt == "llama" and cfg.get("mlp_bias"):
                raise PeagleError("mlp_bias=true is not supported natively")
            attn_bias = bool(cfg.get("attention_bias", False)) and mt in ("llama", "qwen3")
            return cls(
                model_type=mt, vocab_size=int(cfg["vocab_size"]), hidden_size=H,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=nh,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or nh),
                head_dim=int(cfg.get("head_dim") or H // nh),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rs,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", mt not in ("llama", "mistral"))
                                         if "tie_word_embeddings" in cfg else False),
                qkv_bias=(mt == "qwen2") or attn_bias, o_bias=attn_bias, qk_norm=(mt == "qwen3"),
                sliding_window=uniform_window(cfg),
                eos_token_ids=eos, raw=cfg)
        except KeyError as e:
            raise PeagleError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def describe(cls, cfg: dict) -> "ModelConfig":
        """The sizes, vocabulary and context of any causal LM's config (a multimodal one's text_config), without
        checking that the native target runs it (the transformers backend, new heads for any target)."""
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = dict(cfg["text_config"], model_type=cfg["text_config"].get("model_type", cfg.get("model_type")))
        if cfg.get("model_type") in SUPPORTED:
            try:
                return cls.from_dict(cfg)
            except PeagleError:
                pass                                   # e.g. a window on some layers only: sizes are still fine
        try:
            H, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            inter = cfg.get("intermediate_size") or 4 * H
            rp = cfg.get("rope_parameters") or {}
            if isinstance(rp.get("full_attention"), dict):         # per-attention-type rope (Gemma 3/4)
                rp = rp["full_attention"]
            eos = cfg.get("eos_token_id")
            return cls(
                model_type=str(cfg.get("model_type")), vocab_size=int(cfg["vocab_size"]), hidden_size=H,
                intermediate_size=int(max(inter) if isinstance(inter, list) else inter),   # Gemma 3n: per layer
                num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=nh,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or nh),
                head_dim=int(cfg.get("head_dim") or H // nh), rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                rope_theta=float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                sliding_window=cfg.get("sliding_window"),
                eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos], raw=cfg)
        except KeyError as e:
            raise PeagleError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        if not os.path.isdir(path):
            raise PeagleError(f"model directory not found: {path}{missing_hint(path)}")
        fn = os.path.join(path, "config.json")
        if not os.path.isfile(fn):
            raise PeagleError(f"no config.json in {path}")
        with open(fn) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise PeagleError(f"{fn} is not valid JSON: {e}") from None
        c = cls.from_dict(cfg)
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                g = json.load(f)
            e = g.get("eos_token_id")
            if e is not None:
                for t in (e if isinstance(e, list) else [e]):
                    if t not in c.eos_token_ids:
                        c.eos_token_ids.append(t)
        return c
