"""Device and dtype: one choice for a run, and device mistakes caught on a CPU-only machine.

* torch.set_default_device("meta") while the model lives on the CPU: any tensor the step creates without an
  explicit device lands on "meta" and the first op mixing it with real tensors raises.
* The whole engine on the "meta" device: meta tensors cannot be read on the host, so every host read inside
  target / drafter forwards, verification and state updates raises -- except the step's one copy, which the
  test serves with zeros and counts.
* bfloat16: speculative greedy output equals plain bfloat16 output (divergences only at bf16 ties)."""
import pytest
import torch
from fakes import FakeProposer, install_proposer
from heads import save_random_head

from peagle import LLM, SamplingParams
from peagle.device import cpu_amx_bf16, resolve, train_compute_dtype
from peagle.errors import PeagleError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return save_random_head(target, str(tmp_path_factory.mktemp("dev-head") / "p"), layers=2)


def spec(head, k=3, parallel=True):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": parallel}


def test_resolve_device_and_dtype():
    assert resolve("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve("cpu", "float16")[1] == torch.float16
    want = (torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else (torch.device("cpu"), torch.float32)
    assert resolve("auto", "auto")[0].type == want[0].type and resolve("auto", "auto")[1] in (want[1], torch.float16)
    with pytest.raises(PeagleError, match="dtype"):
        resolve("cpu", "float8")
    with pytest.raises(PeagleError, match="device"):
        resolve("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PeagleError, match="no CUDA"):
            resolve("cuda")


def test_training_computes_bfloat16_on_a_cpu_only_where_it_has_amx_bf16():
    """Training's "auto" on a CPU: the head autocasts to bfloat16 exactly when /proc/cpuinfo lists amx_bf16 (read
    here through lscpu's flags, another route; avx512_bf16 alone measured slower than float32); an explicit dtype
    is kept as given."""
    import shutil
    import subprocess
    cpu = torch.device("cpu")
    assert train_compute_dtype("float32", cpu) == torch.float32
    assert train_compute_dtype("bf16", cpu) == torch.bfloat16
    assert train_compute_dtype("auto", cpu) == (torch.bfloat16 if cpu_amx_bf16() else torch.float32)
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), None)
        if flags is not None:
            assert cpu_amx_bf16() == ("amx_bf16" in flags)
    with pytest.raises(PeagleError, match="dtype"):
        train_compute_dtype("float8", cpu)
    for half in ("float16", "fp16"):           # unscaled float16 gradients underflow: refused, not trained
        with pytest.raises(PeagleError, match="loss scaling"):
            train_compute_dtype(half, cpu)


def test_llm_places_everything_on_its_device_and_dtype(target, head):
    llm = LLM(target, device="cpu", dtype="bfloat16", speculative_config=spec(head))
    e = llm.engine
    assert llm.device == e.device == torch.device("cpu") and llm.dtype == torch.bfloat16
    tensors = [e.target.embed, e.target.layers[0].qkv_w, e.target.rope.cos, e.cache.k[0],
               e.proposer.cache.k[0], e.proposer.head.fc.weight, e.proposer.mask_h]
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert {t.device.type for t in tensors + [e.cache.lens, e.state.last]} == {"cpu"}
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def _two_steps_then_meta(llm, n_meta_steps=3):
    e = llm.engine
    e.add_request("a", [5, 6, 7, 8], GREEDY)
    e.add_request("b", [9, 10, 11], SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=12, seed=1,
                                                   ignore_eos=True))
    e.step()
    torch.set_default_device("meta")
    try:
        for _ in range(n_meta_steps):
            e.step()
        e.add_request("c", list(range(5, 30)), GREEDY)       # admission (ragged prefill) under meta too
        e.step()
        e.step()
    finally:
        torch.set_default_device(None)
    return e


@pytest.mark.parametrize("parallel", [None, True, False])
def test_step_creates_no_tensor_without_an_explicit_device(target, head, tmp_path, parallel):
    h = head if parallel is not False else save_random_head(target, str(tmp_path / "e"), layers=1, parallel=False,
                                                           draft_vocab=256)
    llm = LLM(target, device="cpu", speculative_config=None if parallel is None else spec(h, 3, parallel))
    e = _two_steps_then_meta(llm)
    assert [len(r.output_ids) for r in e.running] and all(r.output_ids for r in e.running)


