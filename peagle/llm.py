"""Python API shaped like vLLM's offline API: LLM(model=..., speculative_config=...).generate / .chat, and the
one way to build an engine.

Invariant: every engine (LLM and the server, the bench runner, auto K's measurement, `peagle tune`) is built by
make_engine from a loaded target (and tokenizer), a speculative config and options, so they all choose the
proposer the same way (P-EAGLE for a config with parallel_drafting, else EAGLE-3), size the drafter's cache as
the engine sizes the target's (peagle.engine.cache_len), and get the K policy the config asks for
(peagle/autok/factory.py) plugged into the engine here, not inside it."""
from __future__ import annotations

import copy
import numbers
import os
import sys
from dataclasses import dataclass, field, replace

import torch

from .autok.factory import k_max_for, make_policy, trained_depth
from .device import resolve
from .drafters.eagle3 import Eagle3Proposer
from .drafters.peagle import PEagleProposer
from .engine import Engine, cache_len, context_len
from .errors import PeagleError
from .heads.config import is_parallel_head
from .heads.model import DrafterHead
from .kpolicy import KPolicy
from .models.loader import load_target
from .paths import HOME
from .sampling import SamplingParams
from .spec_config import SpecConfig, parse_spec_config

# the default target (SmolLM2-135M-Instruct, converted by `make setup` / `peagle setup`: peagle/default_target.py)
# and its heads, under peagle's home (paths.HOME: the checkout, when peagle runs from one)
MODELS = os.path.join(HOME, "models")
DEFAULT_MODEL = os.path.join(MODELS, "smollm2-135m-instruct")
DEFAULT_PEAGLE_HEAD = os.path.join(MODELS, "smollm2-135m-instruct-peagle")
DEFAULT_EAGLE3_HEAD = os.path.join(MODELS, "smollm2-135m-instruct-eagle3")
# the small target trained here (models/demo-target/README.md): the tests' real-weights fixture
DEMO_TARGET = os.path.join(MODELS, "demo-target")
DEMO_PEAGLE_HEAD = os.path.join(MODELS, "demo-target-peagle")
DEMO_EAGLE3_HEAD = os.path.join(MODELS, "demo-target-eagle3")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: str | None
    stop_reason: int | str | None = None     # the stop token id (not EOS) or stop string that ended it (vLLM's)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = True
    metrics: dict = field(default_factory=dict)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    if path.endswith(".gguf") and os.path.isfile(path):       # a GGUF file's own tokenizer (transformers reads it)
        d, name = os.path.split(os.path.abspath(path))
        try:
            return AutoTokenizer.from_pretrained(d, gguf_file=name)
        except Exception:  # noqa: BLE001 - a file without tokenizer metadata still runs on token ids
            return None
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None       # transformers would build an empty tokenizer of the family's class (its eos stops output)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - one line naming the directory
        raise PeagleError(f"cannot load the tokenizer in {path}: {e}") from None


