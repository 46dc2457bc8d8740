"""Bounded loopback load test of ``vlkv serve``: throughput, TTFT / time-per-output-token p50 and p99,
lost answers, server restarts; one server per policy at the same ``--pool-bytes``.

Each run starts ``python -m vlkv.serve`` on 127.0.0.1 (a free port), sends ``--requests`` streaming
chat requests at ``--concurrency`` (every ``1/--malformed``-th one malformed, cycling through kinds
that must get a 4xx), stops by itself (request count and ``--time-limit``), then stops the server
with SIGTERM. A good request counts as *answered* only if its stream ends with ``[DONE]`` after
exactly ``max_tokens`` tokens (``ignore_eos``); anything else is *lost*. TTFT and TPOT are measured
by the client (request sent → first token; (last − first token) / (tokens − 1)).

    python scripts/bench_serve.py --model tiny-llava --policies full snapkv:0.25 --pool-bytes 1048576 \\
        --requests 200 --concurrency 8 --out docs/benchmarks/serve-tiny-llava-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from bench_common import add_device_args, check_device_args, torch_dtype  # scripts/ is sys.path[0]

START_S = 300.0
STOP_S = 60.0


def _png(seed: int, size: int = 64) -> str:
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- requests
def good_body(model: str, i: int, args, image: str) -> dict:
    text = f"Request {i}. " + "Describe every detail of the picture, one by one. " * args.prompt_repeat
    content = [{"type": "text", "text": text}]
    if i % 2 == 0:  # half the requests carry an image
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:  # vLLM's extra field; transformers serve refuses it
        body["ignore_eos"] = True
    return body


def bad_body(model: str, i: int, args) -> tuple[str, bytes]:
    good = json.loads(json.dumps(good_body(model, i, args, "x")))
    good["messages"][0]["content"] = "hi"
    kinds = [
        ("bad json", b'{"model": "' + model.encode() + b'", "messages": ['),
        ("wrong type", {**good, "max_tokens": "many"}),
        ("unknown policy", {**good, "vlkv": {"policy": "nope"}}),
        ("budget out of range", {**good, "vlkv": {"policy": "snapkv", "budget": 7}}),
        ("broken base64", {**good, "messages": [_image_msg("data:image/png;base64,%%%")]}),
        (
            "not an image",
            {**good, "messages": [_image_msg("data:image/png;base64," + base64.b64encode(b"no").decode())]},
        ),
        ("unknown model", {**good, "model": "gpt-9"}),
        ("too many tokens", {**good, "max_tokens": 10**6}),
    ]
    name, body = kinds[(i // 10) % len(kinds)]
    return name, body if isinstance(body, bytes) else json.dumps(body).encode()


def _image_msg(url: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}],
    }


def _content(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


async def one_good(client: httpx.AsyncClient, url: str, body: dict, deadline: float, peer: bool) -> dict:
    t0 = time.perf_counter()
    times, tokens, done, status, error, usage = [], 0, False, None, None, None
    finished = False  # a finish_reason was sent (transformers serve ends its stream there, without [DONE])
    for _ in range(5):  # 429/503 are retried after Retry-After; they are overload answers, not losses
        try:
            async with client.stream(
                "POST", url, json=body, timeout=max(1.0, deadline - time.monotonic())
            ) as r:
                status = r.status_code
                if status in (429, 503):
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if status != 200:
                    error = (await r.aread()).decode()[:200]
                    break
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        error = f"unparsable SSE line: {data[:80]!r}"
                        continue
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                        continue
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for ch in chunk["choices"]:
                        finished = finished or ch.get("finish_reason") is not None
                        # vlkv sends token_ids; a peer only text: count its content chunks
                        n = len(ch["token_ids"]) if "token_ids" in ch else int(bool(_content(ch)))
                        if n:
                            times.extend([time.perf_counter()] * n)
                            tokens += n
            break
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}"
            break
    if usage is not None:  # the server's own count (a peer's chunks may hold several tokens)
        tokens = usage
    complete = tokens == body["max_tokens"] if body.get("ignore_eos") else tokens >= 1
    ok = (done or finished) and error is None and complete
    out = {"ok": ok, "status": status, "tokens": tokens, "error": error, "done_marker": done}
    if ok:
        out["ttft"] = times[0] - t0
        out["tpot"] = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
        out["latency"] = times[-1] - t0
    return out


async def one_bad(client: httpx.AsyncClient, url: str, name: str, body: bytes) -> dict:
    try:
        r = await client.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError as err:
        return {"kind": name, "ok": False, "status": None, "error": str(err)}
    msg = (
        r.json().get("error", {}).get("message", "")
        if r.headers.get("content-type", "").startswith("application/json")
        else ""
    )
    ok = 400 <= r.status_code < 500 and r.status_code != 429 and msg and "\n" not in msg
    return {"kind": name, "ok": bool(ok), "status": r.status_code, "error": None if ok else r.text[:200]}


async def load(base: str, model: str, args, peer: bool = False) -> tuple[list[dict], list[dict], float]:
    url = f"{base}/v1/chat/completions"
    image = _png(0)
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.time_limit
    every = round(1 / args.malformed) if args.malformed > 0 else 0
    good, bad = [], []

    async def run(i: int, client):
        async with sem:
            if time.monotonic() > deadline:
                return
            if every and i % every == every - 1:
                bad.append(await one_bad(client, url, *bad_body(model, i, args)))
            else:
                good.append(await one_good(client, url, good_body(model, i, args, image), deadline, peer))

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i, client) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    return good, bad, wall


async def sample_metrics(base: str, stop: asyncio.Event, out: dict) -> None:
    """Poll /metrics every 0.2 s for the peak pool bytes and running requests."""
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            try:
                text = (await client.get(f"{base}/metrics", timeout=5)).text
                for name in ("vlkv_pool_used_bytes", "vlkv_running_requests", "vlkv_swapped_requests"):
                    m = re.search(rf"^{name} (\S+)$", text, re.M)
                    if m:
                        out[name] = max(out.get(name, 0.0), float(m.group(1)))
                for name in ("vlkv_pool_total_bytes", "vlkv_max_running_requests", "vlkv_decode_steps"):
                    m = re.search(rf"^{name} (\S+)$", text, re.M)
                    if m:
                        out[name] = float(m.group(1))
            except httpx.HTTPError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


# ---------------------------------------------------------------------- one server per policy
def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), contention-independent work measure."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_policy(policy: str, args) -> dict:
    name, _, budget = policy.partition(":")
    port = _free_port()
    peer = name == "peer"
    if peer:  # another OpenAI server, e.g. `transformers serve DIR --port {port}`
        cmd, model_id = shlex.split(args.peer_cmd.format(port=port)), args.peer_model
    else:
        cmd = [args.python, "-m", "vlkv.serve", "--model", args.model, "--port", str(port)]
        cmd += ["--log-level", "warning", "--policy", name, "--max-tokens", str(args.max_tokens)]
        cmd += ["--device", args.device]
        cmd += ["--max-queue", str(args.requests), "--request-timeout", str(args.time_limit)]
        cmd += ["--budget", budget] if budget else []
        cmd += ["--pool-bytes", str(args.pool_bytes)] if args.pool_bytes else []
        model_id = args.model
    log = Path(tempfile.gettempdir()) / f"bench_serve-{port}.log"
    with open(log, "wb") as f:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t_start = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}: {log.read_text()[-1500:]}")
            if time.monotonic() - t_start > START_S:
                raise SystemExit(f"server not healthy within {START_S} s")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pid = proc.pid

        async def main():
            stop, peaks = asyncio.Event(), {}
            sampler = asyncio.create_task(sample_metrics(base, stop, peaks))
            result = await load(base, model_id, args, peer)
            stop.set()
            await sampler
            return (*result, peaks)

        load0, cpu0 = os.getloadavg()[0], _cpu_s(pid)
        good, bad, wall, peaks = asyncio.run(main())
        cpu, load1 = _cpu_s(pid) - cpu0, os.getloadavg()[0]
        healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
        restarts = 0 if (proc.poll() is None and proc.pid == pid and healthy) else 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(10)
    answered = [g for g in good if g["ok"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    ttft = [g["ttft"] for g in answered]
    tpot = [g["tpot"] for g in answered if g["tpot"] is not None]
    return {
        "policy": policy,
        "good": len(good),
        "answered": len(answered),
        "lost": len(good) - len(answered),
        "lost_examples": [g["error"] for g in good if not g["ok"]][:3],
        "without_done_marker": sum(not g["done_marker"] for g in answered),
        "malformed": len(bad),
        "malformed_4xx": sum(b["ok"] for b in bad),
        "malformed_wrong": [b for b in bad if not b["ok"]][:3],
        "restarts": restarts,
        "exit_code": rc,
        "wall_s": wall,
        "req_per_s": len(answered) / wall,
        "tok_per_s": sum(g["tokens"] for g in answered) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "peak_pool_bytes": peaks.get("vlkv_pool_used_bytes"),
        "pool_bytes": peaks.get("vlkv_pool_total_bytes"),
        "peak_running": peaks.get("vlkv_running_requests"),
        "max_running": peaks.get("vlkv_max_running_requests"),
        "peak_swapped": peaks.get("vlkv_swapped_requests"),
        "server_cpu_s": cpu,
        "cpu_ms_per_token": 1e3 * cpu / max(1, sum(g["tokens"] for g in answered)),
        "loadavg_start_end": [load0, load1],
    }


def _pool(r: dict, args) -> str:
    if r["peak_pool_bytes"] is None:
        return "n/a"
    total = f"{args.pool_bytes / 2**10:.0f} KiB" if args.pool_bytes else "the default fixed pool"
    return f"{r['peak_pool_bytes'] / 2**10:.0f} KiB of {total}"


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(rows: list[dict], args) -> str:
    head = (
        "| policy | answered / good | lost | malformed → 4xx | restarts | req/s | tok/s | TTFT p50 / p99 (s) "
        "| TPOT p50 / p99 (ms) | server CPU ms/token | most running | peak pool used | load avg |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['policy']} | {r['answered']} / {r['good']} | {r['lost']} | {r['malformed_4xx']} / {r['malformed']} "
        f"| {r['restarts']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} "
        f"| {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} | {r['cpu_ms_per_token']:.1f} "
        f"| {_num(r['max_running'], '.0f')} "
        f"| {_pool(r, args)} "
        f"| {r['loadavg_start_end'][0]:.1f} → {r['loadavg_start_end'][1]:.1f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def _portable(value):
    """An argument as a report may record it: absolute paths become their last component (the
    machine's directories say nothing about the measurement)."""
    if not isinstance(value, str):
        return value
    return " ".join(Path(w).name if os.path.isabs(w) else w for w in value.split(" "))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llava")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the server")
    p.add_argument(
        "--policies",
        nargs="+",
        default=["full", "snapkv:0.25"],
        help="NAME, NAME:BUDGET, or 'peer' (needs --peer-cmd)",
    )
    p.add_argument("--peer-cmd", default=None, help="command starting a peer server ('{port}' filled in)")
    p.add_argument("--peer-model", default=None, help="model id the peer serves")
    p.add_argument("--pool-bytes", type=int, default=1 << 20)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--malformed", type=float, default=0.1, help="fraction of malformed requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let answers stop at eos (for peers without ignore_eos; greedy answers on the same weights "
        "still have equal lengths)",
    )
    p.add_argument(
        "--prompt-repeat", type=int, default=4, help="sentence repeats in each prompt (its length)"
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds before the load stops itself")
    p.add_argument("--out", default=None, help="markdown report (a JSON twin is written beside it)")
    add_device_args(p)
    args = p.parse_args(argv)
    check_device_args(p, args)
    if torch_dtype(args.dtype) != torch_dtype("fp32"):
        p.error(f"--dtype {args.dtype}: the vlkv server loads its model in fp32 (it has no dtype option yet)")
    rows = []
    for policy in args.policies:
        row = run_policy(policy, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = markdown(rows, args)
    print(table)
    if args.out:
        meta = {
            "machine": f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.platform()}",
            "args": {k: _portable(v) for k, v in vars(args).items()},
            "rows": rows,
        }
        Path(args.out).with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
        cmd = "python scripts/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.out).write_text(f"<!-- {meta['machine']} -->\n`{cmd}`\n\n{table}")
    return 0 if all(r["lost"] == 0 and r["restarts"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
