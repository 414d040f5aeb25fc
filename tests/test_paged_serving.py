"""The paged serving loop (oscar-calib + oscar-kernels + oscar-math) against the emulation and OscarCache.

CPU: the kernels' torch references (and, on tiny shapes, the Triton kernels under
``TRITON_INTERPRET=1``). On a CUDA machine the same tests run the Triton kernels.

Bounds, and why:
* loop (any prefill chunk) vs the ``oscar2`` emulation's per-query rule (``prefill_chunk=1``):
  both read key ``j`` of query ``t`` quantised iff ``sink <= j <= t - recent``, with the
  same codec; they differ only where the emulation keeps exact float32 keys/values and the
  cache keeps them rounded to bf16 (the BF16 windows and the chunk's own rotated keys,
  ~2^-9 relative) and in the order of float operations of the
  rotations (a code can flip by one step when a value sits on a rounding boundary).
  Measured on the tiny model: perplexity within 0.1 %, final hidden states within ~1 %,
  while the quantisation itself moves the hidden states by ~10 %. The asserted bounds
  are 0.5 % (perplexity) and 3 % (hidden states), and the quantisation effect must be at
  least 3x the loop/emulation difference, so a loop that ignored the INT2 cache (or read
  the wrong tokens from it) fails.
* greedy tokens vs :class:`OscarCache` (``model.generate``): same rule, same codecs; a
  bf16-level difference can flip a near-tie argmax, after which the continuations
  diverge, so agreement is asserted as a fraction of tokens (>= 0.9), not equality.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run through the interpreter on CPU machines
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("oscar_kernels", reason="needs oscar-kernels (pip install 'oscar-calib[kernels]')")

from oscar_calib.cache import OscarCache  # noqa: E402
from oscar_calib.calibrate import CalibrationConfig, calibrate  # noqa: E402
from oscar_calib.metrics import final_hidden, sequences_metrics  # noqa: E402
from oscar_calib.models import tiny_random_model  # noqa: E402
from oscar_calib.paged import PagedConfig, PagedLM  # noqa: E402
from oscar_calib.schemes import SchemeContext, build_scheme  # noqa: E402
from oscar_calib.simulate import Windows, quantized_region, simulate  # noqa: E402
from oscar_calib.text import builtin_text, split_text, tokenize  # noqa: E402
from oscar_math import OscarError  # noqa: E402

SINK, RECENT = 8, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    # head dim 64: the Triton kernels' tl.dot needs d/4 >= 16 on GPUs (d = 32 fails to compile there)
    model, tok = tiny_random_model("llama", seed=1, head_dim=64)
    rot = calibrate(
        model, tok, CalibrationConfig(tokens=512, seq_len=256, sink=SINK, recent=RECENT), progress=False
    )
    model.to(DEVICE)
    ids = tokenize(tok, split_text(builtin_text())[1])
    return model, rot, ids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _emulated(model, rot, ids, chunk, scheme="oscar2"):
    cfg = model.config
    ctx = SchemeContext(cfg.head_dim, cfg.num_hidden_layers, cfg.num_key_value_heads, rot)
    with simulate(model, build_scheme(scheme, ctx), Windows(SINK, RECENT, chunk)):
        return final_hidden(model, ids[None])[0]


def _lm(model, rot, chunk, max_seqs=1, max_len=256, page_size=16, **kw):
    cfg = PagedConfig(
        max_seqs=max_seqs,
        max_len=max_len,
        page_size=page_size,
        sink=SINK,
        recent=RECENT,
        prefill_chunk=chunk,
        **kw,
    )
    return PagedLM(model, rot, cfg)


@pytest.mark.parametrize("chunk", [5, 13, 40, 64])
def test_loop_perplexity_matches_emulation(tiny, chunk):
    """Chunks of 5 and 13 cross the sink (8) inside a chunk; 40 ends exactly at sink+recent;
    64 is longer than the recent window (the chunk's older keys are read as INT2). Every
    chunk size is compared with the per-query emulation: the windows apply per token."""
    model, rot, ids = tiny
    seq = ids[:150].to(DEVICE)
    loop = _lm(model, rot, chunk).final_hidden([seq])[0]
    emu = _emulated(model, rot, seq, 1)
    ref = final_hidden(model, seq[None])[0]
    m = sequences_metrics(model, ref, {"loop": loop, "emu": emu}, seq)
    ratio = m["loop"].perplexity / m["emu"].perplexity
    diff, effect = _rel(loop, emu), _rel(emu, ref)
    assert abs(ratio - 1) < 5e-3, (ratio, m)
    assert diff < 3e-2, diff
    assert effect > 3 * diff, (effect, diff)


def test_loop_does_not_depend_on_the_chunk_size(tiny):
    """Per-token windows: one prompt prefilled in one chunk, in chunks of 1, 7, recent - 1 and
    recent + 3, gives the same hidden states at every position (the same rows are read
    under every schedule; on CPU only float32 summation order differs)."""
    model, rot, ids = tiny
    seq = ids[300:390].to(DEVICE)
    want = _lm(model, rot, 90).final_hidden([seq])[0]
    for chunk in (1, 7, RECENT - 1, RECENT + 3):
        got = _lm(model, rot, chunk).final_hidden([seq])[0]
        err = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
        # CPU: float32 summation order only. 5e-4, not 1e-4, since the default artifact is format 3:
        # INT2 keys are dequantised + RoPE_p(m)@R_K, a term larger than the residual row, so the same
        # float32 reorderings move more (1.5e-4 measured in CI at chunk 1; the INT2 effect is ~1e-1)
        assert err < (5e-4 if DEVICE == "cpu" else 2e-2), (chunk, err)


def test_chunked_region_is_the_chunk_granular_rule():
    """``quantized_region(chunk=C)``: the chunk-granular rule :class:`OscarCache` applies to
    one multi-token ``update`` (prefix key j of chunk [P, P+C') is INT2 iff
    sink <= j < P + C' - recent; the chunk's own keys exact). The kernels no longer use it."""
    s, sink, recent = 50, 3, 7
    for chunk in (1, 4, 7, 10, 64):
        q = torch.arange(s)
        got = quantized_region(q, torch.arange(s), sink, recent, chunk, s)
        want = torch.zeros(s, s, dtype=torch.bool)
        for t in range(s):
            p0 = t // chunk * chunk
            end = min(p0 + chunk, s)
            for j in range(p0):
                want[t, j] = sink <= j < end - recent
        assert torch.equal(got, want), chunk


def test_batch_of_different_lengths_equals_one_by_one(tiny):
    model, rot, ids = tiny
    seqs = [ids[:150], ids[200:297], ids[400:433]]
    seqs = [s.to(DEVICE) for s in seqs]
    lm = _lm(model, rot, 24, max_seqs=3)
    pages = lm.free_pages
    batched = lm.final_hidden(seqs)
    assert lm.free_pages == pages  # every page went back to the pool
    for s, h in zip(seqs, batched, strict=True):
        alone = _lm(model, rot, 24).final_hidden([s])[0]
        assert h.shape == alone.shape
        # Exact arithmetic on CPU; on a GPU, packing three sequences into one row changes
        # the matmul shapes and so the reduction order (tf32/bf16): 2.5e-5 was measured on
        # the H200, far below any quantisation effect (~1e-2).
        assert _rel(h, alone) < (1e-5 if DEVICE == "cpu" else 1e-4)


def _oscar_cache_greedy(model, rot, prompt, new):
    """Greedy tokens through :class:`OscarCache` with the prompt fed one token per ``update``:
    a multi-token update reads its own tokens in BF16 (the chunk-granular rule), one-token
    updates follow the per-query rule the paged loop applies to its prompt too."""
    cache = OscarCache.from_rotations(model, rot, Windows(SINK, RECENT))
    with torch.no_grad():
        for i in range(prompt.numel() - 1):
            model(prompt[None, i : i + 1], past_key_values=cache, use_cache=True)
    out = model.generate(
        prompt[None], past_key_values=cache, max_new_tokens=new, do_sample=False, min_new_tokens=new
    )
    return out[0, prompt.numel() :].tolist()


def test_greedy_generation_agrees_with_oscar_cache(tiny):
    """Free-running greedy tokens are reported; teacher-forced argmaxes (feeding OscarCache's
    tokens to the loop) are asserted: one near-tie flip must not count for every later token."""
    model, rot, ids = tiny
    prompts = [ids[1000:1070].to(DEVICE), ids[2000:2051].to(DEVICE)]
    new = 12  # decode walks positions 51..62: a token leaves the recent window into INT2 every step
    want = [_oscar_cache_greedy(model, rot, p, new) for p in prompts]
    lm = _lm(model, rot, 128, max_seqs=2)  # one-chunk prefill, as model.generate does
    free = lm.generate(prompts, new).tokens
    forced = lm.generate(prompts, new, forced=want).tokens
    agree = sum(a == b for f, w in zip(forced, want, strict=True) for a, b in zip(f, w, strict=True))
    assert agree / (new * len(prompts)) >= 0.95, (agree, forced, want)
    for f, w in zip(free, want, strict=True):
        assert f[0] == w[0]  # the first token has no earlier divergence to inherit
    # batching does not change a sequence's tokens
    alone = _lm(model, rot, 128).generate(prompts[1:], new).tokens[0]
    assert alone == free[1]


def test_int2_loop_differs_from_bf16_loop(tiny):
    """The bf16 baseline loop equals the unquantised model; the int2 loop does not."""
    model, rot, ids = tiny
    seq = ids[:120].to(DEVICE)
    ref = final_hidden(model, seq[None])[0]
    bf16 = _lm(model, None, 32, kv="bf16").final_hidden([seq])[0]
    int2 = _lm(model, rot, 32).final_hidden([seq])[0]
    assert _rel(bf16, ref) < 1e-2
    assert _rel(int2, ref) > 3 * _rel(bf16, ref)


def test_triton_kernels_match_torch_references(tiny):
    """The same loop with backend='triton' (interpreter on CPU) and 'torch', prefill + decode."""
    pytest.importorskip("triton", reason="needs triton (pip install 'oscar-kernels[triton]')")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported")
    model, rot, ids = tiny
    prompts = [ids[:45].to(DEVICE), ids[100:120].to(DEVICE)]
    outs = {}
    for backend in ("torch", "triton"):
        lm = _lm(model, rot, 16, max_seqs=2, backend=backend)
        sids = [lm.add_sequence(), lm.add_sequence()]
        hid = lm.prefill(sids, prompts)
        dec = lm.forward(sids, [ids[50:51].to(DEVICE), ids[130:131].to(DEVICE)])
        outs[backend] = torch.cat([*hid, *dec])
    assert _rel(outs["triton"], outs["torch"]) < 2e-2


def test_errors_are_one_line(tiny):
    model, rot, ids = tiny
    with pytest.raises(OscarError, match="kv"):
        PagedConfig(kv="fp8")
    with pytest.raises(OscarError, match="rotations"):
        PagedLM(model, None, PagedConfig(max_seqs=1, max_len=64))
    lm = _lm(model, rot, 16, max_seqs=1, max_len=64)
    with pytest.raises(OscarError, match="max_seqs"):
        lm.add_sequence(), lm.add_sequence()
    lm = _lm(model, rot, 16, max_seqs=1, max_len=64)
    with pytest.raises(OscarError, match="max_len"):
        lm.final_hidden([ids[:65].to(DEVICE)])


def test_cli_generate_needs_rotations(capsys):
    from oscar_calib.cli import main

    assert main(["generate", "smollm2", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rotations" in err[0]


ARTIFACT = Path(__file__).parents[1] / "packages/oscar-calib/benchmarks/data/smollm2-cpu-2048.safetensors"


@pytest.fixture(scope="module")
def smollm2():
    from oscar_calib.models import load_model, resolve_model
    from oscar_math.artifact import load_rotations

    try:
        resolve_model("smollm2")
    except OscarError as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    model, tok = load_model("smollm2", device=DEVICE)
    return model, tok, load_rotations(ARTIFACT)


def test_smollm2_short_context_loop_vs_emulation_and_oscar_cache(smollm2):
    """400 tokens, windows 64 + 256, prefill chunks of 128 (the third chunk crosses sink+recent = 320)."""
    model, tok, rot = smollm2
    ids = tokenize(tok, split_text(builtin_text())[1])
    seq = ids[:400].to(DEVICE)
    ctx = SchemeContext(64, 30, 3, rot)
    lm = PagedLM(model, rot, PagedConfig(max_seqs=1, max_len=400, prefill_chunk=128))
    loop = lm.final_hidden([seq])[0]
    with simulate(model, build_scheme("oscar2", ctx), Windows(64, 256)):
        emu = final_hidden(model, seq[None])[0]
    ref = final_hidden(model, seq[None])[0]
    m = sequences_metrics(model, ref, {"loop": loop, "emu": emu, "ref": ref}, seq)
    assert abs(m["loop"].perplexity / m["emu"].perplexity - 1) < 5e-3, m
    assert _rel(emu, ref) > 3 * _rel(loop, emu)
    # greedy continuation of a 330-token prompt: teacher-forced argmaxes vs OscarCache, whose
    # one-call prompt prefill reads the prompt in BF16 (chunk-granular; the loop reads keys
    # older than 256 tokens as INT2 there): close, not the same rule, hence the slack
    prompt, new = ids[1000:1330].to(DEVICE), 4
    cache = OscarCache.from_rotations(model, rot)
    out = model.generate(
        prompt[None], past_key_values=cache, max_new_tokens=new, do_sample=False, min_new_tokens=new
    )
    want = out[0, prompt.numel() :].tolist()
    forced = lm.generate([prompt], new, chunk=400, forced=[want]).tokens[0]
    assert sum(a == b for a, b in zip(forced, want, strict=True)) >= new - 1, (forced, want)


def test_eval_scheme_oscar2_kernels_matches_oscar2(tiny):
    """``oscar eval``'s path: run_eval scores ``oscar2-kernels`` through the loop next to ``oscar2``."""
    from oscar_calib.evaluate import EvalConfig, run_eval
    from oscar_calib.models import ByteTokenizer

    model, rot, _ = tiny
    cfg = EvalConfig(
        contexts=(120,),
        schemes=("bf16", "oscar2", "oscar2-kernels"),
        num_sequences=1,
        sink=SINK,
        recent=RECENT,
        error_sequences=0,
        needle_contexts=(),
    )
    res = run_eval(model, ByteTokenizer(), rot, cfg, progress=False)
    block = res.contexts["120"]
    ratio = block["oscar2-kernels"]["perplexity"]["mean"] / block["oscar2"]["perplexity"]["mean"]
    assert abs(ratio - 1) < 5e-3, ratio
    assert block["oscar2-kernels"]["top1"]["mean"] < 1.0  # it did not just return the reference


def test_cli_generate_smollm2(smollm2, capsys):
    from oscar_calib.cli import main

    argv = ["generate", "smollm2", "--rotations", str(ARTIFACT), "--prompt", "The capital of France is"]
    assert main([*argv, "--prompt", "def add(a, b):", "--max-new-tokens", "3", "--device", DEVICE]) == 0
    out = capsys.readouterr().out
    assert "[0] (5 prompt tokens)" in out and "[1] (7 prompt tokens)" in out, out
    assert "int2 cache on" in out.splitlines()[-1] and "tokens/s" in out.splitlines()[-1]
