"""benchmarks/serving_bench.py without an engine: the commands it gives each engine's server and
benchmark client, how it reads both clients' results, and the whole sweep against stand-ins (a
stub HTTP server, a stub client writing the engine's JSON): start, health, one client run per rate,
the table's ratios, the server stopped, failures reported per row."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).parents[1] / "benchmarks" / "serving_bench.py"


@pytest.fixture(scope="module")
def sb():
    spec = importlib.util.spec_from_file_location("oscar_serving_bench", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def _args(sb, engine: str, tmp_path: Path, *extra: str):  # noqa: ANN001, ANN202
    import argparse

    return argparse.Namespace(
        engine=engine, model="/m", rotations="/r.st", tokenizer="/tok", out=str(tmp_path), seed=3,
        server_args=list(extra), startup_timeout=30.0,
    )  # fmt: skip


def test_server_commands_per_engine_and_case(sb, tmp_path):
    a = _args(sb, "vllm", tmp_path, "--load-format", "dummy")
    oscar = sb.server_case("vllm", "oscar", a, 8101)
    assert oscar.command[:6] == ["oscar", "serve", "--engine", "vllm", "/m", "--rotations"]
    assert oscar.command[-2:] == ["--load-format", "dummy"] and "--tokenizer" in oscar.command
    # vLLM's CLI as a module (the staged GPU tree has no ``vllm`` script on PATH)
    assert sb.server_case("vllm", "bf16", a, 8100).command[1:5] == [
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        "/m",
    ]
    a = _args(sb, "sglang", tmp_path)
    bf16 = sb.server_case("sglang", "bf16", a, 8100)
    assert bf16.env["SGLANG_PLUGINS"] == "none" and bf16.health == "/health_generate"
    assert bf16.command[bf16.command.index("--attention-backend") + 1] == "triton"
    oscar = sb.server_case("sglang", "oscar", a, 8101)
    assert oscar.env["SGLANG_PLUGINS"] == "oscar" and "--tokenizer-path" in oscar.command
    assert "OSCAR_ROTATIONS" not in oscar.env  # the command line carries the artifact


def test_client_commands_carry_the_workload_and_rate(sb, tmp_path):
    w = sb.Workload.parse("qa:32768:512:32")
    a = _args(sb, "vllm", tmp_path)
    case = sb.server_case("vllm", "oscar", a, 8101)
    cmd = sb.client_command("vllm", case, a, w, math.inf, tmp_path / "x.json")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "bench", "serve"] and "--ignore-eos" in cmd
    want = {"--random-input-len": "32768", "--random-output-len": "512", "--num-prompts": "32",
            "--request-rate": "inf", "--base-url": "http://127.0.0.1:8101", "--result-filename": "x.json",
            "--tokenizer": "/tok"}  # fmt: skip
    for flag, value in want.items():
        assert cmd[cmd.index(flag) + 1] == value, flag
    a = _args(sb, "sglang", tmp_path)
    cmd = sb.client_command(
        "sglang", sb.server_case("sglang", "bf16", a, 8100), a, w, 0.5, tmp_path / "y.jsonl"
    )
    assert cmd[1:3] == ["-m", "sglang.bench_serving"] and cmd[cmd.index("--request-rate") + 1] == "0.5"
    assert cmd[cmd.index("--output-file") + 1] == str(tmp_path / "y.jsonl")


@pytest.mark.parametrize("bad", ["qa:1:2", "qa:x:2:3", "qa:0:2:3", ":1:2:3"])
def test_bad_workloads_and_rates_are_one_line_errors(sb, bad):
    with pytest.raises(SystemExit, match="--workload"):
        sb.Workload.parse(bad)
    with pytest.raises(SystemExit, match="--rates"):
        sb.parse_rates("1,fast")
    with pytest.raises(SystemExit, match="--rates"):
        sb.parse_rates("0")


def test_reads_both_clients_results(sb, tmp_path):
    vllm = tmp_path / "v.json"
    vllm.write_text(
        json.dumps({"completed": 8, "output_throughput": 120.5, "p99_tpot_ms": 9.0, "ttfts": [1]})
    )
    assert sb.read_result(vllm)["output_throughput"] == 120.5 and sb.read_result(vllm)["completed"] == 8
    sgl = tmp_path / "s.jsonl"  # SGLang appends one JSON line per run: the last is this one
    sgl.write_text(
        json.dumps({"output_throughput": 1.0}) + "\n" + json.dumps({"output_throughput": 2.0}) + "\n"
    )
    assert sb.read_result(sgl)["output_throughput"] == 2.0 and sb.read_result(sgl)["median_ttft_ms"] is None


STUB_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/health_generate") else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

STUB_CLIENT = """
import json, sys, urllib.request
url, out, tput = sys.argv[1], sys.argv[2], float(sys.argv[3])
urllib.request.urlopen(url + "/health").read()  # the server is up while the client runs
json.dump({"completed": 4, "request_throughput": 0.5, "output_throughput": tput, "median_ttft_ms": 10.0,
           "p99_ttft_ms": 20.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 6.0}, open(out, "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench_vllm(sb, monkeypatch, out: Path, server_case, client_command, *args: str) -> tuple[int, dict]:  # noqa: ANN001
    """``serving_bench.main`` for vLLM with stand-in servers and clients: its exit code and report."""
    monkeypatch.setattr(sb, "server_case", server_case)
    monkeypatch.setattr(sb, "client_command", client_command)
    rc = sb.main(["--engine", "vllm", "--model", "/m", "--rotations", "/r", "--out", str(out),
                  "--startup-timeout", "30", *args])  # fmt: skip
    return rc, json.loads((out / "serving_bench.json").read_text())


def _nothing_listens(ports) -> None:  # noqa: ANN001
    """Every server was stopped: nothing answers on its port."""
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_sweep_against_stand_ins(sb, tmp_path, monkeypatch):
    (tmp_path / "server.py").write_text(STUB_SERVER)
    (tmp_path / "client.py").write_text(STUB_CLIENT)
    ports = {"bf16": _free_port(), "oscar": _free_port()}

    def server_case(engine, name, a, port):  # noqa: ANN001, ANN202
        return sb.Case(name, [sys.executable, str(tmp_path / "server.py"), str(ports[name])], {}, ports[name])

    def client_command(engine, case, a, w, rate, out):  # noqa: ANN001, ANN202
        if case.name == "oscar" and rate == 2.0:  # one failing run: reported in its row
            return [sys.executable, "-c", "raise SystemExit(3)"]
        tput = {"bf16": 100.0, "oscar": 250.0}[case.name] * (1 + math.isinf(rate))
        return [sys.executable, str(tmp_path / "client.py"), case.url, str(out), str(tput)]

    out = tmp_path / "out"
    rc, report = _bench_vllm(sb, monkeypatch, out, server_case, client_command,
                             "--workload", "long:1024:16384:4", "--rates", "2,inf")  # fmt: skip
    runs = {(r["case"], run["rate"]): run for r in report["results"] for run in r["runs"]}
    assert rc == 0 and set(runs) == {("bf16", 2.0), ("bf16", "inf"), ("oscar", 2.0), ("oscar", "inf")}
    assert runs[("bf16", "inf")]["output_throughput"] == 200.0
    assert runs[("oscar", 2.0)]["error"].startswith("client exit 3")
    md = (out / "serving_bench.md").read_text()
    assert "| oscar | long | inf | 4 | 0.50 | 500.0 | 10.0 / 20.0 | 5.00 / 6.00 | 2.50× |" in md
    assert "best output tok/s OSCAR 500.0 vs BF16 200.0 = **2.50×**" in md
    _nothing_listens(ports.values())


def test_a_server_that_dies_is_reported_and_the_next_case_runs(sb, tmp_path, monkeypatch):
    def server_case(engine, name, a, port):  # noqa: ANN001, ANN202
        return sb.Case(name, [sys.executable, "-c", "raise SystemExit(7)"], {}, _free_port())

    monkeypatch.setattr(sb, "server_case", server_case)
    rc = sb.main(["--engine", "sglang", "--model", "/m", "--rotations", "/r", "--out", str(tmp_path),
                  "--workload", "qa:8:8:1", "--startup-timeout", "20"])  # fmt: skip
    report = json.loads((tmp_path / "serving_bench.json").read_text())
    assert rc == 1 and [r["case"] for r in report["results"]] == ["bf16", "oscar"]
    assert all("exited with 7" in r["error"] for r in report["results"])


METRICS_SERVER = """
import http.server, sys, time
t0, rate = time.monotonic(), float(sys.argv[2])
prefill = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0  # prompts come in for this long
first = []  # when /metrics was first read: the client's prompts arrive from about then
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200); self.end_headers(); return
        if self.path != "/metrics":
            self.send_response(404); self.end_headers(); return
        n = rate * (time.monotonic() - t0)  # tokens generated so far, split over two label sets
        first.append(time.monotonic())
        body = (
            "# TYPE vllm:generation_tokens_total counter\\n"
            f'vllm:generation_tokens_total{{engine="0"}} {n / 4}\\n'
            f'vllm:generation_tokens_total{{engine="1"}} {3 * n / 4}\\n'
            f'vllm:prompt_tokens_total{{engine="0"}} {1000 * min(time.monotonic() - first[0], prefill)}\\n'
            'vllm:generation_tokens_created{engine="0"} 1.0\\n'
            'vllm:num_requests_running{engine="0"} 72.0\\n'
            'vllm:num_requests_waiting{engine="0"} 9.0\\n'
        ).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_steady_reads_the_servers_counters_over_a_window_and_stops_the_client(sb, tmp_path, monkeypatch):
    """``--steady WARM:WINDOW``: output tok/s from the server's own counter over the window (summed
    over label sets, ``_created`` not counted), the running / waiting gauges, OSCAR ÷ BF16 in the
    table; the client (which would run for an hour) is stopped, and so is every server."""
    (tmp_path / "server.py").write_text(METRICS_SERVER)
    ports = {"bf16": _free_port(), "oscar": _free_port()}
    rates = {"bf16": "1000", "oscar": "3500"}
    prefill = {"bf16": "0", "oscar": "1.5"}  # OSCAR's prompts still come in after the warm-up
    pidfile = tmp_path / "client.pid"
    monkeypatch.setattr(sb, "STEADY_POLL_S", 0.2)

    def server_case(engine, name, a, port):  # noqa: ANN001, ANN202
        cmd = [sys.executable, str(tmp_path / "server.py"), str(ports[name]), rates[name], prefill[name]]
        return sb.Case(name, cmd, {}, ports[name])

    def client_command(engine, case, a, w, rate, out):  # noqa: ANN001, ANN202
        code = f"import os, time; open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(3600)"
        return [sys.executable, "-c", code]

    out = tmp_path / "out"
    rc, report = _bench_vllm(sb, monkeypatch, out, server_case, client_command,
                             "--workload", "reasoning:1024:16384:256", "--steady", "0.5:2")  # fmt: skip
    runs = {r["case"]: r["runs"][0] for r in report["results"]}
    assert rc == 0
    assert runs["bf16"]["steady_output_tok_s"] == pytest.approx(1000, rel=0.1)
    assert runs["oscar"]["steady_output_tok_s"] == pytest.approx(3500, rel=0.1)
    assert runs["oscar"]["steady_running"] == 72.0 and runs["oscar"]["steady_waiting"] == 9.0
    # the window waits for the prompts: it starts once the prompt counter stops growing
    oscar = runs["oscar"]
    assert oscar["steady_start_s"] >= 0.5 + 1.5 and oscar["steady_prompt_tokens_in_window"] == 0
    assert runs["bf16"]["steady_start_s"] < 1.5
    md = (out / "serving_bench.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| oscar | reasoning | inf |"))
    ratio = float(re.search(r"([0-9.]+)× \|$", row).group(1))
    assert "| 72 / 9 | 2 | 0 |" in row and ratio == pytest.approx(3.5, rel=0.1)
    assert "completed" not in md  # no completed runs: only the steady table
    for pid in map(int, pidfile.read_text().split()):  # both clients were stopped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    _nothing_listens(ports.values())  # and both servers


@pytest.mark.parametrize("bad", ["5", "a:b", "-1:5", "5:0"])
def test_bad_steady_windows_are_one_line_errors(sb, bad):
    with pytest.raises(SystemExit, match="--steady"):
        sb.parse_steady(bad)
