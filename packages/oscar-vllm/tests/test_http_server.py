"""A real OpenAI-compatible vLLM server with OSCAR, started the way a user starts it.

``oscar serve --engine vllm smollm2 --rotations FILE ...`` on 127.0.0.1 and a free port (on vLLM's
CPU build that runs ``python -m vllm.entrypoints.openai.api_server``), asked over HTTP: the model
list, a greedy completion of a prompt longer than sink + recent (so INT2 pages are read), a chat
completion, a streamed completion, four concurrent requests, a repeated prompt counted as a
prefix-cache hit in ``/metrics``, and the OSCAR start-up lines in the server's log. One server
serves every positive check (engine start is ~1-2 min on 2 cores); it runs in its own process
group and is always stopped in the fixture's teardown. Before it, a bad artifact: ``oscar serve``
refuses it in one line, and vLLM's own server started on it exits non-zero with
``OSCAR: <message>`` as its last line.

Skipped, with the reason, when vLLM, the ``oscar`` command or SmolLM2 is unavailable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run the nox session 'vllm')")
httpx = pytest.importorskip("httpx", reason="httpx (installed with vLLM) is missing")

MODEL = "smollm2"
SERVER_FLAGS = [
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(512 << 20),
    "--max-num-batched-tokens", "256",
    "--seed", "0",
]  # fmt: skip
START_TIMEOUT_S = 900  # engine start: ~60-140 s on a quiet 2-core machine, much more when it is shared
REQUEST_TIMEOUT_S = 300  # one request (CPU attention through the torch references is slow)
FAIL_TIMEOUT_S = 600  # a server started on a bad artifact must exit by itself within this
STOP_TIMEOUT_S = 60  # after SIGTERM, before SIGKILL
SINK, RECENT = 64, 256  # the artifact's BF16 windows (oscar calibrate's defaults)
NUM_LAYERS = 30  # SmolLM2-135M


def _oscar_command() -> str:
    # beside the interpreter in a venv; on PATH where packages were installed with --target (GPU machine)
    oscar = Path(sys.executable).with_name("oscar")
    found = str(oscar) if oscar.exists() else shutil.which("oscar")
    if not found:
        pytest.skip("the oscar command (oscar-calib) is not installed in this environment")
    return found


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # the plugin must load
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it has not exited in time."""
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # children that outlived the leader (engine core, worker) are in the same group
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, str]:
    """Held-out text: one long prompt (> sink + recent tokens) and four others, all distinct."""
    from oscar_calib.text import load_text, split_text

    held = split_text(load_text(None))[1]
    return {
        "long": held[20_000:22_400],
        "repeat": held[30_000:32_400],
        "concurrent": [held[40_000 + 3_000 * i : 40_000 + 3_000 * i + 1_600] for i in range(4)],
    }


class Server:
    def __init__(self, base: str, log: Path, start_s: float, artifact: str) -> None:
        self.base, self.log, self.start_s, self.artifact = base, log, start_s, artifact

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=REQUEST_TIMEOUT_S)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(model_dir, artifact, tmp_path_factory):
    oscar = _oscar_command()
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [oscar, "serve", "--engine", "vllm", MODEL, "--rotations", artifact]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode} before serving:\n{_tail(log)}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"the server did not serve within {START_TIMEOUT_S} s:\n{_tail(log)}")
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        start_s = time.monotonic() - t0
        print(f"\nserver started in {start_s:.0f} s (oscar serve → /v1/models answers)")
        yield Server(base, log, start_s, artifact)
    finally:
        _stop(proc)


def _tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _complete(c: httpx.Client, prompt: str, max_tokens: int = 16) -> dict:
    r = c.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _prefix_cache_hits(c: httpx.Client) -> float:
    r = c.get("/metrics")
    assert r.status_code == 200
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in r.text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total{") or line.startswith("vllm:prefix_cache_hits{")
    ]
    assert values, "no vllm:prefix_cache_hits counter in /metrics"
    return sum(values)


# ---- a bad artifact (before the server starts: they compete for the same 2 cores) ----------------


def test_oscar_serve_refuses_a_corrupt_artifact_in_one_line(model_dir, tmp_path):
    bad = tmp_path / "rot.safetensors"
    bad.write_bytes(b"this is not a safetensors file")
    cmd = [_oscar_command(), "serve", "--engine", "vllm", MODEL, "--rotations", str(bad), "--port", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=FAIL_TIMEOUT_S, env=_env())
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oscar serve: error: ") and str(bad) in err[0], r.stderr


def test_vllm_server_on_a_wrong_artifact_ends_with_one_oscar_line(model_dir, tmp_path):
    """vLLM's own server (no oscar check first): the worker fails while the model is built; vLLM's
    tracebacks stay, and the last line says why in OSCAR's words."""
    from oscar_math.artifact import identity_rotations, save_rotations

    wrong = save_rotations(tmp_path / "rot.safetensors", identity_rotations(MODEL, NUM_LAYERS - 1, 3, 64))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    oscar = json.dumps({"oscar": {"rotations": str(wrong)}})
    cmd += ["--attention-backend", "OSCAR", "--additional-config", oscar]
    cmd += ["--host", "127.0.0.1", "--port", str(_free_port()), *SERVER_FLAGS]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), start_new_session=True, text=True
    )
    try:
        out, _ = proc.communicate(timeout=FAIL_TIMEOUT_S)
    finally:
        _stop(proc)
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode != 0, out[-3000:]
    why = f"num_layers mismatch: the model being served has {NUM_LAYERS}, the file has {NUM_LAYERS - 1}"
    assert lines[-1] == f"OSCAR: {wrong}: {why}", "\n".join(lines[-20:])
    assert sum(line.startswith("OSCAR: ") for line in lines) == 1


