"""KV cache: per-row lengths are the one record of what is valid (the engine keeps them equal to what each
request holds), rollback is setting a length, stale keys past it are never seen, the attention span is only a
bound, and padding past the cache's end does not disturb real rows."""
import pytest
import torch
from heads import save_random_head

from peagle import LLM, SamplingParams
from peagle.models.llama import Transformer


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return Transformer.from_pretrained(tiny_dirs["llama"])


def fresh_logits(m, rows):
    out = []
    for ids in rows:
        lg, _ = m.forward(torch.tensor([ids]), m.new_cache(1, len(ids) + 4), 0, torch.zeros(1, dtype=torch.long))
        out.append(lg[0])
    return out


def test_rollback_hides_stale_keys_and_span_is_only_a_bound(model):
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 512, (2, 24), generator=g)
    c = model.new_cache(2, 64)
    model.forward(toks[:, :16], c, 0, torch.zeros(2, dtype=torch.long), span=16, s0=0)
    model.forward(torch.randint(3, 512, (2, 8), generator=g), c, 0, torch.tensor([16, 16]), span=24, s0=16)
    c.lens[:] = torch.tensor([16, 10])                 # roll row 0 back over the junk, row 1 further
    start = c.lens.clone()
    blk = torch.stack([toks[0, 16:20], toks[1, 10:14]])
    exact, _ = model.forward(blk, c, 0, start, span=20)
    loose, _ = model.forward(blk, c, 0, start, span=40)     # a larger bound reads stale keys: all masked
    ref = fresh_logits(model, [toks[0, :20].tolist(), toks[1, :14].tolist()])
    assert (exact - loose).abs().max() < 1e-5          # same up to the order of float sums
    assert (exact[0] - ref[0][16:]).abs().max() < 1e-4 and (exact[1] - ref[1][10:]).abs().max() < 1e-4


def test_padding_past_the_cache_end_leaves_real_rows_exact(model):
    """Row 1 has 1 real token and 11 padding ones starting near the end of a 32-position cache."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 512, (12,), generator=g).tolist(), torch.randint(3, 512, (29,), generator=g).tolist()
    c = model.new_cache(2, 32)
    model.forward(torch.tensor([a[:1] + [0] * 27, b[:28]]), c, 0, torch.zeros(2, dtype=torch.long))
    blk = torch.tensor([a[1:12] + [0], [b[28]] + [0] * 11])
    out, _ = model.forward(blk, c, 0, torch.tensor([1, 28]), span=40)
    ref = fresh_logits(model, [a, b])
    assert (out[0, :11] - ref[0][1:12]).abs().max() < 1e-4 and (out[1, 0] - ref[1][28]).abs().max() < 1e-4


def test_grow_and_move_keep_rows_and_lengths(model):
    c = model.new_cache(1, 16)
    model.forward(torch.tensor([[5, 6, 7]]), c, 0, torch.zeros(1, dtype=torch.long))
    c.truncate(0, 3)
    k0 = c.k[0][0].clone()
    c.ensure_rows(3)
    assert c.rows >= 3 and torch.equal(c.k[0][0], k0) and c.lens[0] == 3
    c.move_row(0, 2)
    assert torch.equal(c.k[0][2], k0) and c.lens[2] == 3


@pytest.mark.parametrize("parallel", [True, False])
def test_engine_lengths_match_what_each_request_holds(tiny_dirs, tmp_path, parallel):
    """After every step: target cache length = tokens - 1 (the last waits in state.last), and the drafter's
    derived length = target length - pending drafter rows; rows move when requests leave (max_num_seqs 3)."""
    target = tiny_dirs["llama"]
    head = save_random_head(target, str(tmp_path / "h"), layers=1, parallel=parallel)
    llm = LLM(target, max_num_seqs=3, speculative_config={"method": "eagle3", "model": head,
                                                          "num_speculative_tokens": 4, "parallel_drafting": parallel})
    e = llm.engine
    g = torch.Generator().manual_seed(2)
    for i in range(6):
        e.add_request(str(i), torch.randint(5, 500, (3 + 5 * i,), generator=g).tolist(),
                      SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=6 + 3 * i, ignore_eos=True))
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
        B = len(e.running)
        held = torch.tensor([len(r.all_ids) for r in e.running], dtype=torch.long)
        assert torch.equal(e.cache.lens[:B], held - 1)
        assert torch.equal(e.state.last[:B], torch.tensor([r.all_ids[-1] for r in e.running], dtype=torch.long))
        ctx = e.proposer.context                # the drafter's rows still to feed: one count per running row,
        lens = e.cache.lens[:B].tolist()        # at least the newest token's, at most the cached positions
        assert len(ctx.behind) == B and all(1 <= b <= n for b, n in zip(ctx.behind, lens))
    assert steps > 6


@pytest.mark.parametrize("parallel", [True, False])
def test_rows_never_grow_past_max_num_seqs(tiny_dirs, tmp_path, parallel):
    """Rows double as requests arrive, but not past max_num_seqs: with 5, the target cache, the drafter's cache
    and context and the row state held 6 rows (and 65 of 64 would allocate 128)."""
    target = tiny_dirs["llama"]
    head = save_random_head(target, str(tmp_path / "h"), layers=1, parallel=parallel)
    llm = LLM(target, max_num_seqs=5, speculative_config={"method": "eagle3", "model": head,
                                                          "num_speculative_tokens": 2, "parallel_drafting": parallel})
    eng = llm.engine
    for n in range(1, 6):                      # 1, 2, ... 5 requests at once: rows 1, 2, 4, then 5, not 8
        llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(n)],
                     SamplingParams(temperature=0, max_tokens=3))
    rows = (eng.cache.rows, eng.proposer.cache.rows, eng.proposer.context.rows, eng.state.rows)
    assert rows == (5, 5, 5, 5), rows


def test_grown_positions_are_finite_for_a_short_row_beside_a_long_one(tiny_dirs, tmp_path):
    """Growth past the initial 256 positions fills zeros: the short row's drafter attention reads the grown
    positions under its mask (SDPA: 0 x NaN would leak), so its drafts must equal those it gets alone."""
    target = tiny_dirs["llama"]
    head = save_random_head(target, str(tmp_path / "h"), layers=1)
    llm = LLM(target, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                          "parallel_drafting": True})
    g = torch.Generator().manual_seed(3)
    long, short = (torch.randint(5, 500, (n,), generator=g).tolist() for n in (300, 10))
    seen, draft = {}, llm.engine.proposer.draft

    def recording(requests, k, *a, **kw):
        d, q = draft(requests, k, *a, **kw)
        for r, row in zip(requests, d.tolist()):
            seen.setdefault(r.request_id, []).append(row)
        return d, q
    llm.engine.proposer.draft = recording
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    both = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": short}], sp)
    assert llm.engine.cache.cap > 256 and llm.engine.proposer.cache.cap > 256
    in_batch, seen = seen["1"], {}
    alone = llm.generate([{"prompt_token_ids": short}], sp)
    assert both[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert in_batch == next(iter(seen.values()))
