"""API latency under 100 concurrent clients on loopback: GET /api/runs/{id} and the timeline.

Starts `corral serve` as its own process (SQLite by default, or --database-url), creates a simulated
run with the built-in trainer so the run keeps changing while it is read, lets it deliver a few
batches, then runs `--clients` concurrent clients (asyncio, one keep-alive connection each, raw
HTTP/1.1 so the load generator costs little CPU), each making `--requests` sequential requests to one
endpoint, back to back or every `--interval` seconds. Prints p50, p90, p99 and the request rate per
endpoint. Target: p99 < 50 ms for the run view.

    python -m benchmarks.api_latency [--clients 100] [--requests 20] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "bench-operator-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


async def _client(
    url: str, path: str, requests: int, interval_s: float, out: list[float], errors: list[int]
) -> None:
    """One keep-alive connection speaking raw HTTP/1.1: a client this light keeps the measurement on
    the server (httpx costs about a millisecond of client CPU per request)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n\r\n".encode()
    try:
        for _ in range(requests):
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            took = time.perf_counter() - start
            out.append(took)
            if status != 200:
                errors.append(status)
            if interval_s > took:
                await asyncio.sleep(interval_s - took)
    finally:
        writer.close()
        await writer.wait_closed()


async def _measure(
    url: str, path: str, clients: int, requests: int, interval_s: float
) -> tuple[list[float], list[int], float]:
    latencies: list[float] = []
    errors: list[int] = []
    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(clients):
            if interval_s:
                await asyncio.sleep(interval_s / clients)  # spread the pollers over the interval
            tg.create_task(_client(url, path, requests, interval_s, latencies, errors))
    return latencies, errors, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20, help="sequential requests per client")
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in a temp dir")
    parser.add_argument("--timeline-limit", type=int, default=200, help="events per timeline page")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds between one client's requests (0: each client asks again as soon as answered)",
    )
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": args.database_url or f"sqlite:///{tmp / 'corral.db'}",
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp / "data"),
    }
    log = (tmp / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-c", "from app.cli import main; main()", "serve"], env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"corral serve did not start; see {tmp / 'serve.log'}")
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        spec = {"name": "bench", "kind": "sim", "speed": 2.0, "trainer": "sentinel", "sentinel_step_s": 0.1}
        run_id = httpx.post(f"{url}/api/runs", json=spec, headers=headers, timeout=30).json()["id"]
        while httpx.get(f"{url}/api/runs/{run_id}", timeout=10).json()["live"]["batches"] < 3:
            time.sleep(0.2)
        events = httpx.get(f"{url}/api/runs/{run_id}", timeout=10).json()["live"]["events"]
        print(
            f"corral serve on {url} ({env['CORRAL_DATABASE_URL'].split(':')[0]}), run {run_id} live with "
            f"{events} events"
        )
        idle_cpu = _cpu_s(server.pid)
        time.sleep(2.0)
        idle_rate = (_cpu_s(server.pid) - idle_cpu) / 2.0
        pace = f"every {args.interval:g} s" if args.interval else "back to back"
        print(
            f"{args.clients} clients, {args.requests} requests each, {pace}; server CPU with no request "
            f"(the run itself) {idle_rate:.2f} cores; machine load {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs"
        )
        print(
            "| endpoint | requests | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) | requests/s | errors "
            "| server CPU per request (ms) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        endpoints = [
            ("GET /api/runs/{id}", f"/api/runs/{run_id}"),
            (f"GET /api/runs/{{id}}/timeline?limit={args.timeline_limit}",
             f"/api/runs/{run_id}/timeline?limit={args.timeline_limit}"),
        ]  # fmt: skip
        for label, path in endpoints:
            asyncio.run(_measure(url, path, 10, 2, 0.0))  # warm up
            cpu = _cpu_s(server.pid)
            latencies, errors, wall = asyncio.run(
                _measure(url, path, args.clients, args.requests, args.interval)
            )
            per_request = ((_cpu_s(server.pid) - cpu) - idle_rate * wall) / len(latencies) * 1000
            ms = [x * 1000 for x in latencies]
            print(
                f"| {label} | {len(ms)} | {statistics.median(ms):.1f} | {_quantile(ms, 0.9):.1f} "
                f"| {_quantile(ms, 0.99):.1f} | {max(ms):.1f} | {len(ms) / wall:.0f} | {len(errors)} "
                f"| {per_request:.2f} |"
            )
        httpx.post(f"{url}/api/runs/{run_id}/stop", headers=headers, timeout=30)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
