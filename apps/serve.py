"""Serve a meshtron decoder over HTTP with OpenAI's API, batching requests as they come.

    python -m apps.serve --ckpt checkpoints/gpt_tiny_stdlib --port 8000
    python -m apps.serve --weights weights/ --cache-tokens 4096 --max-waiting 32
    python -m apps.serve --hf-dir weights-hf/ --chat-template chat.jinja

The model comes from a training checkpoint (``--ckpt``), an exported weights folder
(``--weights``) or a Hugging Face directory (``--hf-dir``); the tokenizer is the one
``tools/generate.py`` would use. Requests run through ``apps.serving``: a paged KV cache of
``--cache-tokens`` tokens (its size is printed at start) and a continuous-batching engine;
``apps/serving/http.py`` has the routes. ``--quantize int8`` keeps the weights in int8
(``engine/models/quantize.py``). tp 1 only for now.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from engine.checkpoint.storage import CheckpointError
from engine.inference import ModelSource
from engine.tool_args import ArgumentParser, non_negative_int, positive_int

DTYPES = ("float32", "float64", "bfloat16")
QUANTIZE_MODES = ("none", "int8")  # engine.models.quantize's (not imported: it loads torch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="serve", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="training checkpoint root (or step dir) or model export dir")
    src.add_argument("--weights", help="an exported weights folder (export-model's output)")
    src.add_argument("--hf-dir", help="local Hugging Face directory of a decoder")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one saved with the model)")
    p.add_argument("--chat-template", help="a Jinja chat template (default: tokenizer_config's)")
    p.add_argument("--served-model-name", help="the model name clients send (default: dir name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=non_negative_int, default=8000, help="0: any free port")
    p.add_argument(
        "--cache-tokens",
        type=positive_int,
        help="KV cache size in tokens (default: --max-running × the model's positions)",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--max-running", type=positive_int, default=16, help="sequences per step")
    p.add_argument(
        "--max-waiting",
        type=non_negative_int,
        default=64,
        help="queued requests past which new ones get 429",
    )
    p.add_argument("--token-budget", type=positive_int, default=256, help="tokens fed per step")
    p.add_argument("--tp-size", type=positive_int, default=1, help="only 1 for now")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        default="none",
        help="int8: the layers' linears, the LM head and the word embedding as int8 with "
        "per-output-channel scales, dequantized in the matmul (engine/models/quantize.py)",
    )
    return p.parse_args(argv)


def _source(args: argparse.Namespace) -> tuple[ModelSource, str]:
    """The model's source and its tokenizer path; raises with one line when either is
    missing or the model cannot generate."""
    source = ModelSource(args.ckpt or args.weights, args.hf_dir)
    if args.weights and source.kind() != "export":
        raise ValueError(f"--weights {args.weights} is not an exported weights folder")
    cfg = source.config()
    if not cfg.causal:
        raise ValueError(f"{cfg.arch} is not a decoder: only decoders (gpt, llama) generate")
    tokenizer = args.tokenizer or source.tokenizer_path()
    if tokenizer is None or not os.path.isfile(tokenizer):
        raise FileNotFoundError("no tokenizer found beside the model: pass --tokenizer PATH")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise FileNotFoundError(f"--chat-template {args.chat_template}: no such file")
    return source, tokenizer


def build(args: argparse.Namespace):
    """The FastAPI app for ``args``, and the KV cache's one-line description."""
    import torch

    from apps.serving import PagedKVCache, ServingEngine
    from apps.serving.http import build_app
    from apps.serving.text import TextCodec
    from engine.inference import inference_config
    from engine.models import build_model
    from engine.models.quantize import quantize_model_

    source, tokenizer = _source(args)
    cfg, state = source.load()
    model = build_model(inference_config(cfg), dtype=getattr(torch, args.dtype))
    model.load_full_state_dict(state)
    del state
    quantize_model_(model, args.quantize)
    tokens = args.cache_tokens or args.max_running * cfg.max_positions
    cache = PagedKVCache.for_model(model, tokens=tokens, block_size=args.block_size)
    engine = ServingEngine(
        model,
        cache,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        token_budget=max(args.token_budget, args.max_running),
    )
    codec = TextCodec.from_files(tokenizer, args.chat_template)
    directory = args.ckpt or args.weights or args.hf_dir
    name = args.served_model_name or Path(directory).resolve().name
    return build_app(engine, codec, name), cache.describe()


def main(argv: list[str] | None = None) -> int:
    """Load, print the cache size and the address, serve until SIGINT/SIGTERM; 2 on a bad
    argument."""
    args = parse_args(argv)
    if args.tp_size > 1:
        print(
            f"serve: --tp-size {args.tp_size}: serving at tp > 1 is not built yet", file=sys.stderr
        )
        return 2
    try:
        app, cache_line = build(args)
        sock = socket.create_server((args.host, args.port))
    except (OSError, ValueError, CheckpointError) as err:
        print(f"serve: {err}", file=sys.stderr)
        return 2
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(cache_line, flush=True)
    print(f"serving {app.state.server.model_name} on http://{host}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again to the handler it
    # found: with these, nothing is left to stop and the drained server exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
