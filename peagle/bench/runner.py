"""Offline benchmark runs through peagle's engine (and HF transformers peers), with vLLM-style metrics.

One target is loaded once and shared; each run gets a fresh Engine (built as every engine is, by
``peagle.llm.make_engine``) with at most ``c`` requests in flight: a request is added only when a slot
frees, so TTFT excludes queueing, as in ``vllm bench serve --max-concurrency c``."""
from __future__ import annotations

import hashlib
import math
import statistics
import time

import torch

from ..autok.config import AutoKConfig
from ..autok.factory import auto_policy, chain_of, cost_model_for, k_max_for
from ..data.benchmarks import encode_prompt
from ..device import resolve, synchronize
from ..errors import PeagleError
from ..heads.model import DrafterHead
from ..llm import load_tokenizer, make_engine, measuring_engines
from ..models.loader import load_target
from ..sampling import SamplingParams
from ..spec_config import DEFAULT_DRAFT_SAMPLING, SpecConfig
from .summary import percentile


def stats_ms(xs) -> dict:
    xs = [x * 1000 for x in xs if x is not None]
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": percentile(xs, 99)}


def split_method(label: str):
    """A run's method label -> (drafter method, tree (eagle_topk, num_draft_tokens) or None): "peagle" is a
    chain, "peagle+tree4x8" the same head with token trees of eagle_topk 4 and 8 nodes (`--trees`)."""
    if "+tree" not in label:
        return label, None
    m, t = label.split("+tree", 1)
    topk, nodes = t.split("x")
    return m, (int(topk), int(nodes))


def out_hash(ids) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


class _Timed:
    """Wraps a callable, accumulating wall time and calls (bucketed by a key function). sync() (the device's
    synchronize) runs before and after each call, so device work is timed where it is queued."""

    def __init__(self, fn, key=lambda *a, **k: "call", sync=lambda: None):
        self.fn, self.key, self.sync, self.t, self.n = fn, key, sync, {}, {}

    def __call__(self, *a, **k):
        self.sync()
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.sync()
            b = self.key(*a, **k)
            self.t[b] = self.t.get(b, 0.0) + time.perf_counter() - t0
            self.n[b] = self.n.get(b, 0) + 1


