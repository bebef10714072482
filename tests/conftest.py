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

from tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny(f, str(root / f)) for f in ("llama", "qwen2", "qwen3", "mistral")}
