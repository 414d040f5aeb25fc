"""The engines' own serving benchmarks, OSCAR beside the engine's BF16, over a request-rate sweep.

For each case (``bf16``: the engine's default attention; ``oscar``: ``oscar serve --engine E``) one
server is started on 127.0.0.1 (its own process group, a start-up limit, always stopped), and for each
workload and request rate the engine's benchmark client runs against it, as a user runs it:

* vLLM: ``vllm bench serve --backend vllm --dataset-name random … --save-result``;
* SGLang: ``python -m sglang.bench_serving --backend sglang --dataset-name random … --output-file``.

A workload is ``NAME:INPUT:OUTPUT:PROMPTS`` (random prompts of INPUT tokens, OUTPUT tokens each with
EOS ignored, PROMPTS requests); rates are requests/s, ``inf`` sends all at once (saturation). Both
clients report the same keys, which the table collects: completed requests, request throughput, output
tok/s, TTFT and TPOT median/p99. The table adds OSCAR ÷ BF16 output tok/s per rate and at each case's
best rate. Writes ``serving_bench.json`` and ``serving_bench.md`` and each server's and client's log
to ``--out``. Stdlib only; the engines' CLIs do the measuring.

    python serving_bench.py --engine vllm --model DIR --tokenizer TOK --rotations ART --out OUT \\
        --workload reasoning:1024:16384:64 --workload qa:32768:512:32 --rates 0.5,1,2,inf \\
        -- --load-format dummy --gpu-memory-utilization 0.9

``--tokenizer`` lets a dummy-weight model (a config without a tokenizer) be served with another
model's tokenizer whose ids fit its vocabulary (SmolLM2's 49,152 ids fit Qwen3's 151,936).

``--steady WARM:WINDOW`` (vLLM): a workload whose requests outlast a device call (long reasoning:
16k generated tokens each) is read at saturation instead of to completion: the client runs, and
after ``WARM`` seconds the server's own counters (``/metrics``: ``vllm:generation_tokens_total``,
``vllm:num_requests_running`` / ``_waiting``) are read twice ``WINDOW`` seconds apart; the run
reports output tok/s over the window and the requests running and waiting, then the client is
stopped. The table gets those rows beside the completed runs'. A window reads the contexts of its
moment, not a whole run's average: long generations grow from the prompt's length, so a window early
in a 1k-prompt run reads short contexts; a prompt near the run's mean context (e.g. 9k tokens for
1k + 16k) puts the window there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "sglang")
#: vLLM's CLI (its ``vllm`` console script's target): a tree unpacked with ``pip --target`` or a
#: copied site-packages has the module but not always the script on ``PATH``
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
#: the keys both engines' clients write, in the table's order
KEYS = (
    "completed", "request_throughput", "output_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
)  # fmt: skip
#: how long a client may run for one rate before it is stopped (the row then says so)
CLIENT_LIMIT_S = 3600.0


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    prompts: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        parts = text.split(":")
        try:
            name, i, o, n = parts
            w = cls(name, int(i), int(o), int(n))
        except ValueError:
            raise SystemExit(f"--workload {text!r}: expected NAME:INPUT:OUTPUT:PROMPTS (ints)") from None
        if min(w.input_len, w.output_len, w.prompts) < 1 or not name:
            raise SystemExit(f"--workload {text!r}: lengths and prompt count must be >= 1")
        return w


@dataclass
class Case:
    """One server: its command, environment, health path and port."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    health: str = "/health"
    results: list[dict] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def parse_rates(text: str) -> list[float]:
    try:
        rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--rates {text!r}: expected numbers (requests/s) or inf, comma-separated") from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"--rates {text!r}: expected positive rates")
    return rates


