"""``generate``, ``serve``, ``router`` and ``pd``: the commands that run an engine or a
router. Each ``cmd_*`` hands its flags to its room (``phasewise.generate``,
``phasewise.launch``)."""

from __future__ import annotations

import argparse
import os
import sys

from phasewise.bench.options import http_url, positive_float
from phasewise.cli.args import (
    Command,
    add_connection_args,
    add_engine_args,
    add_kernel_plan_arg,
    add_slo_args,
    add_threads_arg,
    api_key_arg,
    check_seconds,
    check_slo_args,
    connection_limits,
    engine_kwargs,
    model_arg,
    setup_logging,
)
from phasewise.config import API_KEY_ENV


def add_commands(command: Command) -> None:
    from phasewise.config import DEFAULT_STEP_TIMEOUT_S, DTYPE_CHOICES, LOG_LEVELS, SERVE_ROLES

    g = command("generate", "stream a completion for one prompt", cmd_generate)
    add_engine_args(g)
    g.add_argument("prompt",
                   help="the prompt text (with --chat: the user's message)")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate (0: the prompt's K/V alone)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the checkpoint's generation_config.json")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--no-roofline", action="store_true",
                   help="skip the closing lines that hold both phases against this machine's "
                   "roofline (they need phasewise measure's figures; a quick measurement is "
                   "made and saved the first time)")

    s = command("serve", "OpenAI-compatible HTTP server (streaming, /metrics)", cmd_serve)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the folder's name)")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=api_key_arg,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                   "/detokenize, and a login for /dashboard (/health, /metrics and /version "
                   f"stay open; docs/serving.md#authentication); default: ${API_KEY_ENV}, "
                   "which keeps the key out of the process list")
    s.add_argument("--internal-key-file", default=None, metavar="FILE",
                   help="behind a router: the fleet's own key (32+ characters, e.g. "
                   "'openssl rand -hex 32'), which /internal/* then take instead of --api-key, "
                   "so that wrong API keys never lock the router out (default: --api-key "
                   "guards them)")
    add_slo_args(s)
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond it new ones get 503")
    s.add_argument("--max-request-size", default="8MiB", help="request body size limit")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running streams get to finish after SIGTERM")
    s.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S, metavar="S",
                   help="seconds one engine step may run before the engine counts as stuck: "
                   "/health and /health/engine answer 503 (a liveness probe restarts it; a "
                   "router moves its streams) and new requests get 503, until the step ends "
                   "(0: never)")
    s.add_argument("--log-interval", type=float, default=5.0,
                   help="seconds between throughput log lines (0: off)")
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="least severe log lines shown")
    s.add_argument("--role", default="both", choices=SERVE_ROLES,
                   help="both: prefill and decode here; decode: open the K/V port and send "
                   "prompts to prefill workers; prefill: compute prompts for a decode worker")
    s.add_argument("--kv-bind", default="tcp://127.0.0.1:8100",
                   help="decode role: the K/V port to listen on")
    s.add_argument("--kv-connect", nargs="+", default=None, metavar="URL",
                   help="prefill role: the decode workers' K/V ports, tcp://HOST:PORT "
                   "(one or more: it prefills for each)")
    s.add_argument("--kv-secret-file", default=None,
                   help="prefill/decode roles: file holding the shared secret (>= 16 bytes)")
    s.add_argument("--disagg-threshold", type=int, default=0,
                   help="decode role: prompts with fewer uncached tokens prefill here "
                   "(0: every prompt a prefill worker can take)")
    s.add_argument("--prefill-queue-limit", type=int, default=8,
                   help="decode role: prefill here while every prefill worker holds this "
                   "many prompts or more")
    s.add_argument("--remote-prefill-timeout", type=float, default=300.0,
                   help="decode role: seconds from sending a prompt (its wait in the prefill "
                   "worker's queue included) to its first token back, after which the prompt "
                   "is computed here")
    s.add_argument("--kv-name", default=None,
                   help="prefill role: the name decode workers know this worker by (default "
                   "prefill@HOSTNAME); a worker that connects under a name already connected "
                   "replaces it, so give each prefill worker on one host its own")
    s.add_argument("--no-access-log", action="store_true",
                   help="no log line per request")
    add_connection_args(s)

    ro = command("router", "the OpenAI API in front of P/D workers (decode workers "
                 "decide what to prefill remotely)", cmd_router)
    ro.add_argument("--model", default=None,
                    help="the checkpoint folder the workers serve (for its tokenizer; "
                    "default: the bundled stdlib-coder); checked against each worker")
    ro.add_argument("--decode", nargs="+", required=True, metavar="URL", type=http_url,
                    help="decode (or --role both) workers, http://HOST:PORT")
    ro.add_argument("--prefill", nargs="*", default=[], metavar="URL", type=http_url,
                    help="prefill workers, http://HOST:PORT (watched for /health and "
                    "/metrics; their K/V goes to the decode workers directly)")
    ro.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    ro.add_argument("--port", type=int, default=8000,
                    help="port to listen on")
    ro.add_argument("--served-model-name", default=None,
                    help="the model name clients send (default: the folder's name)")
    ro.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=api_key_arg,
                    help=f"required of clients, and sent to the workers (default: "
                    f"${API_KEY_ENV})")
    ro.add_argument("--internal-key-file", default=None, metavar="FILE",
                    help="the workers' --internal-key-file, sent to their /internal/* routes")
    ro.add_argument("--max-waiting-requests", type=int, default=256,
                    help="requests allowed to wait for a worker; beyond it new ones get 503")
    add_slo_args(ro)
    ro.add_argument("--max-request-size", default="8MiB",
                    help="request body size limit")
    ro.add_argument("--shutdown-grace", type=float, default=30.0,
                    help="seconds running streams get to finish after SIGTERM")
    ro.add_argument("--wait", type=float, default=300.0,
                    help="seconds to wait for the workers at start-up")
    from phasewise.disagg.prefix_index import (
        DEFAULT_LOAD_WEIGHT,
        DEFAULT_POLICY,
        DEFAULT_PREFIX_WEIGHT,
        POLICIES,
    )
    ro.add_argument("--routing", default=DEFAULT_POLICY, choices=POLICIES,
                    help="how a decode worker is chosen: prefix (the prompt blocks it holds "
                    "against its load), least-load or round-robin (default: "
                    f"{DEFAULT_POLICY}; docs/pd.md)")
    ro.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT,
                    help="--routing prefix: weight of the share of the prompt's blocks a "
                    f"worker holds (default {DEFAULT_PREFIX_WEIGHT:g})")
    ro.add_argument("--load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                    help="--routing prefix: weight of how much lighter than the busiest "
                    f"worker it is (default {DEFAULT_LOAD_WEIGHT:g})")
    from phasewise.disagg.prefix_index import DEFAULT_MAX_MIGRATIONS, MAX_MIGRATIONS_LIMIT
    ro.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                    help="how often one response may be moved to another decode worker when "
                    "its worker dies, stops or drains mid-stream (each move recomputes the "
                    f"prompt and the tokens so far there); 0: never, the response ends with "
                    f"an error (0-{MAX_MIGRATIONS_LIMIT}, default {DEFAULT_MAX_MIGRATIONS})")
    ro.add_argument("--discover", action="store_true",
                    help="each --decode URL names a DNS name whose addresses are the decode "
                    "workers (a Kubernetes headless Service): resolved again every "
                    "--discover-interval seconds, workers join and leave as pods do")
    ro.add_argument("--discover-interval", type=float, default=5.0,
                    help="--discover: seconds between DNS lookups (default 5)")
    ro.add_argument("--stream-deadline", type=float, default=15.0,
                    help="seconds a decode worker may answer no poll before its streams are "
                    "moved to another worker (or ended, where none can take them); a worker "
                    "that closes its connections is moved from at once (default 15)")
    ro.add_argument("--admit-timeout", type=positive_float, default=120.0, metavar="S",
                    help="seconds a decode worker may take to take or refuse a request (its "
                    "reply's headers) before the router tries the next worker")
    ro.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="least severe log lines shown")
    ro.add_argument("--no-access-log", action="store_true",
                    help="no log line per request")
    add_connection_args(ro)

    pd = command("pd", "start 1 prefill worker, 1 decode worker and a router here "
                 "(Ctrl-C stops all three)", cmd_pd)
    pd.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    pd.add_argument("--host", default="127.0.0.1",
                    help="address the router and both workers bind (0.0.0.0: all)")
    pd.add_argument("--port", type=int, default=8000, help="the router's port")
    pd.add_argument("--decode-port", type=int, default=None, help="default: --port + 1")
    pd.add_argument("--prefill-port", type=int, default=None, help="default: --port + 2")
    pd.add_argument("--kv-port", type=int, default=8100,
                    help="the decode worker's K/V port, which the prefill worker connects to")
    pd.add_argument("--kv-secret-file", default=None,
                    help="default: a fresh random secret, removed when it stops")
    pd.add_argument("--disagg-threshold", type=int, default=0,
                    help="prompts with fewer uncached tokens prefill on the decode worker (0: "
                         "every prompt goes to the prefill worker)")
    pd.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=api_key_arg,
                    help="require 'Authorization: Bearer KEY' on the router's and workers' "
                         "/v1/*, /tokenize and /detokenize, and a login for /dashboard "
                         f"(default: ${API_KEY_ENV}; the three processes get it so, never "
                         "on their command lines)")
    pd.add_argument("--pin", action="store_true",
                    help="decode worker on the first core this process may use, prefill "
                    "worker on the second, one thread each")
    pd.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                    help="both workers' dtype (default: serve's, auto)")
    pd.add_argument("--max-model-len", type=int, default=None,
                    help="both workers' --max-model-len (default: serve's)")
    pd.add_argument("--kv-cache-memory", default=None,
                    help="each worker's KV pool, e.g. 512MiB (default: serve's)")
    pd.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="each worker's step budget (default: serve's)")
    pd.add_argument("--max-num-seqs", type=int, default=None,
                    help="each worker's most sequences a step (default: serve's)")
    add_kernel_plan_arg(pd)
    add_threads_arg(pd, "each worker's CPU threads (--threads of serve; default: torch's, "
                     "the cores; --pin: 1)")
    pd.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="least severe log lines shown")



