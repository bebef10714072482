"""`peagle serve`'s start-up: the model and speculative config to serve (flag, environment or the default
target), the server state around one engine, and uvicorn (the flags: peagle/cli/serve.py; the app:
server/app.py)."""
from __future__ import annotations

import json
import os

from .. import llm  # llm.DEFAULT_*: read when called (tests point them elsewhere)
from ..errors import PeagleError
from ..llm import build_engine, load_tokenizer
from ..paths import SETUP_COMMAND, missing_hint
from ..spec_config import AUTO, OFF, parse_spec_config, speculative_config
from .limits import Limits
from .loop import EngineThread

ENV_SPEC = "PEAGLE_SPECULATIVE_CONFIG"
# The default target's server: its P-EAGLE head with K chosen per step and batch size (K = 0: plain steps), since
# a fixed K that does not pay costs every request. Through the server, q4a8, MT-Bench / HumanEval, c=1: K=7 ran
# 0.66 / 0.75x plain decoding, auto 0.90 / 0.96x; c=16: 0.43 / 0.53x vs 0.83 / 1.02x
# (docs/benchmarks/serve-default/report.md).
SERVE_K = AUTO


def resolve_config(model, spec_flag, env=None):
    """-> (model_dir, served_name, spec_config or None). The flag wins over the environment; with no model
    the default target (SmolLM2-135M-Instruct) is served with its P-EAGLE head (if present) unless a config
    says otherwise."""
    env = os.environ if env is None else env
    spec = spec_flag if spec_flag is not None else env.get(ENV_SPEC) or None
    if isinstance(spec, str) and spec.strip().lower() in OFF:
        spec, explicit_off = None, True
    else:
        explicit_off = False
    if model is None:
        if not os.path.isdir(llm.DEFAULT_MODEL):
            raise PeagleError(f"no MODEL given and the default target {llm.DEFAULT_MODEL} does not exist yet "
                              f"(`{SETUP_COMMAND}` converts it, or pass a model directory)")
        model, name = llm.DEFAULT_MODEL, os.path.basename(llm.DEFAULT_MODEL)
        if spec is None and not explicit_off and os.path.isdir(llm.DEFAULT_PEAGLE_HEAD):
            spec = speculative_config(llm.DEFAULT_PEAGLE_HEAD, SERVE_K, True)
    else:
        if not os.path.isdir(model):
            raise PeagleError(f"{model} is a file, not a model directory" if os.path.isfile(model) else
                              f"model directory {model} does not exist{missing_hint(model)}")
        name = model
    try:
        parsed = parse_spec_config(json.dumps(spec) if isinstance(spec, dict) else spec)
    except PeagleError as e:
        if spec_flag is None and env.get(ENV_SPEC):               # say where a config the user did not type came from
            raise PeagleError(f"${ENV_SPEC}: {e}") from None
        raise
    if parsed is not None and not os.path.isdir(parsed.model):
        raise PeagleError(f"speculative config model {parsed.model} does not exist{missing_hint(parsed.model)}")
    return model, name, parsed


def build_state(model_dir, name, spec, dtype="auto", seed=0, max_num_seqs=128, max_waiting=None,
                max_model_len=None, limits=None, device="auto", api_keys=(), compile=False, target_backend="auto",
                quantization="none", root=None, kv_cache_dtype="auto"):
    """root: the model as the user named it (the default target: its name), for /v1/models."""
    from .app import ServerState  # here, not above: fastapi loads only when a server is built, not for every command
    if max_num_seqs < 1:
        raise PeagleError("--max-num-seqs must be >= 1")
    if max_waiting is not None and max_waiting < 0:
        raise PeagleError("--max-waiting must be >= 0")
    thread = EngineThread()                # builds the engine, then runs its loop (peagle/server/loop.py)
    try:
        engine, _, spec = thread.submit(build_engine, model_dir, dtype=dtype, seed=seed, speculative_config=spec,
                                        max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device,
                                        compile=compile, target_backend=target_backend,
                                        quantization=quantization, kv_cache_dtype=kv_cache_dtype).result()
    except BaseException:
        thread.shutdown()
        raise
    tok = load_tokenizer(model_dir)        # the HTTP side's own copy: the engine thread uses the engine's
    mw = 4 * max_num_seqs if max_waiting is None else max_waiting
    return ServerState(engine, tok, name, model_dir, spec, max_waiting=mw, limits=limits, api_keys=api_keys,
                       thread=thread, root=root)