def server_case(engine: str, name: str, a: argparse.Namespace, port: int) -> Case:
    """The server command of case ``name`` (``bf16`` or ``oscar``) for ``engine``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OSCAR_ROTATIONS", "SGLANG_PLUGINS")}
    extra = list(a.server_args)
    if engine == "vllm":
        tok = ["--tokenizer", a.tokenizer] if a.tokenizer else []
        common = ["--host", "127.0.0.1", "--port", str(port), *tok, *extra]
        if name == "oscar":
            cmd = ["oscar", "serve", "--engine", "vllm", a.model, "--rotations", a.rotations, *common]
        else:
            cmd = [*VLLM_CLI, "serve", a.model, *common]
        return Case(name, cmd, env, port, "/health")
    tok = ["--tokenizer-path", a.tokenizer] if a.tokenizer else []
    common = ["--host", "127.0.0.1", "--port", str(port), *tok, *extra]
    if name == "oscar":
        cmd = [
            "oscar",
            "serve",
            "--engine",
            "sglang",
            a.model,
            "--rotations",
            a.rotations,
            "--page-size",
            "64",
        ]
        env["SGLANG_PLUGINS"] = "oscar"
    else:  # SGLang's BF16 with its Triton backend; SGLANG_PLUGINS is a whitelist: no OSCAR hook
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            a.model,
            "--attention-backend",
            "triton",
        ]
        env["SGLANG_PLUGINS"] = "none"
    return Case(name, [*cmd, *common], env, port, "/health_generate")


def client_command(
    engine: str, case: Case, a: argparse.Namespace, w: Workload, rate: float, out: Path
) -> list[str]:
    """The engine's benchmark client for one workload at one rate, writing its JSON to ``out``."""
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    tok = a.tokenizer or a.model
    common = ["--base-url", case.url, "--dataset-name", "random", "--random-input-len", str(w.input_len),
              "--random-output-len", str(w.output_len), "--num-prompts", str(w.prompts),
              "--request-rate", rate_s, "--seed", str(a.seed)]  # fmt: skip
    if engine == "vllm":
        return [*VLLM_CLI, "bench", "serve", "--backend", "vllm", "--model", a.model, "--tokenizer", tok,
                *common, "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl",
                "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
                "--result-filename", out.name]  # fmt: skip
    # SGLang's client ignores EOS unless --disable-ignore-eos; --random-range-ratio 1: exact lengths
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--tokenizer", tok, *common,
            "--random-range-ratio", "1.0", "--output-file", str(out)]  # fmt: skip


def read_result(path: Path) -> dict:
    """The client's numbers from its output (vLLM: one JSON object; SGLang: JSON lines, the last)."""
    text = path.read_text().strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = json.loads(text.splitlines()[-1])
    return {k: data.get(k) for k in KEYS}


