"""The engines' one-line exit report lives in the serving core (:mod:`oscar_kernels.serving.exit_report`)."""

from oscar_kernels.serving.exit_report import ENV, install, note, oscar_error_in, report

__all__ = ["ENV", "install", "note", "oscar_error_in", "report"]
