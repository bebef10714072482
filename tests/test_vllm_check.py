"""scripts/vllm_check.py's argument checks (the vLLM runs themselves are `make test-vllm`'s): a bad run is refused
with exit status 2 before vLLM is imported and before any run starts, so no earlier result is lost."""
import json
import os
import subprocess
import sys

from peagle.paths import REPO


def test_a_head_without_k_is_refused_before_any_run(tmp_path):
    prompts, matrix = tmp_path / "p.json", tmp_path / "m.json"
    prompts.write_text(json.dumps([[1, 2, 3]]))
    matrix.write_text(json.dumps([{"name": "b", "head": None}, {"name": "s", "head": str(tmp_path / "h")}]))
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "vllm_check.py"), "--prompts", str(prompts),
                        "--matrix", str(matrix), "--scratch", str(tmp_path / "scratch")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "run s: a head needs k" in r.stderr, (r.returncode, r.stderr[-500:])