#: the server counters ``--steady`` reads (vLLM's Prometheus names; summed over their label sets)
STEADY_METRICS = {
    "generated": "vllm:generation_tokens_total",
    "prompt": "vllm:prompt_tokens_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}


def read_metrics(url: str) -> dict[str, float]:
    """The :data:`STEADY_METRICS` from ``url/metrics`` (Prometheus text; a series' value summed over
    its label sets; a name the server does not export is absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in STEADY_METRICS.items():
            if name == metric:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def parse_steady(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        warm, window = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--steady {text!r}: expected WARM:WINDOW (seconds)") from None
    if warm < 0 or window <= 0:
        raise SystemExit(f"--steady {text!r}: expected WARM >= 0 and WINDOW > 0")
    return warm, window


#: seconds between the reads that wait for the server's prompt counter to stop growing
STEADY_POLL_S = 5.0


def steady_run(
    case: Case, cmd: list[str], log: Path, warm: float, window: float, settle_max: float = 0.0
) -> dict:
    """The client ``cmd`` at saturation: ``/metrics`` read after ``warm`` s — and after the server's
    prompt counter stopped growing between two reads :data:`STEADY_POLL_S` apart, waiting at most
    ``settle_max`` s more: a window that still holds prefills is not the decode rate — then
    ``window`` s later, then the client stopped. Returns output tok/s over the window, running and
    waiting requests, the prompt tokens that still came in during the window (0: a clean window)
    and when the window started."""
    with open(log, "wb") as f:
        client = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t_start = time.monotonic()
    try:
        time.sleep(warm)
        if client.poll() is not None:
            return {"error": f"client exit {client.returncode} before the window (see {log.name})"}
        m0 = read_metrics(case.url)
        deadline = time.monotonic() + settle_max
        while "prompt" in m0 and time.monotonic() + STEADY_POLL_S <= deadline:
            time.sleep(STEADY_POLL_S)
            m = read_metrics(case.url)
            if m.get("prompt") == m0["prompt"]:
                m0 = m
                break
            m0 = m
        t0 = time.monotonic()
        time.sleep(window)
        m1, t1 = read_metrics(case.url), time.monotonic()
    finally:
        stop_group(client)
    if "generated" not in m0 or "generated" not in m1:
        return {"error": f"the server exports no {STEADY_METRICS['generated']}"}
    return {
        "steady_output_tok_s": round((m1["generated"] - m0["generated"]) / (t1 - t0), 1),
        "steady_running": m1.get("running"),
        "steady_waiting": m1.get("waiting"),
        "steady_window_s": round(t1 - t0, 1),
        "steady_warm_s": warm,
        "steady_start_s": round(t0 - t_start, 1),
        "steady_prompt_tokens_in_window": m1.get("prompt", 0.0) - m0.get("prompt", 0.0),
    }


def wait_up(case: Case, proc: subprocess.Popen, limit: float) -> float:
    """Seconds until ``case.health`` answers 200; raises if the server exited or the limit passed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"{case.name}: the server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(case.url + case.health, timeout=600) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(2)
    raise TimeoutError(f"{case.name}: the server did not answer {case.health} within {limit:.0f} s")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 30 s; returns once the group is gone (the next
    server must find the GPU memory free)."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def run_case(engine: str, case: Case, a: argparse.Namespace, workloads: list[Workload], rates: list[float],
             out: Path, deadline: float) -> dict:  # fmt: skip
    log = out / f"{case.name}.server.log"
    res: dict = {"case": case.name, "command": shlex.join(case.command), "runs": []}
    with open(log, "wb") as f:
        proc = subprocess.Popen(case.command, stdout=f, stderr=subprocess.STDOUT, env=case.env,
                                start_new_session=True)  # fmt: skip
    try:
        res["startup_s"] = round(wait_up(case, proc, min(a.startup_timeout, deadline - time.monotonic())), 1)
        print(f"{case.name}: serving after {res['startup_s']} s", flush=True)
        for w in workloads:
            for rate in rates:
                run = {"workload": w.name, "input_len": w.input_len, "output_len": w.output_len,
                       "prompts": w.prompts, "rate": "inf" if math.isinf(rate) else rate}  # fmt: skip
                left = deadline - time.monotonic()
                if left < 30:
                    run["skipped"] = "deadline (--budget) reached"
                    res["runs"].append(run)
                    continue
                tag = f"{case.name}_{w.name}_{run['rate']}"
                result_file = out / f"{tag}.json"
                cmd = client_command(engine, case, a, w, rate, result_file)
                run["client"] = shlex.join(cmd)
                if a.steady is not None:
                    warm, window = a.steady
                    if left < warm + window + 30:
                        run["skipped"] = "deadline (--budget) reached"
                    else:
                        settle = left - (warm + window + 30)  # the prompts' time to get in
                        run.update(steady_run(case, cmd, out / f"{tag}.client.log", warm, window, settle))
                    res["runs"].append(run)
                    keys = ("steady_output_tok_s", "steady_running", "steady_prompt_tokens_in_window")
                    keys += ("error",)
                    shown = {k: run[k] for k in keys if k in run}
                    print(f"{case.name} {w.name} rate {run['rate']} (steady): {shown}", flush=True)
                    continue
                t0 = time.monotonic()
                with open(out / f"{tag}.client.log", "wb") as f:
                    try:
                        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                            timeout=min(CLIENT_LIMIT_S, left)).returncode  # fmt: skip
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                run["seconds"] = round(time.monotonic() - t0, 1)
                if rc == 0 and result_file.is_file():
                    run.update(read_result(result_file))
                else:
                    run["error"] = f"client exit {rc} (see {tag}.client.log)"
                res["runs"].append(run)
                shown = {k: run[k] for k in ("output_throughput", "median_tpot_ms", "error") if k in run}
                print(f"{case.name} {w.name} rate {run['rate']}: {shown}", flush=True)
    except Exception as e:  # the report says what failed; the other case still runs
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    finally:
        stop_group(proc)
    return res


