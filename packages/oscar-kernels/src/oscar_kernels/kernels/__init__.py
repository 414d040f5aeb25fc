"""``@triton.jit`` bodies (imported only by the launchers, never at package import)."""