def cmd_generate(a: argparse.Namespace) -> int:
    from phasewise.generate import GenerateOptions, run

    return run(model_arg(a), engine_kwargs(a), GenerateOptions(
        prompt=a.prompt, max_tokens=a.max_tokens, temperature=a.temperature,
        sample_seed=a.sample_seed, chat=a.chat, roofline=not a.no_roofline))


# serve's flags that only some roles read: given to another, they change nothing
ROLE_FLAGS = {"kv_bind": ("decode",), "disagg_threshold": ("decode",),
              "prefill_queue_limit": ("decode",), "remote_prefill_timeout": ("decode",),
              "kv_connect": ("prefill",), "kv_name": ("prefill",),
              "kv_secret_file": ("prefill", "decode")}


def warn_role_flags(a: argparse.Namespace) -> None:
    """A warning for each role flag given a value other than its default that this --role
    does not read (a forgotten --role decode would otherwise serve co-located in silence).
    Not an error: Kubernetes manifests give every engine role one set of flags."""
    import logging

    for dest, roles in ROLE_FLAGS.items():
        if a.role not in roles and getattr(a, dest) != a.parser.get_default(dest):
            logging.getLogger("phasewise.cli").warning(
                "--%s applies to --role %s only; --role %s ignores it", dest.replace("_", "-"),
                " and ".join(roles), a.role)


