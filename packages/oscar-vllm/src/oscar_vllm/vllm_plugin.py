"""Entry point of the ``vllm.general_plugins`` group: vLLM calls :func:`register` in every process.

Idempotent (vLLM may load plugins more than once). On an unsupported vLLM version the
``OSCAR`` name is still registered, so that selecting it gives one clear error from the
backend instead of vLLM's "unknown backend". A failure here is logged, never raised:
the plugin runs in every vLLM process, including those of users who do not select OSCAR.

Besides the backend it installs the start-up reports (:mod:`oscar_vllm.startup`: the KV
capacity line, the CPU platform's note) and the last-line error report
(:mod:`oscar_vllm.exit_report`); each acts only on OSCAR's own configuration or errors.
"""

from __future__ import annotations

import logging

from . import compat, exit_report, startup

_done = False
log = logging.getLogger("oscar_vllm")


def register() -> None:
    """Register the OSCAR backend, its CPU stand-in, the prefix-caching guard and the output
    rotation's fold into ``o_proj`` as weights load (:mod:`oscar_vllm.fold`)."""
    global _done
    if _done:
        return
    _done = True
    # The package's own records (compat, backend) go through vLLM's handler, format and level: a
    # logger outside the "vllm" tree has no handler in a vLLM process (its INFO lines were lost and
    # its warnings printed bare, looking like exit_report's "OSCAR: ..." line). "oscar_vllm" has no
    # dot, so no logger created later can become its parent instead.
    log.parent = logging.getLogger("vllm")
    try:
        exit_report.install()
        compat.register_backend()
        if compat.version_supported(compat.vllm_version()):
            compat.register_cpu_override()
            startup.install_cpu_note()
            from . import records  # imports vLLM's sliding-window classes: only a supported vLLM

            compat.guard_prefix_caching(records.register, records.check_admission)
            compat.default_max_num_seqs()
            compat.default_block_size()
            startup.install_kv_report()
            from .fold import fold_after_reload, fold_on_load  # R_V into o_proj as weights load

            compat.before_weight_processing(fold_on_load)
            compat.after_weights_reloaded(fold_after_reload)
    except Exception as e:  # an unexpected vLLM: OSCAR unavailable, everything else untouched
        log.warning(
            "oscar-vllm could not register the OSCAR backend with vLLM %s: %s", compat.vllm_version(), e
        )
