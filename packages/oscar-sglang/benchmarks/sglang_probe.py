"""Client side of gpu_sglang.sh run: wait for an SGLang server, read its info, one generate, and a
small throughput probe, all with token-id prompts (the server runs --skip-tokenizer-init: dummy
weights need no tokenizer, and no tokenizer has to travel to the GPU machine). Stdlib only.

Usage: python3 sglang_probe.py --url http://127.0.0.1:30000 --pid PID --out FILE.json
           [--wait 600] [--probe BATCH,PROMPT_LEN,GEN ...] [--vocab 151936]

Prints one ``RESULT {json}`` line and writes the same JSON to --out. Exit code 0 only if the
server came up and the single generate returned tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def call(url: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode() or "null")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_up(url: str, pid: int, limit: float) -> float:
    """Seconds until the server is up and has served its warm-up (/health_generate answers 503
    until then); raises if the server process died or the limit passed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not alive(pid):
            raise RuntimeError(f"server process {pid} exited during start-up (see server.log)")
        try:
            call(url, "/model_info", timeout=5)
            # the launcher's own warm-up request runs after /model_info answers; /health_generate
            # waits for a real forward, so the probe does not time the first JIT compiles
            call(url, "/health_generate", timeout=600)
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(2)
    raise TimeoutError(f"server not up after {limit:.0f} s")


def generate(url: str, ids: list[int], gen: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": gen, "temperature": 0, "ignore_eos": True},
    }
    return call(url, "/generate", body)


def probe(url: str, batch: int, plen: int, gen: int, vocab: int) -> dict:
    """BATCH concurrent requests of PLEN random token ids, GEN tokens each (ignore_eos)."""
    rng = random.Random(batch * 1_000_003 + plen)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(plen)] for _ in range(batch)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(batch) as ex:
        outs = list(ex.map(lambda p: generate(url, p, gen), prompts))
    wall = time.monotonic() - t0
    got = [len(o.get("output_ids", [])) for o in outs]
    lat = [o.get("meta_info", {}).get("e2e_latency") for o in outs]
    return {
        "batch": batch,
        "prompt_len": plen,
        "gen": gen,
        "wall_s": round(wall, 3),
        "out_tokens": sum(got),
        "out_tok_per_s": round(sum(got) / wall, 1),
        "total_tok_per_s": round((sum(got) + batch * plen) / wall, 1),
        "e2e_latency_max_s": max((x for x in lat if x is not None), default=None),
        "all_full": all(g == gen for g in got),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wait", type=float, default=600)
    ap.add_argument("--probe", action="append", default=[], help="BATCH,PROMPT_LEN,GEN (repeatable)")
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    res: dict = {"ok": False}
    try:
        res["startup_s"] = round(wait_up(a.url, a.pid, a.wait), 1)
        for path in ("/v1/models", "/model_info", "/server_info"):
            try:
                info = call(a.url, path, timeout=30)
            except (urllib.error.URLError, OSError) as e:
                info = {"error": str(e)}
            res[path] = info
        srv = res["/server_info"]
        if isinstance(srv, dict):  # the capacity line: the KV pool's token count
            res["max_total_num_tokens"] = srv.get("max_total_num_tokens") or next(
                (
                    d.get("max_total_num_tokens")
                    for d in srv.get("internal_states", [])
                    if isinstance(d, dict)
                ),
                None,
            )
        t0 = time.monotonic()
        one = generate(a.url, list(range(1000, 1032)), 16)
        res["generate"] = {
            "s": round(time.monotonic() - t0, 3),
            "output_ids": one.get("output_ids"),
            "meta_info": one.get("meta_info"),
        }
        res["ok"] = bool(one.get("output_ids"))
        res["probes"] = []
        for spec in a.probe:
            b, p, g = (int(x) for x in spec.split(","))
            res["probes"].append(probe(a.url, b, p, g, a.vocab))
            print("PROBE", json.dumps(res["probes"][-1]), flush=True)
    except Exception as e:  # the report must say what failed, whatever it was
        res["error"] = f"{type(e).__name__}: {e}"
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    summary = {k: v for k, v in res.items() if not k.startswith("/")}
    print("RESULT", json.dumps(summary, default=str), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
