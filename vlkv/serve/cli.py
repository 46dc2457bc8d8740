"""``vlkv serve``: parse the options, load the model, start the engine thread and uvicorn.

Wired into ``vlkv`` by ``add_serve_parser(sub)`` in :func:`vlkv.cli.build_parser`; ``python -m
vlkv.serve`` runs it alone. Nothing heavy is imported until the command runs, so ``vlkv generate``
never needs the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import sys

from vlkv.runtime.link.spec import PICKS

SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny-llava", help="built-in name or local HF directory (default: tiny-llava)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--pool-bytes", type=int, default=None, help="fixed KV pool in bytes (default: --kv-memory-fraction)"
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="share in (0, 1] of the memory free once the model is loaded that the fixed KV pool takes "
        "(default 0.5, capped at --max-running requests of the model's position limit)",
    )
    p.add_argument(
        "--allowed-media-dir", default=None, help="local image files are read only under this directory"
    )
    p.add_argument("--max-body-bytes", type=int, default=32 * 2**20, help="largest request body (413 above)")
    p.add_argument("--max-images", type=int, default=8, help="most images per request")
    p.add_argument("--max-image-bytes", type=int, default=16 * 2**20, help="largest encoded image")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="largest max_tokens a request may ask (and the chat default)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="most requests waiting for prefill; more get 429 + Retry-After",
    )
    p.add_argument("--max-running", type=int, default=256, help="most requests decoded together")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled (504)"
    )
    p.add_argument("--policy", default="full", help="KV policy of requests whose vlkv field names none")
    p.add_argument("--budget", type=float, default=None, help="budget of --policy (default: the CLI's)")
    p.add_argument("--backend", default="torch", help="torch or onnxruntime (default: torch)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay decode steps (plain and statistics ones) as a CUDA graph per batch size (CUDA, torch "
        "backend; the server's pool is fixed; experimental: off until a GPU run has measured it)",
    )
    p.add_argument(
        "--store",
        default=None,
        help="context store shared by requests (and replicas): a directory, redis://host:port/db or mooncake://...",
    )
    p.add_argument(
        "--link", default="none", help="default link method: none, prefix, full-reuse, cacheblend or mpic"
    )
    p.add_argument("--link-k", type=int, default=32, help="MPIC: leading tokens of each image to recompute")
    p.add_argument("--link-pick", choices=PICKS, help="MPIC: each image's first k tokens (default) or a ramp")
    p.add_argument("--link-r", type=float, help="CacheBlend: fraction of image tokens to recompute (0.15)")
    p.add_argument("--link-deviation", help="CacheBlend: deviation checked, k (default) or v")
    p.add_argument("--store-budget", type=float, help="share of an image's entries new records keep (0, 1]")
    p.add_argument("--store-scorer", help="how a compressed record picks its entries (default keynorm)")
    p.add_argument(
        "--store-rank", type=int, help="store new records' K/V as rank-R factors (default 0: dense)"
    )
    p.add_argument(
        "--link-threshold",
        type=float,
        default=None,
        help="refuse linking when the model's saved link-check agreement is below this, in [0, 1] (default 0.9)",
    )
    p.add_argument(
        "--encode-workers",
        type=int,
        default=0,
        help="processes that tokenize and preprocess prompts (default 0: the request handlers' threads, "
        "which measured the smaller gaps in running streams on a 2-core CPU: the images' pickling costs "
        "the engine process more than the GIL does; try 1 or more on machines with spare cores)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to ``vlkv``'s subcommands (``subparsers`` from ``add_subparsers``)."""
    p = subparsers.add_parser("serve", help="serve the OpenAI API (chat, completions) over the scheduler")
    _add_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def _check_extra() -> None:
    import importlib.util

    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"vlkv serve needs {', '.join(missing)}: pip install 'vlkv[serve]'")


