"""The router's part of a rollout against a real HAProxy, with the project's fake OpenAI servers as
hosts and a steady client load through it: a drained host swaps without one failed request; a host
that dies mid-stream is taken out by the health check, and the router counts the requests it cut as
the clients do; a host that serves nothing is kept out, in maintenance."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import numpy as np
import pytest

from tasks.fleet.canary import MIN_REQUESTS, TTFT, Histogram, HostWindow, judge_canary, observe_canary, parse_histograms
from tasks.fleet.hosts import FleetHost
from tasks.fleet.router import HAProxy, RouterRefused, ServerStats, Traffic, rotation
from testkit.openai_server import StreamingServer
from testkit.prefect_processes import free_port
from testkit.router import SteadyLoad, haproxy


def _until(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def _host(port: int, *, itl_s: float = 0.02) -> StreamingServer:
    """A host's server: 20 tokens take ~0.45 s, so some are always in flight under the load."""
    return StreamingServer(ttft_s=0.05, itl_s=itl_s, port=port)


def test_drain_swap_admit_under_load_then_a_host_dies_and_one_serves_nothing(tmp_path):
    ports = {"host-a": free_port(), "host-b": free_port()}
    front = free_port()
    with contextlib.ExitStack() as hosts:
        # host-b's streams last ~2 s: when it is killed, the streams the router saw there are still
        # being sent (with 0.45 s streams, on a loaded machine, they had finished by the kill: CI, stop 43).
        servers = {name: hosts.enter_context(_host(port, itl_s=0.1 if name == "host-b" else 0.02))
                   for name, port in ports.items()}
        router = hosts.enter_context(haproxy([(n, "127.0.0.1", p) for n, p in ports.items()], work_dir=tmp_path,
                                             port=front))
        at = HAProxy(router)
        assert all(at.admit(name).in_rotation for name in ports)

        # Drain, swap, admit, under a steady load: not one request fails.
        with SteadyLoad(f"http://127.0.0.1:{front}", "fake", streams=4, max_tokens=20) as load:
            _until(lambda: len(load.requests) > 20)
            before = at.read()
            with at.out_of_rotation("host-a") as spell:  # no new requests; those in flight finish first
                assert at.server("host-a").status == "DRAIN" and at.server("host-a").current == 0
                assert spell.drained_s < 5 and spell.admitted is None
                servers["host-a"].__exit__()  # the swap: the old server stops, the next one starts on its port
                servers["host-a"] = hosts.enter_context(_host(ports["host-a"]))
            assert spell.admitted.in_rotation and rotation(spell.admitted) == "in rotation"
            served = at.server("host-a").requests
            _until(lambda: at.server("host-a").requests > served + 5)  # it takes its share again
            after = at.read()
        traffic = Traffic.between(before, after, frontend=True)
        seen = load.between(before.at, after.at)
        assert [r.error for r in load.failed_between(before.at, after.at)] == [] and traffic.failed == 0
        assert abs(traffic.requests - len(seen)) <= 4  # the requests in flight at either reading
        assert traffic.out_of_rotation == ()

        # A host dies mid-stream: the router's health check takes it out within ~1 s, and its count
        # of the requests cut is the clients' count.
        with SteadyLoad(f"http://127.0.0.1:{front}", "fake", streams=4, max_tokens=20) as load:
            _until(lambda: len(load.requests) > 20)
            before = at.read()
            _until(lambda: at.server("host-b").current >= 1)  # streams in flight there
            servers["host-b"].__exit__()  # kill -9
            _until(lambda: at.server("host-b").status == "DOWN", timeout_s=5)
            settled = len(load.requests)
            _until(lambda: len(load.requests) > settled + 10)
            after = at.read()
        traffic = Traffic.between(before, after, frontend=True)
        failed = load.failed_between(before.at, after.at)
        assert 1 <= len(failed) <= 4 and traffic.failed == len(failed), (traffic, [r.error for r in failed])
        assert traffic.out_of_rotation == ("host-b",)

        # Admitted with nothing serving, after a deploy that failed: the health check keeps it out,
        # and maintenance keeps it there.
        with pytest.raises(RuntimeError), HAProxy(router.model_copy(update={"admit_timeout_s": 3})).out_of_rotation(
                "host-b") as spell:
            raise RuntimeError("the deploy failed")
        kept_out = spell.admitted
        assert kept_out.status == "MAINT" and not kept_out.in_rotation
        assert rotation(kept_out) == "out of rotation: it failed the router's health check, kept in maintenance"


