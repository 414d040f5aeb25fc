"""The start-up log lines (plain values, no vLLM) and the last-line error report (fresh processes)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import pytest

from oscar_math.errors import ArtifactError, OscarError
from oscar_vllm import exit_report, startup


def test_bits_per_element_is_the_code_plus_scale_and_zero_per_group():
    assert startup.bits_per_element(64) == 2.5  # SmolLM2 (group = head dim 64)
    assert startup.bits_per_element(128) == 2.25


def test_active_line_names_artifact_layers_bits_and_records():
    line = startup.active_line("/a/rot.safetensors", "3", 30, (), 64, "held")
    assert line == (
        "OSCAR active: artifact /a/rot.safetensors (format version 3), 30 INT2 layers, "
        "2.50 bits/element, window records held"
    )
    line = startup.active_line("r", "2", 30, (29, 0, 5), 128, None)
    assert "27 INT2 layers, excluded [0, 5, 29] (BF16), 2.25 bits/element" in line
    assert line.endswith("window records none (prefix caching off)")


def _bf16_estimate(line: str) -> int:
    return int(re.search(r"BF16 would hold about ([\d,]+) tokens", line).group(1).replace(",", ""))


def test_kv_line_reproduces_the_measured_bf16_capacity():
    """docs/vllm.md, "Layers kept in BF16" (test_engine's measurement): SmolLM2 at 512 MiB and 8 slots,
    vLLM gave the BF16 engine 23,296 tokens, OSCAR 1037 blocks of 128 tokens (132,736 tokens) and OSCAR
    with layers 0, 5, 29 in BF16 681 blocks. The estimate misses only vLLM's unused remainder
    (less than one OSCAR block), so it is within one 128-token block of the measurement."""
    line = startup.kv_line(132_736, 1037, 128, 30, 0, 3, 64, 64, 64 + 256, 8)
    assert line.startswith("OSCAR KV cache: 132,736 tokens; BF16 would hold about ")
    assert 23_296 - 128 <= _bf16_estimate(line) <= 23_296
    assert "3,600 bytes per token against BF16's 23,040 (6.40x)" in line
    # excluded layers keep BF16 pages and allocate no windows
    line = startup.kv_line(87_168, 681, 128, 30, 3, 3, 64, 64, 320, 8)
    assert 23_296 - 128 <= _bf16_estimate(line) <= 23_296
    assert "5,544 bytes per token" in line


def test_cpu_note_rewrites_only_vllms_oscar_record():
    class Member:  # what vLLM passes: an AttentionBackendEnum member
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return f"AttentionBackendEnum.{self.name}"

    logger = logging.getLogger("vllm.platforms.cpu")
    startup.install_cpu_note()
    startup.install_cpu_note()  # idempotent
    assert sum(isinstance(f, startup._CpuNote) for f in logger.filters) == 1
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("Cannot use %s backend on CPU.", Member("OSCAR"))
        logger.info("Cannot use %s backend on CPU.", Member("FLASH_ATTN"))
        logger.info("Using %s backend.", Member("OSCAR"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == [
        startup.CPU_NOTE,
        "Cannot use AttentionBackendEnum.FLASH_ATTN backend on CPU.",
        "Using AttentionBackendEnum.OSCAR backend.",
    ]


def test_oscar_error_is_found_in_the_exception_chain():
    err = ArtifactError("/x.safetensors: num_layers mismatch")
    try:
        try:
            raise err
        except OscarError as e:
            raise RuntimeError("WorkerProc initialization failed") from e
    except RuntimeError as outer:
        assert exit_report.oscar_error_in(outer) is err
    assert exit_report.oscar_error_in(ValueError("other")) is None
    assert exit_report.oscar_error_in(None) is None


def test_report_prints_each_recorded_message_once_and_removes_the_file(tmp_path, capsys):
    path = str(tmp_path / "errors")
    assert exit_report.report(path) == []  # nothing recorded: nothing printed
    for _ in range(2):  # two worker processes, the same error
        exit_report.note(ArtifactError("/x: bad\nsecond line"), path)
    exit_report.note(ValueError("not ours"), path)
    assert exit_report.report(path) == ["OSCAR: /x: bad"]
    assert capsys.readouterr().err == "OSCAR: /x: bad\n"
    assert not (tmp_path / "errors").exists()


# A launching process that starts an engine-like multiprocessing child: the child logs an OscarError
# through a vLLM-style logger (as vLLM's WorkerProc does), the parent then dies of a plain error.
_LAUNCH = textwrap.dedent(
    """
    import logging, multiprocessing, sys
    from oscar_vllm import exit_report

    def child():
        exit_report.install()  # the plugin, loaded in the child
        log = logging.getLogger("vllm.v1.executor.multiproc_executor")
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
        try:
            from oscar_math.errors import ArtifactError
            raise ArtifactError("/tmp/r.safetensors: num_layers mismatch: the model has 30, the file has 29")
        except Exception:
            log.exception("WorkerProc failed to start.")
        sys.exit(1)

    if __name__ == "__main__":
        exit_report.install()
        exit_report.install()  # idempotent
        p = multiprocessing.get_context(sys.argv[1]).Process(target=child)
        p.start()
        p.join()
        raise RuntimeError("Engine core initialization failed. See root cause above.")
    """
)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_launching_process_ends_with_the_oscar_line(tmp_path, method):
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    r = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "RuntimeError: Engine core initialization failed" in r.stderr  # vLLM's own output stays
    assert "WorkerProc failed to start." in r.stderr and "Traceback" in r.stderr
    assert lines[-1] == (
        "OSCAR: /tmp/r.safetensors: num_layers mismatch: the model has 30, the file has 29"
    ), r.stderr[-2000:]
    assert sum(line.startswith("OSCAR: ") for line in lines) == 1


def test_no_line_when_the_launching_process_handled_the_failure(tmp_path):
    """A test that expects an engine to fail (or a script that retries) ends without the line."""
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH.replace("raise RuntimeError(", "print("))
    r = subprocess.run([sys.executable, str(script), "spawn"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WorkerProc failed to start." in r.stderr  # the child did record it
    assert "OSCAR:" not in r.stderr + r.stdout


def test_no_line_without_an_oscar_error(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(
        "from oscar_vllm import exit_report\nexit_report.install()\nraise ValueError('something else')\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "ValueError: something else" in r.stderr
    assert "OSCAR:" not in r.stderr


def test_the_packages_records_go_through_vllms_logger():
    pytest.importorskip("vllm", reason="vLLM is not installed (run the nox session 'vllm')")
    from oscar_vllm import register

    register()
    assert logging.getLogger("oscar_vllm").parent is logging.getLogger("vllm")
