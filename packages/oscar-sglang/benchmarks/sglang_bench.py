"""BF16 (SGLang's Triton backend) vs OSCAR, Qwen3-8B shape, one SGLang server each (gpu_sglang.sh bench).

Dummy weights, ``--skip-tokenizer-init``, token-id prompts, CUDA graphs and the radix cache on
(SGLang's defaults); both servers get the same ``--context-length``, ``--max-running-requests`` and
``--mem-fraction-static``. Per server:

* start-up seconds (launch → ``/health_generate`` answers: SGLang's warm-up has run) and the KV
  capacity (``max_total_num_tokens`` from ``/server_info``, else from the log);
* prefill seconds of one 32k prompt (time to its first streamed token; a fresh prompt, so no radix hit);
* decode tok/s at 1 × 128k context and 8 × 32k: the prompts are streamed (``/generate`` with
  ``stream``), each chunk time-stamped; the decode phase is the window after the last request's first
  token and before the first request's last token, and tok/s = tokens streamed in that window / its
  length (all requests decoding together, no prefill in between).

A global deadline (``--budget``, default 530 s) keeps the whole action inside one device call: a
workload that would start after it is skipped and says so. Writes ``sglang_bench.json`` and
``sglang_bench.md`` (a table) to ``--out``, plus each server's log. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# the engines' serving benchmark lives with oscar-vllm's benchmarks; its server stop is shared
sys.path.insert(0, str(Path(__file__).parents[2] / "oscar-vllm" / "benchmarks"))
from serving_bench import stop_group  # noqa: E402
from sglang_probe import call, wait_up  # noqa: E402

VOCAB = 151936
#: the servers: SGLang's BF16 with its Triton backend, with FA3 (sgl_kernel's flash_ops), and OSCAR
CASES = ("bf16", "oscar", "fa3")


def stream_generate(url: str, ids: list[int], gen: int, timeout: float) -> dict:
    """One streamed /generate: chunk arrival times and completion-token counts."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": gen, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    marks: list[tuple[float, int]] = []  # (seconds since send, completion tokens so far)
    last: dict = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            last = json.loads(data)
            meta = last.get("meta_info", {})
            n = meta.get("completion_tokens")
            if n is None:
                n = len(last.get("output_ids") or [])
            marks.append((time.monotonic() - t0, int(n)))
    return {"t_send": t0, "marks": marks, "meta_info": last.get("meta_info", {})}


def decode_rate(results: list[dict]) -> dict:
    """Tokens per second in the window where every request had its first token and none had ended."""
    starts, ends = [], []
    for r in results:
        firsts = [r["t_send"] + t for t, n in r["marks"] if n >= 1]
        if not firsts:
            return {"error": "a request streamed no token"}
        starts.append(firsts[0])
        ends.append(r["t_send"] + r["marks"][-1][0])
    lo, hi = max(starts), min(ends)
    if hi <= lo:
        return {"error": "no window where all requests decode together", "window_s": round(hi - lo, 4)}
    tokens = 0
    for r in results:
        inside = [n for t, n in r["marks"] if lo <= r["t_send"] + t <= hi]
        if inside:
            tokens += inside[-1] - inside[0]
    return {
        "decode_tok_per_s": round(tokens / (hi - lo), 1),
        "per_request_tok_per_s": round(tokens / (hi - lo) / len(results), 1),
        "window_s": round(hi - lo, 3),
        "window_tokens": tokens,
        "ttft_s": [round(s - r["t_send"], 3) for s, r in zip(starts, results, strict=True)],
    }


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB - 100) for _ in range(length)] for _ in range(n)]


def workload(url: str, batch: int, length: int, gen: int, seed: int, timeout: float) -> dict:
    ps = prompts(batch, length, seed)
    t0 = time.monotonic()
    with ThreadPoolExecutor(batch) as ex:
        outs = list(ex.map(lambda p: stream_generate(url, p, gen, timeout), ps))
    res = {"batch": batch, "prompt_len": length, "gen": gen, "wall_s": round(time.monotonic() - t0, 3)}
    res.update(decode_rate(outs))
    res["completion_tokens"] = [o["meta_info"].get("completion_tokens") for o in outs]
    res["cached_tokens"] = [o["meta_info"].get("cached_tokens") for o in outs]
    return res


