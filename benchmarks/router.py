"""Which router lets a host swap with no client noticing: HAProxy and nginx, side by side, in one run.

Two fake OpenAI servers (tests/testkit/openai_server.py: 20 streamed tokens in ~0.45 s) behind the
router, a steady load of 4 client streams through it, and host-a swapped five times per router: taken
out, its server killed and started again on its port, put back. Counted by the clients: failed
requests, and the p99 of request latency during the swaps.

- HAProxy, as the fleet rollout drives it (tasks/fleet/router.py): `state drain`, wait until its
  stats count nothing in flight on host-a, swap, `state ready`, wait for the health check.
- nginx 1.22 (open source): host-a marked `down` in the upstream and `nginx -s reload`; nginx keeps
  no count of a server's requests in flight that a script can read, so the swap follows the reload
  after a fixed grace (0 s, then 1 s).

Run: `python benchmarks/router.py` (needs `apt-get install haproxy nginx`; 2-3 minutes).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from testkit.openai_server import StreamingServer  # noqa: E402
from testkit.prefect_processes import free_port  # noqa: E402
from testkit.router import SteadyLoad, haproxy  # noqa: E402

from tasks.fleet.router import HAProxy  # noqa: E402

SWAPS = 5


def _host(port: int) -> StreamingServer:
    return StreamingServer(ttft_s=0.05, itl_s=0.02, port=port)


def _swap(servers: dict, port: int) -> None:
    servers["host-a"].__exit__()
    servers["host-a"] = _host(port).__enter__()


NGINX_CONF = """worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    upstream fleet {{
        least_conn;
        server 127.0.0.1:{a}{down};
        server 127.0.0.1:{b};
    }}
    server {{
        listen 127.0.0.1:{front};
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


@contextlib.contextmanager
def _nginx(work: Path, ports: dict, front: int):
    conf = work / "nginx.conf"

    def write(down: bool) -> None:
        conf.write_text(NGINX_CONF.format(work=work, a=ports["host-a"], b=ports["host-b"], front=front,
                                          down=" down" if down else ""))
    write(False)
    subprocess.run(["nginx", "-c", str(conf), "-p", str(work)], check=True)
    try:
        yield lambda down: (write(down), subprocess.run(["nginx", "-c", str(conf), "-p", str(work), "-s", "reload"],
                                                        check=True))
    finally:
        subprocess.run(["nginx", "-c", str(conf), "-p", str(work), "-s", "quit"], check=False)
        time.sleep(1)


def _measure(name: str, front: int, swap_once) -> dict:
    with SteadyLoad(f"http://127.0.0.1:{front}", "fake", streams=4, max_tokens=20) as load:
        time.sleep(2)
        started = time.time()
        for _ in range(SWAPS):
            swap_once()
            time.sleep(1)
        ended = time.time()
    during = load.between(started, ended)
    failed = load.failed_between(started, ended)
    latencies = sorted(r.ended - r.started for r in during if not r.failed)
    p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan")
    return {"router": name, "requests": len(during), "failed": len(failed),
            "p99 latency s": round(p99, 3), "median s": round(statistics.median(latencies), 3)}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ports = {"host-a": free_port(), "host-b": free_port()}
        with contextlib.ExitStack() as stack:
            servers = {name: stack.enter_context(_host(port)) for name, port in ports.items()}
            stack.callback(lambda: servers["host-a"].__exit__())
            front = free_port()
            with haproxy([(n, "127.0.0.1", p) for n, p in ports.items()], work_dir=work, port=front) as router:
                at = HAProxy(router)
                for name in ports:
                    at.admit(name)

                def haproxy_swap() -> None:
                    at.drain("host-a")
                    _swap(servers, ports["host-a"])
                    at.admit("host-a")
                rows.append(_measure("HAProxy: drain, wait for requests in flight, admit", front, haproxy_swap))
            for grace in (0.0, 1.0):
                front = free_port()
                with _nginx(work, ports, front) as reload:
                    time.sleep(1)

                    def nginx_swap(grace=grace) -> None:
                        reload(True)
                        time.sleep(grace)
                        _swap(servers, ports["host-a"])
                        reload(False)
                    rows.append(_measure(f"nginx: upstream down + reload, swap after {grace:g} s", front, nginx_swap))
    width = max(len(r["router"]) for r in rows)
    print(f"{'router':<{width}}  requests  failed  median s  p99 s   ({SWAPS} swaps of host-a under 4 streams)")
    for r in rows:
        print(f"{r['router']:<{width}}  {r['requests']:>8}  {r['failed']:>6}  {r['median s']:>8}  {r['p99 latency s']:>5}")


if __name__ == "__main__":
    main()