def chat_ids(tok, messages) -> list[int]:
    """A conversation's token ids through the tokenizer's chat template, with the generation prompt (what
    LLM.apply_chat_template, the server's chat endpoint and datagen send the model)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def load_head(spec: SpecConfig, target) -> DrafterHead:
    """The config's head, on the target's device and dtype (sharing the target's embedding where it has none)."""
    return DrafterHead.from_pretrained(spec.model, target.cfg, parallel=spec.parallel_drafting, dtype=target.dtype,
                                       device=target.device, target_embed=target.embed)


_SAID: set[str] = set()        # head notes already printed by this process (a bench builds many engines)


def head_notes(spec: SpecConfig, head_cfg: dict, k: int) -> list[str]:
    """What a speculative config asks of its head that the head was not trained for (it runs, losslessly, but
    drafts nothing useful there): a static K past the trained depth; a P-EAGLE head drafting autoregressively."""
    notes, depth = [], trained_depth(head_cfg)
    if not spec.auto and depth is not None and k > depth:
        notes.append(f"num_speculative_tokens {k} is above the head's trained depth ({depth}): drafts past it "
                     "are rarely accepted")
    if not spec.parallel_drafting and is_parallel_head(head_cfg):
        notes.append(f"{spec.model} is a P-EAGLE head but the config has no \"parallel_drafting\": true: it "
                     "drafts autoregressively (K passes), as EAGLE-3")
    return notes


def make_engine(target, tok, spec: SpecConfig | None, max_num_seqs: int = 128, max_model_len: int | None = None,
                seed: int = 0, compile: bool = False, head: DrafterHead | None = None,
                k_policy: KPolicy | None = None, model_dir: str | None = None) -> Engine:
    """spec None: plain decoding. Otherwise the head (given, or loaded from spec.model), a proposer for the
    largest K the config allows, and the K policy: k_policy if given, else the config's (FixedK, vLLM's
    schedule, or AutoK, whose cost model is cached per model_dir, head and dtype, or measured with engines
    built here)."""
    mlen = context_len(max_model_len, target.cfg.max_position_embeddings)
    if spec is None:
        return Engine(target, tok, None, 0, max_num_seqs, mlen, seed, compile=compile)
    head = head if head is not None else load_head(spec, target)
    k = k_max_for(spec, head.cfg)
    if k_policy is None:                         # not auto K's measuring engines: say what will not pay, once
        for note in head_notes(spec, head.cfg, k):
            if note not in _SAID:
                _SAID.add(note)
                print(f"peagle: {note}", file=sys.stderr, flush=True)
    tree = spec.tree(k)
    cls = PEagleProposer if spec.parallel_drafting else Eagle3Proposer
    proposer = cls(head, k, cache_len(mlen, k, tree), draft_sampling=spec.draft_sampling,
                   dual=getattr(target, "dual_layout", False), quantization=getattr(target, "quantization", "none"))
    if k_policy is None:
        k_policy = make_policy(spec, target, head, lambda s: measuring_engines(target, head, s, k), k, max_num_seqs,
                               model_dir, target.dtype)
    return Engine(target, tok, proposer, k, max_num_seqs, mlen, seed, k_policy=k_policy, compile=compile, tree=tree)


def measuring_engines(target, head: DrafterHead, spec: SpecConfig, k: int):
    """make_engine(policy, max_num_seqs, max_model_len, seed) for auto K's measurement
    (peagle/autok/measure.py): engines of this target and head built for K = k, drafting the argmax, with K
    chosen by the measurement's policy."""
    fixed = replace(spec, num_speculative_tokens=k, max_num_speculative_tokens=None,
                    num_speculative_tokens_per_batch_size=None, draft_sampling="argmax")

    def build(policy: KPolicy, max_num_seqs: int, max_model_len: int, seed: int) -> Engine:
        return make_engine(target, None, fixed, max_num_seqs, max_model_len, seed, head=head, k_policy=policy)
    return build


def build_engine(model, dtype="auto", seed=0, speculative_config=None, max_num_seqs=128, max_model_len=None,
                 device="auto", compile=False, target_backend="auto", quantization="auto", kv_cache_dtype="auto"):
    """Target (from the directory `model`), tokenizer and engine on one device and dtype (peagle.device.resolve),
    the engine built by make_engine (compile: peagle/compile.py); the target's implementation per
    target_backend (peagle/models/loader.py); quantization: auto (the default: loader.resolve_quantization) /
    none / q8 / q4 / q8a8 / q4a8 (native target on the CPU: peagle/models/quant.py; the target's `precision`
    says what runs); kv_cache_dtype: auto / bfloat16 (loader.load_target)."""
    device, dtype = resolve(device, dtype)
    if quantization not in (None, "none", "auto") and dtype != torch.float32:
        raise PeagleError(f"quantization={quantization!r} runs on float32 (dtype={dtype})")
    torch.manual_seed(seed)
    target = load_target(model, dtype, target_backend, device, quantization or "auto", kv_cache_dtype or "auto")
    tok = load_tokenizer(model)
    spec = parse_spec_config(speculative_config)
    eng = make_engine(target, tok, spec, max_num_seqs, max_model_len, seed, compile, model_dir=model)
    return eng, tok, spec


def _is_token_ids(p) -> bool:
    """A prompt given as token ids: a list or tuple of integers (numpy's included)."""
    return isinstance(p, (list, tuple)) and (not p or isinstance(p[0], numbers.Integral))


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", seed: int = 0,
                 speculative_config=None, max_num_seqs: int = 128, max_model_len: int | None = None,
                 device: str = "auto", compile: bool = False, target_backend: str = "auto",
                 quantization: str | None = None, kv_cache_dtype: str = "auto", **kw):
        model = model or DEFAULT_MODEL
        if kw:
            raise PeagleError(f"unsupported LLM argument(s): {', '.join(kw)}")
        self.model = model
        self.engine, self.tokenizer, self.spec = build_engine(model, dtype, seed, speculative_config,
                                                              max_num_seqs, max_model_len, device, compile,
                                                              target_backend, quantization or "auto",
                                                              kv_cache_dtype)
        self.device, self.dtype = self.engine.device, self.engine.target.dtype
        self._next = 0

    def get_tokenizer(self):
        return self.tokenizer

    def with_speculative_config(self, speculative_config) -> LLM:
        """Another LLM on this one's loaded target and tokenizer (read once, held once) with its own engine for
        `speculative_config` (None: plain decoding); e.g. plain vs EAGLE-3 vs P-EAGLE side by side."""
        spec = parse_spec_config(speculative_config)
        e = self.engine
        other = copy.copy(self)
        other.engine = make_engine(e.target, self.tokenizer, spec, e.max_num_seqs, e.max_model_len, e.seed,
                                   e.compiled, model_dir=self.model)
        other.spec, other._next = spec, 0
        return other

    def _encode(self, p):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), list(p["prompt_token_ids"])
            p = p["prompt"]
        if _is_token_ids(p):
            return None, [int(t) for t in p]
        if not isinstance(p, str):
            raise PeagleError(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
        if self.tokenizer is None:
            raise PeagleError(f"{self.model} has no tokenizer: pass prompt_token_ids")
        return p, self.tokenizer(p)["input_ids"]         # with the tokenizer's special tokens (BOS), as vLLM's

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None, use_tqdm: bool = False):
        single = isinstance(prompts, (str, dict)) or (bool(prompts) and _is_token_ids(prompts))
        if single:
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(sps) != len(prompts):
            raise PeagleError("sampling_params list must be as long as prompts")
        reqs = []
        try:
            for p, sp in zip(prompts, sps):
                text, ids = self._encode(p)
                reqs.append(self.engine.add_request(str(self._next), ids, sp, text))
                self._next += 1
        except Exception:
            for r in reqs:                             # a bad prompt queues none of the call's prompts
                self.engine.abort(r.request_id)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generate")
        try:
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    if o.finished and bar:
                        bar.update(1)
        except BaseException:                          # an error or Ctrl-C: none of the call's requests stays queued
            for r in reqs:
                if not r.finished:
                    self.engine.abort(r.request_id)
            raise
        finally:
            if bar:
                bar.close()
        return [self._output(r) for r in reqs]

    def _output(self, r) -> RequestOutput:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        if r.stop_text_at is not None:
            text = text[: r.stop_text_at]
        m = {"num_drafts": r.num_drafts, "num_accepted_tokens": r.num_accepted,
             "mean_acceptance_length": 1 + r.num_accepted / r.num_drafts if r.num_drafts else 1.0}
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                             [CompletionOutput(0, text, list(r.output_ids), r.finish_reason, r.stop_reason)], True, m)

    def apply_chat_template(self, messages) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise PeagleError(f"{self.model} has no chat template")
        return chat_ids(self.tokenizer, messages)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False):
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        batch = isinstance(messages, list) and bool(messages) and isinstance(messages[0], list)
        convs = messages if batch else [messages]
        for c in convs:
            if not (isinstance(c, list) and c and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                      and isinstance(m.get("content"), str) for m in c)):
                raise PeagleError("a conversation is a non-empty list of {'role': str, 'content': str} messages, "
                                  f"got {c!r:.80}")
        outs = self.generate([{"prompt_token_ids": self.apply_chat_template(c)} for c in convs], sampling_params,
                             use_tqdm)
        return outs

    def get_metrics(self) -> dict:
        return self.engine.metrics.as_dict()

    def reset_metrics(self):
        self.engine.metrics.reset()
