import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# measured step-cost models (num_speculative_tokens "auto") go to a throw-away directory, not ~/.cache
os.environ["PEAGLE_CACHE_DIR"] = tempfile.mkdtemp(prefix="peagle-test-cache-")

from tiny import save_tiny  # noqa: E402 - after the environment above is set


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny(f, str(root / f)) for f in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="module")
def target(tiny_dirs):
    """The tiny Llama target most engine tests run on (a module may define its own)."""
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def qtarget(tmp_path_factory):
    """A tiny llama whose every projection width is a multiple of 32 (all quantized): the quantized-target tests'."""
    return save_tiny("llama", str(tmp_path_factory.mktemp("q") / "llama"), intermediate_size=128)


@pytest.fixture(scope="session")
def tiny_gguf(qtarget, tmp_path_factory):
    """qtarget as a llama.cpp-style GGUF of mixed block types (ggufs.save_tiny_gguf)."""
    from ggufs import save_tiny_gguf
    return save_tiny_gguf(qtarget, str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Random P-EAGLE (2 layers) and EAGLE-3 (1 layer, 256-token draft vocabulary) heads for `target`."""
    from heads import save_random_head
    d = tmp_path_factory.mktemp("heads")
    return {"peagle": save_random_head(target, str(d / "p"), layers=2),
            "eagle3": save_random_head(target, str(d / "e"), layers=1, parallel=False, draft_vocab=256)}


_NOTES = pytest.StashKey[list]()


@pytest.fixture
def summary_note(request):
    """Append a line to the end-of-run summary (e.g. how many cases a fuzz test ran): shown even under -q."""
    return request.config.stash.setdefault(_NOTES, []).append


def pytest_terminal_summary(terminalreporter, config):
    notes = config.stash.get(_NOTES, [])
    if notes:
        terminalreporter.section("notes")
        for line in notes:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """Tiny GPT-OSS, Qwen3-MoE, Gemma 3 and Gemma 4 checkpoints (transformers backend), with tokenizers."""
    from families import HF_FAMILIES, save_family
    root = tmp_path_factory.mktemp("families")
    return {f: save_family(f, str(root / f)) for f in HF_FAMILIES}
