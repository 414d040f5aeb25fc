"""oscar-vllm."""

__version__ = "0.1.0"
__all__: list[str] = []