def _histogram(values: list[float]) -> Histogram:
    """What vLLM's /metrics would show for these latencies, in its TTFT buckets."""
    lines = []
    for bound in TTFT_BOUNDS + ["+Inf"]:
        le = float(bound)
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{bound}",model_name="m"}} '
                     f"{sum(v <= le for v in values)}.0")
    lines += [f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {sum(values)}',
              f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {len(values)}.0']
    return parse_histograms("\n".join(lines))[TTFT]


TTFT_BOUNDS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5"]


def _window(name: str, values: list[float], requests: int = 100, failed: int = 0) -> HostWindow:
    def stats(n: int, f: int) -> ServerStats:
        return ServerStats(name, status="UP", current=0, queued=0, requests=n, responses_5xx=f, cut_by_server=0,
                           connect_errors=0, response_errors=0, weight=100, mean_response_ms=0, mean_total_ms=0)
    return HostWindow(name, latency_start={}, latency_end={TTFT: _histogram(values)}, router_start=stats(0, 0),
                      router_end=stats(requests, failed))


def test_the_canary_rule_fails_a_slower_canary_and_not_one_like_the_rest():
    rng = np.random.default_rng(7)

    def draw(scale: float, n: int = 60) -> list[float]:
        return list(rng.lognormal(np.log(0.03 * scale), 0.4, n))

    slower = judge_canary(_window("a", draw(2.0)), [_window("b", draw(1.0)), _window("c", draw(1.0))],
                          max_slowdown=0.2)
    assert not slower.passed and "outside the noise" in slower.findings[0], slower.findings
    assert slower.findings[1].startswith("TPOT not judged: 0 requests at the canary")
    # Alike: across 200 canaries drawn like the rest, the rule fails none at this bar.
    alarms = sum(not judge_canary(_window("a", draw(1.0)), [_window("b", draw(1.0))], max_slowdown=0.2).passed
                 for _ in range(200))
    assert alarms == 0
    # A canary whose requests fail where the rest's do not; too few requests to judge a latency.
    erring = judge_canary(_window("a", draw(1.0), failed=6), [_window("b", draw(1.0))], max_slowdown=0.2)
    assert not erring.passed and erring.findings[-1] == ("errors 6 of 100 vs the rest's 0 of 100 (above the rest's "
                                                         "beyond chance)")
    few = judge_canary(_window("a", draw(3.0, n=5)), [_window("b", draw(1.0))], max_slowdown=0.2)
    assert few.passed and few.findings[0].startswith("TTFT not judged: 5 requests at the canary")


def test_a_canary_window_with_too_few_requests_is_held_open_until_it_can_judge(tmp_path):
    # A window that ends with a handful of requests at the canary judges nothing; it is held open,
    # up to three times its length, until the canary has answered enough to judge.
    ports = {"host-a": free_port(), "host-b": free_port()}
    front = free_port()
    with contextlib.ExitStack() as hosts:
        for port in ports.values():
            hosts.enter_context(StreamingServer(ttft_s=0.005, itl_s=0.001, port=port))
        router = hosts.enter_context(haproxy([(n, "127.0.0.1", p) for n, p in ports.items()], work_dir=tmp_path,
                                             port=front))
        at = HAProxy(router)
        assert all(at.admit(name).in_rotation for name in ports)
        window = router.model_copy(update={"canary_window_s": 2.0, "canary_share_percent": 100})
        canary, rest = (FleetHost(name=n, port=p, address="127.0.0.1") for n, p in ports.items())
        judged: list = []
        observer = threading.Thread(target=lambda: judged.append(observe_canary(window, canary, [rest], poll_s=0.2)))
        began = time.monotonic()
        observer.start()

        def ask() -> None:
            reply = httpx.post(f"http://127.0.0.1:{front}/v1/completions", timeout=10,
                               json={"model": "fake", "prompt": "1 2", "max_tokens": 2})
            assert reply.status_code == 200

        for _ in range(10):  # quiet traffic during the window: about 5 requests at the canary
            ask()
        while observer.is_alive() and time.monotonic() - began < 2.5:
            time.sleep(0.05)
        while observer.is_alive():  # then traffic again, for as long as the canary is observed
            ask()
        observer.join()
    verdict, = judged
    assert verdict.requests >= MIN_REQUESTS, verdict.summary()
    assert 2.0 < verdict.extended_to_s < 3 * 2.0 and "window held open to" in verdict.summary()


def test_a_command_the_router_refuses_is_one_clear_line_and_one_it_takes_is_not(tmp_path):
    port = free_port()
    with _host(port), haproxy([("host-a", "127.0.0.1", port)], work_dir=tmp_path, port=free_port()) as router:
        at = HAProxy(router)
        assert at.admit("host-a").in_rotation
        at.set_weight("host-a", 50)  # taken: no error
        assert at.server("host-a").weight == 50
        for refused, said in [(lambda: at.set_weight("host-z", 50), "No such server."),
                              (lambda: at.set_state("host-a", "half-open"), "'set server <srv> state' expects"),
                              (lambda: at.ask("enable agent fleet/host-a"), "Agent was not configured"),
                              (lambda: at.ask("set server fleet/host-a addr 1.2.3"), "Invalid addr '1.2.3'"),
                              (lambda: at.ask("frobnicate"), "Unknown command")]:
            with pytest.raises(RouterRefused) as err:
                refused()
            assert said in str(err.value) and "\n" not in str(err.value), err.value
    # A router whose servers keep HAProxy's default weight (1): half of it is 0, no traffic at all.
    # The canary's share is refused, and its weight is left whole.
    (tmp_path / "weight-1").mkdir()
    with _host(port), haproxy([("host-a", "127.0.0.1", port)], work_dir=tmp_path / "weight-1", port=free_port(),
                              edit=lambda cfg: cfg.replace(" weight 100", "")) as router:
        at = HAProxy(router)
        assert at.admit("host-a").in_rotation
        with pytest.raises(RouterRefused, match="50% of server fleet/host-a's configured weight is 0"):
            at.set_weight("host-a", 50)
        assert at.server("host-a").in_rotation and at.server("host-a").user_weight == 1