def test_engine_on_meta_reads_the_device_once_per_step(target, head, monkeypatch):
    """Everything on "meta": any host read (int(), .item(), bool(), .tolist()) raises, so a step that
    completes read the device only through Engine._to_host, whose calls are counted. The target runs torch's
    products, as off the CPU (a CPU float32 target's kernels read host memory)."""
    from peagle.models import llama
    monkeypatch.setattr(llama, "F32_KERNEL", False)
    llm = LLM(target, device="cpu", speculative_config=spec(head, 3))
    e = llm.engine
    meta = torch.device("meta")
    t = e.target
    t.device = meta
    for name in ("embed", "norm", "lm_head_t"):
        setattr(t, name, getattr(t, name).to(meta))
    for L in t.layers:
        for k, v in vars(L).items():
            if torch.is_tensor(v):
                setattr(L, k, v.to(meta))
    t.rope.cos, t.rope.sin, t.rope.ar, t.rope.device = t.rope.cos.to(meta), t.rope.sin.to(meta), t.rope.ar.to(meta), meta
    p = e.proposer
    p.head.to(meta)
    p.head.prepare_inference()
    p.head.rope = None
    p.mask_h = p.mask_h.to(meta)
    p.cache = type(p.cache)(p.cache.n_layers, p.cache.n_kv, p.cache.head_dim, p.cache.max_len, 1, p.cache.dtype,
                            meta, lens=False)
    e.cache = t.new_cache(1, e.cache.max_len)
    e.device = meta
    e.state = type(e.state)(meta)
    copies = []

    def to_host(x):           # the step's one copy: serve zeros (accepted 0, token 0) of the right shape
        copies.append(tuple(x.shape))
        return torch.zeros(x.shape, dtype=torch.long).tolist()
    monkeypatch.setattr(e, "_to_host", to_host)
    e.add_request("a", [5, 6, 7, 8], GREEDY)
    e.add_request("b", [9, 10], GREEDY)
    e.step()                                   # admission: first tokens, then the first decode step
    assert copies == [(2,), (2, 5)]
    for _ in range(4):
        e.step()
    assert copies[2:] == [(2, 5)] * 4          # one copy per decode step: accepted count + K+1 tokens per row


class PlainOracle(FakeProposer):
    """Drafts the plain decoding continuation with draft number n % (K + 1) corrupted (ragged acceptance)."""

    def __init__(self, k, ref):
        super().__init__(k)
        self.ref, self.n = ref, 0

    def propose(self, batch, k=None):
        k, out = k or self.k, []
        for r in batch.requests:
            self.n += 1
            d = (self.ref[tuple(r.prompt_token_ids)][len(r.output_ids):] + [7] * k)[:k]
            out.append([t if i != self.n % (k + 1) else (t + 1) % 500 for i, t in enumerate(d)])
        return torch.tensor(out)


def assert_same_but_ties(llm, prompts, got, want):
    """got == want per prompt, or the first divergence sits where the target's own top-2 logits are within
    2 bfloat16 steps (a tie that rounding of a different block shape may break either way)."""
    t, n_same = llm.engine.target, 0
    for p, a, b in zip(prompts, got, want):
        if a == b:
            n_same += 1
            continue
        j = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        ids = p + b[:j]
        logits, _ = t.forward(torch.tensor([ids]), t.new_cache(1, len(ids) + 4), 0, torch.zeros(1, dtype=torch.long),
                              logits_at=torch.tensor([len(ids) - 1]))
        top = logits[0].topk(2).values
        assert top[0] - top[1] <= 2 * 2 ** -7 * top[0].abs(), (j, top.tolist())
    assert n_same >= len(prompts) - 2


@pytest.mark.parametrize("kind", ["peagle", "oracle"])
def test_bfloat16_speculative_greedy_equals_plain_bfloat16(target, head, kind):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (8,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, device="cpu", dtype="bfloat16")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    if kind == "peagle":
        llm = LLM(target, device="cpu", dtype="bfloat16", speculative_config=spec(head, 5), max_num_seqs=3)
    else:
        llm = install_proposer(LLM(target, device="cpu", dtype="bfloat16", max_num_seqs=3),
                               PlainOracle(5, {tuple(p): w for p, w in zip(prompts, want)}), 5)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    if kind == "oracle":
        assert llm.get_metrics()["mean_acceptance_length"] > 2
    assert_same_but_ties(plain, prompts, got, want)


@pytest.mark.parametrize("command,required", [
    ("generate", ["--prompt", "x"]), ("serve", []), ("bench", []), ("datagen", ["--out", "o"]),
    ("tune", ["--speculative-config", "{}"]),
    ("train", ["--method", "eagle3", "--data", "d", "--out", "o"])])
def test_every_command_defaults_to_auto_device_and_dtype(command, required):
    """--device / --dtype default to auto everywhere (a GPU is used when there is one); --dtype takes any case."""
    from peagle.cli import build_parser
    a = build_parser(command).parse_args([command, *required])
    assert (a.device, a.dtype) == ("auto", "auto")
    assert build_parser(command).parse_args([command, *required, "--dtype", "BF16"]).dtype == "bf16"
