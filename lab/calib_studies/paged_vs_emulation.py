"""PagedLM (the kernels' torch references on CPU) perplexity against the oscar2 emulation.

SmolLM2-135M, two held-out 512-token sequences, windows 64 + 256, the committed CPU
artifact. Prints the perplexity of the bf16 model, the per-query emulation
(``Windows(prefill_chunk=1)``), the chunk-granular emulation (``prefill_chunk=128``) and
the served loop prefilled in chunks of 128 and in one 512-token chunk, plus the relative
distance of the loop's final hidden states to each emulation. Run from the repository
root (results in docs/serving.md):

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-calib/src \\
        python lab/calib_studies/paged_vs_emulation.py
"""

from __future__ import annotations

import time
from pathlib import Path

from oscar_calib.metrics import final_hidden, sequences_metrics
from oscar_calib.models import load_model
from oscar_calib.paged import PagedConfig, PagedLM
from oscar_calib.schemes import SchemeContext, build_scheme
from oscar_calib.simulate import Windows, simulate
from oscar_calib.text import builtin_text, split_text, tokenize
from oscar_math.artifact import load_rotations

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 512


def _rel(hs: dict, a: str, b: str) -> float:
    return float((hs[a] - hs[b]).norm() / hs[b].norm())


def main() -> None:
    model, tok = load_model("smollm2", device="cpu")
    rot = load_rotations(ROOT / "packages/oscar-calib/benchmarks/data/smollm2-cpu-2048.safetensors")
    ids = tokenize(tok, split_text(builtin_text())[1])
    ctx = SchemeContext(64, 30, 3, rot)
    for start in (0, 3000):
        seq = ids[start : start + LENGTH]
        t0 = time.time()
        ref = final_hidden(model, seq[None])[0]
        hs = {"ref": ref}
        for c in (1, 128):
            with simulate(model, build_scheme("oscar2", ctx), Windows(64, 256, c)):
                hs[f"emu_chunk{c}"] = final_hidden(model, seq[None])[0]
        for c in (128, LENGTH):
            lm = PagedLM(model, rot, PagedConfig(max_seqs=1, max_len=LENGTH, prefill_chunk=c))
            hs[f"paged_chunk{c}"] = lm.final_hidden([seq])[0]
        m = sequences_metrics(model, ref, hs, seq)
        ppl = {k: round(v.perplexity, 4) for k, v in m.items()}
        print(f"held-out @{start}, {LENGTH} tokens ({time.time() - t0:.0f} s): {ppl}")

        print(
            f"  hidden states: paged128 vs emu1 {_rel(hs, 'paged_chunk128', 'emu_chunk1'):.2e}, "
            f"vs emu128 {_rel(hs, 'paged_chunk128', 'emu_chunk128'):.2e}, "
            f"paged128 vs paged{LENGTH} {_rel(hs, 'paged_chunk128', f'paged_chunk{LENGTH}'):.2e}"
        )


if __name__ == "__main__":
    main()