def cmd_serve(a: argparse.Namespace) -> int:
    setup_logging(a.log_level)
    os.environ.pop(API_KEY_ENV, None)  # read (a.api_key); no child process inherits it
    try:
        return _serve(a)
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing to drain
        print("phasewise: interrupted", file=sys.stderr)
        return 130


def _serve(a: argparse.Namespace) -> int:
    from phasewise.config import EngineConfig, parse_memory
    from phasewise.launch.serve import build_server, read_internal_key, read_secret
    from phasewise.server.serve import check_port, run

    check_seconds(a, ("shutdown_grace", 0, 3600, False), ("log_interval", 0.1, 86400, True),
                  ("remote_prefill_timeout", 0.1, 86400, False))
    warn_role_flags(a)
    model = model_arg(a)
    check_port(a.host, a.port)  # before the minutes a large model can take to load
    check_slo_args(a)
    limits = connection_limits(a)
    secret = read_secret(a.kv_secret_file, a.role) if a.role != "both" else None
    internal_key = read_internal_key(a.internal_key_file)
    server = build_server(
        EngineConfig(model=model, **engine_kwargs(a)),
        served_model_name=a.served_model_name,
        log_interval_s=a.log_interval, api_key=a.api_key,
        max_waiting_requests=a.max_waiting_requests,
        max_request_bytes=parse_memory(a.max_request_size), role=a.role,
        kv_bind=a.kv_bind, kv_connect=a.kv_connect, kv_secret=secret,
        disagg_threshold=a.disagg_threshold, prefill_queue_limit=a.prefill_queue_limit,
        remote_prefill_timeout=a.remote_prefill_timeout, kv_name=a.kv_name,
        slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, internal_key=internal_key,
        step_timeout_s=a.step_timeout or None)
    try:
        run(server, host=a.host, port=a.port, shutdown_grace_s=a.shutdown_grace,
            log_level=a.log_level, access_log=not a.no_access_log, limits=limits)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has drained and shut down
        pass
    return 0



