"""Python API shaped like vLLM's offline API: LLM(model=..., speculative_config=...).generate / .chat."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .errors import PeagleError
from .sampling import SamplingParams
from .spec_config import parse_spec_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the default target (SmolLM2-135M-Instruct, converted by `make setup`: peagle/default_target.py) and its heads
DEFAULT_MODEL = os.path.join(REPO, "models", "smollm2-135m-instruct")
DEFAULT_PEAGLE_HEAD = os.path.join(REPO, "models", "smollm2-135m-instruct-peagle")
DEFAULT_EAGLE3_HEAD = os.path.join(REPO, "models", "smollm2-135m-instruct-eagle3")
# the small target trained here (models/demo-target/README.md): the tests' real-weights fixture
DEMO_TARGET = os.path.join(REPO, "models", "demo-target")
DEMO_PEAGLE_HEAD = os.path.join(REPO, "models", "demo-target-peagle")
DEMO_EAGLE3_HEAD = os.path.join(REPO, "models", "demo-target-eagle3")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = True
    metrics: dict = field(default_factory=dict)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a model dir without tokenizer files still runs on token ids
        if os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(os.path.join(path, "tokenizer_config.json")):
            raise PeagleError(f"cannot load the tokenizer in {path}: {e}") from None
        return None


def build_engine(model, dtype="auto", seed=0, speculative_config=None, max_num_seqs=128, max_model_len=None,
                 device="auto", compile=False, target_backend="auto"):
    """Target, tokenizer and proposer on one device and dtype (peagle.device.resolve), in one Engine
    (compile: peagle/compile.py); the target's implementation per target_backend (peagle/models/loader.py)."""
    from .autok.factory import k_max_for, make_policy
    from .device import resolve
    from .drafters.eagle3 import Eagle3Proposer
    from .drafters.peagle import PEagleProposer
    from .models.drafter import DrafterHead
    from .models.loader import load_target
    device, dtype = resolve(device, dtype)
    torch.manual_seed(seed)
    target = load_target(model, dtype, target_backend, device)
    tok = load_tokenizer(model)
    spec = parse_spec_config(speculative_config)
    proposer, k, policy = None, 0, None
    mlen = min(max_model_len or target.cfg.max_position_embeddings, target.cfg.max_position_embeddings)
    if spec is not None:
        head = DrafterHead.from_pretrained(spec.model, target.cfg, parallel=spec.parallel_drafting,
                                           dtype=dtype, device=device, target_embed=target.embed)
        cls = PEagleProposer if spec.parallel_drafting else Eagle3Proposer
        k = k_max_for(spec, head.cfg)
        proposer = cls(head, k, mlen + 3 * k + 8, draft_sampling=spec.draft_sampling)
        policy = make_policy(spec, target, head, lambda n: cls(head, k, n), k, max_num_seqs, model, dtype)
    eng = Engine(target, tok, proposer, k, max_num_seqs, mlen, seed, k_policy=policy, compile=compile)
    return eng, tok, spec


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", seed: int = 0,
                 speculative_config=None, max_num_seqs: int = 128, max_model_len: int | None = None,
                 device: str = "auto", compile: bool = False, target_backend: str = "auto", **kw):
        model = model or DEFAULT_MODEL
        if kw:
            raise PeagleError(f"unsupported LLM argument(s): {', '.join(kw)}")
        self.model = model
        self.engine, self.tokenizer, self.spec = build_engine(model, dtype, seed, speculative_config,
                                                              max_num_seqs, max_model_len, device, compile,
                                                              target_backend)
        self.device, self.dtype = self.engine.device, self.engine.target.dtype
        self._next = 0

    def get_tokenizer(self):
        return self.tokenizer

    def _encode(self, p):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), list(p["prompt_token_ids"])
            p = p["prompt"]
        if isinstance(p, (list, tuple)) and (not p or isinstance(p[0], int)):
            return None, list(p)
        if not isinstance(p, str):
            raise PeagleError(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
        if self.tokenizer is None:
            raise PeagleError(f"{self.model} has no tokenizer: pass prompt_token_ids")
        return p, self.tokenizer(p, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None, use_tqdm: bool = False):
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(sps) != len(prompts):
            raise PeagleError("sampling_params list must be as long as prompts")
        reqs = []
        for p, sp in zip(prompts, sps):
            text, ids = self._encode(p)
            reqs.append(self.engine.add_request(str(self._next), ids, sp, text))
            self._next += 1
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generate")
        while self.engine.has_unfinished():
            for o in self.engine.step():
                if o.finished and bar:
                    bar.update(1)
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
                             [CompletionOutput(0, text, list(r.output_ids), r.finish_reason)], True, m)

    def apply_chat_template(self, messages) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise PeagleError(f"{self.model} has no chat template")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False):
        batch = messages and isinstance(messages[0], list)
        convs = messages if batch else [messages]
        outs = self.generate([{"prompt_token_ids": self.apply_chat_template(c)} for c in convs], sampling_params,
                             use_tqdm)
        return outs

    def get_metrics(self) -> dict:
        return self.engine.metrics.as_dict()

    def reset_metrics(self):
        self.engine.metrics.reset()