class Bench:
    """Holds the target, tokenizer and heads; builds engines and encodes prompts."""

    def __init__(self, model: str, heads: dict, dtype: str = "auto", seed: int = 0, max_batch: int = 128,
                 remeasure: bool = False, device: str = "auto", compile: bool = False, target_backend: str = "auto",
                 draft_sampling: str = DEFAULT_DRAFT_SAMPLING, auto_k: AutoKConfig | None = None,
                 quantization: str = "none", kv_cache_dtype: str = "auto"):
        self.draft_sampling = draft_sampling      # the speculative config's "draft_sampling" for every run
        self.auto_k = auto_k                      # its "auto_k" for the runs with K "auto"
        self.device, self.dtype = resolve(device, dtype)
        self.compile = compile
        self.model, self.heads_dirs, self.seed = model, heads, seed
        self.target = load_target(model, self.dtype, target_backend, self.device, quantization, kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.quantization = getattr(self.target, "quantization", "none")      # "auto" resolved
        self.backend = target_backend
        self.tok = load_tokenizer(model)
        self._heads = {}
        self.max_batch, self.remeasure, self.costs = max_batch, remeasure, {}    # K "auto": cost model per method

    # ---------------------------------------------------------------- prompts
    def encode(self, p) -> list:
        return encode_prompt(self.tok, self.target.cfg.vocab_size, p)

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None else ""

    # ---------------------------------------------------------------- engines
    def head(self, method: str):
        method = split_method(method)[0]
        if method not in self._heads:
            d = self.heads_dirs.get(method)
            if not d:
                raise PeagleError(f"no head directory for {method}")
            self._heads[method] = DrafterHead.from_pretrained(d, self.target.cfg, parallel=(method == "peagle"),
                                                              dtype=self.dtype, device=self.device,
                                                              target_embed=self.target.embed)
        return self._heads[method]

    def spec(self, method: str, k) -> SpecConfig | None:
        """The speculative config of a run: None for the baseline."""
        if method == "baseline":
            return None
        method, tree = split_method(method)
        return SpecConfig("eagle3", self.heads_dirs.get(method), k, parallel_drafting=(method == "peagle"),
                          draft_sampling=self.draft_sampling, eagle_topk=tree[0] if tree else 1,
                          num_draft_tokens=tree[1] if tree else None)

    def auto_policy(self, method: str):
        """A fresh AutoK: the cost model comes from the cache (or is measured once per run and method, for batch
        sizes up to max_batch); acceptance starts from the head's prior, as a fresh server would."""
        head = self.head(method)
        spec = self.spec(method, "auto")
        k = k_max_for(spec, head.cfg)
        chain = chain_of(spec)
        for s in {chain.cost_name: chain, spec.cost_name: spec}.values():    # a tree run: its chain's and its own
            if s.cost_name not in self.costs:
                self.costs[s.cost_name] = cost_model_for(self.target, measuring_engines(self.target, head, s, k),
                                                         s.cost_name, k, self.max_batch, self.model, spec.model,
                                                         self.dtype, refresh=self.remeasure)
        tree_cost = self.costs[spec.cost_name] if spec.cost_name != chain.cost_name else None
        return auto_policy(self.costs[chain.cost_name], head.cfg, k, self.auto_k, tree_cost=tree_cost)

    def engine(self, method: str, k, c: int, max_model_len: int):
        """k: an int, or "auto" (K per step, up to the head's trained depth)."""
        spec = self.spec(method, k)
        policy = self.auto_policy(method) if spec is not None and spec.auto else None
        torch.manual_seed(self.seed)
        eng = make_engine(self.target, self.tok, spec, c, max_model_len, self.seed, self.compile,
                          head=self.head(method) if spec is not None else None, k_policy=policy)
        eng.cache.ensure_rows(c)                  # allocate outside the timed region
        if eng.proposer is not None:
            eng.proposer.cache.ensure_rows(c)
        return eng

    # ---------------------------------------------------------------- one run
    def run(self, method: str, k: int, c: int, prompts_ids: list, params: SamplingParams, max_model_len: int) -> dict:
        eng = self.engine(method, k, c, max_model_len)
        sync = (lambda: synchronize(self.device)) if self.device.type != "cpu" else (lambda: None)
        own = vars(self.target).get("forward")     # an instance's own forward (--compile's) comes back after
        tgt_fwd = _Timed(self.target.forward, key=lambda *a, **kw: "prefill" if kw.get("logits_at") is not None
                         else "decode", sync=sync)
        self.target.forward = tgt_fwd
        prop = eng.proposer
        if prop is not None:
            prop.propose = _Timed(prop.propose, sync=sync)
            prop.prefill = _Timed(prop.prefill, sync=sync)
            if hasattr(prop, "propose_tree"):                # tree steps (--trees) draft here
                prop.propose_tree = _Timed(prop.propose_tree, sync=sync)
        try:
            pending = list(enumerate(prompts_ids))
            reqs, steps = [], 0
            t0 = time.perf_counter()
            while pending or eng.has_unfinished():
                while pending and len(eng.running) + len(eng.waiting) < c:
                    i, ids = pending.pop(0)
                    reqs.append(eng.add_request(f"r{i}", ids, params))
                eng.step()
                steps += 1
            wall = time.perf_counter() - t0
        finally:
            if own is None:
                del self.target.forward            # back to the class method
            else:
                self.target.forward = own          # back to the compiled one (deleting it ran eager from run 2)
        m = eng.metrics.as_dict()
        drafts = [] if prop is None else [f for f in (prop.propose, getattr(prop, "propose_tree", None))
                                          if isinstance(f, _Timed)]
        n_out = [len(r.output_ids) for r in reqs]
        total = sum(n_out)
        timing = {"n_steps": steps, "target_prefill_s": tgt_fwd.t.get("prefill", 0.0),
                  "target_decode_s": tgt_fwd.t.get("decode", 0.0), "target_decode_calls": tgt_fwd.n.get("decode", 0),
                  "drafter_prefill_s": prop.prefill.t.get("call", 0.0) if prop else 0.0,
                  "drafter_propose_s": sum(f.t.get("call", 0.0) for f in drafts),
                  "drafter_propose_calls": sum(f.n.get("call", 0) for f in drafts)}
        nd = max(timing["target_decode_calls"], 1)
        timing["verify_ms_per_step"] = 1000 * timing["target_decode_s"] / nd
        timing["draft_ms_per_step"] = 1000 * timing["drafter_propose_s"] / max(timing["drafter_propose_calls"], 1)
        timing["other_s"] = wall - sum(timing[x] for x in ("target_prefill_s", "target_decode_s",
                                                           "drafter_prefill_s", "drafter_propose_s"))
        per_req = [{"id": i, "prompt_len": len(r.prompt_token_ids), "output_len": len(r.output_ids),
                    "num_drafts": r.num_drafts, "num_accepted": r.num_accepted, "finish_reason": r.finish_reason,
                    "ttft_s": r.first_token_time - r.arrival,
                    "tpot_s": (r.finish_time - r.first_token_time) / (len(r.output_ids) - 1)
                    if len(r.output_ids) > 1 else None,
                    "e2e_s": r.finish_time - r.arrival, "hash": out_hash(r.output_ids)}
                   for i, r in enumerate(reqs)]
        tree = split_method(method)[1]
        return {"method": method, "k": k, "k_max": eng.k, "mean_k": m["mean_num_speculative_tokens"],
                "tree": None if tree is None else {"eagle_topk": tree[0], "num_draft_tokens": tree[1]},
                "concurrency": c, "n_requests": len(reqs), "output_tokens": total,
                "wall_s": wall, "output_tok_s": total / wall, "req_s": len(reqs) / wall,
                "ttft_ms": stats_ms([r["ttft_s"] for r in per_req]),
                "tpot_ms": stats_ms([r["tpot_s"] for r in per_req]),
                "e2e_ms": stats_ms([r["e2e_s"] for r in per_req]),
                "metrics": m, "timing": timing, "requests": per_req,
                "_outputs": [list(r.output_ids) for r in reqs]}

    # ---------------------------------------------------------------- losslessness
    @torch.no_grad()
    def top2_gap(self, ids: list) -> tuple[float, float]:
        """(gap between the target's two best logits for the token after ids (fresh prefill, batch 1), the spacing
        of the run's dtype at the best logit: one rounding step there)."""
        cache = self.target.new_cache(1, len(ids) + 8)
        dev = self.device
        logits, _ = self.target.forward(torch.tensor([ids], device=dev), cache, 0,
                                        torch.zeros(1, dtype=torch.long, device=dev),
                                        logits_at=torch.tensor([len(ids) - 1], device=dev), span=len(ids), s0=0)
        top = logits[0].topk(2).values
        step = torch.finfo(self.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), 1e-30)))
        return float(top[0] - top[1]), step

    def identity(self, prompts_ids, outs, ref_outs, tie_eps: float = 1e-4) -> dict:
        """Compare a run's greedy outputs with the baseline's, token for token. A divergence counts as a
        floating-point tie when the target's top-2 logits at that step are within tie_eps, or within two rounding
        steps of the run's dtype there (bfloat16 logits of 16-32 are 0.125 apart: a verify block's other rounding
        flips such a pair)."""
        n_same, ties, bad = 0, [], []
        for i, (a, b) in enumerate(zip(outs, ref_outs)):
            if a == b:
                n_same += 1
                continue
            j = next((t for t in range(min(len(a), len(b))) if a[t] != b[t]), min(len(a), len(b)))
            gap, step = self.top2_gap(prompts_ids[i] + b[:j]) if j < min(len(a), len(b)) else (None, None)
            rec = {"request": i, "first_divergence": j, "top2_gap": gap, "dtype_step": step, "len": [len(a), len(b)]}
            (ties if gap is not None and gap <= max(tie_eps, 2 * step) else bad).append(rec)
        return {"n": len(outs), "identical": n_same, "ties": ties, "mismatches": bad, "ok": not bad}


