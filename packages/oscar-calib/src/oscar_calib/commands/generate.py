"""``oscar generate MODEL --rotations FILE --prompt TEXT``: greedy generation through the paged INT2 kernels.

The model's attention runs on :class:`oscar_calib.paged.PagedLM` — the INT2 pages and
BF16 windows of ``oscar-kernels`` (Triton on CUDA, the torch references on CPU). Several
``--prompt`` arguments are served together as one batch of different lengths.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with the model's KV cache in the paged INT2 kernels (oscar-calib[kernels])",
        description=(
            "Greedy generation with every attention layer served from the OSCAR paged cache: "
            "prefill in chunks over the INT2 prefix, then decode token by token, all prompts in "
            "one batch. Needs the optional extra oscar-calib[kernels]; Triton kernels run on "
            "CUDA, the torch references on CPU (slow but exact)."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="'smollm2' or a local Hugging Face causal-LM folder")
    p.add_argument("--rotations", metavar="FILE", help="calibrated artifact (required unless --kv bf16)")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="tokens per prompt (default 32)"
    )
    p.add_argument(
        "--chunk", type=int, default=256, metavar="C", help="prefill chunk in tokens (default 256)"
    )
    p.add_argument("--page-size", type=int, default=64, metavar="P", help="tokens per INT2 page (default 64)")
    p.add_argument("--sink", type=int, help="BF16 sink tokens (default: the artifact's, else 64)")
    p.add_argument("--recent", type=int, help="BF16 recent tokens (default: the artifact's, else 256)")
    p.add_argument(
        "--kv", choices=("int2", "bf16"), default="int2", help="int2: the OSCAR cache; bf16: plain BF16 pages"
    )
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="model dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")


def run(args: argparse.Namespace) -> int:
    import torch

    from oscar_math import OscarError
    from oscar_math.artifact import load_rotations

    from ..models import load_model, model_info
    from ..paged import PagedConfig, PagedLM
    from . import serving_windows

    if args.max_new_tokens < 1:
        raise OscarError(f"Invalid --max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.kv == "int2" and not args.rotations:
        raise OscarError("Invalid --rotations: expected a calibrated artifact for --kv int2, got none")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype), device=device)
    info = model_info(model)
    rotations = None
    if args.kv == "int2":
        rotations = load_rotations(
            args.rotations, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim
        )
    prompts = []
    for text in args.prompt:
        if args.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        prompts.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long))
    if any(p.numel() == 0 for p in prompts):
        raise OscarError(
            "Invalid --prompt: expected text that tokenizes to at least one token, got an empty one"
        )
    longest = max(p.numel() for p in prompts) + args.max_new_tokens
    sink, recent = serving_windows(args.sink, args.recent, rotations)
    config = PagedConfig(
        max_seqs=len(prompts),
        max_len=longest,
        page_size=args.page_size,
        sink=sink,
        recent=recent,
        prefill_chunk=args.chunk,
        kv=args.kv,
    )
    lm = PagedLM(model, rotations, config)
    result = lm.generate(prompts, args.max_new_tokens, eos_token_id=getattr(tokenizer, "eos_token_id", None))
    for i, (prompt, toks) in enumerate(zip(prompts, result.tokens, strict=True)):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        print(f"[{i}] ({prompt.numel()} prompt tokens) {text}")
    print(
        f"{args.kv} cache on {device}: prefill {result.prefill_seconds:.2f} s, "
        f"decode {result.decode_tokens} tokens in {result.decode_seconds:.2f} s "
        f"({result.decode_tokens_per_second:.1f} tokens/s)"
    )
    sys.stdout.flush()
    return 0