# ---- one server for everything else ------------------------------------------------------------


def test_models_lists_the_served_name(server):
    with server.client() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert r.json()["data"][0]["max_model_len"] == 2048


def test_greedy_completion_of_a_prompt_longer_than_the_windows(server, prompts):
    with server.client() as c:
        out = _complete(c, prompts["long"], max_tokens=24)
    assert out["usage"]["prompt_tokens"] > SINK + RECENT  # INT2 pages are read
    choice = out["choices"][0]
    assert choice["text"].strip(), out
    assert choice["finish_reason"] in ("length", "stop")
    assert out["usage"]["completion_tokens"] >= 1


def test_chat_completion(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].strip()


def test_streaming_sends_chunks_then_done_and_matches_the_plain_answer(server, prompts):
    prompt = prompts["long"][:1_200]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    events: list[str] = []
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        plain = _complete(c, prompt, max_tokens=12)["choices"][0]["text"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2  # tokens arrive as they are generated
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert streamed.strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert streamed == plain  # greedy: the stream is the same answer


def test_four_concurrent_requests_all_succeed(server, prompts):
    def one(prompt: str) -> dict:
        with server.client() as c:
            return _complete(c, prompt, max_tokens=16)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, prompts["concurrent"], timeout=4 * REQUEST_TIMEOUT_S))
    assert len(outs) == 4
    for out in outs:
        assert out["choices"][0]["text"].strip(), out
        assert out["usage"]["completion_tokens"] >= 1


def test_repeated_prompt_is_a_prefix_cache_hit(server, prompts):
    with server.client() as c:
        before = _prefix_cache_hits(c)
        first = _complete(c, prompts["repeat"])
        assert first["usage"]["prompt_tokens"] > SINK + RECENT
        after_first = _prefix_cache_hits(c)
        again = _complete(c, prompts["repeat"])
        after_again = _prefix_cache_hits(c)
    assert after_first == before  # a new prompt: nothing to hit
    assert after_again > after_first, (before, after_first, after_again)
    # a hit restores the BF16 windows from vLLM's window pages: the same greedy answer
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_log_says_oscar_is_active(server):
    log = server.text()
    active = [line for line in log.splitlines() if "OSCAR active: " in line]
    # one worker process on the CPU build: one line, however many layers it built
    assert len(active) == 1, active
    # transient window records with either model runner: V1 (CPU build) keys slots by request id
    assert active[0].endswith(
        f"OSCAR active: artifact {server.artifact} (format version 3), {NUM_LAYERS} INT2 layers, "
        f"2.50 bits/element, window records transient"
    )
    kv = [line for line in log.splitlines() if "OSCAR KV cache: " in line]
    assert len(kv) == 1, kv
    m = re.search(r"OSCAR KV cache: ([\d,]+) tokens; BF16 would hold about ([\d,]+) tokens", kv[0])
    assert m, kv[0]
    oscar_tokens, bf16_tokens = (int(g.replace(",", "")) for g in m.groups())
    vllm_count = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert vllm_count and int(vllm_count.group(1).replace(",", "")) == oscar_tokens  # vLLM's own count
    # vLLM's defaults (prefix caching on) give the capacity: >= 5x BF16 at 2,048-token requests
    # (16 INT2 blocks + 1 open window block per request)
    assert oscar_tokens >= 5 * bf16_tokens > 0, (oscar_tokens, bf16_tokens)
    # vLLM's misleading CPU message is replaced, and the CPU build's missing `vllm` metadata is no issue
    assert "Cannot use AttentionBackendEnum.OSCAR backend on CPU" not in log
    if not _on_gpu():
        assert "OSCAR selected: vLLM's CPU platform names CPU_ATTN" in log
    assert "PackageNotFoundError" not in log
    # no bare "OSCAR..." line: the package's records carry vLLM's prefix, and a good start has no
    # exit report
    assert not [line for line in log.splitlines() if line.startswith("OSCAR")]