def run_case(name: str, a: argparse.Namespace, deadline: float) -> dict:
    port = 30000 + CASES.index(name)
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--load-format", "dummy"]
    args += ["--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--context-length", str(a.ctx), "--max-running-requests", str(a.max_running)]
    args += [
        "--mem-fraction-static",
        str(a.mem),
        "--sampling-backend",
        "pytorch",
        "--disable-flashinfer-autotune",
    ]
    args += ["--log-level", "info"]
    env = dict(os.environ, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1")  # 128k > the config's 40,960
    env.pop("OSCAR_ROTATIONS", None)
    if name == "oscar":
        args += ["--attention-backend", "oscar", "--oscar-rotations", a.rotations, "--page-size", "64"]
        env["SGLANG_PLUGINS"] = "oscar"
    else:  # bf16: SGLang's Triton backend; fa3: its FlashAttention-3 (needs flash_ops: pack fa3)
        args += ["--attention-backend", "triton" if name == "bf16" else "fa3"]
        env["SGLANG_PLUGINS"] = "none"  # SGLANG_PLUGINS is a whitelist: no OSCAR hook in the baseline
    log = Path(a.out) / f"bench_{name}.server.log"
    res: dict = {"case": name, "command": " ".join(args[1:])}
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        res["startup_s"] = round(
            wait_up(url, proc.pid, min(a.startup_timeout, deadline - time.monotonic())), 1
        )
        srv = call(url, "/server_info", timeout=30)
        cap = srv.get("max_total_num_tokens") or next(
            (d.get("max_total_num_tokens") for d in srv.get("internal_states", []) if isinstance(d, dict)),
            None,
        )
        if cap is None:
            m = re.findall(r"max_total_num_tokens=(\d+)", log.read_text(errors="replace"))
            cap = int(m[-1]) if m else None
        res["max_total_num_tokens"] = cap
        res["max_running_requests"] = srv.get("max_running_requests")
        res["workloads"] = []
        for spec in a.workload:
            kind, b, length, gen = spec.split(",")
            if time.monotonic() > deadline - a.reserve:
                res["workloads"].append({"spec": spec, "skipped": "deadline (--budget) reached"})
                continue
            seed = zlib.crc32(
                spec.encode()
            )  # the same prompts on both servers; new per workload: no radix hit
            t0 = time.monotonic()
            limit = max(30.0, min(a.request_timeout, deadline - a.reserve / 2 - t0))
            w = workload(url, int(b), int(length), int(gen), seed, limit)
            w.update(spec=spec, kind=kind, seconds=round(time.monotonic() - t0, 1))
            if kind == "prefill":  # one request: its time to first token is the prefill
                w["prefill_s"] = (w.get("ttft_s") or [None])[0]
            res["workloads"].append(w)
            print(f"{name} {spec}: {json.dumps({k: v for k, v in w.items() if k != 'ttft_s'})}", flush=True)
    except Exception as e:  # the report says what failed; the other case still runs
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    finally:
        stop_group(proc)
    text = log.read_text(errors="replace")
    res["oscar_lines"] = [ln.split("] ", 1)[-1] for ln in text.splitlines() if "OSCAR: " in ln][:4]
    res["graphs_captured"] = "Capture target decode CUDA graph end" in text
    return res


def table(results: list[dict]) -> str:
    def w(r: dict, kind: str, key: str) -> str:
        x = next((x for x in r.get("workloads", []) if x.get("kind") == kind), {})
        v = x.get(key)
        return "—" if v is None else str(v)

    rows = [
        "| case | start-up s | KV tokens | prefill 32k s | decode tok/s 1×128k | decode tok/s 8×32k |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r['case']} | {r.get('startup_s', '—')} | {r.get('max_total_num_tokens', '—')} | "
            f"{w(r, 'prefill', 'prefill_s')} | {w(r, 'long', 'decode_tok_per_s')} | "
            f"{w(r, 'batch', 'decode_tok_per_s')} |"
        )
    cap = {r["case"]: r.get("max_total_num_tokens") for r in results}
    if cap.get("bf16") and cap.get("oscar"):
        rows += ["", f"KV capacity OSCAR / BF16: {cap['oscar'] / cap['bf16']:.2f}×"]
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="model dir (config.json; dummy weights)")
    ap.add_argument("--rotations", required=True, help="OSCAR artifact for the model")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cases", default="bf16,oscar", help="bf16,oscar,fa3 (fa3: SGLang's FA3 backend; stash fa1..)"
    )
    ap.add_argument("--ctx", type=int, default=133_120, help="--context-length (128k prompt + generation)")
    ap.add_argument("--max-running", type=int, default=16, help="--max-running-requests (both servers)")
    ap.add_argument("--mem", type=float, default=0.85, help="--mem-fraction-static (both servers)")
    ap.add_argument(
        "--workload",
        action="append",
        default=None,
        help="KIND,BATCH,PROMPT_LEN,GEN; KIND prefill|long|batch (default: prefill,1,32768,2 "
        "long,1,131072,48 batch,8,32768,48)",
    )
    ap.add_argument("--budget", type=float, default=530, help="seconds for the whole action")
    ap.add_argument("--reserve", type=float, default=45, help="seconds kept free for stopping and writing")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=240)
    a = ap.parse_args()
    unknown = sorted(set(a.cases.split(",")) - set(CASES))
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    a.workload = a.workload or ["prefill,1,32768,2", "long,1,131072,48", "batch,8,32768,48"]
    deadline = time.monotonic() + a.budget
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.cases.split(","):
        if time.monotonic() > deadline - a.reserve - 60:
            results.append({"case": name, "skipped": "deadline (--budget) reached before start-up"})
            continue
        results.append(run_case(name, a, deadline))
    doc = {
        "model": a.model,
        "ctx": a.ctx,
        "max_running_requests": a.max_running,
        "mem_fraction_static": a.mem,
        "results": results,
    }
    (Path(a.out) / "sglang_bench.json").write_text(json.dumps(doc, indent=1, default=str))
    md = table(results)
    (Path(a.out) / "sglang_bench.md").write_text(md)
    print(md)
    return 0 if all("error" not in r and "skipped" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