def check_listen(host: str, port: int) -> None:
    """PeagleError if nothing can listen on host:port now (in use, no such address, not allowed). uvicorn binds
    again later: a port taken in between still fails there."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PeagleError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    fam, typ, proto, _, addr = infos[0]
    with socket.socket(fam, typ, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn does
        try:
            s.bind(addr)
        except OSError as e:
            raise PeagleError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run(args) -> int:
    import sys

    from .app import create_app  # fastapi (app, auth) loads only when serving: `peagle CMD` imports this module
    from .auth import exposed_without_key, resolve_api_keys
    check_listen(args.host, args.port)            # before the model loads and auto K measures (~30 s)
    model = args.model or args.model_opt
    model_dir, name, spec = resolve_config(model, args.speculative_config)
    limits = Limits(args.max_body_bytes, args.max_prompt_tokens, args.max_tokens_limit, args.default_max_tokens,
                    args.max_stop, args.max_stop_chars)
    keys = resolve_api_keys(args.api_key, os.environ)
    if exposed_without_key(args.host, keys):
        print(f"peagle serve: WARNING: binding {args.host} without an API key: anyone who can reach this port can "
              "use the model (set --api-key or $PEAGLE_API_KEY)", file=sys.stderr, flush=True)
    try:
        state = build_state(model_dir, args.served_model_name or name, spec, args.dtype, args.seed,
                            args.max_num_seqs, args.max_waiting, args.max_model_len, limits=limits,
                            device=args.device, api_keys=keys, compile=args.compile,
                            target_backend=args.target_backend, quantization=getattr(args, "quantization", "none"),
                            root=model or name, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    except KeyboardInterrupt:
        # Ctrl-C while the engine thread is still building (e.g. auto K's first measurement, ~30 s): end now,
        # without waiting for it or unwinding it out of the C++ kernels at interpreter exit (std::terminate)
        print("peagle: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    sp = "off" if spec is None else f"{spec.name} K={spec.k_label} head={spec.model}"
    print(f"peagle serve: {state.model_name} ({model_dir}) at http://{args.host}:{args.port}/v1  "
          f"speculative={sp} max_num_seqs={args.max_num_seqs} max_waiting={state.loop.max_waiting} "
          f"max_model_len={state.max_model_len} device={state.engine.device} "
          f"dtype={str(state.engine.target.dtype).replace('torch.', '')} api_keys={len(keys)}", flush=True)
    print(f"peagle serve: target {getattr(state.engine.target, 'precision', 'float weights')}", flush=True)
    try:
        make_server(create_app(state), state, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=args.access_log).run()
    except KeyboardInterrupt:      # Server.run re-raises the SIGINT it handled, after the shutdown (uvicorn.run ate it)
        pass
    return 0


GRACE_S = 5     # uvicorn's graceful shutdown; running requests may finish for a second less


def make_server(app, state, **config):
    """A uvicorn.Server (config: uvicorn.Config's keywords) whose shutdown drains the engine loop first: waiting
    requests answered 503, running ones finishing for GRACE_S - 1 seconds, the rest answered 503 (without it,
    uvicorn cancelled them after GRACE_S seconds: a bare 500 or a stream cut without an error)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.loop.drain(GRACE_S - 1)
            super().handle_exit(sig, frame)
    return Server(uvicorn.Config(app, timeout_graceful_shutdown=GRACE_S, **config))