def table(results: list[dict]) -> str:
    """Markdown: one row per case, workload and rate; OSCAR ÷ BF16 output tok/s where both ran."""
    by = {(r["case"], run["workload"], str(run["rate"])): run for r in results for run in r.get("runs", [])}
    head = ("| case | workload | rate (req/s) | completed | req/s | output tok/s | TTFT p50 / p99 ms "
            "| TPOT p50 / p99 ms | OSCAR ÷ BF16 output tok/s |")  # fmt: skip
    lines = [head, "|" + " --- |" * 9]

    def f(x: object, nd: int = 1) -> str:
        return "—" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)

    steady = {k: r for k, r in by.items() if "steady_output_tok_s" in r}
    by = {k: r for k, r in by.items() if "steady_output_tok_s" not in r}
    if not by:
        lines = []
    for (case, wl, rate), run in by.items():
        if "skipped" in run or "error" in run:
            lines.append(f"| {case} | {wl} | {rate} | {run.get('skipped') or run.get('error')} ||||||")
            continue
        base, osc = by.get(("bf16", wl, rate)), by.get(("oscar", wl, rate))
        ratio = "—"
        if (
            case == "oscar"
            and base
            and osc
            and base.get("output_throughput")
            and osc.get("output_throughput")
        ):
            ratio = f"{osc['output_throughput'] / base['output_throughput']:.2f}×"
        lines.append(
            f"| {case} | {wl} | {rate} | {f(run.get('completed'))} | {f(run.get('request_throughput'), 2)} "
            f"| {f(run.get('output_throughput'))} "
            f"| {f(run.get('median_ttft_ms'))} / {f(run.get('p99_ttft_ms'))} "
            f"| {f(run.get('median_tpot_ms'), 2)} / {f(run.get('p99_tpot_ms'), 2)} | {ratio} |"
        )
    best = {}
    for (case, wl, _), run in by.items():
        v = run.get("output_throughput")
        if isinstance(v, int | float):
            best[(case, wl)] = max(best.get((case, wl), 0.0), float(v))
    for wl in dict.fromkeys(w for _, w in best):
        if ("bf16", wl) in best and ("oscar", wl) in best and best[("bf16", wl)] > 0:
            lines.append("")
            o, b = best[("oscar", wl)], best[("bf16", wl)]
            lines.append(f"{wl}: best output tok/s OSCAR {o:.1f} vs BF16 {b:.1f} = **{o / b:.2f}×**")
    if steady:
        head = ("| case | workload | rate (req/s) | steady output tok/s | running / waiting | window s "
                "| prompt tokens in the window | OSCAR ÷ BF16 |")  # fmt: skip
        lines += [*([""] if lines else []), head, "|" + " --- |" * 8]
        for (case, wl, rate), run in steady.items():
            base = steady.get(("bf16", wl, rate))
            ratio = "—"
            if case == "oscar" and base and base["steady_output_tok_s"]:
                ratio = f"{run['steady_output_tok_s'] / base['steady_output_tok_s']:.2f}×"
            queue = f"{f(run.get('steady_running'), 0)} / {f(run.get('steady_waiting'), 0)}"
            late = f(run.get("steady_prompt_tokens_in_window"), 0)
            lines.append(
                f"| {case} | {wl} | {rate} | {run['steady_output_tok_s']:.1f} | {queue} "
                f"| {run['steady_window_s']:.0f} | {late} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rotations", help="the OSCAR artifact (needed for the oscar case)")
    p.add_argument("--tokenizer", help="tokenizer folder for server and client (default: the model's)")
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="bf16,oscar")
    p.add_argument(
        "--workload", action="append", required=True, help="NAME:INPUT:OUTPUT:PROMPTS (repeatable)"
    )
    p.add_argument("--rates", default="inf", help="request rates, comma-separated (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--budget", type=float, default=math.inf, help="seconds for the whole run")
    p.add_argument(
        "--steady", metavar="WARM:WINDOW", help="vLLM: read output tok/s at saturation over a window "
        "of the server's counters instead of running the clients to completion (long generations)"
    )  # fmt: skip
    a = p.parse_args(argv)
    a.steady = parse_steady(a.steady)
    if a.steady is not None and a.engine != "vllm":
        raise SystemExit("--steady reads vLLM's /metrics counters: --engine vllm only")
    a.server_args = server_args
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    if not cases or set(cases) - {"bf16", "oscar"}:
        raise SystemExit(f"--cases {a.cases!r}: expected bf16 and/or oscar")
    if "oscar" in cases and not a.rotations:
        raise SystemExit("--rotations FILE is needed for the oscar case (oscar calibrate MODEL --out FILE)")
    workloads = [Workload.parse(w) for w in a.workload]
    rates = parse_rates(a.rates)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget
    results = [
        run_case(a.engine, server_case(a.engine, name, a, a.port + i), a, workloads, rates, out, deadline)
        for i, name in enumerate(cases)
    ]
    report = {"engine": a.engine, "model": a.model, "tokenizer": a.tokenizer, "results": results,
              "command": shlex.join([sys.executable, *sys.argv])}  # fmt: skip
    (out / "serving_bench.json").write_text(json.dumps(report, indent=1))
    md = table(results)
    (out / "serving_bench.md").write_text(md)
    print(md)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
