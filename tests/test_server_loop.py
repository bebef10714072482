"""The engine loop (peagle/server/loop.py) runs on the thread that built its engine: the server's HTTP side and the
engine share no thread that enters the target's parallel regions, and outputs stay those of plain decoding."""
import threading

from serving import client, head_dir, model_dir, ref_complete, ref_llm, spec_cfg, start  # noqa: F401 (fixtures)

import peagle.server.start as server_start
from peagle.engine import Engine


def test_engine_steps_on_the_thread_that_built_it(model_dir, head_dir, ref_llm, monkeypatch):
    prompts = ["Hello there", "Once upon a time"]
    want = [o.text for o in ref_complete(ref_llm, prompts, 8)]
    built, stepped = [], set()
    real_build, real_step = server_start.build_engine, Engine.step

    def build(*a, **kw):
        built.append(threading.get_ident())
        return real_build(*a, **kw)

    def step(self):
        stepped.add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(server_start, "build_engine", build)
    monkeypatch.setattr(Engine, "step", step)
    srv = start(model_dir, spec_cfg(head_dir), max_num_seqs=2)
    try:
        got = [client(srv).completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
    finally:
        srv.stop()
    assert got == want
    assert len(built) == 1 and built[0] != threading.main_thread().ident
    assert stepped == {built[0]}