def cmd_router(a: argparse.Namespace) -> int:
    from phasewise.config import parse_memory
    from phasewise.launch.serve import build_router, read_internal_key
    from phasewise.server.serve import check_port, run

    setup_logging(a.log_level)
    os.environ.pop(API_KEY_ENV, None)  # read (a.api_key); no child process inherits it
    check_seconds(a, ("shutdown_grace", 0, 3600, False), ("wait", 1, 86400, False))
    from phasewise.disagg.prefix_index import DEFAULT_LOAD_WEIGHT, DEFAULT_PREFIX_WEIGHT

    weights = [f for f, v, d in (("--prefix-weight", a.prefix_weight, DEFAULT_PREFIX_WEIGHT),
                                 ("--load-weight", a.load_weight, DEFAULT_LOAD_WEIGHT))
               if v != d]
    if a.routing != "prefix" and weights:
        raise ValueError(f"{' and '.join(weights)} weigh --routing prefix's score; with "
                         f"--routing {a.routing} they would be ignored (drop them, or use "
                         "--routing prefix)")
    model = model_arg(a)
    check_port(a.host, a.port)
    check_slo_args(a)
    limits = connection_limits(a)
    try:
        server = build_router(model, a.decode, a.prefill or [],
                              served_model_name=a.served_model_name, api_key=a.api_key,
                              internal_key=read_internal_key(a.internal_key_file),
                              wait_s=a.wait, max_waiting_requests=a.max_waiting_requests,
                              slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
                              max_request_bytes=parse_memory(a.max_request_size),
                              routing={"routing": a.routing, "prefix_weight": a.prefix_weight,
                                       "load_weight": a.load_weight,
                                       "max_migrations": a.max_migrations,
                                       "stream_deadline": a.stream_deadline,
                                       "admit_timeout": a.admit_timeout,
                                       "discover": a.discover,
                                       "discover_interval": a.discover_interval})
        run(server, host=a.host, port=a.port, shutdown_grace_s=a.shutdown_grace,
            log_level=a.log_level, access_log=not a.no_access_log, limits=limits)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_pd(a: argparse.Namespace) -> int:
    from phasewise.launch.pd import Launcher, PDConfig

    setup_logging(a.log_level)
    if a.disagg_threshold < 0:  # (checked here, not by the worker it would fail to start)
        raise ValueError(f"--disagg-threshold must be >= 0, got {a.disagg_threshold}")
    if a.kv_secret_file is not None:
        from phasewise.launch.serve import read_secret

        read_secret(a.kv_secret_file, "decode")
    if a.pin and a.threads not in (None, 1):
        raise ValueError(f"--pin runs each worker on a core of its own with one thread; "
                         f"--threads {a.threads} cannot apply (leave one of them out)")
    engine = []
    for flag, value in (("--dtype", a.dtype), ("--max-model-len", a.max_model_len),
                        ("--kv-cache-memory", a.kv_cache_memory),
                        ("--max-num-batched-tokens", a.max_num_batched_tokens),
                        ("--max-num-seqs", a.max_num_seqs), ("--kernel-plan", a.kernel_plan),
                        ("--threads", a.threads)):
        if value is not None:
            engine += [flag, str(value)]
    return Launcher(PDConfig(
        model=model_arg(a), host=a.host, port=a.port, decode_port=a.decode_port,
        prefill_port=a.prefill_port, kv_port=a.kv_port, kv_secret_file=a.kv_secret_file,
        disagg_threshold=a.disagg_threshold, api_key=a.api_key, pin=a.pin,
        engine_args=engine, log_level=a.log_level)).run()