def listen_socket(host: str, port: int):
    """A TCP socket bound to ``host:port`` (uvicorn listens on it); one-line ``ValueError`` when the
    host does not resolve to an address of this machine or the port is taken."""
    import errno
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"--host {host!r} is not an address to listen on ({why})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    try:
        sock.bind(addr)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port} is already in use on {host}: pick another port") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host!r} is not an address of this machine") from None
        if err.errno == errno.EACCES:
            raise ValueError(f"--port {port} needs privileges on {host}: use a port above 1023") from None
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    _check_extra()
    from vlkv.runtime.device import resolve_device
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.policies.settings import default_budget
    from vlkv.serve.config import ServeConfig

    cfg = ServeConfig(
        model=args.model,
        pool_bytes=args.pool_bytes,
        kv_memory_fraction=args.kv_memory_fraction,
        allowed_media_dir=args.allowed_media_dir,
        max_body_bytes=args.max_body_bytes,
        max_images=args.max_images,
        max_image_bytes=args.max_image_bytes,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        max_running=args.max_running,
        request_timeout_s=args.request_timeout,
        policy=args.policy,
        budget=args.budget,
        store=args.store,
        link=args.link,
        link_k=args.link_k,
        link_pick=args.link_pick,
        link_r=args.link_r,
        link_deviation=args.link_deviation,
        store_budget=args.store_budget,
        store_scorer=args.store_scorer,
        store_rank=args.store_rank,
        link_threshold=args.link_threshold,
    )
    budget = {"budget": cfg.budget} if cfg.budget is not None else default_budget(cfg.policy)
    make_policy(cfg.policy, **budget)  # refuse a bad default now
    if not (isinstance(args.encode_workers, int) and args.encode_workers >= 0):
        raise ValueError(f"--encode-workers must be an integer >= 0, got {args.encode_workers}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    device = resolve_device(args.device)
    check_cuda_graph(args, device)
    sock = listen_socket(args.host, args.port)  # a taken port or a bad host fails here, not after the banner
    try:
        return _serve(args, cfg, device, sock)
    finally:
        sock.close()


def check_cuda_graph(args, device) -> None:
    """``--cuda-graph`` needs a CUDA device and the torch backend (one-line ``ValueError`` before the model
    loads, as ``vlkv generate`` refuses it); the server's pool is always fixed, as a graph needs."""
    if args.cuda_graph:
        from vlkv.runtime.cuda_graph import cli_refusal

        why = cli_refusal(device, args.backend)
        if why is not None:
            raise ValueError(why)


def build_scheduler(cfg, engine, store=None):
    """The server's :class:`~vlkv.runtime.scheduler.Scheduler` over a fixed pool (``--pool-bytes``, or
    ``--kv-memory-fraction`` of the memory free now, after the model is loaded), and its
    :class:`~vlkv.runtime.kv.sizing.PoolSize`."""
    from vlkv.runtime.kv.pool import PoolSpec
    from vlkv.runtime.kv.sizing import free_memory_bytes
    from vlkv.runtime.limits import position_limit
    from vlkv.runtime.scheduler import Scheduler

    spec = PoolSpec.for_backend(engine.backend)
    size = cfg.fixed_pool(spec, free_memory_bytes(spec.device), position_limit(engine.loaded))
    sched = Scheduler(
        engine, size.nbytes, max_running=cfg.max_running, store=store, link_threshold=cfg.link_threshold
    )
    return sched, size


def _serve(args, cfg, device, sock) -> int:
    """Load the model, start the engine thread and uvicorn on ``sock`` (bound by :func:`listen_socket`)."""
    import uvicorn

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.limits import position_limit
    from vlkv.runtime.models.registry import load_model
    from vlkv.serve.app import ServerState, create_app
    from vlkv.serve.engine_loop import EngineLoop
    from vlkv.serve.metrics import ServeMetrics

    loaded = load_model(args.model, device=str(device))
    engine = Engine(loaded, backend=args.backend, decode_graph=args.cuda_graph)
    store = None
    if cfg.store is not None:
        from vlkv.runtime.store.url import open_store

        store = open_store(cfg.store)
    scheduler, size = build_scheduler(cfg, engine, store)
    metrics = ServeMetrics(args.model)
    encoder = None
    if args.encode_workers:
        from vlkv.runtime.encoder_pool import EncoderPool

        # started and warmed before the banner (a worker that cannot start fails here, not a request)
        encoder = EncoderPool(loaded.processor, args.encode_workers, timeout_s=cfg.request_timeout_s)
        encoder.warm()
        from PIL import Image

        from vlkv.runtime.prompt import Prompt

        # one image too: the image processor's code paths load on their first image, not a request's
        engine.encode([Prompt("warm up", [Image.new("RGB", (64, 64))])], process=encoder.process)
    state = ServerState(
        cfg,
        engine,
        EngineLoop(scheduler, metrics),
        metrics,
        args.model,
        position_limit(loaded),
        encoder=encoder,
    )
    app = create_app(state)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: refuse new work, drain in-flight, exit
            state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after its drain; exit 0 instead (a clean stop)
            captured = getattr(self, "_captured_signals", None)
            if captured:
                captured.clear()

    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(cfg.request_timeout_s) + 5,
        )
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"vlkv serve: {args.model} on http://{shown}:{port}; {size.describe()}", file=sys.stderr, flush=True
    )
    try:
        server.run(sockets=[sock])
    finally:
        if encoder is not None:  # idempotent: the app's shutdown stops it too
            encoder.shutdown()
    if state.loop.fatal:
        print(f"vlkv serve: the engine thread died: {state.loop.fatal}", file=sys.stderr)
        return 1
    print("vlkv serve: stopped (in-flight requests drained)", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from vlkv.cli_common import OneLineParser as _Parser
    from vlkv.cli_common import run_command

    parser = _Parser(prog="vlkv serve", description="OpenAI-compatible server over the vlkv scheduler")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(cmd_serve, args)