# -------------------------------------------------------------------- HF transformers peers
class _FirstToken:
    """A generate() streamer that records when the first new token arrives."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:   # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


class HFPeer:
    def __init__(self, model: str, dtype=torch.float32, device="cpu"):
        from transformers import AutoModelForCausalLM
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(self.device).eval()
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        self.pad = gc.pad_token_id if gc.pad_token_id is not None else (self.eos[0] if self.eos else 0)

    @torch.no_grad()
    def generate(self, ids: list, n: int, ignore_eos: bool, temperature: float, pld: int = 0, streamer=None):
        kw = dict(max_new_tokens=n, pad_token_id=self.pad, eos_token_id=self.eos or None)
        if ignore_eos:
            kw.update(min_new_tokens=n, eos_token_id=None)
        kw.update(do_sample=False) if temperature == 0 else kw.update(do_sample=True, temperature=temperature,
                                                                       top_k=0, top_p=1.0)
        if pld:
            kw["prompt_lookup_num_tokens"] = pld
        x = torch.tensor([ids], device=self.device)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer, **kw)
        res = out[0, len(ids):].tolist()
        if not ignore_eos:                      # peagle keeps the EOS token it stopped on; so does HF
            for t, tok in enumerate(res):
                if tok in self.eos:
                    return res[: t + 1]
        return res

    def run(self, name: str, prompts_ids: list, n: int, ignore_eos: bool, temperature: float, pld: int = 0) -> dict:
        self.generate(prompts_ids[0][:16], 4, True, temperature, pld)          # warm-up
        per_req, outs = [], []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts_ids):
            s = _FirstToken()
            a = time.perf_counter()
            o = self.generate(ids, n, ignore_eos, temperature, pld, streamer=s)
            b = time.perf_counter()
            first = s.first or b
            outs.append(o)
            per_req.append({"id": i, "prompt_len": len(ids), "output_len": len(o), "ttft_s": first - a,
                            "tpot_s": (b - first) / (len(o) - 1) if len(o) > 1 else None, "e2e_s": b - a,
                            "hash": out_hash(o)})
        wall = time.perf_counter() - t0
        total = sum(len(o) for o in outs)
        return {"method": name, "k": pld, "concurrency": 1, "n_requests": len(outs), "output_tokens": total,
                "wall_s": wall, "output_tok_s": total / wall, "req_s": len(outs) / wall,
                "ttft_ms": stats_ms([r["ttft_s"] for r in per_req]), "tpot_ms": stats_ms([r["tpot_s"] for r in per_req]),
                "e2e_ms": stats_ms([r["e2e_s"] for r in per_req]), "requests": per_req, "_outputs": outs}
